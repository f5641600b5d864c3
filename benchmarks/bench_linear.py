"""FP8 te.Linear fwd+bwd vs torch bf16 nn.Linear, same run, same GPU.

    python benchmarks/bench_linear.py [--shapes 8192x4096x16384 ...] [--energy SECONDS] [--json out.json]
    python benchmarks/bench_linear.py --sweep      (FP8 vs bf16 GPU time over GEMM sizes: min_fp8_gemm="auto")

Rows per shape (tokens × in → out), bf16 activations and weights:
  torch bf16         torch.nn.Linear
  te bf16            te.Linear outside fp8_autocast
  te fp8 delayed     te.Linear in fp8_autocast(DelayedScaling), weight recast every step (every GEMM in FP8)
  te fp8 current     te.Linear in fp8_autocast(Float8CurrentScaling), weight recast every step
  te fp8 block       te.Linear in fp8_autocast(Float8BlockScaling), weight recast every step
  te fp8 delayed, torch._scaled_mm GEMM   the delayed row with every FP8 GEMM through torch._scaled_mm
                     instead of te_parallel's own cuBLASLt call (csrc/gemm; MMParams(backend="native"))
  TE bf16 / TE fp8 delayed / current / block   NVIDIA Transformer Engine's te.Linear, when it is installed
"ms" is per step with steps issued back to back (as a training loop runs), the median of 7 rounds that
each time every row (common.time_interleaved: no row gains from its place in the sequence),
"ms_synced" per step started on an idle GPU (host latency to the first kernel included).
--energy SECONDS adds each row's joules per step, watts and SM clock over SECONDS of back-to-back steps
(common.energy_interleaved, NVML through nvidia-ml-py) and ms_at_limit, those joules over the power limit.
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
from common import (OTHER_GEMM_LABEL, Parser, energy_interleaved, nvml_missing, report,  # noqa: E402
                    report_energy, te_training_step, time_cuda, time_interleaved, training_step, transformer_engine,
                    with_torch_gemm)
from te_parallel import recipe  # noqa: E402
from te_parallel.fp8.gemm_size import intensity  # noqa: E402
from te_parallel.native import gemm as gemm_kernels  # noqa: E402


SETTLE = None  # untimed steps before each timed sample (common.time_interleaved; --settle)


def bench_shape(m: int, k: int, n: int, energy: float | None = None):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    ref = torch.nn.Linear(k, n, device=dev, dtype=dt)
    lin = te.Linear(k, n, device=dev, params_dtype=dt)
    flops = 3 * 2 * m * k * n
    rows = []
    cases = [("torch bf16", ref, None), ("te bf16", lin, None),
             ("te fp8 delayed", lin, recipe.DelayedScaling()), ("te fp8 current", lin, recipe.Float8CurrentScaling()),
             ("te fp8 block", lin, recipe.Float8BlockScaling())]
    if gemm_kernels.usable():
        cases.append((f"te fp8 delayed, {OTHER_GEMM_LABEL}", lin, with_torch_gemm(recipe.DelayedScaling())))
    steps = {name: training_step(mod, x, dy, rec) for name, mod, rec in cases}
    te_peer = transformer_engine()
    if te_peer is not None:
        peer = te_peer.Linear(k, n, params_dtype=dt, device=dev)
        for kind in (None, "delayed", "current", "block"):
            steps[f"TE {'bf16' if kind is None else 'fp8 ' + kind}"] = te_training_step(peer, x, dy, kind)
    back_to_back = time_interleaved(steps, settle=SETTLE)
    synced = {name: time_cuda(step) for name, step in steps.items()}
    base, base_synced = back_to_back["torch bf16"], synced["torch bf16"]
    for name in steps:
        ms = back_to_back[name]
        rows.append({"shape": f"{m}x{k}->{n}", "case": name, "ms": ms, "tflops": flops / ms / 1e9,
                     "speedup_vs_torch_bf16": base / ms, "ms_synced": synced[name],
                     "synced_speedup": base_synced / synced[name]})
    if energy is not None:
        got = energy_interleaved(steps, back_to_back, seconds=energy)
        for row in rows:
            row.update(got[row["case"]])
    return rows


SWEEP_M = (256, 512, 1024, 2048, 4096, 8192)
SWEEP_KN = (1024, 2048, 4096, 8192)


def graphed_gpu_ms(step, replays: int = 20) -> float:
    """GPU time of one step with the host out of the way: the step captured in a CUDA graph, replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return time_cuda(graph.replay, warmup=3, iters=replays)


def sweep(json_path) -> None:
    """GPU time (CUDA-graphed, so host time does not count) of a te.Linear fwd+bwd in bf16 and in FP8
    (each recipe) over a grid of M x K x N: where FP8 stops paying for its casts. What decides is the
    intensity M·K·N / (M·K + K·N + M·N) (GEMM work per element cast), not M·K·N; the intensity that
    loses least time at the measured sizes is the recipe's break-even on this GPU
    (te_parallel/fp8/gemm_size.py keeps one per architecture for min_fp8_gemm="auto")."""
    rows = []
    for m in SWEEP_M:
        for k in SWEEP_KN:
            for n in SWEEP_KN:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                lin = te.Linear(k, n, device="cuda", params_dtype=torch.bfloat16)
                row = {"shape": f"{m}x{k}x{n}", "MKN": m * k * n,
                       "bf16_ms": graphed_gpu_ms(training_step(lin, x, dy))}
                for kind, rec in (("delayed", recipe.DelayedScaling()), ("current", recipe.Float8CurrentScaling())):
                    row[f"{kind}_ms"] = graphed_gpu_ms(training_step(lin, x, dy, rec))
                    row[f"{kind}_speedup"] = row["bf16_ms"] / row[f"{kind}_ms"]
                rows.append(row)
    rows.sort(key=lambda r: r["MKN"])
    report("FP8 vs bf16 by GEMM size: te.Linear fwd+bwd GPU time (CUDA graph replay, ms)", rows,
           ["shape", "MKN", "bf16_ms", "delayed_ms", "delayed_speedup", "current_ms", "current_speedup"], json_path)
    for kind in ("delayed", "current"):
        t, fp8_slower, bf16_slower = break_even(rows, kind)
        print(f"{kind}: FP8 from intensity M*K*N/(M*K+K*N+M*N) >= {t:.0f}; at the measured sizes that picks FP8 where "
              f"it is slower {len(fp8_slower)}x (worst {min(fp8_slower, default=1):.3f}x) and bf16 where FP8 is "
              f"faster {len(bf16_slower)}x (worst {max(bf16_slower, default=1):.3f}x)")


def break_even(rows, kind: str):
    """(threshold, speedups where FP8 is picked but slower, where bf16 is picked but FP8 faster): the
    intensity threshold that loses least time over the measured sizes."""
    points = [(intensity(*(int(v) for v in r["shape"].split("x"))), r[f"{kind}_speedup"]) for r in rows]
    best = None
    for t in sorted({p for p, _ in points}):
        slow_fp8 = [s for p, s in points if p >= t and s < 1]
        slow_bf16 = [s for p, s in points if p < t and s >= 1]
        cost = sum(1 / s - 1 for s in slow_fp8) + sum(s - 1 for s in slow_bf16)
        if best is None or cost < best[0]:
            best = (cost, t, slow_fp8, slow_bf16)
    return best[1:]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: one-line errors before any work."""
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["8192x4096x16384"], help="tokens x in x out, e.g. 8192x4096x16384")
    ap.add_argument("--sweep", action="store_true", help="FP8 vs bf16 GPU time over GEMM sizes (min_fp8_gemm='auto')")
    ap.add_argument("--settle", type=int, default=None,
                    help="untimed steps before each timed sample (default: as many as are timed)")
    ap.add_argument("--energy", type=float, default=None, metavar="SECONDS",
                    help="also measure each row's energy per step over SECONDS of back-to-back steps (NVML)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.sizes = []
    for text in a.shapes:
        parts = text.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--shapes {text}: a shape is three positive integers, tokens x in x out (8192x4096x16384)")
        a.sizes.append(tuple(int(p) for p in parts))
    if not a.sizes and not a.sweep:
        ap.error("--shapes: no shape given; give one or more, tokens x in x out (8192x4096x16384)")
    if a.settle is not None and a.settle < 0:
        ap.error(f"--settle {a.settle}: a count of steps, 0 or more")
    if a.energy is not None and not 0.5 <= a.energy <= 60:
        ap.error(f"--energy {a.energy}: seconds per measurement window, between 0.5 and 60")
    if a.energy is not None and a.sweep:
        ap.error("--energy goes with the --shapes rows, not --sweep")
    if a.energy is not None and nvml_missing():
        ap.error(f"--energy {nvml_missing()}")
    return a


def main() -> None:
    args = parse_args()
    global SETTLE
    SETTLE = args.settle
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA GPU")
    if args.sweep:
        sweep(args.json)
        return
    rows = []
    for m, k, n in args.sizes:
        rows += bench_shape(m, k, n, args.energy)
    report("Linear fwd+bwd (ms per step back to back; ms_synced: each step from an idle GPU)", rows,
           ["shape", "case", "ms", "tflops", "speedup_vs_torch_bf16", "ms_synced", "synced_speedup"], args.json)
    if args.energy is not None:
        report_energy(rows, args.energy, ["shape", "case"])


if __name__ == "__main__":
    main()
