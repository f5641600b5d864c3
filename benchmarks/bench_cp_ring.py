"""Context parallelism over one GPU per rank: each rank's attention step (fwd+bwd) against the same rank's compute
with no communication, for the p2p ring, all_gather and a2a; and a rank's memory against CP = 1.

    torchrun --standalone --nproc-per-node=N benchmarks/bench_cp_ring.py [--seq 32768 131072] [--comm p2p ...]
             [--part time memory] [--iters I] [--rounds R] [--json out.json]
    python benchmarks/bench_cp_ring.py --nproc-per-node N [...]      (checks the arguments, then starts torchrun)
    python benchmarks/bench_cp_ring.py --nproc-per-node 2 --cpu      (gloo on the CPU, tiny sizes: the plumbing)

--seq is tokens PER GPU: the sequence is cp × that, in the causal load-balanced layout (rank r holds chunks r
and 2·cp−1−r). The step is te_parallel.DotProductAttention(cp_group=all ranks, cp_comm_type=...), causal, bshd,
batch 1; Llama-like heads: 32 query heads, 8 KV heads, head dim 128, bf16.

Floor: the rank's share of the p2p step without its transfers: te_parallel.parallel.cp_ring.RankSchedule run by
rank_forward / rank_backward with every other rank's K/V already on this GPU (the ring's blocks, LSE merges and
dK/dV sums, no communication). "ratio" = step ms / floor ms, per rank; the worst rank per length and comm type
is the figure (target: p2p within 1.1× of the floor). all_gather and a2a are against the same floor: the same
rank's causal FLOPs computed without communication. Times: steps issued back to back, interleaved rounds
(common.time_interleaved), median over rounds, on each rank.

Memory: per rank, q/k/v/dout plus the peak allocated above them during one step, against the same at CP = 1
(one GPU, no cp_group, the same tokens per GPU): "vs_cp1" (attention over cp× the keys at the same local length).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrun_bench as tb  # noqa: E402
import te_parallel as te  # noqa: E402
from te_parallel.ops.attention_lse import acc_dtype  # noqa: E402
from te_parallel.parallel.cp_ring import DenseChunks, RankSchedule, rank_backward, rank_forward  # noqa: E402

MIB = 2.0 ** 20
TARGET = 1.1
COMMS = ("p2p", "all_gather", "a2a")
CPU_SHAPE = dict(seq=[64], heads=4, kv_heads=2, head_dim=16)


def make_kv(src: int, s_local: int, groups: int, dim: int, device) -> torch.Tensor:
    """stack([k, v]) [2, 1, s_local, g, d] of rank src, the same on every rank (drawn from src's seed)."""
    gen = torch.Generator(device=device).manual_seed(1000 + src)
    return torch.randn(2, 1, s_local, groups, dim, generator=gen, device=device, dtype=torch.bfloat16)


class Floor:
    """This rank's p2p compute without transfers: the ring's schedule with every rank's K/V at hand."""

    def __init__(self, world: tb.World, q, dout, kv_all, scale: float) -> None:
        self.q, self.dout, self.kv_all = q, dout, kv_all
        self.dkv_all = [torch.zeros(kv.shape, dtype=acc_dtype(kv.dtype), device=kv.device) for kv in kv_all]
        chunks = DenseChunks(q.shape[1])
        self.sched = RankSchedule(world.rank, world.size, chunks, chunks, True, scale)

    def step(self) -> None:
        out, lse, aux = rank_forward(self.sched, self.q, self.kv_all.__getitem__)
        rank_backward(self.sched, self.dout, self.q, out, lse, self.kv_all.__getitem__, aux, self.dkv_all.__getitem__)


def attention_step(dpa, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def clear():
        q.grad = k.grad = v.grad = None

    def step():
        clear()
        dpa(q, k, v).backward(dout)
    step.clear = clear  # (before a memory measurement: the last call's gradients are not part of its base)
    return step


def build(world: tb.World, s_local: int, heads: int, groups: int, dim: int, comms):
    """(steps by name, the rank's inputs' bytes, the floor) at s_local tokens per GPU."""
    dev = world.device
    gen = torch.Generator(device=dev).manual_seed(world.rank)
    q = torch.randn(1, s_local, heads, dim, generator=gen, device=dev, dtype=torch.bfloat16)
    dout = torch.randn(1, s_local, heads * dim, generator=gen, device=dev, dtype=torch.bfloat16)
    kv_all = [make_kv(src, s_local, groups, dim, dev) for src in range(world.size)]
    k, v = kv_all[world.rank]
    kw = dict(num_gqa_groups=groups, qkv_format="bshd", attn_mask_type="causal", attention_dropout=0.0)
    ranks = list(range(world.size))
    steps = {}
    for comm in comms:
        dpa = te.DotProductAttention(heads, dim, cp_group=world.group, cp_global_ranks=ranks, cp_comm_type=comm, **kw)
        steps[comm] = attention_step(dpa, q, k, v, dout)
    floor = Floor(world, q, dout.view(q.shape), kv_all, 1 / math.sqrt(dim))
    steps["floor"] = floor.step
    cp1 = attention_step(te.DotProductAttention(heads, dim, **kw), q, k, v, dout)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    return steps, cp1, inputs


def bench_length(world: tb.World, args, s_local: int):
    steps, cp1, inputs = build(world, s_local, args.heads, args.kv_heads, args.head_dim, args.comm)
    rows = []
    if "time" in args.part:
        iters = args.iters or (1 if not world.cuda else max(1, (131072 // s_local) ** 2 // (2 * world.size)))
        ms = tb.time_steps(world, steps, iters=iters, rounds=args.rounds, warmup=1, settle=1)
        floor = ms["floor"]
        base = {"part": "time", "tokens_per_gpu": s_local, "total_tokens": s_local * world.size, "cp": world.size,
                "rank": world.rank, "floor_ms": floor}
        rows.append(dict(base, case="floor (no communication)", ms=floor, ratio=1.0))
        rows += [dict(base, case=comm, ms=ms[comm], ratio=ms[comm] / floor) for comm in args.comm]
    if "memory" in args.part:
        cp1.clear()
        one = tb.peak_bytes(world, cp1)
        total1 = inputs + one
        base = {"part": "memory", "tokens_per_gpu": s_local, "cp": world.size, "rank": world.rank,
                "inputs_MiB": inputs / MIB}
        rows.append(dict(base, case="cp 1 (no cp_group)", peak_over_inputs_MiB=one / MIB, total_MiB=total1 / MIB,
                         vs_cp1=1.0 if world.cuda else None))  # (the CPU measures no memory)
        for comm in args.comm:
            steps[comm].clear()
            peak = tb.peak_bytes(world, steps[comm])
            rows.append(dict(base, case=comm, peak_over_inputs_MiB=peak / MIB, total_MiB=(inputs + peak) / MIB,
                             vs_cp1=(inputs + peak) / total1 if world.cuda else None))
    return rows


def report_rows(rows, world_size: int) -> None:
    time_rows = [r for r in rows if r["part"] == "time"]
    if time_rows:
        tb.report(f"CP={world_size} attention step fwd+bwd per rank (ms) against the rank's compute with no "
                  f"communication (floor)", time_rows,
                  ["tokens_per_gpu", "total_tokens", "case", "rank", "ms", "floor_ms", "ratio"], None)
        worst = tb.worst([r for r in time_rows if r["case"] in COMMS], "ratio", ["tokens_per_gpu", "case"])
        for r in worst:
            r["within_target"] = r["ratio"] <= TARGET if r["case"] == "p2p" else None
        tb.report(f"worst rank per length and comm type (target: p2p within {TARGET}x of the floor)", worst,
                  ["tokens_per_gpu", "case", "rank", "ratio", "within_target"], None)
    mem_rows = [r for r in rows if r["part"] == "memory"]
    if mem_rows:
        tb.report(f"CP={world_size} one step's memory per rank (MiB) against CP=1 at the same tokens per GPU",
                  [r for r in mem_rows if r["rank"] == 0],
                  ["tokens_per_gpu", "case", "inputs_MiB", "peak_over_inputs_MiB", "total_MiB", "vs_cp1"], None)


def parse_args(argv=None):
    ap = tb.parser(__doc__)
    ap.add_argument("--seq", type=int, nargs="+", default=None, help="tokens per GPU (default 32768 131072)")
    ap.add_argument("--comm", nargs="+", default=list(COMMS), choices=COMMS)
    ap.add_argument("--part", nargs="+", default=["time", "memory"], choices=["time", "memory"])
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    shape = CPU_SHAPE if args.cpu else dict(seq=[32768, 131072], heads=32, kv_heads=8, head_dim=128)
    for name, value in shape.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    cp = tb.world_size_asked(ap, args)
    bad = [s for s in args.seq if s % 2 or s < 2 or (not args.cpu and s % 256)]
    if bad:
        ap.error(f"--seq {' '.join(map(str, bad))}: tokens per GPU must be even (two chunks per rank)"
                 + ("" if args.cpu else " and a multiple of 256 (chunks of whole 128-token tiles)"))
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if "a2a" in args.comm and args.heads % cp:
        ap.error(f"--heads {args.heads}: cp_comm_type a2a spreads the heads over the {cp} ranks; drop a2a from --comm "
                 f"or use a multiple of {cp} heads")
    if args.head_dim % 8 or args.head_dim > 256:
        ap.error(f"--head-dim {args.head_dim}: needs a multiple of 8 up to 256")
    tb.check_counts(ap, args)
    return ap, args


def main(argv=None) -> None:
    args, world = tb.start(parse_args, argv)
    rows = []
    for s_local in args.seq:
        rows += tb.all_rows(world, bench_length(world, args, s_local))
        if world.cuda:
            torch.cuda.empty_cache()
        if world.rank == 0:  # after each length, so that a run cut short keeps what it measured
            tb.write_json(args.json, f"bench_cp_ring CP={world.size}", rows, world, target=TARGET)
    if world.rank == 0:
        report_rows(rows, world.size)
    tb.finish()


if __name__ == "__main__":
    main()
