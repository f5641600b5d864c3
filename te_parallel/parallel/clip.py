"""Gradient norm and clipping of a tensor-parallel model, over the whole model on every rank.

    total = te.clip_grad_norm_(model, max_norm=1.0)   # after backward, before optimizer.step()

`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` cannot do this under TP: a TP-sharded
parameter is a plain tensor holding this rank's shard, so torch adds up one rank's shards and each rank
clips by a different factor, and the parameters every TP rank holds whole (norm weights, row-parallel
biases) drift apart. Here the norm is taken from what the model's modules say about each parameter
(`tp_shard_layouts()`, te_parallel.parallel.sharding):

    total^p = sum over TP groups of all_reduce_sum(sum over that group's shards of ||g||^p)
            + sum over whole parameters of ||g||^p          (counted once: the same on every TP rank)

(max and all_reduce_max for p = inf). FSDP2's gradients are DTensors over the data-parallel mesh: their
norms are reduced over it by DTensor itself, as torch's clip_grad_norm_ does. DDP's gradients are already
the same on every data-parallel rank. Every rank gets the same total, bit for bit (the same numbers in the
same order), so every rank clips by the same factor and whole parameters stay identical.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()


def _grads_by_group(model: nn.Module) -> Dict[Optional[dist.ProcessGroup], List[torch.Tensor]]:
    """{TP group: gradients of the parameters it shards, None: gradients of whole parameters}."""
    sharded = {}
    for sub in model.modules():
        layouts = getattr(sub, "tp_shard_layouts", None)  # the modules that answer it: shard_layouts' rule
        if layouts is None:
            continue
        for name, layout in layouts().items():
            if layout.local_shape != layout.full_shape:
                sharded[id(sub._parameters[name])] = sub.tp_group
    out: Dict[Optional[dist.ProcessGroup], List[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            out.setdefault(sharded.get(id(p)), []).append(p.grad)
    return out


def _norm(grads: List[torch.Tensor], norm_type: float, foreach: Optional[bool]) -> torch.Tensor:
    """The p-norm of `grads` as a plain fp32 tensor (DTensor gradients: reduced over their mesh)."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False, foreach=foreach)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()


def get_total_norm(model: nn.Module, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm of all of `model`'s gradients as one vector: every TP shard once, every whole parameter
    once; the same value on every rank (see the module docstring)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_total_norm: pass the model (an nn.Module), got {type(model).__name__}: which "
                        f"parameters are TP shards is known from its modules, not from the tensors")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"get_total_norm: norm_type must be positive (or inf), got {norm_type}")
    return _total(_grads_by_group(model), norm_type, error_if_nonfinite, foreach)


def _total(buckets, norm_type: float, error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
    if not buckets:
        return torch.tensor(0.0)
    device = next(iter(buckets.values()))[0].device
    inf = norm_type == float("inf")
    parts = []
    for group, grads in buckets.items():
        part = _norm(grads, norm_type, foreach).to(device)
        part = part if inf else part.pow(norm_type)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        parts.append(part)
    total = torch.stack(parts).amax() if inf else torch.stack(parts).sum().pow(1.0 / norm_type)
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
    total = get_total_norm(model, norm_type, error_if_nonfinite, foreach)  # (checks model and norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for grads in _grads_by_group(model).values():
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            by_device.setdefault(local.device, []).append(local)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total
