"""Tensor-parallel state shared by the modules: the group they were handed, and its checks."""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from te_parallel.parallel.groups import as_group, check_group_device, group_size

_WARNED_CONNECTIONS = [False]


def resolve_tp_size(owner: str, tp_group, tp_size: int) -> int:
    """TE's rule: the group's size when a group is given (tp_size must then be 1 or equal), else tp_size.
    tp_group: a ProcessGroup, a 1-D DeviceMesh, or None."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    tp_group = as_group(owner, "tp_group", tp_group)[0]
    if tp_group is None:
        return tp_size
    size = group_size(tp_group)
    if tp_size not in (1, size):
        raise ValueError(f"{owner}: tp_size={tp_size} but tp_group has {size} ranks; they must match")
    return size


class TensorParallelMixin:
    """Holds `tp_group`, `tp_size`, `sequence_parallel`; checks them once before the first parallel forward.

    The group may be handed as a ProcessGroup or as a 1-D DeviceMesh (e.g. `mesh["tp"]` of a dp × tp
    mesh). `tp_group` is always the ProcessGroup the collectives use; `tp_mesh` keeps the mesh when one
    was given (None otherwise), for code that places TP shards on it (distributed checkpoints).
    """

    tp_group: Optional[dist.ProcessGroup]
    tp_mesh: Optional[object]
    tp_size: int
    sequence_parallel: bool

    def _init_tp(self, owner: str, tp_group, tp_size: int, sequence_parallel: bool) -> None:
        group, mesh = as_group(owner, "tp_group", tp_group)
        self.tp_size = resolve_tp_size(owner, group, tp_size)
        self.tp_group, self.tp_mesh = group, mesh
        self.tp_group_initialized = group is not None
        self.sequence_parallel = bool(sequence_parallel)
        self._tp_checked = False

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Hand the module its TP group (a ProcessGroup or a 1-D DeviceMesh) after construction (TE's API)."""
        owner = type(self).__name__
        group, mesh = as_group(owner, "tp_group", tp_group)
        size = resolve_tp_size(owner, group, self.tp_size)
        if size != self.tp_size:
            raise ValueError(f"{owner}: was built for tp_size={self.tp_size}, got a group of {size} ranks")
        self.tp_group, self.tp_mesh, self.tp_group_initialized = group, mesh, group is not None
        self._tp_checked = False

    def _check_tp_ready(self, device: torch.device) -> None:
        if self._tp_checked:
            return
        self._tp_checks(device)
        self._tp_checked = True

    def _tp_checks(self, device: torch.device) -> None:
        """The first forward's checks of the TP settings against the input's device (no state written)."""
        owner = type(self).__name__
        if self.tp_size > 1 and self.tp_group is None:
            raise RuntimeError(f"{owner}: built with tp_size={self.tp_size} but has no tp_group; call set_tensor_parallel_group(group) first")
        if self.sequence_parallel and self.tp_group is None and self.tp_size > 1:
            raise RuntimeError(f"{owner}: sequence_parallel=True needs a tp_group; call set_tensor_parallel_group(group)")
        check_group_device(owner, self.tp_group, device)
        if device.type == "cuda" and self.tp_size > 1:
            _warn_connections()


def _warn_connections() -> None:
    if _WARNED_CONNECTIONS[0] or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    _WARNED_CONNECTIONS[0] = True
    warnings.warn(
        "te_parallel: CUDA_DEVICE_MAX_CONNECTIONS is not 1; set it to 1 before CUDA starts so tensor-parallel "
        "collectives are scheduled ahead of the GEMMs they overlap (otherwise the overlap may serialise)",
        stacklevel=3,
    )


def set_tree_tp_group(module, tp_group) -> None:
    """set_tensor_parallel_group of a module built from TP modules (MultiheadAttention,
    TransformerLayer): every descendant that holds a TP group gets this one."""
    owner = type(module).__name__
    group, mesh = as_group(owner, "tp_group", tp_group)
    size = resolve_tp_size(owner, group, module.tp_size)
    if size != module.tp_size:
        raise ValueError(f"{owner}: was built for tp_size={module.tp_size}, got a group of {size} ranks")
    module.tp_group, module.tp_mesh = group, mesh
    for sub in module.modules():
        if sub is not module and isinstance(sub, TensorParallelMixin):
            sub.set_tensor_parallel_group(tp_group)
