"""residual + dropout(x) in one pass, with a mask that is never stored (te_parallel/native/dropout.py).

torch's dropout keeps its mask for backward: a byte per element, live from the forward to the backward
(in a TransformerLayer, one [tokens, hidden] mask per residual block, at the step's memory peak). The
native kernel draws the mask from Philox at (seed, offset, element index) instead; the backward
regenerates it from the two numbers, and the residual add rides in the same pass (one read of x and of
the residual, one write; no mask written or read).

The seed and offset come from torch's CUDA generator of x's device, as torch's own dropout draws them:
`torch.manual_seed` makes a run repeatable, and an RNG tracker's `fork()` (which swaps that generator's
state) gives its stream's masks. Each call advances the generator's offset by 4 (torch's unit), so two
calls never share a mask. The masks differ from torch's dropout for the same seed (another generator);
the distribution is the same: each element kept with probability 1 - p, scaled by 1 / (1 - p).

torch's path runs instead where the kernel does not: on the CPU, under torch.compile (which fuses torch's
dropout itself), while a CUDA graph is captured (the seed and offset would be frozen into the graph and
every replay would repeat one mask), and for inputs the kernel does not take.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from te_parallel.native import dropout as native_dropout

__all__ = ["dropout_add"]


def _draw(device: torch.device):
    """(seed, offset) for one mask from the CUDA generator of `device`, advancing it past them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    seed, offset = gen.initial_seed(), gen.get_offset()
    gen.set_offset(offset + 4)
    return seed, offset


class _DropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, p):
        seed, offset = _draw(x.device)
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        return native_dropout.dropout_add(x, residual, p, seed, offset)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            if native_dropout.usable(grad):
                dx = native_dropout.dropout_add(grad, None, ctx.p, ctx.seed, ctx.offset)
            else:  # (a misaligned gradient: one aligned copy first)
                dx = native_dropout.dropout_add(grad.clone(), None, ctx.p, ctx.seed, ctx.offset)
        return dx, grad if ctx.needs_input_grad[1] else None, None


def fused(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> bool:
    """True when dropout_add(x, residual, p, training) runs the native kernel."""
    return (training and 0.0 < p < 1.0 and native_dropout.usable(x, residual)
            and not torch.cuda.is_current_stream_capturing())


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """residual + dropout(x, p, training) (TE's bias-dropout-add after a projection whose bias is already
    added): the native kernel where `fused` says so, else torch's dropout and add."""
    if fused(x, residual, p, training):
        return _DropoutAdd.apply(x, residual, p)
    return residual + F.dropout(x, p=p, training=training)
