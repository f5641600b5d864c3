"""Tensor parallelism with sequence parallelism under block scaling: the FP8 all-gather of a block-scaled
activation (FP8 bytes + 1x128 scales, as the block-scaled column Linear gathers its input) against the bf16
all-gather of the same activation: bytes and time, over one GPU per rank.

    torchrun --standalone --nproc-per-node=N benchmarks/bench_block_gather.py [--rows 4096] [--hidden 4096 8192]
             [--iters I] [--rounds R] [--json out.json]
    python benchmarks/bench_block_gather.py --nproc-per-node N [...]   (checks the arguments, then starts torchrun)
    python benchmarks/bench_block_gather.py --nproc-per-node 2 --cpu   (gloo on the CPU, tiny sizes: the plumbing)

Each rank holds x_local [rows, hidden] bf16 (rows: its sequence shard, a multiple of 128 so that its 1x128 tiles
along the sequence are the gathered tensor's). Rows:
  bf16                     all-gather of x_local (a bf16 SP Linear's forward, and again in its backward for wgrad)
  FP8 rowwise              the forward's gather of the block-scaled input: FP8 bytes [rows, hidden] and scales
                           [hidden/128, rows], two all-gathers and the scales' re-order (te_parallel.ops.linear)
  FP8 columnwise           the backward's gather of the columnwise copy wgrad reads: bytes [hidden, rows] and scales
                           [rows/128, hidden]
  FP8 bytes alone          one all-gather of the rowwise bytes only: what the scales and their second collective add
  cast (local)             the 1x128 cast of x_local in both directions (no communication; FP8 pays it either way)
"MiB_per_rank" is what a rank contributes, "busbw_GBps" = gathered bytes × (tp−1)/tp / time (nccl-tests'
convention), "time_vs_bf16" and "bytes_vs_bf16" are against the bf16 row. The summary compares one fwd+bwd's
gathers: two bf16 gathers against the FP8 rowwise + columnwise pair. Every rank's time; the slowest is shown.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrun_bench as tb  # noqa: E402
from te_parallel.fp8.blockwise import quantize_blockwise  # noqa: E402
from te_parallel.ops import linear as linear_ops  # noqa: E402
from te_parallel.parallel.collectives import all_gather_dim0  # noqa: E402

BLOCK = 128
FP8 = torch.float8_e4m3fn
MIB = 2.0 ** 20


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bench_hidden(world: tb.World, args, hidden: int):
    gen = torch.Generator(device=world.device).manual_seed(world.rank)
    x_local = torch.randn(args.rows, hidden, generator=gen, device=world.device).to(torch.bfloat16)  # [s/tp, h]
    xq = quantize_blockwise(x_local, FP8, 1, rowwise=True, columnwise=True)
    row, col = xq.rowwise_only(), xq.only_columnwise()
    g = world.group
    steps = {
        "bf16": lambda: all_gather_dim0(x_local, g),
        "FP8 rowwise (forward)": lambda: linear_ops._gather(row, g),
        "FP8 columnwise (backward)": lambda: linear_ops._gather(col, g),
        "FP8 bytes alone": lambda: all_gather_dim0(row.data, g),
        "cast (local)": lambda: quantize_blockwise(x_local, FP8, 1, rowwise=True, columnwise=True),
    }
    sizes = {"bf16": nbytes(x_local), "FP8 rowwise (forward)": nbytes(row.data, row.scale_inv),
             "FP8 columnwise (backward)": nbytes(col.data_t, col.scale_inv_t), "FP8 bytes alone": nbytes(row.data),
             "cast (local)": 0}
    ms = tb.time_steps(world, steps, iters=args.iters, rounds=args.rounds)
    tp, rows = world.size, []
    for case, t in ms.items():
        moved = sizes[case] * tp * (tp - 1) / tp
        rows.append({"tp": tp, "rows_per_rank": args.rows, "hidden": hidden, "rank": world.rank, "case": case, "ms": t,
                     "MiB_per_rank": sizes[case] / MIB, "busbw_GBps": moved / (t * 1e-3) / 1e9 if moved else None,
                     "time_vs_bf16": t / ms["bf16"],
                     "bytes_vs_bf16": sizes[case] / sizes["bf16"] if sizes[case] else None})
    return rows


def summary(rows):
    """Per hidden size, the slowest rank's one fwd+bwd of gathers: 2 × bf16 against FP8 rowwise + columnwise."""
    out = []
    slow = {(r["hidden"], r["case"]): r for r in tb.worst(rows, "ms", ["hidden", "case"])}
    for hidden in sorted({r["hidden"] for r in rows}):
        bf16, fwd, bwd = (slow[(hidden, c)] for c in ("bf16", "FP8 rowwise (forward)", "FP8 columnwise (backward)"))
        fp8, b_fp8 = fwd["ms"] + bwd["ms"], fwd["MiB_per_rank"] + bwd["MiB_per_rank"]
        b_bf16, bf16 = 2 * bf16["MiB_per_rank"], 2 * bf16["ms"]
        out.append({"hidden": hidden, "bf16_2_gathers_ms": bf16, "fp8_row_col_ms": fp8, "time_vs_bf16": fp8 / bf16,
                    "bf16_MiB_per_rank": b_bf16, "fp8_MiB_per_rank": b_fp8, "bytes_vs_bf16": b_fp8 / b_bf16})
    return out


def parse_args(argv=None):
    ap = tb.parser(__doc__)
    ap.add_argument("--rows", type=int, default=None, help="sequence rows per rank (default 4096; 128 with --cpu)")
    ap.add_argument("--hidden", type=int, nargs="+", default=None, help="default 4096 8192 (256 with --cpu)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case and round (default 20; 2 with --cpu)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    args.rows = args.rows or (128 if args.cpu else 4096)
    args.hidden = args.hidden or ([256] if args.cpu else [4096, 8192])
    args.iters = args.iters or (2 if args.cpu else 20)
    tb.world_size_asked(ap, args)
    if args.rows < BLOCK or args.rows % BLOCK:
        ap.error(f"--rows {args.rows}: must be a positive multiple of {BLOCK} (whole 1x128 tiles along the sequence "
                 f"on each rank, as the Linear needs to gather FP8)")
    bad = [h for h in args.hidden if h < BLOCK or h % BLOCK]
    if bad:
        ap.error(f"--hidden {' '.join(map(str, bad))}: must be positive multiples of {BLOCK}")
    tb.check_counts(ap, args)
    return ap, args


def main(argv=None) -> None:
    args, world = tb.start(parse_args, argv)
    rows = []
    for hidden in args.hidden:
        rows += tb.all_rows(world, bench_hidden(world, args, hidden))
        if world.rank == 0:
            tb.write_json(args.json, f"bench_block_gather TP={world.size}", rows, world, summary=summary(rows))
    if world.rank == 0:
        tb.report(f"TP={world.size} SP all-gather of one activation shard, slowest rank per case",
                  tb.worst(rows, "ms", ["hidden", "case"]),
                  ["hidden", "case", "rank", "ms", "MiB_per_rank", "busbw_GBps", "time_vs_bf16", "bytes_vs_bf16"], None)
        tb.report("one fwd+bwd's gathers: bf16 (forward + backward re-gather) against FP8 rowwise + columnwise",
                  summary(rows), ["hidden", "bf16_2_gathers_ms", "fp8_row_col_ms", "time_vs_bf16", "bf16_MiB_per_rank",
                                  "fp8_MiB_per_rank", "bytes_vs_bf16"], None)
    tb.finish()


if __name__ == "__main__":
    main()
