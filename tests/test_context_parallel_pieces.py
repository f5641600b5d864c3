"""Context parallelism's single-process pieces: the load-balanced layout (shard / unshard, positions, packed
sequences), the chunk orders the collectives use, attention of one block with its log-sum-exp against
full softmax, the LSE merge and the per-block backward with the merged statistics, and the one-line errors.
The collectives and the comm types against one process: tests/distributed/test_context_parallel.py."""
import math

import pytest
import torch

import te_parallel as te
from te_parallel.ops.attention_lse import BlockMask, block_backward, block_forward, merge
from te_parallel.parallel import context_parallel as cpm
from te_parallel.parallel.cp_comm import ChunkOrder, packed_order
from te_parallel.parallel.cp_ring import PackedChunks
from tests.attention_reference import te_mask


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_shard_unshard_round_trip(cp, seq_dim):
    s = 8 * cp
    x = torch.randn(s, 3, 5) if seq_dim == 0 else torch.randn(3, s, 5)
    shards = [cpm.shard_sequence(x, seq_dim, r, cp) for r in range(cp)]
    assert torch.equal(cpm.unshard_sequence(shards, seq_dim), x)
    for r in range(cp):
        pos = cpm.sequence_positions(s, r, cp)
        assert torch.equal(shards[r], x.index_select(seq_dim, pos))
        first, second = cpm.chunk_ids(r, cp)
        assert pos[0] == first * (s // (2 * cp)) and pos[-1] == (second + 1) * (s // (2 * cp)) - 1
    # under a causal mask every rank sees the same number of (query, key) pairs
    work = [int(sum(p + 1 for p in cpm.sequence_positions(s, r, cp).tolist())) for r in range(cp)]
    assert len(set(work)) == 1


def test_thd_layout():
    cu = torch.tensor([0, 5, 5, 13, 14], dtype=torch.int32)
    cp = 2
    cu_pad = cpm.pad_cu_seqlens(cu, cp)
    assert cu_pad.tolist() == [0, 8, 8, 16, 20]
    x = torch.randn(int(cu_pad[-1]), 3)
    shards = [cpm.shard_thd(x, cu_pad, r, cp) for r in range(cp)]
    assert all(s.shape[0] == 10 for s in shards)
    assert torch.equal(cpm.unshard_thd(shards, cu_pad), x)
    # rank 0 holds chunks 0 and 3 of each sequence (chunk length = padded length / 4)
    assert cpm.thd_rows(cu_pad, 0, cp).tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    assert cpm.thd_positions(cu_pad, 0, cp).tolist() == [0, 1, 6, 7, 0, 1, 6, 7, 0, 3]
    chunks = PackedChunks(cu, cu_pad, cp, 10, 2)
    pos, real = chunks.positions(1)
    assert pos.tolist() == [2, 3, 4, 5, 2, 3, 4, 5, 1, 2] and real.tolist() == [1, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    cu_rank, pad_rank = cpm.thd_cu_seqlens_on_rank(cu, cu_pad, 1, cp)
    assert cu_rank.tolist() == [0, 3, 3, 7, 7] and pad_rank.tolist() == [0, 4, 4, 8, 10]
    assert torch.equal(chunks.view(1, "all").cu, cu_rank)
    second = chunks.view(1, "second")
    assert second.rows.tolist() == [2, 6, 7] and second.cu.tolist() == [0, 1, 1, 3, 3]


@pytest.mark.parametrize("G", [2, 4])
def test_chunk_orders(G):
    b, s = 2, 4 * G
    full = torch.randn(b, s, 3)
    ranks = torch.stack([cpm.shard_sequence(full, 1, r, G) for r in range(G)])  # [G, b, s/G, 3] as gathered
    order = ChunkOrder(None, G)
    assert torch.equal(order.to_sequence(ranks), full)
    assert torch.equal(order.to_ranks(full), ranks)
    cu_pad = torch.tensor([0, 4 * G, 4 * G, 10 * G], dtype=torch.int32)
    packed = torch.randn(10 * G, 3)
    shards = torch.stack([cpm.shard_thd(packed, cu_pad, r, G) for r in range(G)])
    porder = packed_order(None, G, cu_pad, G, shards.shape[1])
    assert torch.equal(porder.to_sequence(shards), packed)
    assert torch.equal(porder.to_ranks(packed), shards)


def _ref(q, k, v, masked, scale):
    """q [b, s, h, d] dense reference in fp64: (out, lse)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", probs, v), lse.transpose(1, 2)


@pytest.mark.parametrize("band", [(-1, -1), (-1, 0), (3, 0), (2, 1)])
@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 10)])
def test_block_forward_with_lse(band, sq, skv):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, sq, 4, 8, dtype=torch.float64), *torch.randn(2, 2, skv, 2, 8, dtype=torch.float64)
    scale = 0.3
    out, lse, _ = block_forward(q, k, v, BlockMask(*band), scale)
    masked = _bottom_right(sq, skv, *band)
    ref, ref_lse = _ref(q, k, v, masked, scale)
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.allclose(lse, ref_lse, atol=1e-12)


def _bottom_right(sq, skv, left, right):
    i = torch.arange(sq).view(-1, 1) + (skv - sq)
    j = torch.arange(skv).view(1, -1)
    out = torch.zeros(sq, skv, dtype=torch.bool)
    if left >= 0:
        out |= j < i - left
    if right >= 0:
        out |= j > i + right
    return out


def test_block_forward_packed_matches_dense_per_sequence():
    torch.manual_seed(1)
    lq, lkv = [3, 0, 5], [4, 2, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_kv = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q = torch.randn(8, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 11, 2, 8, dtype=torch.float64)
    mask = BlockMask(-1, 0, cu_q, cu_kv, 5, 5)
    out, lse, _ = block_forward(q, k, v, mask, 0.5)
    for n in range(3):
        if lq[n] == 0:
            continue
        qs, ks, vs = q[cu_q[n]:cu_q[n + 1]], k[cu_kv[n]:cu_kv[n + 1]], v[cu_kv[n]:cu_kv[n + 1]]
        ref, ref_lse = _ref(qs[None], ks[None], vs[None], _bottom_right(lq[n], lkv[n], -1, 0), 0.5)
        assert torch.allclose(out[cu_q[n]:cu_q[n + 1]], ref[0], atol=1e-12)
        assert torch.allclose(lse[cu_q[n]:cu_q[n + 1]], ref_lse[0], atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_merge_and_block_backward_match_full_softmax(dtype):
    """Keys split in three blocks (one causal diagonal): the merged out/lse is full softmax's, and the blocks'
    backward with the merged statistics sums to full attention's gradients."""
    torch.manual_seed(2)
    s, scale = 9, 1 / math.sqrt(8)
    q, k, v = (torch.randn(2, s, n, 8, dtype=torch.float64) for n in (4, 2, 2))
    masked = te_mask(s, s, "causal")
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = _ref(qr, kr, vr, masked, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    qx, kx, vx, dx = (t.to(dtype) for t in (q, k, v, dout))
    blocks = [(slice(0, 3), BlockMask()), (slice(3, 6), BlockMask()), (slice(6, 9), BlockMask(-1, 0))]
    # the last block is the diagonal for queries 6..8; keys 0..5 are fully visible to them
    parts = [block_forward(qx[:, 6:], kx[:, sl], vx[:, sl], m, scale) for sl, m in blocks]
    out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    assert torch.allclose(out.double(), ref[:, 6:].detach(), atol=tol)
    assert torch.allclose(lse.double(), ref_lse[:, 6:], atol=tol)
    out_q = out.to(dtype)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for (sl, m), (_, _, aux) in zip(blocks, parts):
        gq, gk, gv = block_backward(dx[:, 6:], qx[:, 6:], kx[:, sl], vx[:, sl], out_q, lse, aux, m, scale)
        dq[:, 6:] += gq.double()
        dk[:, sl] += gk.double()
        dv[:, sl] += gv.double()
    # full attention's gradients restricted to the queries 6..8: recompute them
    qr2, kr2, vr2 = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref2, _ = _ref(qr2, kr2, vr2, masked, scale)
    (ref2[:, 6:] * dout[:, 6:]).sum().backward()
    gtol = 1e-11 if dtype == torch.float64 else 5e-2
    for got, want in ((dq, qr2.grad), (dk, kr2.grad), (dv, vr2.grad)):
        assert (got - want).abs().max() <= gtol * max(1.0, want.abs().max())


def test_rows_without_keys():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    out, lse, _ = block_forward(q, k, v, BlockMask(0, 0), 1.0)  # bottom-right: query 0 sees key 1 only
    assert torch.isfinite(lse).all()
    out, lse, _ = block_forward(q[:, :0], k, v, BlockMask(), 1.0)
    assert out.shape == (1, 0, 1, 4)
    full, full_lse = merge([torch.zeros(1, 2, 1, 4)], [torch.full((1, 2, 1), float("-inf"))])
    assert torch.equal(full, torch.zeros(1, 2, 1, 4)) and torch.isneginf(full_lse).all()


def test_errors():
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        te.DotProductAttention(4, 8, cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"needs cp_group=\[a2a group, p2p group\]"):
        cpm.make_context_parallel("DotProductAttention", object(), cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="a list cp_group is"):
        cpm.make_context_parallel("DotProductAttention", [None, None], cp_comm_type="p2p")
    with pytest.raises(TypeError, match="cp_group must be"):
        te.DotProductAttention(4, 8, cp_group=object())
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2·cp = 8"):
        cpm.shard_sequence(torch.zeros(12, 2), 0, 0, 4)
    for msg in (str(e) for e in _raised()):
        assert "\n" not in msg


def _raised():
    out = []
    for fn in (lambda: cpm.shard_sequence(torch.zeros(12, 2), 0, 0, 4),
               lambda: cpm.make_context_parallel("X", object(), cp_comm_type="a2a+p2p")):
        try:
            fn()
        except ValueError as e:
            out.append(e)
    return out


def test_no_group_changes_nothing():
    torch.manual_seed(3)
    q, k, v = (torch.randn(8, 2, 4, 8) for _ in range(3))
    a = te.DotProductAttention(4, 8, attn_mask_type="causal")
    b = te.DotProductAttention(4, 8, attn_mask_type="causal", cp_group=None, cp_comm_type="a2a")
    b.set_context_parallel_group(None, None, None, "all_gather")
    assert b.cp_config is None and torch.equal(a(q, k, v), b(q, k, v))
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    layer.set_context_parallel_group(None, None, None, "p2p")
    assert layer.self_attention.core_attention.cp_config is None
