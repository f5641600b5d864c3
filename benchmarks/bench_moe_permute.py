"""MoE token routing on one GPU: moe_permute, moe_unpermute (with merging probs) and moe_sort_chunks_by_index,
forward and forward+backward, te_parallel's against another implementation of the same functions in the same run.

    python benchmarks/bench_moe_permute.py [--old PATH] [--tokens 16384] [--hidden 2048] [--experts 128]
                                           [--topk 8] [--ep 2] [--iters 30] [--profile] [--json out.json]

--old PATH: a Python file defining moe_permute / moe_unpermute / moe_sort_chunks_by_index with the same
  signatures (e.g. an earlier version of te_parallel/ops/moe_permute.py: `git show REV:te_parallel/ops/moe_permute.py
  > old.py`), timed beside te_parallel's, with the largest difference of their outputs and gradients.
Routing: each token picks its top-k experts of uniform random scores (every token exactly k rows, T·k in all);
probs are the softmax over the chosen k (fp32). sort_chunks re-sorts the T·k rows from [rank][local expert] to
[local expert][rank] chunks for --ep ranks, as expert-parallel dispatch does after its all-to-all.
"ms" is the median of --iters timed calls (CUDA events around each, after warm-up); "copy" is a clone of the
permuted buffer (one read and one write of T·k·hidden elements), the memory-bound floor of one row movement.
--profile prints torch.profiler's table of one forward+backward of each te_parallel op.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Parser  # noqa: E402
from te_parallel.ops import moe_permute as new_impl  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("moe_permute_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def make_case(tokens: int, hidden: int, experts: int, topk: int, ep: int):
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(tokens, experts, device=dev, generator=gen)
    top, chosen = scores.topk(topk, dim=1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=dev).scatter_(1, chosen, True)
    probs = torch.zeros(tokens, experts, device=dev).scatter_(1, chosen, torch.softmax(top, dim=1))
    rows = tokens * topk
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    y = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    g_rows = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    g_tokens = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    local = experts // ep
    sizes = routing_map.sum(0)  # [E] = [rank][local expert] chunk sizes
    order = torch.arange(experts, device=dev).view(ep, local).t().reshape(-1)
    return dict(x=x, y=y, g_rows=g_rows, g_tokens=g_tokens, routing_map=routing_map, probs=probs, rows=rows,
                sizes=sizes, order=order)


def op_calls(impl, c):
    """{op: (forward, forward+backward)} closures of one implementation; each returns its outputs/gradients."""
    x, y, probs = c["x"].requires_grad_(True), c["y"].requires_grad_(True), c["probs"].requires_grad_(True)
    _, row_id_map = impl.moe_permute(x.detach(), c["routing_map"], num_out_tokens=c["rows"])

    def permute():
        return impl.moe_permute(x, c["routing_map"], num_out_tokens=c["rows"])[0]

    def unpermute():
        return impl.moe_unpermute(y, row_id_map, merging_probs=probs)

    def sort_chunks():
        return impl.moe_sort_chunks_by_index(y, c["sizes"], c["order"])

    def fwd(f):
        def run():
            with torch.no_grad():
                return (f(),)
        return run

    def fwd_bwd(f, inputs, upstream):
        def run():
            out = f()
            return (out.detach(),) + torch.autograd.grad(out, inputs, upstream)
        return run

    return {"permute": (fwd(permute), fwd_bwd(permute, (x,), c["g_rows"])),
            "unpermute+probs": (fwd(unpermute), fwd_bwd(unpermute, (y, probs), c["g_tokens"])),
            "sort_chunks": (fwd(sort_chunks), fwd_bwd(sort_chunks, (y,), c["g_rows"]))}


def largest_difference(a, b) -> float:
    return max(((u.double() - v.double()).abs().max().item() / max(v.double().abs().max().item(), 1e-30))
               for u, v in zip(a, b))


def no_host_sync(calls) -> str:
    """Run each forward+backward once with torch's sync debug mode set to error: "none", or what synced."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, (_, both) in calls.items():
            both()
    except RuntimeError as exc:
        return f"{name}: {str(exc).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def profile(calls) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for _, both in calls.values():
        both()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _, both in calls.values():
            both()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        print(averages.table(sort_by="device_time_total", row_limit=30))
    except (AttributeError, KeyError, ValueError):
        print(averages.table(sort_by="cuda_time_total", row_limit=30))


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default=None, help="file with another implementation to time beside te_parallel's")
    for name, default in (("tokens", 16384), ("hidden", 2048), ("experts", 128), ("topk", 8), ("ep", 2),
                          ("iters", 30)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.tokens, args.hidden, args.experts, args.topk, args.ep, args.iters) < 1:
        p.error("--tokens, --hidden, --experts, --topk, --ep and --iters must be positive")
    if args.topk > args.experts or args.experts % args.ep:
        p.error(f"--topk {args.topk} must be <= --experts {args.experts}, which must divide by --ep {args.ep}")
    if args.old is not None and not os.path.isfile(args.old):
        p.error(f"--old {args.old!r} is not a file")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    case = make_case(args.tokens, args.hidden, args.experts, args.topk, args.ep)
    impls = {"te_parallel": new_impl}
    if args.old is not None:
        impls["old"] = load_module(args.old)
    calls = {name: op_calls(impl, case) for name, impl in impls.items()}
    moved_gb = 2 * case["rows"] * args.hidden * 2 / 1e9
    copy_ms = median_ms(lambda: case["y"].detach().clone(), args.iters)
    print(f"shape: tokens {args.tokens}, hidden {args.hidden}, experts {args.experts}, top-{args.topk}, ep {args.ep}, "
          f"bf16; copy of the permuted buffer {copy_ms:.3f} ms ({moved_gb / copy_ms * 1e3:.0f} GB/s)")
    rows = []
    for op in calls["te_parallel"]:
        for kind, index in (("fwd", 0), ("fwd+bwd", 1)):
            row = {"op": op, "pass": kind}
            for name in impls:
                row[f"{name} ms"] = median_ms(calls[name][op][index], args.iters)
            if "old" in impls:
                row["speedup"] = row["old ms"] / row["te_parallel ms"]
                row["max rel diff"] = largest_difference(calls["te_parallel"][op][index](), calls["old"][op][index]())
            rows.append(row)
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    print(f"te_parallel from {os.path.dirname(new_impl.__file__)}")
    syncs = no_host_sync(calls["te_parallel"])
    print(f"host syncs in te_parallel's forward+backward: {syncs}")
    if args.profile:
        profile(calls["te_parallel"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "copy_ms": copy_ms, "host_syncs": syncs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
