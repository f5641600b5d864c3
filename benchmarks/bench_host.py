"""Host overhead of one small Linear forward: te FP8 vs torch bf16 nn.Linear (the CPU-bound regime).

    python benchmarks/bench_host.py [--shape 128x1024x1024] [--calls 20] [--rounds 9] [--floor] [--profile] [--json out.json]

Microseconds of host time per forward call, for `calls` calls issued back to back while the GPU is
held busy by a sleep kernel, so the host never waits for the GPU and what is timed is only the work
of issuing the call (Python, autograd bookkeeping, allocator, kernel launches). Rows: training forward
(grad enabled) and inference forward (no_grad). FP8 rows run all calls inside one fp8_autocast region
(as a model's forward does) with the weight cast cached (is_first_microbatch=False after the first call);
the once-per-region cost (the delayed-scaling update at the region's exit) is its own row. The FP8
rows run the GEMM in FP8 (the recipes' default); one more row has a recipe whose min_fp8_gemm runs a
GEMM this small in bf16.
--floor times the blocks of an FP8 forward alone (the cast and GEMM calls with everything prepared,
an allocation, an autograd node): what any Python-orchestrated FP8 forward pays at least (JSON:
<json stem>_floor.json).
--profile prints the top functions of the FP8 training forward under cProfile.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import OTHER_GEMM_LABEL, report, with_torch_gemm  # noqa: E402
from te_parallel import native, recipe  # noqa: E402
from te_parallel.native import gemm as gemm_kernels  # noqa: E402


def issue_us(call, calls: int, region=contextlib.nullcontext) -> float:
    """Host microseconds per call of `calls` calls issued behind a GPU sleep (so the host never waits)."""
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
    return dt / calls * 1e6


def measure(cases, calls: int, rounds: int) -> dict:
    """{name: (median, min) host us per call} of cases [(name, call, region)], measured in `rounds`
    interleaved rounds (every case once per round): a host's speed drifts by tens of percent within a
    run, and interleaving spreads the drift over all cases instead of favouring the ones timed first."""
    for _, call, region in cases:
        for _ in range(20):  # warm-up: allocator pools, lazy inits, cuBLAS handles
            with region():
                call()
    torch.cuda.synchronize()
    times = {name: [] for name, _, _ in cases}
    for _ in range(rounds):
        for name, call, region in cases:
            times[name].append(issue_us(call, calls, region))
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g


def floor(m: int, k: int, n: int, a) -> None:
    """The building blocks of an FP8 forward, each alone, called from Python with everything prepared:
    what any Python-orchestrated FP8 forward (one cast, one FP8 GEMM, an autograd node) pays at least."""
    dev, bf16, e4m3 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn
    mod = native.load()  # the raw binding: these rows time the calls without the wrappers' checks
    x, w = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(n, k, device=dev, dtype=bf16)
    bias = torch.randn(n, device=dev, dtype=bf16)
    x8, w8 = x.to(e4m3), w.to(e4m3)
    one = torch.ones((), device=dev)
    y = torch.empty(m, n, device=dev, dtype=bf16)
    xq, xq_t = torch.empty(m, k, device=dev, dtype=e4m3), torch.empty(k, m, device=dev, dtype=e4m3)
    amax, scale_inv = torch.zeros(1, device=dev), torch.empty((), device=dev)
    stream = native.launch_on(dev)[1]
    ws = gemm_kernels.workspace(dev, stream)
    codes = native.DTYPES
    leaf = x.clone().requires_grad_()

    def native_gemm():
        mod.gemm(x8.data_ptr(), codes[e4m3], w8.data_ptr(), codes[e4m3], m, n, k, one.data_ptr(), one.data_ptr(), 0,
                 y.data_ptr(), codes[bf16], bias.data_ptr(), False, ws.data_ptr(), gemm_kernels.WORKSPACE_BYTES, stream)

    def native_cast():
        mod.cast_transpose_amax(x.data_ptr(), codes[bf16], m, k, one.data_ptr(), xq.data_ptr(), xq_t.data_ptr(),
                                amax.data_ptr(), scale_inv.data_ptr(), 0, codes[e4m3], stream)

    def function_apply():
        with torch.enable_grad():
            _Identity.apply(leaf)

    nothing = contextlib.nullcontext
    cases = [("torch F.linear bf16 + bias (no autograd)", lambda: torch.nn.functional.linear(x, w, bias), nothing),
             ("torch._scaled_mm FP8 + bias, output allocated", lambda: torch._scaled_mm(
                 x8, w8.t(), scale_a=one, scale_b=one, bias=bias, out_dtype=bf16), nothing),
             ("te _C.cast_transpose_amax, outputs given, no checks", native_cast, nothing),
             ("torch.empty (one FP8 [m, k])", lambda: torch.empty(m, k, device=dev, dtype=e4m3), nothing),
             ("autograd.Function.apply (identity, one input)", function_apply, nothing)]
    if gemm_kernels.usable():
        cases.insert(2, ("te _C.gemm FP8 + bias, output given, no checks", native_gemm, nothing))
    with torch.no_grad():
        got = measure(cases, a.calls, a.rounds)
    rows = [{"block": name, "host_us": med, "min_us": low} for name, (med, low) in got.items()]
    report(f"Host time of the blocks of an FP8 forward ({m}x{k}x{n}; us per call: median and min of {a.rounds} "
           "rounds)", rows, ["block", "host_us", "min_us"],
           None if a.json is None else os.path.splitext(a.json)[0] + "_floor.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128x1024x1024")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--floor", action="store_true", help="also time the blocks of an FP8 forward alone")
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
    # The default recipes run every GEMM in FP8, whatever its size; a recipe with min_fp8_gemm above
    # this GEMM's size runs it in bf16 (the small-GEMM fallback), which is its own row.
    delayed, current = recipe.DelayedScaling(), recipe.Float8CurrentScaling()
    fallback = recipe.DelayedScaling(min_fp8_gemm=m * k * n + 1)

    def fp8_region(rec):
        return lambda: te.fp8_autocast(fp8_recipe=rec)

    def te_call():
        lin(x, is_first_microbatch=False)

    nothing = contextlib.nullcontext
    rows = []
    for grad in (True, False):
        mode = torch.enable_grad if grad else torch.no_grad
        cases = [("torch bf16 nn.Linear", lambda: ref(x), nothing),
                 ("te bf16", te_call, nothing),
                 ("te FP8 delayed", te_call, fp8_region(delayed)),
                 ("te FP8 current", te_call, fp8_region(current)),
                 ("te FP8 delayed, bf16 GEMM below min_fp8_gemm", te_call, fp8_region(fallback))]
        if gemm_kernels.usable():
            cases += [(f"te FP8 delayed, {OTHER_GEMM_LABEL}", te_call, fp8_region(with_torch_gemm(delayed))),
                      (f"te FP8 current, {OTHER_GEMM_LABEL}", te_call, fp8_region(with_torch_gemm(current)))]
        with mode():
            got = measure(cases, a.calls, a.rounds)
        base = got["torch bf16 nn.Linear"]
        for name, (med, low) in got.items():
            rows.append({"forward": "training" if grad else "no_grad", "case": name, "host_us": med,
                         "vs_torch": med / base[0], "min_us": low, "min_vs_torch": low / base[1]})
    # Once per fp8_autocast region: entering, and the exit's fused delayed-scaling update (amortised
    # over the model). Regions back to back, `calls` per timing, as consecutive training steps run them.
    def region_of(call):
        def run():
            with te.fp8_autocast(fp8_recipe=delayed):
                call()
        return run

    got = measure([("empty", region_of(lambda: None), nothing), ("one", region_of(te_call), nothing),
                   ("call", te_call, fp8_region(delayed))], a.calls, a.rounds)
    rows.append({"forward": "per region", "case": "fp8_autocast enter+exit (no module)", "host_us": got["empty"][0]})
    rows.append({"forward": "per region", "case": "enter+exit with one module (its update), less its forward",
                 "host_us": got["one"][0] - got["call"][0]})
    report(f"Host time per Linear forward ({a.shape}, bf16; us per call: median and min of {a.rounds} rounds)",
           rows, ["forward", "case", "host_us", "vs_torch", "min_us", "min_vs_torch"], a.json)
    if a.floor:
        floor(m, k, n, a)
    if a.profile:  # cProfile of the FP8 training forward, with torch._scaled_mm and with the native GEMM
        for native_gemm in (False, True) if gemm_kernels.usable() else (False,):
            prof = cProfile.Profile()
            with te.fp8_autocast(fp8_recipe=delayed if native_gemm else with_torch_gemm(delayed)):
                prof.enable()
                for _ in range(2000):
                    te_call()
                prof.disable()
            torch.cuda.synchronize()
            print(f"\ncProfile of 2000 FP8 delayed training forwards, native GEMM: {native_gemm}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)

if __name__ == "__main__":
    main()
