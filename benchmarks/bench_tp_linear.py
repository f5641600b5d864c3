"""TP=2 sequence-parallel column Linear, fwd+bwd: FP8 all-gather vs bf16 all-gather vs bf16 (no FP8).

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_tp_linear.py [--tokens 8192] [--json out.json]

Shape: seq·batch = --tokens in total (each rank holds tokens/tp), hidden 4096 -> 12288
(each rank 6144 outputs). Rows: te bf16; te FP8 (delayed) gathering FP8 bytes (the default);
te FP8 gathering bf16 then casting; plus the all-gather alone of the bf16 and the FP8 input.
Rank 0 prints the table and writes JSON.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import init_torchrun_nccl, report, time_cuda  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.parallel.collectives import all_gather_dim0  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", type=int, default=12288)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rank, world, group = init_torchrun_nccl()
    dt, dev = torch.bfloat16, "cuda"
    batch = 2
    x = torch.randn(args.tokens // world // batch, batch, args.hidden, device=dev, dtype=dt, requires_grad=True)
    lin = te.Linear(args.hidden, args.out, parallel_mode="column", sequence_parallel=True, tp_group=group,
                    params_dtype=dt, device=dev)
    dy = torch.randn(args.tokens // batch, batch, args.out // world, device=dev, dtype=dt)
    rows = []

    def case(name, fp8_recipe, fp8_gather=True):
        lin.fp8_all_gather = fp8_gather

        def step():
            lin.drop_fp8_weight_cache()
            with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                y = lin(x)
            y.backward(dy)
        ms = time_cuda(step, warmup=10, iters=30)
        rows.append({"case": name, "ms": ms})

    case("te bf16 (bf16 all-gather)", None)
    case("te fp8 delayed, FP8 all-gather", recipe.DelayedScaling())
    case("te fp8 delayed, bf16 all-gather then cast", recipe.DelayedScaling(), fp8_gather=False)
    case("te fp8 current, FP8 all-gather", recipe.Float8CurrentScaling())
    x_local = x.detach().reshape(-1, args.hidden)
    x_fp8 = x_local.to(torch.float8_e4m3fn)
    rows.append({"case": "all-gather alone, bf16 input", "ms": time_cuda(lambda: all_gather_dim0(x_local, group))})
    rows.append({"case": "all-gather alone, FP8 input", "ms": time_cuda(lambda: all_gather_dim0(x_fp8, group))})
    base = rows[0]["ms"]
    for r in rows[:4]:
        r["speedup_vs_te_bf16"] = base / r["ms"]
    if rank == 0:
        title = f"TP={world} SP column Linear fwd+bwd, {args.tokens} tokens, {args.hidden}->{args.out} (median ms, rank 0)"
        report(title, rows, ["case", "ms", "speedup_vs_te_bf16"], args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
