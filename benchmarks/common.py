"""Timing helpers for the GPU benchmarks: CUDA events, warm-up, median of many runs."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from typing import Callable, Dict, List

import torch


def time_cuda(fn: Callable[[], None], warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of fn() over `iters` runs, each timed with its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cuda_stream(fn: Callable[[], None], warmup: int = 5, iters: int = 20, repeats: int = 5) -> float:
    """Milliseconds per fn() call with calls issued back to back, as a training loop does: one pair of
    events around `iters` calls, no synchronisation between them, median over `repeats`. The host's
    time to issue a call is hidden wherever it is shorter than the GPU's (and shows where it is not),
    whereas time_cuda starts every call on an idle GPU and adds the host's latency to its first kernel.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


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
