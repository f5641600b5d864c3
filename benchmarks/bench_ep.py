"""Expert parallelism over one GPU per rank: te_parallel's MoE dispatch and combine against
torch.distributed.all_to_all_single on the same bytes, and the MoE layer step at EP = world against EP = 1.

    torchrun --standalone --nproc-per-node=N benchmarks/bench_ep.py [--tokens 16384] [--part comm layer]
             [--iters I] [--rounds R] [--json out.json]
    python benchmarks/bench_ep.py --nproc-per-node N [...]      (checks the arguments, then starts torchrun)
    python benchmarks/bench_ep.py --nproc-per-node 2 --cpu      (gloo on the CPU, tiny sizes: the plumbing)

Qwen3-30B-A3B-like MoE: 128 experts, top-8, hidden 2048, expert FFN 768, bf16; --tokens per GPU (fixed as the
world grows: each rank routes its own batch, as data-parallel ranks do).

--part comm (forward only, one routing drawn per rank from a fixed seed: uniform top-k, so each rank sends about
(ep−1)/ep of its tokens·topk rows away):
  dispatch            te_parallel.moe.dispatch: permute by expert, the counts' all-to-all and the host read of the
                      split sizes, the rows' all-to-all, the re-sort by local expert
  combine             te_parallel.moe.combine: re-sort, the rows' all-to-all back, unpermute weighted by the probs
  all_to_all_single   torch.distributed.all_to_all_single alone with the same split sizes, each way
Bandwidth as nccl-tests' alltoall: algbw = bytes this rank sends (the rows' all-to-all's input) / time,
busbw = algbw × (ep−1)/ep; "vs_a2a" = the a2a alone's time / the te_parallel op's (1.0: no overhead beyond the
bytes). The worst rank's time decides a step, so the table gives every rank and the worst.

--part layer: te_parallel.MoELayer fwd+bwd (router, dispatch, grouped SwiGLU experts, combine) on [tokens, hidden]
per GPU: ep_group = all ranks (128 / ep experts per rank) against ep_group = None (all 128 experts on every rank,
no communication), µs per token and their ratio.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrun_bench as tb  # noqa: E402
from common import training_step  # noqa: E402
from te_parallel.moe import MoELayer, combine, dispatch  # noqa: E402

GPU_SHAPE = dict(tokens=16384, experts=128, topk=8, hidden=2048, ffn=768)
CPU_SHAPE = dict(tokens=64, experts=8, topk=2, hidden=32, ffn=64)


def routing(world: tb.World, tokens: int, experts: int, topk: int):
    """(probs [T, E] fp32 as MoELayer's router gives them, zeros off the map; routing_map [T, E] bool, topk per row):
    uniform top-k."""
    gen = torch.Generator(device=world.device).manual_seed(world.rank)
    scores = torch.rand(tokens, experts, generator=gen, device=world.device)
    top, idx = scores.topk(topk, dim=1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=world.device).scatter_(1, idx, True)
    probs = torch.zeros(tokens, experts, device=world.device).scatter_(1, idx, top.softmax(1))
    return probs, routing_map


def bench_comm(world: tb.World, args, dtype):
    dev, ep = world.device, world.size
    gen = torch.Generator(device=dev).manual_seed(100 + world.rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=dev, dtype=dtype)
    probs, routing_map = routing(world, args.tokens, args.experts, args.topk)
    local = args.experts // ep
    with torch.no_grad():
        rows, _, disp = dispatch(x, probs, routing_map, args.topk, world.group, local)
    send, recv = disp.ep.send, disp.ep.recv
    permuted = torch.randn(sum(send), args.hidden, generator=gen, device=dev, dtype=dtype)
    got, back = torch.empty(sum(recv), args.hidden, device=dev, dtype=dtype), torch.empty_like(permuted)

    def te_dispatch():
        with torch.no_grad():
            dispatch(x, probs, routing_map, args.topk, world.group, local)

    def te_combine():
        with torch.no_grad():
            combine(rows, disp)

    steps = {
        "dispatch": te_dispatch,
        "a2a dispatch's splits": lambda: dist.all_to_all_single(got, permuted, recv, send, group=world.group),
        "combine": te_combine,
        "a2a combine's splits": lambda: dist.all_to_all_single(back, got, send, recv, group=world.group),
    }
    ms = tb.time_steps(world, steps, iters=args.iters, rounds=args.rounds)
    elem = x.element_size() * args.hidden
    sent = {"dispatch": sum(send) * elem, "combine": sum(recv) * elem}
    out = []
    for op, a2a in (("dispatch", "a2a dispatch's splits"), ("combine", "a2a combine's splits")):
        for case, t in ((f"te_parallel {op}", ms[op]), (f"all_to_all_single, {op}'s bytes", ms[a2a])):
            algbw = sent[op] / (t * 1e-3) / 1e9
            out.append({"part": "comm", "ep": ep, "rank": world.rank, "op": op, "case": case, "ms": t,
                        "MiB_sent": sent[op] / 2 ** 20, "algbw_GBps": algbw, "busbw_GBps": algbw * (ep - 1) / ep,
                        "vs_a2a": ms[a2a] / t})
    return out


def bench_layer(world: tb.World, args, dtype):
    dev = world.device
    shape = (args.hidden, args.ffn, args.experts, args.topk)
    gen = torch.Generator(device=dev).manual_seed(200 + world.rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.tokens, args.hidden, generator=gen, device=dev, dtype=dtype)
    torch.manual_seed(0)
    ep_layer = MoELayer(*shape, ep_group=world.group, params_dtype=dtype, device=dev)
    torch.manual_seed(0)
    one = MoELayer(*shape, params_dtype=dtype, device=dev)
    steps = {f"EP={world.size}": training_step(ep_layer, x, dy), "EP=1": training_step(one, x, dy)}
    ms = tb.time_steps(world, steps, iters=args.iters, rounds=args.rounds)
    base = ms["EP=1"]
    return [{"part": "layer", "ep": world.size, "rank": world.rank, "case": name, "tokens_per_gpu": args.tokens,
             "experts_per_gpu": args.experts // (world.size if name != "EP=1" else 1), "ms": t,
             "us_per_token": t * 1e3 / args.tokens, "vs_ep1": t / base} for name, t in ms.items()]


def report_rows(rows, ep: int) -> None:
    comm = [r for r in rows if r["part"] == "comm"]
    if comm:
        tb.report(f"EP={ep} dispatch / combine (forward) against all_to_all_single on the same bytes, every rank", comm,
                  ["op", "case", "rank", "ms", "MiB_sent", "algbw_GBps", "busbw_GBps", "vs_a2a"], None)
        tb.report("slowest rank per case", tb.worst(comm, "ms", ["case"]),
                  ["op", "case", "rank", "ms", "busbw_GBps", "vs_a2a"], None)
    layer = [r for r in rows if r["part"] == "layer"]
    if layer:
        tb.report(f"MoE layer fwd+bwd per GPU: EP={ep} against EP=1 (slowest rank per case)",
                  tb.worst(layer, "ms", ["case"]),
                  ["case", "rank", "tokens_per_gpu", "experts_per_gpu", "ms", "us_per_token", "vs_ep1"], None)


def parse_args(argv=None):
    ap = tb.parser(__doc__)
    for name in GPU_SHAPE:
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"default {GPU_SHAPE[name]} ({CPU_SHAPE[name]} with --cpu)")
    ap.add_argument("--part", nargs="+", default=["comm", "layer"], choices=["comm", "layer"])
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case and round (default 20; 2 with --cpu)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    for name, value in (CPU_SHAPE if args.cpu else GPU_SHAPE).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.iters is None:
        args.iters = 2 if args.cpu else 20
    ep = tb.world_size_asked(ap, args)
    small = [f"--{n} {getattr(args, n)}" for n in GPU_SHAPE if getattr(args, n) < 1]
    if small:
        ap.error(f"{', '.join(small)}: each must be at least 1")
    if args.experts % ep:
        ap.error(f"--experts {args.experts} is not divisible by the {ep} ranks of the EP group")
    if args.topk > args.experts:
        ap.error(f"--topk {args.topk} is more than --experts {args.experts}")
    tb.check_counts(ap, args)
    return ap, args


def main(argv=None) -> None:
    args, world = tb.start(parse_args, argv)
    dtype = torch.bfloat16 if world.cuda else torch.float32  # (the CPU's grouped GEMMs run in fp32)
    rows = []
    for part, fn in (("comm", bench_comm), ("layer", bench_layer)):
        if part in args.part:
            rows += tb.all_rows(world, fn(world, args, dtype))
            if world.rank == 0:
                shape = {n: getattr(args, n) for n in GPU_SHAPE}
                tb.write_json(args.json, f"bench_ep EP={world.size}", rows, world, shape=shape)
    if world.rank == 0:
        report_rows(rows, world.size)
    tb.finish()


if __name__ == "__main__":
    main()
