"""Tensor-parallel state shared by the modules: the group they were handed, and its checks."""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from te_parallel.parallel.groups import check_group_device, group_size

_WARNED_CONNECTIONS = [False]


def resolve_tp_size(owner: str, tp_group, tp_size: int) -> int:
    """TE's rule: the group's size when a group is given (tp_size must then be 1 or equal), else tp_size."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is None:
        return tp_size
    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{owner}: tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")
    size = group_size(tp_group)
    if tp_size not in (1, size):
        raise ValueError(f"{owner}: tp_size={tp_size} but tp_group has {size} ranks; they must match")
    return size


class TensorParallelMixin:
    """Holds `tp_group`, `tp_size`, `sequence_parallel`; checks them once before the first parallel forward."""

    tp_group: Optional[dist.ProcessGroup]
    tp_size: int
    sequence_parallel: bool

    def _init_tp(self, owner: str, tp_group, tp_size: int, sequence_parallel: bool) -> None:
        self.tp_size = resolve_tp_size(owner, tp_group, tp_size)
        self.tp_group = tp_group
        self.tp_group_initialized = tp_group is not None
        self.sequence_parallel = bool(sequence_parallel)
        self._tp_checked = False

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Hand the module its TP group after construction (TE's API)."""
        size = resolve_tp_size(type(self).__name__, tp_group, self.tp_size)
        if size != self.tp_size:
            raise ValueError(f"{type(self).__name__}: was built for tp_size={self.tp_size}, got a group of {size} ranks")
        self.tp_group, self.tp_group_initialized, self._tp_checked = tp_group, tp_group is not None, False

    def _check_tp_ready(self, device: torch.device) -> None:
        if self._tp_checked:
            return
        owner = type(self).__name__
        if self.tp_size > 1 and self.tp_group is None:
            raise RuntimeError(f"{owner}: built with tp_size={self.tp_size} but has no tp_group; call set_tensor_parallel_group(group) first")
        if self.sequence_parallel and self.tp_group is None and self.tp_size > 1:
            raise RuntimeError(f"{owner}: sequence_parallel=True needs a tp_group; call set_tensor_parallel_group(group)")
        check_group_device(owner, self.tp_group, device)
        if device.type == "cuda" and self.tp_size > 1:
            _warn_connections()
        self._tp_checked = True


def _warn_connections() -> None:
    if _WARNED_CONNECTIONS[0] or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    _WARNED_CONNECTIONS[0] = True
    warnings.warn(
        "te_parallel: CUDA_DEVICE_MAX_CONNECTIONS is not 1; set it to 1 before CUDA starts so tensor-parallel "
        "collectives are scheduled ahead of the GEMMs they overlap (otherwise the overlap may serialise)",
        stacklevel=3,
    )
