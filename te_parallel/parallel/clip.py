"""Gradient norm and clipping of a tensor-parallel model, over the whole model on every rank.

    total = te.clip_grad_norm_(model, max_norm=1.0)   # after backward, before optimizer.step()

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` cannot do this under TP: a TP-sharded
parameter is a plain tensor holding this rank's shard, so torch adds up one rank's shards and each rank
clips by a different factor, and the parameters every TP rank holds whole (norm weights, row-parallel
biases) drift apart. Here the norm is taken from what the model's modules say about each parameter
(`tp_shard_layouts()`, te_parallel.parallel.sharding):

    total^p = sum over TP groups of all_reduce_sum(sum over that group's shards of ||g||^p)
            + sum over whole parameters of ||g||^p          (counted once: the same on every TP rank)

Under expert parallelism (an MoE layer's experts split over an "ep" group, each rank holding its own; the
modules' `ep_shard()`) the experts' sums are also all-reduced over the ep group, so every expert counts
once, and the parameters every ep rank holds (router, norms, shared expert) count once.

(max and all_reduce_max for p = inf). FSDP2's gradients are DTensors over the data-parallel mesh: their
local shards' sums are also all-reduced over the mesh dims that shard them. DDP's gradients are already
the same on every data-parallel rank. Every rank gets the same total, bit for bit (the same numbers in the
same order), so every rank clips by the same factor and whole parameters stay identical. The sums are
taken in fp64 and the total rounded to fp32 once, so the total does not depend on how the gradients are
cut into shards: FSDP2 and DDP, or TP=2 and TP=1 given the same gradients, get the same fp32 number (a
norm summed in fp32 would differ in its last bits, and so would the clipped gradients). `foreach` is
accepted for torch's signature; the sums are per gradient.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()


_CHUNK = 1 << 24  # elements per fp64 reduction: a large gradient is not copied to fp64 whole


def _sharded_params(model: nn.Module) -> Dict[int, Tuple[dist.ProcessGroup, ...]]:
    """{id(parameter): the groups its pieces are spread over} for the TP-sharded parameters of `model`'s
    modules (their TP group) and the experts split over an ep group (`ep_shard()`: the ep group, after
    the TP group of a TP-sharded expert)."""
    sharded: Dict[int, Tuple[dist.ProcessGroup, ...]] = {}
    for sub in model.modules():
        layouts = getattr(sub, "tp_shard_layouts", None)  # the modules that answer it: shard_layouts' rule
        if layouts is not None:
            for name, layout in layouts().items():
                if layout.local_shape != layout.full_shape:
                    sharded[id(sub._parameters[name])] = (sub.tp_group,)
        ep_shard = getattr(sub, "ep_shard", None)  # (ExpertShard's rule, te_parallel.parallel.sharding)
        if ep_shard is not None and ep_shard() is not None:
            for p in sub._parameters.values():
                if p is not None:
                    sharded[id(p)] = sharded.get(id(p), ()) + (sub.ep_group,)
    return sharded


def _grads(model: nn.Module) -> List[Tuple[torch.Tensor, Tuple[dist.ProcessGroup, ...]]]:
    """[(the local gradient, the groups over which its pieces are spread)]: the TP group of a TP shard,
    the ep group of an expert split over one, the mesh dims of a DTensor gradient (FSDP2) that shard it;
    () for a gradient held whole."""
    sharded = _sharded_params(model)
    out = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        groups = sharded.get(id(p), ())
        if isinstance(g, DTensor):
            for dim, placement in enumerate(g.placements):
                if placement.is_partial():
                    raise ValueError(f"get_total_norm: a gradient with a Partial placement ({g.placements}) is a sum "
                                     f"not yet reduced; reduce it (redistribute) before taking its norm")
                if placement.is_shard():
                    groups += (g.device_mesh.get_group(dim),)
            g = g.to_local()
        out.append((g, groups))
    return out


def _power_sum(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |g|^p (max |g| for p = inf) in fp64: the same number however the gradient is cut into
    shards, to far below fp32's rounding, so that the total does not depend on the layout."""
    flat = g.detach().reshape(-1)
    if norm_type == float("inf"):
        return flat.abs().max().double() if flat.numel() else torch.zeros((), dtype=torch.float64, device=g.device)
    parts = [torch.linalg.vector_norm(c, norm_type, dtype=torch.float64) for c in flat.split(_CHUNK)]
    return sum(p.pow(norm_type) for p in parts) if parts else torch.zeros((), dtype=torch.float64, device=g.device)


def get_total_norm(model: nn.Module, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm of all of `model`'s gradients as one vector: every TP shard once, every whole parameter
    once; the same value on every rank (see the module docstring)."""
    return _total(_grads(_checked(model)), _checked_norm_type(norm_type), error_if_nonfinite)


def _checked(model) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_total_norm: pass the model (an nn.Module), got {type(model).__name__}: which "
                        f"parameters are TP shards is known from its modules, not from the tensors")
    return model


def _checked_norm_type(norm_type) -> float:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"get_total_norm: norm_type must be positive (or inf), got {norm_type}")
    return norm_type


def _total(grads, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """The fp32 total norm: each gradient's power sum in fp64, summed (max for inf) per set of groups its
    pieces are spread over, reduced over those groups, then added up in a fixed order."""
    if not grads:
        return torch.tensor(0.0)
    device = grads[0][0].device
    inf = norm_type == float("inf")
    by_groups: Dict[Tuple[dist.ProcessGroup, ...], List[torch.Tensor]] = {}
    for g, groups in grads:
        by_groups.setdefault(groups, []).append(_power_sum(g, norm_type).to(device))
    parts = []
    for groups, sums in by_groups.items():
        part = torch.stack(sums).amax() if inf else torch.stack(sums).sum()
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        parts.append(part)
    total = torch.stack(parts).amax() if inf else torch.stack(parts).sum().pow(1.0 / norm_type)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"get_total_norm: the total norm of order {norm_type} of the gradients is {total.item()}; "
                           f"pass error_if_nonfinite=False to clip anyway")
    return total


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model with TP-sharded parameters: scales all of `model`'s
    gradients in place by min(1, max_norm / (total + 1e-6)), total = get_total_norm(model, ...), and
    returns total (the same on every rank). Takes the model, not its parameters: see get_total_norm."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a positive number, got {max_norm!r}")
    grads = _grads(_checked(model))  # (one walk of the modules per step, for the norm and the scaling)
    total = _total(grads, _checked_norm_type(norm_type), error_if_nonfinite)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g, _ in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total
