"""FP8 te.Linear fwd+bwd vs torch bf16 nn.Linear, same run, same GPU.

    python benchmarks/bench_linear.py [--shapes 8192x4096x16384 ...] [--json out.json]
    python benchmarks/bench_linear.py --sweep      (FP8 vs bf16 over GEMM sizes: the small-GEMM threshold)

Rows per shape (tokens × in → out), bf16 activations and weights:
  torch bf16         torch.nn.Linear
  te bf16            te.Linear outside fp8_autocast
  te fp8 delayed     te.Linear in fp8_autocast(DelayedScaling), weight recast every step (every GEMM in FP8)
  te fp8 current     te.Linear in fp8_autocast(Float8CurrentScaling), weight recast every step
  te fp8 delayed, torch._scaled_mm GEMM   the delayed row with every FP8 GEMM through torch._scaled_mm
                     instead of te_parallel's own cuBLASLt call (csrc/gemm; MMParams(backend="native"))
  TE bf16 / TE fp8 delayed / TE fp8 current   NVIDIA Transformer Engine's te.Linear, when it is installed
"ms" is per step with steps issued back to back (as a training loop runs), the median of 7 rounds that
each time every row (common.time_interleaved: no row gains from its place in the sequence),
"ms_synced" per step started on an idle GPU (host latency to the first kernel included).
"Weight recast every step" models training (the optimizer changes the weight each step), so the
weight cast is inside the timing; the speedup column is torch bf16 time / row time.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import (OTHER_GEMM_LABEL, report, te_training_step, time_cuda, time_cuda_stream,  # noqa: E402
                    time_interleaved, training_step, transformer_engine, with_torch_gemm)
from te_parallel import recipe  # noqa: E402
from te_parallel.native import gemm as gemm_kernels  # noqa: E402


SETTLE = None  # untimed steps before each timed sample (common.time_interleaved; --settle)


def bench_shape(m: int, k: int, n: int):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    ref = torch.nn.Linear(k, n, device=dev, dtype=dt)
    lin = te.Linear(k, n, device=dev, params_dtype=dt)
    flops = 3 * 2 * m * k * n
    rows = []
    cases = [("torch bf16", ref, None), ("te bf16", lin, None),
             ("te fp8 delayed", lin, recipe.DelayedScaling()), ("te fp8 current", lin, recipe.Float8CurrentScaling())]
    if gemm_kernels.usable():
        cases.append((f"te fp8 delayed, {OTHER_GEMM_LABEL}", lin, with_torch_gemm(recipe.DelayedScaling())))
    steps = {name: training_step(mod, x, dy, rec) for name, mod, rec in cases}
    te_peer = transformer_engine()
    if te_peer is not None:
        peer = te_peer.Linear(k, n, params_dtype=dt, device=dev)
        for kind in (None, "delayed", "current"):
            steps[f"TE {'bf16' if kind is None else 'fp8 ' + kind}"] = te_training_step(peer, x, dy, kind)
    back_to_back = time_interleaved(steps, settle=SETTLE)
    synced = {name: time_cuda(step) for name, step in steps.items()}
    base, base_synced = back_to_back["torch bf16"], synced["torch bf16"]
    for name in steps:
        ms = back_to_back[name]
        rows.append({"shape": f"{m}x{k}->{n}", "case": name, "ms": ms, "tflops": flops / ms / 1e9,
                     "speedup_vs_torch_bf16": base / ms, "ms_synced": synced[name],
                     "synced_speedup": base_synced / synced[name]})
    return rows


SWEEP = ["1024x1024x1024", "2048x768x3072", "2048x2048x2048", "4096x2048x2048", "8192x2048x2048",
         "4096x4096x4096", "8192x4096x4096", "8192x4096x8192", "8192x4096x16384"]


def sweep(shapes, json_path) -> None:
    """te FP8 (every GEMM in FP8, the recipes' default) against te bf16 (what a min_fp8_gemm fallback runs)."""
    rows = []
    for s in shapes:
        m, k, n = (int(v) for v in s.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = te.Linear(k, n, device="cuda", params_dtype=torch.bfloat16)
        bf = time_cuda_stream(training_step(lin, x, dy))
        f8 = time_cuda_stream(training_step(lin, x, dy, recipe.DelayedScaling()))
        rows.append({"shape": s, "MKN": m * k * n, "te_bf16_ms": bf, "te_fp8_forced_ms": f8, "fp8_speedup": bf / f8})
    rows.sort(key=lambda r: r["MKN"])
    # the smallest size from which FP8 wins at every larger measured shape
    wins = [r["fp8_speedup"] >= 1.0 for r in rows]
    first = next((i for i in range(len(rows)) if all(wins[i:])), None)
    report("FP8 vs bf16 by GEMM size (te.Linear fwd+bwd, ms per step back to back)", rows,
           ["shape", "MKN", "te_bf16_ms", "te_fp8_forced_ms", "fp8_speedup"], json_path)
    if first is not None:
        print(f"FP8 wins from M*K*N = {rows[first]['MKN']:.3g} ({rows[first]['shape']}); "
              f"largest losing size {rows[first - 1]['MKN']:.3g}" if first else "FP8 wins at every measured size")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["8192x4096x16384"])
    ap.add_argument("--sweep", action="store_true", help="FP8 vs bf16 over GEMM sizes (the small-GEMM threshold)")
    ap.add_argument("--settle", type=int, default=None,
                    help="untimed steps before each timed sample (default: as many as are timed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    global SETTLE
    SETTLE = args.settle
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA GPU")
    if args.sweep:
        sweep(args.shapes if args.shapes != ["8192x4096x16384"] else SWEEP, args.json)
        return
    rows = []
    for s in args.shapes:
        m, k, n = (int(v) for v in s.split("x"))
        rows += bench_shape(m, k, n)
    report("Linear fwd+bwd (ms per step back to back; ms_synced: each step from an idle GPU)", rows,
           ["shape", "case", "ms", "tflops", "speedup_vs_torch_bf16", "ms_synced", "synced_speedup"], args.json)


if __name__ == "__main__":
    main()
