"""The groups a module is handed (passed in, never looked up): a ProcessGroup or a DeviceMesh turned
into the ProcessGroup the collectives use, and the checks on it (size, divisibility, device/backend).

A DeviceMesh carries its own axis names; this module never assumes one. The caller picks the axis
(`mesh["tp"]`) and hands over the 1-D mesh, or hands a whole mesh where all of its ranks are meant
(`fp8_autocast(fp8_group=mesh)`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # a torch built without distributed: no mesh can be passed
    DeviceMesh = ()

# The attribute under which a multi-dimensional mesh keeps the group of all its ranks (made once by
# mesh_group and cached on that mesh object: no registry outside the mesh).
_ALL_RANKS_ATTR = "_te_parallel_all_ranks_group"


def as_group(owner: str, what: str, group) -> Tuple[Optional[dist.ProcessGroup], Optional["DeviceMesh"]]:
    """(ProcessGroup or None, the 1-D DeviceMesh it came from or None) of a group argument: None, a
    ProcessGroup, or a 1-D DeviceMesh (its group is used; the mesh is returned for those who need it,
    e.g. checkpoints that place shards on it). A mesh of more dimensions is an error naming its axes."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group, None
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names
            hint = f"mesh[{names[-1]!r}]" if names else "a 1-D mesh of the tensor-parallel ranks"
            raise ValueError(f"{owner}: {what} got a {group.ndim}-D DeviceMesh of shape {tuple(group.shape)} "
                             f"(dims {names}); pass its tensor-parallel axis, e.g. {hint}")
        return group.get_group(), group
    raise TypeError(f"{owner}: {what} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                    f"got {type(group).__name__}")


def mesh_group(mesh: "DeviceMesh") -> dist.ProcessGroup:
    """The ProcessGroup of all the ranks of `mesh` (whatever its dimensions). A 1-D mesh has it already;
    for more dimensions torch has no public flatten, so the group is made once with dist.new_group over
    the mesh's ranks (only those ranks take part) and kept on the mesh object itself."""
    if mesh.ndim == 1:
        return mesh.get_group()
    group = mesh.__dict__.get(_ALL_RANKS_ATTR)
    if group is None:
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        group = dist.new_group(ranks, use_local_synchronization=True)
        setattr(mesh, _ALL_RANKS_ATTR, group)
    return group


def amax_group(owner: str, group) -> Optional[dist.ProcessGroup]:
    """An fp8_group argument as a ProcessGroup: None, a ProcessGroup, or a DeviceMesh of any dimensions
    meaning all of its ranks (a dp × tp mesh: amaxes are reduced over TP and DP)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        return mesh_group(group)
    raise TypeError(f"{owner}: fp8_group must be a torch.distributed ProcessGroup, a DeviceMesh or None, "
                    f"got {type(group).__name__}")


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
