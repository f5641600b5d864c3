"""Where the time of one fwd+bwd step goes: a per-kernel table from torch.profiler, and the GEMMs alone.

    python benchmarks/profile_step.py linear [--shape 8192x4096x16384] [--recipe delayed|current|block|bf16]
    python benchmarks/profile_step.py layer  [--model gpt|llama] [--recipe delayed|current|block|bf16|torch] [--batch 4] [--seq 512]
    add --peer to linear / layer to profile NVIDIA Transformer Engine's module (installed beside)
    add --compile to linear / layer to profile te_parallel's module under torch.compile
    python benchmarks/profile_step.py gemm   [--shape 8192x4096x16384]
    add --host to linear / layer for a cProfile of the host side of 8 steps
    add --gaps to linear / layer for the idle gaps between kernels (and whether the host was late)
    add --memory to linear / layer for the allocations live at the step's memory peak, and where each was made

`linear` / `layer` print the kernels of 5 profiled steps grouped by name (total ms per step, calls per
step), the GPU busy time per step and the host time to issue one step. `gemm` times the three GEMMs of a
linear layer alone: bf16 `mm` against FP8 `torch._scaled_mm` with and without fast accumulation.
--json writes the rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from common import Parser, report, te_training_step, time_cuda, training_step, transformer_engine  # noqa: E402
from te_parallel import recipe  # noqa: E402
from te_parallel.ops.attention import BACKENDS  # noqa: E402

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling,
           "bf16": None, "torch": None}


def _build(kind: str, args):
    """The step to profile: te_parallel's module (or torch's, --recipe torch), or TE's with --peer."""
    dt = torch.bfloat16
    peer = transformer_engine() if args.peer else None
    if args.peer and peer is None:
        sys.exit("--peer needs NVIDIA Transformer Engine (transformer_engine.pytorch) installed")
    rec = RECIPES[args.recipe]() if RECIPES[args.recipe] else None
    lib, fwd = (peer or te), {}
    if kind == "linear":
        m, k, n = (int(v) for v in args.shape.split("x"))
        mod = (torch.nn.Linear(k, n, device="cuda", dtype=dt) if args.recipe == "torch"
               else lib.Linear(k, n, device="cuda", params_dtype=dt))
        x = torch.randn(m, k, device="cuda", dtype=dt, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=dt)
    else:
        from bench_transformer import MODELS, TorchLayer, TorchLlamaLayer, layer_kwargs
        size = argparse.Namespace(**MODELS[args.model])
        size.batch = args.batch or size.batch
        size.seq = args.seq or size.seq
        if args.recipe == "torch":
            mod = (TorchLayer(size.hidden, size.ffn, size.heads) if args.model == "gpt"
                   else TorchLlamaLayer(size.hidden, size.ffn, size.heads, size.gqa)).to("cuda", dt)
        else:
            kw = layer_kwargs(args.model, size)
            if peer is None and args.attention_backend:
                kw["attention_backend"] = args.attention_backend
            mod = lib.TransformerLayer(size.hidden, size.ffn, size.heads, **kw)
        x = torch.randn(size.seq, size.batch, size.hidden, device="cuda", dtype=dt, requires_grad=True)
        dy = torch.randn_like(x)
        if args.model == "llama":
            rope_cls = te.RotaryPositionEmbedding if peer is None else _peer_rope()
            fwd = {"rope" if args.recipe == "torch" else "rotary_pos_emb":
                   rope_cls(size.hidden // size.heads).to("cuda")(size.seq)}
    if peer is not None:
        return te_training_step(mod, x, dy, None if args.recipe == "bf16" else args.recipe, **fwd)
    if args.compile:
        mod = torch.compile(mod, dynamic=False)
    return training_step(mod, x, dy, rec, **fwd)


def _peer_rope():
    from transformer_engine.pytorch.attention import RotaryPositionEmbedding
    return RotaryPositionEmbedding


def profile(kind: str, args) -> list:
    step = _build(kind, args)
    ms = time_cuda(step, warmup=5, iters=20)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # host issue time: keep the GPU busy so the host never waits for it
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    host_ms = (time.perf_counter() - t0) * 1000 / 3
    torch.cuda.synchronize()
    steps = 5
    before = torch.cuda.memory_stats()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.gaps:  # the launch calls too: whether the host was late for the kernel after a gap
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if args.gaps:
        _print_gaps(prof, steps, before)
    per_name = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name][0] += ev.device_time_total / 1000 / steps
            per_name[ev.name][1] += 1
            spans.append((ev.time_range.start, ev.time_range.end))
    busy = sum(v[0] for v in per_name.values())
    span_ms, covered_ms = _span_and_covered(spans)
    print(f"\n{'TE ' if args.peer else ''}{kind} {args.recipe}: step {ms:.3f} ms (events), host issue {host_ms:.3f} ms/step, "
          f"GPU kernel time {busy:.3f} ms/step, {sum(v[1] for v in per_name.values()) / steps:.0f} kernels/step; "
          f"the {steps} profiled steps (issued back to back) span {span_ms / steps:.3f} ms/step on the GPU, "
          f"idle between kernels {(span_ms - covered_ms) / steps:.3f} ms/step")
    rows = []
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        rows.append({"kernel": name[:110], "ms_per_step": t, "calls_per_step": n / steps,
                     "share": t / busy})
    report(f"{kind} {args.recipe} kernels", rows, ["ms_per_step", "calls_per_step", "share", "kernel"], None)
    return [{"kind": kind, "recipe": args.recipe, "step_ms": ms, "host_ms": host_ms, "gpu_ms": busy}] + rows


def _print_gaps(prof, steps: int, before: dict) -> None:
    """The largest idle gaps between kernels per (kernel before, kernel after), and the caching
    allocator's device calls over the profiled steps (a cudaMalloc / cudaFree synchronises the GPU)."""
    from profile_layer_kernels import idle_gaps

    rows = [{"before": b, "after": a, "us_per_step": us, "gaps_per_step": n, "host_late_us": late}
            for b, a, us, n, _, late in idle_gaps(prof, steps, top=12)]
    report("idle gaps between kernels (per step; host_late: the next launch returned after the gap began)",
           rows, ["us_per_step", "gaps_per_step", "host_late_us", "before", "after"], None)
    after = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    print("allocator over the profiled steps: " + ", ".join(f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in keys))


def _span_and_covered(spans):
    """(first start to last end, time covered by at least one kernel), ms, of (start, end) pairs in µs."""
    if not spans:
        return 0.0, 0.0
    spans.sort()
    covered, cur_start, cur_end = 0.0, *spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            covered += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    covered += cur_end - cur_start
    return (max(e for _, e in spans) - spans[0][0]) / 1000, covered / 1000


def host_profile(kind: str, args) -> list:
    """cProfile of 8 steps: where the host's issue time goes (the GPU is kept ahead by a sleep). More steps
    would fill CUDA's launch queue (~1000 launches) behind the sleep, and the launch that finds it full
    would wait for the GPU and take the blame (20 steps of the GPT layer did: 0.9 s in one cast)."""
    import cProfile
    import pstats

    step = _build(kind, args)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    prof.enable()
    for _ in range(8):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    print(f"\n{kind} {args.recipe}: host profile of 8 steps")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return []


def memory_profile(kind: str, args) -> list:
    """The allocations live at one step's memory peak (made during the step, as bench_transformer's peak
    counts them: from cleared gradients and no FP8 weight copies), largest first, each with the frames
    that made it (te_parallel's and the benchmarks'; "torch" where only torch's own were on the stack,
    e.g. the autograd engine's gradient buffers), from torch.cuda.memory's allocation history."""
    step = _build(kind, args)
    for _ in range(3):
        step()
    step.clear_grads()
    getattr(step, "drop_fp8_weights", lambda: None)()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    live, now, peak, at_peak, peak_event = {}, 0, -1, {}, None
    for ev in events:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev["frames"]))
            now += ev["size"]
            if now > peak:
                peak, at_peak, peak_event = now, dict(live), ev
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    print(f"\n{'TE ' if args.peer else ''}{kind} {args.recipe}: peak {peak_gib:.3f} GiB over what the step started "
          f"with ({peak / 2**30:.3f} GiB in the allocation history), reached by an allocation at "
          f"{_where(peak_event['frames']) if peak_event else '-'}")
    rows = [{"MiB": size / 2**20, "made_at": where} for size, where in sorted(at_peak.values(), key=lambda v: -v[0])]
    report("allocations live at the peak", rows[: args.top], ["MiB", "made_at"], None)
    return [{"kind": kind, "recipe": args.recipe, "peak_GiB": peak_gib}] + rows


def _where(frames) -> str:
    """The innermost te_parallel and benchmark frames of an allocation (up to three), innermost first."""
    ours = [f for f in frames if "te_parallel" in f["filename"] or "benchmarks" in f["filename"]][:3]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours) or "torch"


def gemms(args) -> list:
    m, k, n = (int(v) for v in args.shape.split("x"))
    dev, rows = "cuda", []
    f8, f8b = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=dev)
    for what, (mm, kk, nn) in {"fprop": (m, k, n), "dgrad": (m, n, k), "wgrad": (n, m, k)}.items():
        a = torch.randn(mm, kk, device=dev, dtype=torch.bfloat16)
        b = torch.randn(nn, kk, device=dev, dtype=torch.bfloat16)
        bf = time_cuda(lambda: a @ b.t())
        a8 = a.to(f8b if what != "fprop" else f8)
        b8 = b.to(f8)
        res = {"gemm": what, "MxKxN": f"{mm}x{kk}x{nn}", "bf16_ms": bf}
        for fast in (False, True):
            t = time_cuda(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16, use_fast_accum=fast))
            res[f"fp8_{'fast' if fast else 'precise'}_ms"] = t
        res["tflops_fp8_precise"] = 2 * mm * kk * nn / res["fp8_precise_ms"] / 1e9
        res["bf16_over_fp8_precise"] = bf / res["fp8_precise_ms"]
        rows.append(res)
    report("GEMMs alone", rows, list(rows[0]), None)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["linear", "layer", "gemm"])
    ap.add_argument("--shape", default="8192x4096x16384")
    ap.add_argument("--recipe", default="delayed", choices=list(RECIPES))
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt", help="layer: bench_transformer's model")
    ap.add_argument("--batch", type=int, default=None, help="layer: micro-batch (default: the model's)")
    ap.add_argument("--seq", type=int, default=None, help="layer: sequence length (default: the model's)")
    ap.add_argument("--peer", action="store_true", help="profile NVIDIA Transformer Engine's module instead")
    ap.add_argument("--compile", action="store_true", help="te_parallel's module under torch.compile(dynamic=False)")
    ap.add_argument("--attention-backend", default=None, choices=list(BACKENDS),
                    help="layer: te_parallel's attention backend (default auto)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--host", action="store_true", help="cProfile the host side instead of the kernels")
    ap.add_argument("--gaps", action="store_true", help="also list the idle gaps between kernels and their cause")
    ap.add_argument("--memory", action="store_true", help="the allocations live at the step's memory peak instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if (args.host or args.gaps or args.memory) and args.what == "gemm":
        ap.error("--host, --gaps and --memory go with linear or layer, not gemm")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value is not None and (value < 1 or args.what != "layer"):
            ap.error(f"{flag} {value} with {args.what}: sizes a layer step, a positive int (profile_step.py layer {flag} N)")
    if args.memory and (args.host or args.gaps):
        ap.error("--memory goes alone: not with --host or --gaps")
    if args.compile and (args.peer or args.what == "gemm" or args.recipe == "torch"):
        ap.error(f"--compile profiles te_parallel's linear or layer; got {args.what} with "
                 f"{'--peer' if args.peer else '--recipe ' + args.recipe}")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step needs a CUDA GPU")
    if args.what == "gemm":
        rows = gemms(args)
    elif args.memory:
        rows = memory_profile(args.what, args)
    else:
        rows = host_profile(args.what, args) if args.host else profile(args.what, args)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
