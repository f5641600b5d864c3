"""Tensor- and sequence-parallel collectives, each a named autograd Function (fwd and bwd stated together).

Shapes are per rank, tp = group size, s = sequence (dim 0, sequence parallelism shards it):

  CopyToTP          fwd identity                    bwd all-reduce(grad)
  ReduceFromTP      fwd all-reduce                  bwd identity
  GatherFromSP      fwd all-gather  [s/tp] -> [s]   bwd reduce-scatter [s] -> [s/tp]
  ReduceScatterToSP fwd reduce-scatter [s] -> [s/tp] bwd all-gather [s/tp] -> [s]
  all_reduce_grad   CopyToTP applied to a parameter: weights that see sequence-sharded activations
                    (norm γ/β, row-parallel bias) get partial gradients, summed over the group

The plain helpers below (all_gather_dim0, reduce_scatter_dim0) move "a tensor" and know nothing
of FP8; an FP8 gather moves the uint8 view of the bytes (communication stays apart from
the FP8 math).

Under torch.compile the helpers issue torch's functional collectives instead (the same
collectives, as ops a graph can hold): a graph orders them itself, so `async_op` has no handle to
give back (None) and the graph waits where the result is first used. Eagerly they are the
torch.distributed calls, asynchronous where asked.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.parallel.groups import check_scatter_dim, group_size

try:
    import torch.distributed._functional_collectives as funcol
except ImportError:  # a torch built without distributed: no group has more than one rank
    funcol = None

Handle = Optional[dist.Work]
# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(t: torch.Tensor, group, async_op: bool = False) -> Tuple[torch.Tensor, Handle]:
    """[n, ...] on each rank -> [tp·n, ...] (rank order). FP8 tensors travel as bytes."""
    t = t.contiguous()
    tp = group_size(group)
    if tp == 1:
        return t, None
    fp8 = t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(t.view(torch.uint8) if fp8 else t, 0, group)
        return (out.view(t.dtype) if fp8 else out), None
    out = torch.empty((tp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    if fp8:
        handle = _all_gather(out.view(torch.uint8), t.view(torch.uint8), group=group, async_op=async_op)
    else:
        handle = _all_gather(out, t, group=group, async_op=async_op)
    return out, handle


def reduce_scatter_dim0(t: torch.Tensor, group, async_op: bool = False) -> Tuple[torch.Tensor, Handle]:
    """[n, ...] partial sums on each rank -> [n/tp, ...] this rank's slice of the sum."""
    tp = group_size(group)
    if tp == 1:
        return t, None
    check_scatter_dim("reduce_scatter", t.shape[0], tp)
    t = t.contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(t, "sum", 0, group), None
    out = torch.empty((t.shape[0] // tp, *t.shape[1:]), dtype=t.dtype, device=t.device)
    handle = _reduce_scatter(out, t, group=group, async_op=async_op)
    return out, handle


def all_reduce(t: torch.Tensor, group, async_op: bool = False) -> Handle:
    """Sum `t` over the group, in place."""
    if group_size(group) == 1:
        return None
    if torch.compiler.is_compiling():
        t.copy_(funcol.all_reduce(t, "sum", group))
        return None
    return dist.all_reduce(t, group=group, async_op=async_op)


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group)[0], None


class ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group)[0], None


def copy_to_tp(x, group):
    return CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sp(x, group):
    return GatherFromSP.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_to_sp(x, group):
    return ReduceScatterToSP.apply(x, group) if group_size(group) > 1 else x


def all_reduce_grad(param, group):
    """Use `param` as is; sum its gradient over `group` (parameters that see sequence shards)."""
    return CopyToTP.apply(param, group) if param is not None and group_size(group) > 1 else param
