"""Validation of the tensor-parallel group a module is handed (no globals: STYLE.md 1, 2)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

PARALLEL_MODES = (None, "column", "row")


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def check_tp_args(owner: str, tp_group, tp_size: int, sequence_parallel: bool, parallel_mode) -> int:
    """Check TE's tensor-parallel arguments; returns the TP world size."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{owner}: tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")
    size = group_size(tp_group)
    if tp_group is not None and size != tp_size and tp_size != 1:
        raise ValueError(f"{owner}: tp_size={tp_size} but tp_group has {size} ranks; pass tp_size={size} (or omit it)")
    if tp_group is None and tp_size > 1:
        raise ValueError(f"{owner}: tp_size={tp_size} needs tp_group (a process group of {tp_size} ranks); got tp_group=None")
    if sequence_parallel and tp_group is None:
        raise ValueError(f"{owner}: sequence_parallel=True needs tp_group (the ranks that share the sequence); got tp_group=None")
    if size > 1 and parallel_mode is None:
        raise ValueError(f"{owner}: a tp_group of {size} ranks needs parallel_mode='column' or 'row', got None")
    return size


def check_divisible(owner: str, what: str, value: int, tp_size: int) -> int:
    if value % tp_size:
        raise ValueError(f"{owner}: {what}={value} is not divisible by tp_size={tp_size}")
    return value // tp_size


def check_group_device(owner: str, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """A gloo group cannot move CUDA tensors (NCCL cannot move CPU ones): say so before a collective hangs or fails."""
    if group is None or group_size(group) == 1:
        return
    backend = dist.get_backend(group)
    if device.type == "cuda" and backend == "gloo":
        raise ValueError(f"{owner}: tp_group uses backend 'gloo', which cannot communicate CUDA tensors; create it with backend 'nccl'")
    if device.type == "cpu" and backend == "nccl":
        raise ValueError(f"{owner}: tp_group uses backend 'nccl', which cannot communicate CPU tensors; use 'gloo' or move the module to CUDA")


def check_scatter_dim(owner: str, rows: int, tp_size: int) -> None:
    if rows % tp_size:
        raise ValueError(
            f"{owner}: sequence length {rows} (dim 0) is not divisible by tp_size={tp_size}, needed to reduce-scatter it under sequence_parallel"
        )
