"""Kernel-side timing: fn() replayed from one CUDA graph of several back-to-back calls.

common.time_cuda times each call between its own pair of events after a synchronize, so it includes
the host time to enqueue the call (Python checks, allocations): for a 30 us kernel that can be half the
measurement. Replaying a captured graph removes the host side and shows what the kernels themselves
reach; benchmarks report both.
"""
from __future__ import annotations

from typing import Callable

import torch

from common import time_cuda


def time_cuda_graph(fn: Callable[[], object], calls: int = 10, iters: int = 20) -> float:
    """Median milliseconds of one fn() call, from replays of a CUDA graph holding `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = time_cuda(graph.replay, warmup=3, iters=iters) / calls
    del graph
    torch.cuda.synchronize()
    return ms
