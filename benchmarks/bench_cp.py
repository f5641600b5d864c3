"""Context parallelism (p2p ring, causal load-balanced layout) on one GPU: each rank's share of a CP step against
the unsplit attention with the same FLOPs, and a rank's memory against cp = 1.

    python benchmarks/bench_cp.py [--seq 32768 131072] [--cp 2 4 8] [--part time memory] [--iters N]
                                  [--json out.json]

Method. Rank r of a CP group holds chunks r and 2·cp−1−r of the 2·cp chunks of the sequence. Its share of a
p2p step is te_parallel.parallel.cp_ring.RankSchedule run by rank_forward / rank_backward: the same blocks
(the causal diagonal of its two chunks, then one no-mask block of half its queries or half the keys per
other rank), the same fp32 LSE merges and the same dq / dK/dV accumulations as RingAttention, with the other
ranks' K/V already on this GPU instead of arriving over the ring (the CPU suite checks that these are the
ring's blocks, tensor for tensor). So "rank ms" is a rank's step without communication, forward + backward.
The load-balanced layout gives every rank exactly 1/cp of the causal score matrix, so the floor is
  floor = (unsplit causal attention over the whole sequence, one flash call forward + one backward) / cp:
the same kernels on the same FLOPs, at the length where they are most efficient; "ratio" = rank ms / floor
(1.0: splitting costs nothing but the transfers). "ratio_equal_call" is against one causal call with the
rank's FLOPs (length s/√cp rounded to 128, its time scaled by the exact FLOP ratio), a laxer floor. The
row "cp 1 cuDNN" is the unsplit attention through SDPA's cuDNN kernel (DotProductAttention's pick at cp = 1 on
sm_90), for the kernel's share of any gap: the ring's blocks run the flash kernels that return the LSE.
Memory: one rank's step, from its inputs to its gradients: its q, k, v, dout, the peak measured above them,
and the ring's transfer buffers (one received K/V in the forward; a received K/V and two fp32 dK/dV sums in
the backward), which this one-GPU run does not allocate, counted from their shapes; against the unsplit
call's (cp = 1) the same way. Llama-like sizes: 32 heads, 8 KV heads, head dim 128, bf16, batch 1.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Parser, environment, report, time_interleaved  # noqa: E402
from te_parallel.ops.attention_lse import BlockMask, acc_dtype, block_backward, block_forward  # noqa: E402
from te_parallel.parallel import context_parallel as cpm  # noqa: E402
from te_parallel.parallel.cp_ring import DenseChunks, RankSchedule, rank_backward, rank_forward  # noqa: E402

MIB = 2.0 ** 20
CAUSAL = BlockMask(-1, 0)


def rank_pairs(s: int, cp: int) -> int:
    """(query, key) pairs one rank scores under the causal mask: the diagonal of its two chunks (n rows each:
    n² + n(n+1)) and 2n² per other rank; cp of them make s(s+1)/2, the whole causal matrix."""
    n = s // (2 * cp)
    return n * n + n * (n + 1) + (cp - 1) * 2 * n * n


def tflops(pairs: int, heads: int, dim: int, ms: float) -> float:
    """Forward 4 and backward 10 flops per scored pair per head and head-dim unit (flash-attention's count)."""
    return 14 * pairs * heads * dim / (ms * 1e-3) / 1e12


class Rank:
    """Rank r's share of a p2p CP step on this GPU: its shards, every rank's K/V, the dK/dV sums it adds to."""

    def __init__(self, full, r: int, cp: int, kv_all, dkv_all, scale: float) -> None:
        self.q, self.k, self.v, self.dout = (cpm.shard_sequence(t, 1, r, cp) for t in full)
        self.r, self.kv_all, self.dkv_all = r, kv_all, dkv_all
        chunks = DenseChunks(self.q.shape[1])
        self.sched = RankSchedule(r, cp, chunks, chunks, True, scale)

    def _kv_of(self, own):
        return lambda src: own if src == self.r else self.kv_all[src]

    def forward(self):
        own = torch.stack([self.k, self.v])  # the ring's first message, stacked as RingAttention does
        return rank_forward(self.sched, self.q, self._kv_of(own))

    def backward(self, out, lse, aux):
        own = torch.stack([self.k, self.v])
        dq = rank_backward(self.sched, self.dout, self.q, out, lse, self._kv_of(own), aux, self.dkv_all.__getitem__)
        return dq, self.dkv_all[self.r].to(self.k.dtype)  # the own block's sum, cast as the ring's last step does

    def step(self):
        self.backward(*self.forward())

    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.dout))

    def ring_buffer_bytes(self) -> int:
        """What the ring holds beyond this run at its peak, in the backward: a received K/V and two fp32 dK/dV
        sums (the one being added to and the one arriving); the forward holds only a received K/V."""
        return 2 * self.k.numel() * self.k.element_size() + 2 * (2 * self.k.numel() * 4)


def unsplit_step(q, k, v, dout, scale):
    def step():
        out, lse, aux = block_forward(q, k, v, CAUSAL, scale)
        return block_backward(dout, q, k, v, out, lse, aux, CAUSAL, scale)
    return step


def cudnn_step(q, k, v, dout, scale):
    """The unsplit causal attention through SDPA's cuDNN kernel (what DotProductAttention picks at cp = 1 on
    sm_90): a second floor, for the kernel rather than the split. None where SDPA has no cuDNN kernel for it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))  # [b, h, s, d] views
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return torch.autograd.grad(out, (q, k, v), dout)
    try:
        step()
    except RuntimeError as e:
        print(f"(no cuDNN row: {str(e).splitlines()[0]})")
        return None
    return step


def make_inputs(s: int, heads: int, groups: int, dim: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, s, n, dim, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (heads, groups, groups, heads)]


def ranks_for(full, cp: int, scale: float):
    kv_all = [torch.stack([cpm.shard_sequence(t, 1, r, cp) for t in full[1:3]]) for r in range(cp)]
    dkv_all = [torch.zeros(t.shape, dtype=acc_dtype(t.dtype), device=t.device) for t in kv_all]
    return [Rank(full, r, cp, kv_all, dkv_all, scale) for r in range(cp)]


def bench_time(s: int, cps, heads: int, groups: int, dim: int, iters: int):
    scale = 1 / math.sqrt(dim)
    full = make_inputs(s, heads, groups, dim)
    steps = {"unsplit": unsplit_step(*full, scale)}
    cudnn = cudnn_step(*full, scale)
    if cudnn is not None:
        steps["unsplit cuDNN"] = cudnn
    equal = {}
    for cp in cps:
        length = max(128, round(s / math.sqrt(cp) / 128) * 128)
        equal[cp] = length
        steps[f"equal cp={cp}"] = unsplit_step(*(t[:, :length] for t in full), scale)
        for rank in ranks_for(full, cp, scale):
            steps[f"cp={cp} rank {rank.r}"] = rank.step
    ms = time_interleaved(steps, warmup=1, iters=iters, rounds=3, settle=1)
    floor_full = ms["unsplit"]
    rows = [{"seq": s, "cp": 1, "rank": "-", "ms": floor_full, "floor_ms": floor_full, "ratio": 1.0,
             "tflops": tflops(s * (s + 1) // 2, heads, dim, floor_full)}]
    if "unsplit cuDNN" in ms:
        t = ms["unsplit cuDNN"]
        rows.append({"seq": s, "cp": 1, "rank": "cuDNN", "ms": t, "floor_ms": floor_full, "ratio": t / floor_full,
                     "tflops": tflops(s * (s + 1) // 2, heads, dim, t)})
    for cp in cps:
        length = equal[cp]
        equal_ms = ms[f"equal cp={cp}"] * rank_pairs(s, cp) / (length * (length + 1) // 2)
        for r in range(cp):
            t = ms[f"cp={cp} rank {r}"]
            rows.append({"seq": s, "cp": cp, "rank": r, "ms": t, "floor_ms": floor_full / cp, "ratio": t / (floor_full / cp),
                         "ratio_equal_call": t / equal_ms, "tflops": tflops(rank_pairs(s, cp), heads, dim, t)})
    return rows


def _measure(forward, backward):
    """(activations held from forward to backward, peak above what was allocated before), bytes."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    saved = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    grads = backward(saved)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del saved, grads
    return held, peak


def bench_memory(s: int, cps, heads: int, groups: int, dim: int):
    scale = 1 / math.sqrt(dim)
    full = make_inputs(s, heads, groups, dim)
    q, k, v, dout = full
    inputs = sum(t.numel() * t.element_size() for t in full)
    held, peak = _measure(lambda: block_forward(q, k, v, CAUSAL, scale),
                          lambda saved: block_backward(dout, q, k, v, *saved, CAUSAL, scale))
    base_total = inputs + peak
    rows = [{"seq": s, "cp": 1, "inputs_MiB": inputs / MIB, "held_fwd_to_bwd_MiB": held / MIB, "peak_over_inputs_MiB": peak / MIB,
             "ring_buffers_MiB": 0.0, "total_MiB": base_total / MIB, "vs_cp1": 1.0, "ideal_1_over_cp": 1.0}]
    for cp in cps:
        rank = ranks_for(full, cp, scale)[0]  # every rank's shapes are the same
        held, peak = _measure(rank.forward, lambda saved: rank.backward(*saved))
        total = rank.input_bytes() + peak + rank.ring_buffer_bytes()
        rows.append({"seq": s, "cp": cp, "inputs_MiB": rank.input_bytes() / MIB, "held_fwd_to_bwd_MiB": held / MIB,
                     "peak_over_inputs_MiB": peak / MIB, "ring_buffers_MiB": rank.ring_buffer_bytes() / MIB,
                     "total_MiB": total / MIB, "vs_cp1": total / base_total, "ideal_1_over_cp": 1 / cp})
        rank = None  # (its shards and K/V go before the next size is measured)
    return rows


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072], help="total sequence lengths")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="CP sizes (each > 1)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--part", nargs="+", default=["time", "memory"], choices=["time", "memory"])
    ap.add_argument("--iters", type=int, default=None, help="timed steps per row and round (default: 1 at 128k tokens, 8 at 32k)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if any(c < 2 for c in args.cp):
        ap.error(f"--cp {' '.join(map(str, args.cp))}: CP sizes must be at least 2 (cp = 1 is the unsplit row)")
    for s in args.seq:
        bad = [c for c in args.cp if s % (2 * c) or s // (2 * c) < 128]
        if bad:
            ap.error(f"--seq {s}: must be a multiple of 2·cp with chunks of at least 128 tokens for cp = "
                     f"{', '.join(map(str, bad))}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 8 or args.head_dim > 256:
        ap.error(f"--head-dim {args.head_dim}: the flash kernels need a multiple of 8 up to 256")
    if args.iters is not None and args.iters < 1:
        ap.error(f"--iters {args.iters}: need at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cp needs a CUDA GPU")
    results = []
    shape = dict(heads=args.heads, groups=args.kv_heads, dim=args.head_dim)
    for s in args.seq:
        if "time" in args.part:
            iters = args.iters or max(1, (131072 // s) ** 2 // 2)  # ~1 s of steps per row and round
            rows = bench_time(s, args.cp, iters=iters, **shape)
            report(f"p2p CP step on one GPU, seq {s}: each rank's fwd+bwd (no transfers) against the unsplit causal "
                   f"call / cp", rows, ["seq", "cp", "rank", "ms", "floor_ms", "ratio", "ratio_equal_call", "tflops"], None)
            worst = [max((r for r in rows if r["cp"] == cp), key=lambda r: r["ratio"]) for cp in args.cp]
            report(f"worst rank per cp, seq {s}", worst, ["seq", "cp", "rank", "ratio", "ratio_equal_call"], None)
            results += [dict(r, part="time") for r in rows]
        if "memory" in args.part:
            rows = bench_memory(s, args.cp, **shape)
            report(f"one rank's attention step memory, seq {s} (MiB)", rows,
                   ["seq", "cp", "inputs_MiB", "held_fwd_to_bwd_MiB", "peak_over_inputs_MiB", "ring_buffers_MiB",
                    "total_MiB", "vs_cp1", "ideal_1_over_cp"], None)
            results += [dict(r, part="memory") for r in rows]
        torch.cuda.empty_cache()
        if args.json:  # after each length, so that a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"title": "bench_cp", "env": environment(), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
