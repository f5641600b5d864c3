"""Activations of LayerNormMLP, by TE's names.

Gated ones (geglu, qgeglu, reglu, sreglu, swiglu) take fc1's output [.., 2F] as (a, b) halves
along the last dim and return act(a) * b, so fc1 has 2·ffn_hidden_size outputs.

On CUDA, with the native kernels built, `apply_activation` / `bias_activation` run through
`_BiasActivationFunction`: one kernel for act(x + bias) forward, one for dact (+ dbias) backward
(te_parallel/ops/native_activation.py). Elsewhere, and under torch.compile, they are the PyTorch ops below.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def gelu(x):  # TE's gelu is the tanh approximation
    return F.gelu(x, approximate="tanh")


def qgelu(x):  # "quick GELU": x·σ(1.702x)
    return x * torch.sigmoid(1.702 * x)


def srelu(x):  # squared ReLU
    return torch.square(F.relu(x))


_BASE: Dict[str, Callable] = {"gelu": gelu, "relu": F.relu, "qgelu": qgelu, "srelu": srelu, "silu": F.silu}
_GATED: Dict[str, Callable] = {"geglu": gelu, "qgeglu": qgelu, "reglu": F.relu, "sreglu": srelu, "swiglu": F.silu}
ACTIVATIONS = tuple(_BASE) + tuple(_GATED)


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def is_gated(name: str) -> bool:
    return name in _GATED


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return bias_activation(name, x)


def bias_activation(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) over the last dim of x [.., cols] (gated: [.., cols/2]); bias [cols] or None."""
    if x.is_cuda and not torch.compiler.is_compiling():
        from te_parallel.ops import native_activation

        if native_activation.supports(name, x, bias):
            return _BiasActivationFunction.apply(x, bias, name)
    return apply_activation_torch(name, x if bias is None else x + bias)


def apply_activation_torch(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation with PyTorch ops (autograd through them)."""
    if name in _BASE:
        return _BASE[name](x)
    a, b = x.chunk(2, dim=-1)
    return _GATED[name](a) * b


class _BiasActivationFunction(torch.autograd.Function):
    """y = act(x + bias) by the native kernels; backward dx = dy * act'(x + bias), dbias = sum of dx over rows.

    x [.., cols] is viewed as x2d [tokens, cols] (a copy only if it is not contiguous); saved for
    backward is x2d (and bias), not the output. Once differentiable.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], name: str) -> torch.Tensor:
        from te_parallel.ops.native_activation import bias_activation_forward

        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # [tokens, cols]
        y2d, _ = bias_activation_forward(name, x2d, bias)  # [tokens, cols or cols/2]
        ctx.name, ctx.x_shape = name, x.shape
        ctx.save_for_backward(x2d, bias)
        return y2d.view(*x.shape[:-1], y2d.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        from te_parallel.ops.native_activation import dbias_dactivation_backward

        x2d, bias = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dbias = bias is not None and ctx.needs_input_grad[1]
        if not (need_dx or need_dbias):
            return None, None, None
        dy2d = dy.reshape(-1, dy.shape[-1]).to(x2d.dtype).contiguous()  # [tokens, cols or cols/2]
        dx2d, dbias, _ = dbias_dactivation_backward(ctx.name, dy2d, x2d, bias, need_dbias=need_dbias,
                                                    high_precision=need_dx)
        return (None if dx2d is None else dx2d.view(ctx.x_shape)), dbias, None


def activation_reference(name: str, x: torch.Tensor) -> torch.Tensor:
    """fp64 reference written from the formulas (independent of torch.nn.functional)."""
    x = x.double()

    def act(v, n):
        if n in ("gelu", "geglu"):
            return 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3)))
        if n in ("relu", "reglu"):
            return torch.where(v > 0, v, torch.zeros_like(v))
        if n in ("qgelu", "qgeglu"):
            return v / (1 + torch.exp(-1.702 * v))
        if n in ("srelu", "sreglu"):
            return torch.where(v > 0, v * v, torch.zeros_like(v))
        return v / (1 + torch.exp(-v))  # silu, swiglu

    if name in _BASE:
        return act(x, name)
    a, b = x.chunk(2, dim=-1)
    return act(a, name) * b
