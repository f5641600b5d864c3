"""FP8 te.Linear fwd+bwd vs torch bf16 nn.Linear, same run, same GPU.

    python benchmarks/bench_linear.py [--shapes 8192x4096x16384 ...] [--json out.json]

Rows per shape (tokens × in → out), bf16 activations and weights:
  torch bf16         torch.nn.Linear
  te bf16            te.Linear outside fp8_autocast
  te fp8 delayed     te.Linear in fp8_autocast(DelayedScaling), weight recast every step
  te fp8 current     te.Linear in fp8_autocast(Float8CurrentScaling), weight recast every step
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
from common import report, time_cuda  # noqa: E402
from te_parallel import recipe  # noqa: E402


def _step_fn(module, x, dy, fp8_recipe=None):
    params = list(module.parameters())

    def step():
        x.grad = None  # optimizer.zero_grad(set_to_none=True): no .grad accumulation in the timing
        for p in params:
            p.grad = None
        if fp8_recipe is not None:
            module.drop_fp8_weight_cache()
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            y = module(x)
        y.backward(dy)
    return step


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
    base = None
    for name, mod, rec in cases:
        ms = time_cuda(_step_fn(mod, x, dy, rec))
        base = base or ms
        rows.append({"shape": f"{m}x{k}->{n}", "case": name, "ms": ms, "tflops": flops / ms / 1e9,
                     "speedup_vs_torch_bf16": base / ms})
        x.grad = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["8192x4096x16384"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA GPU")
    rows = []
    for s in args.shapes:
        m, k, n = (int(v) for v in s.split("x"))
        rows += bench_shape(m, k, n)
    report("Linear fwd+bwd (median ms)", rows, ["shape", "case", "ms", "tflops", "speedup_vs_torch_bf16"], args.json)


if __name__ == "__main__":
    main()
