"""Validation of the tensor-parallel group a module is handed (groups are passed in, never looked up)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in `group` (1 for None). ProcessGroup.size() directly: dist.get_world_size's checks and
    logging wrapper cost microseconds per call, and the TP path asks several times per GEMM."""
    if group is None:
        return 1
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


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
