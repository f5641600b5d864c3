"""Host overhead of a small Linear forward, or of a transformer layer's training step beside its GPU time.

One small Linear forward: te FP8 vs torch bf16 nn.Linear (the CPU-bound regime), NVIDIA TE's Linear beside them
when it is installed; or one training step of a whole transformer layer: te_parallel vs plain PyTorch vs NVIDIA
TE (--layer).

    python benchmarks/bench_host.py [--shape 128x1024x1024] [--calls 20] [--rounds 9] [--floor] [--profile] [--json out.json]
    python benchmarks/bench_host.py --layer llama|gpt [--tokens 512,1024,2048,4096] [--recipe delayed|current|bf16]
        [--graph] [--compile-mode reduce-overhead|default] [--calls 1] [--rounds 9] [--json out.json]

Microseconds of host time per forward call, for `calls` calls issued back to back while the GPU is
held busy by a sleep kernel, so the host never waits for the GPU and what is timed is only the work
of issuing the call (Python, autograd bookkeeping, allocator, kernel launches). Rows: training forward
(grad enabled) and inference forward (no_grad). FP8 rows run all calls inside one fp8_autocast region
(as a model's forward does) with the weight cast cached (is_first_microbatch=False after the first call);
the once-per-region cost (the delayed-scaling update at the region's exit) is its own row. The FP8
rows run the GEMM in FP8 (the recipes' default); one more row has a recipe whose min_fp8_gemm runs a
GEMM this small in bf16, and one ("general path") a Linear whose one-call FP8 forward is switched off.
With TE installed, "TE" rows time its Linear the same way (its fp8_autocast and recipe of the same name).
--floor times the blocks of an FP8 forward alone (the cast and GEMM calls with everything prepared,
an allocation, an autograd node): what any Python-orchestrated FP8 forward pays at least (JSON:
<json stem>_floor.json).
--profile prints the top functions of the FP8 training forward under cProfile.

--layer: one training step of one transformer layer (bench_transformer's builders: llama is the
Llama-3-8B layer, h4096 ffn14336 SwiGLU, 32 heads / 8 KV groups, RMSNorm, no biases, RoPE; gpt the layer
h4096 ffn16384 32 heads, LayerNorm, GELU, biases, dropout 0.1), batch 1 and each of --tokens as the
sequence: gradients cleared, forward (under fp8_autocast with --recipe delayed or current; te_parallel's
FP8 weight copies dropped first, as after an optimizer step) and backward, for te_parallel, the plain
PyTorch layer (bf16 + SDPA, whatever --recipe) and TE's TransformerLayer with the same config when
transformer_engine is installed; with --graph, also te_parallel's layer captured by te.make_graphed_callables
(a copy per token count; its host time is a graph launch per pass); with --compile-mode, also the torch
and te_parallel layers under torch.compile(dynamic=False) in that mode (a copy of te_parallel's per token
count; the warm-up steps compile it, and reduce-overhead records its CUDA graphs). Per step, milliseconds:
  host_ms  the host's time to issue the step, queued behind a GPU sleep (the host never waits);
  gpu_ms   the GPU's time to run the step's kernels, from CUDA events around the same queued step: the
           kernels run back to back, with no gap waiting for the host (they start after the sleep, from
           a light load, so at a power cap they may run a few percent faster than in a long loop);
  step_ms  steps issued back to back as a training loop does (common.time_interleaved: every case in
           each round, clocks settled), about the larger of host_ms and gpu_ms.
host_ms and gpu_ms are medians over --rounds rounds (every case once per round, interleaved; --calls
steps per sample); host_over_gpu above 1 marks a step bound by the host. Ratios to the torch row.
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
from common import (OTHER_GEMM_LABEL, Parser, report, te_recipe, te_training_step, time_interleaved,  # noqa: E402
                    training_step, transformer_engine, with_torch_gemm)
from te_parallel import native, recipe  # noqa: E402
from te_parallel.native import gemm as gemm_kernels  # noqa: E402
from te_parallel.native import torch_ops as native_ops  # noqa: E402


SLEEP_CYCLES = int(2e8)  # ~0.1 s of GPU time ahead of the calls


def issue_timed(call, calls: int, region=contextlib.nullcontext) -> tuple:
    """(host us, GPU ms) per call of `calls` calls queued behind a GPU sleep: the host's time to issue them
    (it never waits for the GPU), and the GPU's time to run what they launched, from an event after the
    sleep to one after the last call (their kernels back to back, no gap waiting for the host)."""
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    with region():
        for _ in range(calls):
            call()
    dt = time.perf_counter() - t0
    end.record()
    if start.query():
        print("warning: the GPU went idle while the host issued the calls; raise the sleep", file=sys.stderr)
    torch.cuda.synchronize()
    return dt / calls * 1e6, start.elapsed_time(end) / calls


def issue_us(call, calls: int, region=contextlib.nullcontext) -> float:
    """Host microseconds per call of `calls` calls issued behind a GPU sleep (so the host never waits)."""
    return issue_timed(call, calls, region)[0]


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
    ws, _scratch = gemm_kernels.workspace(dev, stream)
    codes = native.DTYPES
    leaf = x.clone().requires_grad_()

    def native_gemm():
        mod.gemm(x8.data_ptr(), codes[e4m3], w8.data_ptr(), codes[e4m3], m, n, k, one.data_ptr(), one.data_ptr(), 0,
                 y.data_ptr(), codes[bf16], bias.data_ptr(), False, ws, gemm_kernels.WORKSPACE_BYTES, stream)

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
    if native_ops.usable():  # the one-call forward's op: the cast, the GEMM and their four outputs
        cases.insert(2, ("te te_parallel::linear_fp8_fwd + bias, outputs allocated", lambda: native_ops.linear_fp8_fwd(
            x, one, amax, e4m3, True, w8, one, bias, True), nothing))
    with torch.no_grad():
        got = measure(cases, a.calls, a.rounds)
    rows = [{"block": name, "host_us": med, "min_us": low} for name, (med, low) in got.items()]
    report(f"Host time of the blocks of an FP8 forward ({m}x{k}x{n}; us per call: median and min of {a.rounds} "
           "rounds)", rows, ["block", "host_us", "min_us"],
           None if a.json is None else os.path.splitext(a.json)[0] + "_floor.json")


def layer_steps(cfg, layers, tokens: int, kind, device="cuda", graph: bool = False,
                compile_mode: str | None = None, backend: str = "inductor") -> dict:
    """{case: training step} of one layer on `tokens` tokens (batch 1): torch bf16, te_parallel and TE (when
    built) in `kind` (None: bf16, "delayed", "current"); with `graph`, also te_parallel's layer in a CUDA
    graph (te.make_graphed_callables, a copy of the layer per token count: a capture keeps its shapes); with
    `compile_mode`, also the torch layer and a copy of te_parallel's under torch.compile in that mode
    (compiled by their first steps)."""
    from bench_transformer import compile_label, compile_layer, forward_kwargs, fp8_recipe, graphed_steps, te_copy

    x = torch.randn(tokens, 1, cfg.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)  # [s, b, h]
    dy = torch.randn_like(x)
    fwd, base_fwd, peer_fwd = forward_kwargs(cfg, tokens, device, peer=layers.peer is not None)
    label = "bf16" if kind is None else f"FP8 {kind}"
    steps = {"torch bf16 + SDPA": training_step(layers.base, x, dy, **base_fwd),
             f"te {label}": training_step(layers.te, x, dy, fp8_recipe(kind), **fwd)}
    if layers.peer is not None:
        steps[f"TE {label}"] = te_training_step(layers.peer, x, dy, kind, **peer_fwd)
    # The graphed and compiled rows take leaves of their own. torch.cuda.make_graphed_callables warms up on a
    # side stream, so a leaf it sees first gets its gradient node there, and every later backward into that
    # leaf crosses streams (torch's AccumulateGrad stream warning). With one leaf for all rows, inductor's
    # recording of the reduce-overhead row's CUDA graphs can fail on a caching-allocator assert; the shared
    # leaf is the suspected cause (docs/compile.md, "Known limits").
    if graph:
        steps.update(graphed_steps(cfg, layers, x.detach().clone().requires_grad_(), dy, fwd, device, kinds=(kind,)))
    if compile_mode is not None:
        x, label_c = x.detach().clone().requires_grad_(), compile_label(compile_mode)
        base_c = compile_layer(layers.base, compile_mode, backend)
        te_c = compile_layer(te_copy(cfg, layers, device), compile_mode, backend)
        steps[f"torch bf16 + SDPA, {label_c}"] = training_step(base_c, x, dy, **base_fwd)
        steps[f"te {label}, {label_c}"] = training_step(te_c, x, dy, fp8_recipe(kind), **fwd)
    return steps


def time_steps(steps: dict, calls: int, rounds: int) -> dict:
    """{case: (host ms, GPU ms, host min ms, GPU min ms, step ms)}: host and GPU time of steps queued behind
    a sleep (issue_timed), `rounds` rounds with every case once each, starting one case further each round;
    step ms back to back with clocks settled (common.time_interleaved)."""
    for step in steps.values():
        for _ in range(5):  # warm-up: allocator pools, lazy inits, attention plans, FP8 scales, compilations
            step()
    torch.cuda.synchronize()
    names, samples = list(steps), {name: [] for name in steps}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            samples[name].append(issue_timed(steps[name], calls))
    back_to_back = time_interleaved(steps, warmup=2, iters=10, rounds=5)
    out = {}
    for name, got in samples.items():
        host, gpu = [h / 1e3 for h, _ in got], [g for _, g in got]
        out[name] = (statistics.median(host), statistics.median(gpu), min(host), min(gpu), back_to_back[name])
    return out


def layer_mode(a) -> None:
    """--layer: host, GPU and back-to-back time of one training step per token count."""
    from bench_transformer import build_layers, model_config

    cfg = model_config(a.layer)
    layers = build_layers(cfg)
    kind = None if a.recipe == "bf16" else a.recipe
    rows = []
    for tokens in a.tokens:
        got = time_steps(layer_steps(cfg, layers, tokens, kind, graph=a.graph, compile_mode=a.compile_mode),
                         a.calls, a.rounds)
        base = got["torch bf16 + SDPA"]
        for name, (host, gpu, host_min, gpu_min, step) in got.items():
            rows.append({"tokens": tokens, "case": name, "host_ms": host, "gpu_ms": gpu, "step_ms": step,
                         "host_over_gpu": host / gpu, "host_vs_torch": host / base[0], "gpu_vs_torch": gpu / base[1],
                         "step_vs_torch": step / base[4], "host_min_ms": host_min, "gpu_min_ms": gpu_min})
    shape = f"h{cfg.hidden} ffn{cfg.ffn} heads{cfg.heads}/{cfg.gqa}"
    report(f"One training step of one {a.layer} layer ({shape}, batch 1, te {a.recipe}; ms per step: host issue and "
           f"GPU time median of {a.rounds} rounds, step back to back)", rows,
           ["tokens", "case", "host_ms", "gpu_ms", "step_ms", "host_over_gpu", "host_vs_torch", "gpu_vs_torch",
            "step_vs_torch"], a.json)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: one-line errors before any work starts."""
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="Linear: MxKxN (default: 128x1024x1024)")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls (steps with --layer) per timed sample (default: 20; 1 with --layer)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--floor", action="store_true", help="also time the blocks of an FP8 forward alone")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layer", choices=["llama", "gpt"], default=None,
                    help="time one training step of this transformer layer instead of a Linear forward")
    ap.add_argument("--tokens", default=None,
                    help="--layer: token counts, comma-separated (default: 512,1024,2048,4096)")
    ap.add_argument("--recipe", choices=["delayed", "current", "bf16"], default=None,
                    help="--layer: te_parallel's and TE's precision (default: delayed)")
    ap.add_argument("--graph", action="store_true",
                    help="--layer: also te_parallel's layer in a CUDA graph (te.make_graphed_callables)")
    ap.add_argument("--compile-mode", choices=["default", "reduce-overhead"], default=None,
                    help="--layer: also the torch and te_parallel layers under torch.compile in this mode")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.layer is None:
        for flag, value in (("--tokens", a.tokens), ("--recipe", a.recipe), ("--graph", a.graph or None),
                            ("--compile-mode", a.compile_mode)):
            if value is not None:
                ap.error(f"{flag} goes with --layer llama|gpt")
        a.shape = a.shape or "128x1024x1024"
        dims = a.shape.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            ap.error(f"--shape {a.shape}: give MxKxN, three positive integers (128x1024x1024)")
    else:
        for flag, value in (("--shape", a.shape), ("--floor", a.floor), ("--profile", a.profile)):
            if value:
                ap.error(f"{flag} times the Linear; run it without --layer")
        a.recipe = a.recipe or "delayed"
        a.tokens = _token_counts(ap, a.tokens or "512,1024,2048,4096", a.recipe)
        if a.graph and a.recipe == "bf16":
            ap.error("--graph times FP8 layers (make_graphed_callables' FP8 regions); use --recipe delayed or current")
    a.calls = a.calls if a.calls is not None else (20 if a.layer is None else 1)
    for flag, value in (("--calls", a.calls), ("--rounds", a.rounds)):
        if value < 1:
            ap.error(f"{flag} {value}: at least 1")
    return a


def _token_counts(ap, text: str, recipe_name: str) -> list:
    counts = text.split(",")
    if not all(c.strip().isdigit() and int(c) > 0 for c in counts):
        ap.error(f"--tokens {text}: give positive integers separated by commas (512,1024)")
    counts = [int(c) for c in counts]
    if recipe_name != "bf16" and any(c % 8 for c in counts):
        ap.error(f"--tokens {text}: FP8 steps take multiples of 8 tokens (TE's FP8 GEMMs need them); "
                 "use --recipe bf16 or round up")
    return counts


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host needs a CUDA GPU")
    if a.layer is not None:
        return layer_mode(a)
    linear_mode(a)


def linear_mode(a) -> None:
    """The Linear rows (and --floor, --profile)."""
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

    # the same layer with its one-call FP8 forward switched off: the general path (Linear._fp8_one_call)
    general = te.Linear(k, n, device="cuda", params_dtype=dt)
    general._fp8_one_call = lambda *args: None

    def te_call():
        lin(x, is_first_microbatch=False)

    def general_call():
        general(x, is_first_microbatch=False)

    # NVIDIA TE's Linear beside them when it is installed: the same call (weight cast kept after the first
    # forward, is_first_microbatch=False) in TE's fp8_autocast with its recipe of the same name
    peer = transformer_engine()
    if peer is not None:
        other = peer.Linear(k, n, params_dtype=dt, device="cuda")

        def peer_call():
            other(x, is_first_microbatch=False)

        def peer_region(kind):
            return lambda: peer.fp8_autocast(enabled=True, fp8_recipe=te_recipe(kind))

    nothing = contextlib.nullcontext
    rows = []
    for grad in (True, False):
        mode = torch.enable_grad if grad else torch.no_grad
        cases = [("torch bf16 nn.Linear", lambda: ref(x), nothing),
                 ("te bf16", te_call, nothing),
                 ("te FP8 delayed", te_call, fp8_region(delayed)),
                 ("te FP8 current", te_call, fp8_region(current)),
                 ("te FP8 delayed, general path", general_call, fp8_region(delayed)),
                 ("te FP8 delayed, bf16 GEMM below min_fp8_gemm", te_call, fp8_region(fallback))]
        if gemm_kernels.usable():
            cases += [(f"te FP8 delayed, {OTHER_GEMM_LABEL}", te_call, fp8_region(with_torch_gemm(delayed))),
                      (f"te FP8 current, {OTHER_GEMM_LABEL}", te_call, fp8_region(with_torch_gemm(current)))]
        if peer is not None:
            cases += [("TE bf16", peer_call, nothing), ("TE FP8 delayed", peer_call, peer_region("delayed")),
                      ("TE FP8 current", peer_call, peer_region("current"))]
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
