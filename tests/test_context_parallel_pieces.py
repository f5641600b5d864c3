"""Context parallelism's single-process pieces: the load-balanced layout (shard / unshard, positions, packed
sequences), the chunk orders the collectives use, attention of one block with its log-sum-exp against
full softmax, the LSE merge and the per-block backward with the merged statistics, and the one-line errors.
Then the ring's per-rank schedule run on one device (what benchmarks/bench_cp.py times) against the real
ring, its ranks in threads with mailboxes in place of the process group.
The collectives and the comm types against one process: tests/distributed/test_context_parallel.py."""
import math
import queue
import threading

import pytest
import torch

import te_parallel as te
from te_parallel.ops.attention_lse import BlockMask, block_backward, block_forward, merge
from te_parallel.parallel import context_parallel as cpm
from te_parallel.parallel.cp_comm import ChunkOrder, packed_order
from te_parallel.parallel import cp_ring
from te_parallel.parallel.cp_ring import DenseChunks, PackedChunks, RankSchedule, Ring, rank_backward, rank_forward
from tests.attention_reference import te_mask, window


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
    masked = window(sq, skv, *band)
    ref, ref_lse = _ref(q, k, v, masked, scale)
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.allclose(lse, ref_lse, atol=1e-12)


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
        ref, ref_lse = _ref(qs[None], ks[None], vs[None], window(lq[n], lkv[n], -1, 0), 0.5)
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


# -- one rank's share of the ring on one device, against the ring ------------------------------------------

class _Mailboxes:
    """The ring's transport for ranks in threads of one process: a send lands in the next peer's box (per tag),
    and the work handed back copies the rank's own next message into its receive buffer on wait()."""

    def __init__(self, size: int) -> None:
        self.boxes = {(r, tag): queue.Queue() for r in range(size) for tag in (0, 1)}

    def exchange(self, send, recv, ring, tag):
        self.boxes[(ring.next_peer, tag)].put(send.clone())
        box = self.boxes[(ring.rank, tag)]
        return [type("Arrival", (), {"wait": lambda self_: recv.copy_(box.get(timeout=120))})()]


class _Recorder:
    """block_forward / block_backward as the ring calls them, each call's tensors and mask kept per rank."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.here = {}, threading.local()
        for name in ("block_forward", "block_backward"):
            monkeypatch.setattr(cp_ring, name, self._wrap(name, getattr(cp_ring, name)))

    def _wrap(self, name, fn):
        def call(*args):
            mask = args[-2]
            self.calls.setdefault(self.here.rank, []).append(
                (name, [a.clone() for a in args if isinstance(a, torch.Tensor)], mask))
            return fn(*args)
        return call


def _same_mask(a, b) -> bool:
    same = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))  # noqa: E731
    return (a.left, a.right, a.max_q, a.max_kv) == (b.left, b.right, b.max_q, b.max_kv) and \
        same(a.cu_q, b.cu_q) and same(a.cu_kv, b.cu_kv)


def _ring_case(fmt: str, size: int):
    """Every rank's q, k, v, dout (fp64, load-balanced shards of one batch) and its chunk views."""
    gen = torch.Generator().manual_seed(7)
    h, g, d = 4, 2, 8
    if fmt == "dense":
        s = 8 * size
        full = [torch.randn(2, s, n, d, generator=gen, dtype=torch.float64) for n in (h, g, g, h)]
        shards = [[cpm.shard_sequence(t, 1, r, size) for t in full] for r in range(size)]
        return full, shards, DenseChunks(s // size), DenseChunks(s // size)
    lengths = [10, 0, 3, 16 + 5 * size]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    cu_pad = cpm.pad_cu_seqlens(cu, size)
    full = [torch.randn(int(cu_pad[-1]), n, d, generator=gen, dtype=torch.float64) for n in (h, g, g, h)]
    shards = [[cpm.shard_thd(t, cu_pad, r, size) for t in full] for r in range(size)]
    max_chunk = int((cu_pad[1:] - cu_pad[:-1]).max()) // (2 * size)
    chunks = PackedChunks(cu, cu_pad, size, shards[0][0].shape[0], max_chunk)
    return full, shards, chunks, chunks


def _run_ring_in_threads(shards, q_chunks, kv_chunks, causal, scale, recorder, monkeypatch):
    size = len(shards)
    boxes = _Mailboxes(size)
    monkeypatch.setattr(cp_ring, "_exchange", boxes.exchange)
    results, failures = {}, []

    def rank_main(r):
        recorder.here.rank = ("ring", r)
        try:
            q, k, v, dout = shards[r]
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = cp_ring.ring_attention(q, k, v, Ring(None, size, r, (r + 1) % size, (r - 1) % size),
                                         q_chunks, kv_chunks, causal, scale)
            results[r] = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
        except Exception as e:  # noqa: BLE001 (re-raised below, with the rank)
            failures.append((r, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, f"ring rank {failures[0][0]} failed: {failures[0][1]!r}"
    return results


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("fmt", ["dense", "packed"])
@pytest.mark.parametrize("causal", [True, False])
def test_rank_schedule_is_the_ring(size, fmt, causal, monkeypatch):
    """rank_forward / rank_backward with every rank's K/V at hand call block_forward / block_backward on the
    same tensors with the same masks, in the same order, as rank r of RingAttention does, and give its
    out and dq exactly and its dK/dV (summed over the ranks) to rounding; dense: the unsharded result is
    full attention's."""
    full, shards, q_chunks, kv_chunks = _ring_case(fmt, size)
    scale = 0.35
    recorder = _Recorder(monkeypatch)
    ring = _run_ring_in_threads(shards, q_chunks, kv_chunks, causal, scale, recorder, monkeypatch)
    kv = [torch.stack([k, v]) for _, k, v, _ in shards]
    dkv = [torch.zeros_like(t) for t in kv]
    local = {}
    for r in range(size):
        recorder.here.rank = ("local", r)
        q, _, _, dout = shards[r]
        sched = RankSchedule(r, size, q_chunks, kv_chunks, causal, scale)
        out, lse, aux = rank_forward(sched, q, kv.__getitem__)
        local[r] = [out, rank_backward(sched, dout, q, out, lse, kv.__getitem__, aux, dkv.__getitem__)]
    for r in range(size):
        got, want = recorder.calls[("local", r)], recorder.calls[("ring", r)]
        assert len(got) == len(want) == 2 * sum(len(RankSchedule(r, size, q_chunks, kv_chunks, causal, scale).blocks(i))
                                                for i in range(size))
        for (name_a, ts_a, mask_a), (name_b, ts_b, mask_b) in zip(got, want):
            assert name_a == name_b and _same_mask(mask_a, mask_b)
            assert len(ts_a) == len(ts_b) and all(torch.equal(a, b) for a, b in zip(ts_a, ts_b))
        assert torch.equal(local[r][0], ring[r][0]) and torch.equal(local[r][1], ring[r][1])
        assert torch.allclose(dkv[r][0], ring[r][2], atol=1e-12) and torch.allclose(dkv[r][1], ring[r][3], atol=1e-12)
    if fmt == "dense":
        s = full[0].shape[1]
        out = cpm.unshard_sequence([local[r][0] for r in range(size)], 1)
        ref, _ = _ref(*full[:3], te_mask(s, s, "causal" if causal else "no_mask"), scale)
        assert torch.allclose(out, ref, atol=1e-12)


def test_bench_cp_ranks_do_the_whole_causal_attention():
    """benchmarks/bench_cp.py's ranks (RankSchedule with the other ranks' K/V at hand, as timed on the GPU):
    together they give full causal attention and its q, k, v gradients, and the pairs each scores (the FLOPs
    its floor is set by) are its share, 1/cp of the causal matrix."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_cp

    torch.manual_seed(4)
    s, scale = 32, 0.3
    full = [torch.randn(1, s, n, 8, dtype=torch.float64) for n in (4, 2, 2, 4)]
    qr, kr, vr = (t.clone().requires_grad_(True) for t in full[:3])
    ref, _ = _ref(qr, kr, vr, te_mask(s, s, "causal"), scale)
    ref.backward(full[3])
    for cp in (2, 4):
        ranks = bench_cp.ranks_for(full, cp, scale)
        outs, dqs = [], []
        for rank in ranks:
            out, lse, aux = rank.forward()
            outs.append(out)
            dqs.append(rank.backward(out, lse, aux)[0])
        dk, dv = (cpm.unshard_sequence([t[j] for t in ranks[0].dkv_all], 1) for j in (0, 1))
        for got, want in ((cpm.unshard_sequence(outs, 1), ref), (cpm.unshard_sequence(dqs, 1), qr.grad),
                          (dk, kr.grad), (dv, vr.grad)):
            assert torch.allclose(got, want, atol=1e-12)
        for rank in ranks:
            pairs = 0
            for i in range(cp):
                for qv, kvv, mask in rank.sched.blocks(i):
                    n_q, n_kv = ((v.stop or s // cp) - v.start for v in (qv, kvv))
                    pairs += n_q * (n_q + 1) // 2 if mask.right == 0 else n_q * n_kv
            assert pairs == bench_cp.rank_pairs(s, cp)
        assert cp * bench_cp.rank_pairs(s, cp) == s * (s + 1) // 2
