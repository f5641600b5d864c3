"""Timing helpers for the GPU benchmarks: CUDA events, warm-up, median of many runs."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import threading
import time
from typing import Callable, Dict, List

import torch


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr ("<script>: error: <what>; see --help"), exit status 2,
    no usage block: a benchmark's command-line mistakes end there, before any work starts."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def _events_ms(fn: Callable[[], None], calls: int) -> float:
    """Milliseconds between a pair of CUDA events around `calls` back-to-back calls of fn()."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _warm(fn: Callable[[], None], warmup: int) -> None:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()


def time_cuda(fn: Callable[[], None], warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of fn() over `iters` runs, each timed with its own pair of CUDA events."""
    _warm(fn, warmup)
    return statistics.median(_events_ms(fn, 1) for _ in range(iters))


def time_cuda_stream(fn: Callable[[], None], warmup: int = 5, iters: int = 20, repeats: int = 5) -> float:
    """Milliseconds per fn() call with calls issued back to back, as a training loop does: one pair of
    events around `iters` calls, no synchronisation between them, median over `repeats`. The host's
    time to issue a call is hidden wherever it is shorter than the GPU's (and shows where it is not),
    whereas time_cuda starts every call on an idle GPU and adds the host's latency to its first kernel.
    """
    _warm(fn, warmup)
    return statistics.median(_events_ms(fn, iters) / iters for _ in range(repeats))


def time_interleaved(steps: Dict[str, Callable[[], None]], warmup: int = 5, iters: int = 20,
                     rounds: int = 7, settle: int | None = None) -> Dict[str, float]:
    """time_cuda_stream for several cases at once, in rounds: each round times `iters` back-to-back calls
    of every case, starting one case further on each round; the median over rounds per case. A GPU at
    its power cap runs a case faster or slower by where it sits in a sequence (the last of five Linear
    rows ran 3-5% faster than the same code in the third), so cases are compared inside each round.
    `settle` calls (default: iters) run untimed before each timed sample, so that the clock the power cap
    sets has adjusted from the previous case's load to this one's."""
    for fn in steps.values():
        _warm(fn, warmup)
    names = list(steps)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            for _ in range(iters if settle is None else max(settle, 1)):
                steps[name]()
            samples[name].append(_events_ms(steps[name], iters) / iters)
    return {n: statistics.median(v) for n, v in samples.items()}


class EnergyMeter:
    """The GPU's energy counter, enforced power limit and SM clock, read through NVML (nvidia-ml-py's
    `pynvml`). At the power limit the clock follows the load: a step then takes about its energy divided by
    the limit, and a faster kernel helps only by the energy it saves (docs/benchmarks.md, "Energy at the power
    limit")."""

    def __init__(self, device: int | None = None) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(torch.cuda.current_device() if device is None else device)
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000

    def joules(self) -> float:
        """Energy used by the GPU since the driver loaded (NVML counts millijoules)."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000

    def sm_mhz(self) -> int:
        return self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)


def nvml_missing() -> str | None:
    """Why EnergyMeter cannot run here (None when it can)."""
    if importlib.util.find_spec("pynvml") is None:
        return "needs NVIDIA's NVML bindings: pip install nvidia-ml-py"
    return None


def energy_interleaved(steps: Dict[str, Callable[[], None]], ms: Dict[str, float], seconds: float = 3.0,
                       rounds: int = 2, meter: EnergyMeter | None = None) -> Dict[str, dict]:
    """Energy per step of each case, in interleaved rounds as time_interleaved: each case runs untimed for a
    second (its clock settles), then `seconds` of steps back to back (as many as `ms`, its time per step,
    fits) between two reads of the energy counter, while a thread samples the SM clock every 20 ms. Per case,
    the medians over rounds of: joules per step, mean watts, mean SM clock, ms per step in the window, and
    ms_at_limit = joules per step / the power limit (the fastest a step of that energy can run there)."""
    meter = meter or EnergyMeter()
    names = list(steps)
    samples: Dict[str, List[tuple]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            step = steps[name]
            n = max(1, round(seconds * 1000 / ms[name]))
            for _ in range(max(1, round(1000 / ms[name]))):
                step()
            torch.cuda.synchronize()
            clocks, stop = [], threading.Event()

            def sample():
                while not stop.wait(0.02):
                    clocks.append(meter.sm_mhz())

            sampler = threading.Thread(target=sample, daemon=True)
            j0, t0 = meter.joules(), time.perf_counter()
            sampler.start()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            j1, t1 = meter.joules(), time.perf_counter()
            stop.set()
            sampler.join()
            samples[name].append(((j1 - j0) / n, (j1 - j0) / (t1 - t0), statistics.fmean(clocks or [meter.sm_mhz()]),
                                  (t1 - t0) * 1000 / n))
    out = {}
    for name, got in samples.items():
        joules, watts, mhz, step_ms = (statistics.median(v) for v in zip(*got))
        out[name] = {"J_per_step": joules, "watts": watts, "sm_MHz": mhz, "ms_in_window": step_ms,
                     "ms_at_limit": joules / meter.limit_w * 1000, "limit_W": meter.limit_w}
    return out


def report_energy(rows: List[Dict], seconds: float, lead: List[str], ratios: List[str] = ()) -> None:
    """The table of energy_interleaved's fields in `rows` (2 rounds): the `lead` columns first, the `ratios`
    columns after J_per_step."""
    report(f"Energy per step ({seconds:g} s of back-to-back steps per row and round, median of 2 rounds; "
           f"power limit {rows[0]['limit_W']:.0f} W; ms_at_limit = J_per_step / limit)", rows,
           [*lead, "ms_in_window", "J_per_step", *ratios, "watts", "sm_MHz", "ms_at_limit"], None)


def training_step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, fp8_recipe=None,
                  **forward_kwargs) -> Callable[[], None]:
    """One fwd+bwd of `module` on x (and forward_kwargs) as a training loop runs it: gradients cleared
    first (optimizer.zero_grad(set_to_none=True), so no .grad accumulation is timed), FP8 weight casts
    dropped (the optimizer changes the weights every step). `step.clear_grads()` clears alone,
    `step.drop_fp8_weights()` drops the FP8 weight copies alone."""
    import te_parallel as te

    droppers = [m.drop_fp8_weight_cache for m in module.modules() if hasattr(m, "drop_fp8_weight_cache")]

    def drop_fp8_weights():  # (the list is made once: walking the modules is the harness's cost, not the step's)
        for drop in droppers:
            drop()

    region = functools.partial(te.fp8_autocast, enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe)
    step = _fwd_bwd_step(module, x, dy, region, drop_fp8_weights if fp8_recipe is not None else None, forward_kwargs)
    step.drop_fp8_weights = drop_fp8_weights
    return step


def _fwd_bwd_step(module, x, dy, region, before, forward_kwargs) -> Callable[[], None]:
    """The step of training_step / te_training_step: clear the gradients, call `before` (if any), run the
    forward inside region() and the backward; with .clear_grads and .params."""
    params = list(module.parameters())

    def clear_grads():
        x.grad = None
        for p in params:
            p.grad = None

    def step():
        clear_grads()
        if before is not None:
            before()
        with region():
            y = module(x, **forward_kwargs)
        y.backward(dy)

    step.clear_grads, step.params = clear_grads, params
    return step


def init_torchrun_nccl():
    """(rank, world size, group of all ranks) of a torchrun job on NCCL, each rank on its own GPU
    (NVLink multicast off unless the environment says otherwise)."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    return rank, world, dist.new_group(list(range(world)))


def max_over_ranks(value: float) -> float:
    """The largest of every rank's `value` (a collective: every rank calls it)."""
    import torch.distributed as dist

    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def environment() -> Dict[str, str]:
    commit = os.environ.get("GIT_COMMIT", "")  # set by runs from a copy of the tree whose .git may be stale
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "commit": commit or "unknown",
    }


def report(title: str, rows: List[Dict], columns: List[str], json_path: str | None) -> None:
    """Print a fixed-width table and, if asked, write {"env", "rows"} as JSON."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"title": title, "env": environment(), "rows": rows}, f, indent=2)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


# The comparison row of an FP8 benchmark: every FP8 GEMM through torch._scaled_mm instead of
# te_parallel's own cuBLASLt call (the recipes' default MMParams(backend="native")).
OTHER_GEMM_LABEL = "torch._scaled_mm GEMM"


def with_torch_gemm(rec):
    """`rec` (a recipe) with every FP8 GEMM issued by torch._scaled_mm (backend="torch"), each with its
    recipe's accumulation."""
    return dataclasses.replace(rec, **{f"fp8_gemm_{g}": dataclasses.replace(getattr(rec, f"fp8_gemm_{g}"), backend="torch")
                                       for g in ("fprop", "dgrad", "wgrad")})


def transformer_engine():
    """NVIDIA's Transformer Engine (`transformer_engine.pytorch`) when the real one is installed, else None.
    te_parallel's own compat package also answers to that name; it marks itself and is not a peer."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te_peer
    except Exception:  # not installed, or installed without its torch extension
        return None
    return None if getattr(transformer_engine, "IS_TE_PARALLEL_COMPAT", False) else te_peer


def te_recipe(kind: str):
    """TE's recipe of the same name as te_parallel's benchmark recipes ("delayed": HYBRID, history 16,
    max; "delayed_dpa": the same with fp8_dpa=True, FP8 attention; "current")."""
    from transformer_engine.common import recipe as te_recipes

    if kind in ("delayed", "delayed_dpa"):
        return te_recipes.DelayedScaling(fp8_format=te_recipes.Format.HYBRID, amax_history_len=16,
                                          amax_compute_algo="max", fp8_dpa=kind == "delayed_dpa")
    if kind == "block":
        return te_recipes.Float8BlockScaling()
    return te_recipes.Float8CurrentScaling()


def te_training_step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, kind: str | None = None,
                     **forward_kwargs) -> Callable[[], None]:
    """training_step for a TE module: `kind` None (bf16), "delayed", "delayed_dpa", "current" or "block". TE recasts its weights
    on every forward without is_first_microbatch, as te_parallel's step does after dropping its copies."""
    rec = te_recipe(kind) if kind else None
    region = functools.partial(transformer_engine().fp8_autocast, enabled=rec is not None, fp8_recipe=rec)
    return _fwd_bwd_step(module, x, dy, region, None, forward_kwargs)
