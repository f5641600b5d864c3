"""Context parallelism's attention on one CUDA GPU: the flash kernels that return the log-sum-exp, the merge
and the per-block backward, and the whole ring's arithmetic with every rank's share run on the one device.

1. One block of queries against keys cut into blocks (dense: no mask, causal, sliding window; GQA): the
   blocks' (out, lse) merged and their backward with the merged statistics, in bf16 through the flash
   kernels, against fp64; outputs, lse and the gradients of q, k, v.
2. CP = 2 and 4 on one GPU: every rank's RankSchedule (cp_ring.rank_forward / rank_backward: the blocks,
   merges and dK/dV accumulations of RingAttention, with the other ranks' K/V already on the device instead
   of arriving over the ring), dense bshd and packed thd (uneven sequences, one empty), causal and no mask;
   the unsharded out, dq, dk, dv against fp64.

Tolerance (the CP rule of tests/distributed/test_context_parallel.py): the bf16 error against fp64 (on the
same bf16-rounded inputs) is within 2x the error of the unsplit attention run in bf16 by the same kernel in
one call (plus a floor of 2e-4, where that error is tiny).
"""
import math

import pytest
import torch

from te_parallel.ops.attention_lse import BlockMask, block_backward, block_forward, lse_kernel, merge
from te_parallel.parallel import context_parallel as cpm
from te_parallel.parallel.cp_ring import DenseChunks, PackedChunks, RankSchedule, rank_backward, rank_forward
from tests.attention_reference import te_mask
from tests.reference import rel_err

FLOOR = 2e-4
H, D = 8, 128


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"needs sm_80+ for the flash kernels, this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    return "cuda"


def _ref(q, k, v, masked, scale):
    """Dense q [b, s_q, h, d], k/v [b, s_kv, g, d] in fp64, masked bool [s_q, s_kv] (True = hidden) -> (out, lse)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(masked.to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", probs, v), lse.transpose(1, 2)


def _ref_grads(tensors, masked, rows, scale):
    """fp64 (out, lse, dq, dk, dv) of the query rows `rows` of dense attention, dout = tensors[3]."""
    q, k, v = (t.double().requires_grad_(True) for t in tensors[:3])
    out, lse = _ref(q[:, rows], k, v, masked, scale)
    out.backward(tensors[3].double())
    return out.detach(), lse.detach(), q.grad[:, rows], k.grad, v.grad


def _check(name, got, unsplit, exact):
    for what, g, u, e in zip(("out", "lse", "dq", "dk", "dv"), got, unsplit, exact):
        err, base = rel_err(g, e), rel_err(u, e)
        assert err <= 2 * base + FLOOR, f"{name} {what}: relative error {err:.2e} > 2 × {base:.2e} (unsplit, bf16)"


# -- 1. blocks of keys, merged ---------------------------------------------------------------------------------

def _layout(case: str, s: int, n: int, window: int):
    """(query rows, [(key slice, BlockMask)], the unsplit call's BlockMask, reference mask [rows, s])."""
    if case == "no_mask":
        blocks = [(slice(0, 300), BlockMask()), (slice(300, 700), BlockMask()), (slice(700, s), BlockMask())]
        return slice(0, s), blocks, BlockMask(), te_mask(s, s)
    # the last n queries (a chunk); bottom-right masks: query i' is at p = i' + len_kv − n of each block
    rows = slice(s - n, s)
    if case == "causal":
        blocks = [(slice(0, 384), BlockMask()), (slice(384, s - n), BlockMask()), (slice(s - n, s), BlockMask(-1, 0))]
        return rows, blocks, BlockMask(-1, 0), te_mask(s, s, "causal")[s - n:]
    # sliding window (window, 0): the earlier keys [0, s − n) are seen from p − (window − n) on, no right bound
    blocks = [(slice(0, s - n), BlockMask(window - n, -1)), (slice(s - n, s), BlockMask(window, 0))]
    return rows, blocks, BlockMask(window, 0), te_mask(s, s, "causal", (window, 0))[s - n:]


@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("case", ["no_mask", "causal", "window"])
def test_merged_blocks_against_unsplit(case, groups, cuda):
    torch.manual_seed(0)
    b, s, n, scale = 2, 1024, 256, 1 / math.sqrt(D)
    rows, blocks, whole, masked = _layout(case, s, n, window=384)
    full = [torch.randn(b, s, c, D, device=cuda).bfloat16().double() for c in (H, groups, groups)]
    full.append(torch.randn_like(full[0][:, rows]).bfloat16().double())
    q, k, v, dout = (t.bfloat16() for t in full)
    assert lse_kernel(q) == "flash"
    parts = [block_forward(q[:, rows], k[:, sl], v[:, sl], m, scale) for sl, m in blocks]
    out, lse = merge([p[0] for p in parts], [p[1] for p in parts])
    out = out.bfloat16()
    dq, dk, dv = (torch.zeros(t.shape, device=cuda) for t in (q[:, rows], k, v))
    for (sl, m), (_, _, aux) in zip(blocks, parts):
        gq, gk, gv = block_backward(dout, q[:, rows], k[:, sl], v[:, sl], out, lse, aux, m, scale)
        dq += gq.float()
        dk[:, sl] += gk.float()
        dv[:, sl] += gv.float()
    o1, l1, aux1 = block_forward(q[:, rows], k, v, whole, scale)  # the unsplit call
    o1 = o1.to(q.dtype)
    unsplit = [o1, l1, *(g.to(q.dtype) for g in block_backward(dout, q[:, rows], k, v, o1, l1, aux1, whole, scale))]
    got = [out, lse, *(g.to(q.dtype) for g in (dq, dk, dv))]
    _check(f"{case} g={groups}", got, unsplit, _ref_grads(full, masked, rows, scale))


# -- 2. the ring's arithmetic, every rank on one GPU ---------------------------------------------------------

LENGTHS = [700, 0, 33, 1500, 257]


def _inputs(fmt: str, cp: int, groups: int, device):
    """q, k, v, dout of one batch (dense [2, 1024, ..], or packed padded for 2·cp) in bf16 values held in fp64
    (the references see exactly the kernels' inputs), and the cu_seqlens."""
    gen = torch.Generator(device=device).manual_seed(3)
    if fmt == "dense":
        shape, cu, cu_pad = (lambda c: (2, 1024, c, D)), None, None  # noqa: E731
    else:
        cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32).to(device)
        cu_pad = cpm.pad_cu_seqlens(cu, cp)
        shape = lambda c: (int(cu_pad[-1]), c, D)  # noqa: E731
    full = [torch.randn(shape(c), generator=gen, device=device).bfloat16().double() for c in (H, groups, groups, H)]
    return full, cu, cu_pad


def _one_gpu_ring(shards, q_chunks, kv_chunks, causal: bool, scale: float):
    """Every rank's share of the ring (its RankSchedule) on this device -> per rank [out, dq, dk, dv] in bf16."""
    cp = len(shards)
    kv = [torch.stack([k, v]) for _, k, v, _ in shards]
    dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
    results = []
    for r, (q, _, _, dout) in enumerate(shards):
        sched = RankSchedule(r, cp, q_chunks, kv_chunks, causal, scale)
        out, lse, aux = rank_forward(sched, q, kv.__getitem__)
        results.append([out, rank_backward(sched, dout, q, out, lse, kv.__getitem__, aux, dkv.__getitem__)])
    for r in range(cp):
        results[r] += [dkv[r][0].bfloat16(), dkv[r][1].bfloat16()]
    return results


def _packed_ref(full, cu, causal: bool, scale: float):
    """fp64 out, dq, dk, dv of packed sequences (each on its own, dense per sequence); rows of padding stay 0."""
    q, k, v = (t.requires_grad_(True) for t in (x.detach().clone() for x in full[:3]))
    outs = torch.zeros_like(full[0])
    bounds = cu.tolist()
    for a, e in zip(bounds[:-1], bounds[1:]):
        if e > a:
            o, _ = _ref(q[None, a:e], k[None, a:e], v[None, a:e], te_mask(e - a, e - a, "causal" if causal else "no_mask"),
                        scale)
            outs[a:e] = o[0]
    outs.backward(full[3])
    return outs.detach(), q.grad, k.grad, v.grad


def _real_rows(cu, cu_pad):
    """Rows of the padded packed layout that hold real tokens."""
    return torch.cat([torch.arange(p, p + (e - a)) for a, e, p in zip(cu[:-1].tolist(), cu[1:].tolist(),
                                                                         cu_pad[:-1].tolist())]).to(cu.device)


@pytest.mark.parametrize("groups", [2, 8])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("fmt", ["dense", "packed"])
def test_ring_on_one_gpu_against_unsplit(fmt, mask, cp, groups, cuda):
    scale, causal = 1 / math.sqrt(D), mask == "causal"
    full, cu, cu_pad = _inputs(fmt, cp, groups, cuda)
    q, k, v, dout = (t.bfloat16() for t in full)
    if fmt == "dense":
        s = q.shape[1]
        shards = [[cpm.shard_sequence(t, 1, r, cp) for t in (q, k, v, dout)] for r in range(cp)]
        chunks = DenseChunks(s // cp)
        whole = BlockMask(-1, 0 if causal else -1)
        unshard = lambda ts: cpm.unshard_sequence(ts, 1)  # noqa: E731
        exact = _ref_grads(full, te_mask(s, s, mask), slice(0, s), scale)
        exact = [exact[0], *exact[2:]]
        keep = slice(None)
    else:
        shards = [[cpm.shard_thd(t, cu_pad, r, cp) for t in (q, k, v, dout)] for r in range(cp)]
        max_chunk = int((cu_pad[1:] - cu_pad[:-1]).max()) // (2 * cp)
        chunks = PackedChunks(cu, cu_pad, cp, shards[0][0].shape[0], max_chunk)
        unshard = lambda ts: cpm.unshard_thd(ts, cu_pad)  # noqa: E731
        keep = _real_rows(cu, cu_pad)
        # the unsplit call sees the real tokens only, packed without the padding
        q, k, v, dout = (t.index_select(0, keep) for t in (q, k, v, dout))
        whole = BlockMask(-1, 0 if causal else -1, cu, cu, max(LENGTHS), max(LENGTHS))
        exact = list(_packed_ref([t.index_select(0, keep) for t in full], cu, causal, scale))
    assert lse_kernel(q) == "flash"
    ranks = _one_gpu_ring(shards, chunks, chunks, causal, scale)
    got = [unshard([ranks[r][j] for r in range(cp)]) for j in range(4)]
    got = [t[:, keep] if fmt == "dense" else t.index_select(0, keep) for t in got]
    o1, l1, aux1 = block_forward(q, k, v, whole, scale)
    o1 = o1.to(q.dtype)  # (the flash kernels' outputs are bf16; the CPU's math ones fp32)
    unsplit = [o1, *(g.to(q.dtype) for g in block_backward(dout, q, k, v, o1, l1, aux1, whole, scale))]
    name = f"{fmt} {mask} cp={cp} g={groups}"
    for what, g, u, e in zip(("out", "dq", "dk", "dv"), got, unsplit, exact):
        err, base = rel_err(g, e), rel_err(u, e)
        assert err <= 2 * base + FLOOR, f"{name} {what}: relative error {err:.2e} > 2 × {base:.2e} (unsplit, bf16)"
