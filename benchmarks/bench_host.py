"""Host overhead of one small Linear forward: te FP8 vs torch bf16 nn.Linear (the CPU-bound regime).

    python benchmarks/bench_host.py [--shape 128x1024x1024] [--calls 20] [--profile] [--json out.json]

Microseconds of host time per forward call, for `calls` calls issued back to back while the GPU is
held busy by a sleep kernel, so the host never waits for the GPU and what is timed is only the work
of issuing the call (Python, autograd bookkeeping, allocator, kernel launches). Rows: training forward
(grad enabled) and inference forward (no_grad). FP8 rows run all calls inside one fp8_autocast region
(as a model's forward does) with the weight cast cached (is_first_microbatch=False after the first call);
the once-per-region cost (the delayed-scaling update at the region's exit) is its own row.
--profile prints the top functions of the FP8 training forward under cProfile.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import report  # noqa: E402
from te_parallel import _native, recipe  # noqa: E402
from te_parallel.ops import gemm  # noqa: E402


def host_us(call, calls: int, region=contextlib.nullcontext, repeats: int = 7) -> float:
    """Median over `repeats` of the per-call host time of `calls` calls issued behind a GPU sleep."""
    for _ in range(20):  # warm-up: allocator pools, lazy inits, cuBLAS handles
        with region():
            call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time ahead of the calls
        busy = torch.cuda.Event()
        busy.record()
        t0 = time.perf_counter()
        with region():
            for _ in range(calls):
                call()
        dt = time.perf_counter() - t0
        if busy.query():
            print("warning: the GPU went idle while the host issued the calls; raise the sleep", file=sys.stderr)
        torch.cuda.synchronize()
        times.append(dt / calls * 1e6)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128x1024x1024")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host needs a CUDA GPU")
    m, k, n = (int(v) for v in a.shape.split("x"))
    dt = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt, requires_grad=True)
    ref = torch.nn.Linear(k, n, device="cuda", dtype=dt)
    lin = te.Linear(k, n, device="cuda", params_dtype=dt)
    delayed, current = recipe.DelayedScaling(), recipe.Float8CurrentScaling()

    def fp8_region(rec):
        return lambda: te.fp8_autocast(fp8_recipe=rec)

    def te_call():
        lin(x, is_first_microbatch=False)

    rows = []
    for grad in (True, False):
        mode = torch.enable_grad if grad else torch.no_grad
        with mode():
            base = host_us(lambda: ref(x), a.calls)
            cases = [("torch bf16 nn.Linear", base),
                     ("te bf16", host_us(te_call, a.calls)),
                     ("te FP8 delayed", host_us(te_call, a.calls, fp8_region(delayed))),
                     ("te FP8 current", host_us(te_call, a.calls, fp8_region(current)))]
            if _native.gemm_usable():  # the same, with te_parallel's cuBLASLt call for the GEMM
                gemm.NATIVE_GEMM = True
                cases += [("te FP8 delayed, native GEMM", host_us(te_call, a.calls, fp8_region(delayed))),
                          ("te FP8 current, native GEMM", host_us(te_call, a.calls, fp8_region(current)))]
                gemm.NATIVE_GEMM = False
        for name, us in cases:
            rows.append({"forward": "training" if grad else "no_grad", "case": name, "host_us": us,
                         "vs_torch": us / base})
    # Once per fp8_autocast region: the exit's fused delayed-scaling update (amortised over the model).
    exit_us = host_us(lambda: None, 1, fp8_region(delayed))
    with te.fp8_autocast(fp8_recipe=delayed):
        te_call()
    region_us = host_us(te_call, 1, fp8_region(delayed)) - host_us(te_call, a.calls, fp8_region(delayed))
    rows.append({"forward": "per region", "case": "fp8_autocast enter+exit (no module)", "host_us": exit_us,
                 "vs_torch": None})
    rows.append({"forward": "per region", "case": "exit update of one module", "host_us": region_us,
                 "vs_torch": None})
    report(f"Host time per Linear forward ({a.shape}, bf16; us per call, median)", rows,
           ["forward", "case", "host_us", "vs_torch"], a.json)
    if a.profile:
        prof = cProfile.Profile()
        with te.fp8_autocast(fp8_recipe=delayed):
            prof.enable()
            for _ in range(2000):
                te_call()
            prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
