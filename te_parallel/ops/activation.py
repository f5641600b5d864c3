"""Activations of LayerNormMLP, by TE's names.

Gated ones (geglu, qgeglu, reglu, sreglu, swiglu) take fc1's output [.., 2F] as (a, b) halves
along the last dim and return act(a) * b, so fc1 has 2·ffn_hidden_size outputs.

Where the native kernels take the input (te_parallel.native.activation.usable: CUDA, the kernels built,
not under torch.compile), `apply_activation` / `bias_activation` run through `_BiasActivationFunction`:
one kernel for act(x + bias) forward, one for dact (+ dbias) backward. Elsewhere they are the PyTorch
ops below. The FP8 entry points (`bias_activation_fp8`, `dbias_dactivation_fp8`) fuse the cast into
those passes, with `quantize` of the PyTorch ops as their fallback; the fp64 references
(`activation_reference`, `bias_activation_reference`, `dbias_dactivation_reference`) are what the
tests hold both paths to.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import activation as native_act
from te_parallel.ops.cast import amax_torch, quantize


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
    if native_act.usable(name, x, bias):
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
        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # [tokens, cols]
        y2d = native_act.bias_activation_forward(name, x2d, bias)[0]  # [tokens, cols or cols/2]
        ctx.name, ctx.x_shape = name, x.shape
        ctx.save_for_backward(x2d, bias)
        return y2d.view(*x.shape[:-1], y2d.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2d, bias = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dbias = bias is not None and ctx.needs_input_grad[1]
        if not (need_dx or need_dbias):
            return None, None, None
        dy2d = dy.reshape(-1, dy.shape[-1]).to(x2d.dtype).contiguous()  # [tokens, cols or cols/2]
        dx2d, dbias, _, _ = native_act.dbias_dactivation_backward(ctx.name, dy2d, x2d, bias, need_dbias=need_dbias,
                                                                  high_precision=need_dx)
        return (None if dx2d is None else dx2d.view(ctx.x_shape)), dbias, None


# ------------------------------------------------------------------------------------------------
# FP8 entry points (for fusing the activation into fc2's FP8 Linear; they fall back to PyTorch)

def _float8(data: torch.Tensor, data_t: Optional[torch.Tensor], scale: torch.Tensor) -> Float8Tensor:
    return Float8Tensor(data=data, scale_inv=torch.reciprocal(scale), data_t=data_t)


def bias_activation_fp8(name: str, x: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor,
                        fp8_dtype: torch.dtype, *, amax_out: Optional[torch.Tensor] = None,
                        transpose: bool = True) -> Float8Tensor:
    """act(x + bias) of a 2-D x straight to FP8 (+ transpose, + amax): the same bytes as
    quantize(act(x + bias)) of the kernels' high-precision output. PyTorch ops where the kernels cannot run."""
    if x.dim() != 2:
        raise ValueError(f"bias_activation_fp8: x is {tuple(x.shape)}; need a 2-D [rows, cols] tensor")
    if native_act.usable(name, x, bias):
        scale = scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
        _, data, data_t = native_act.bias_activation_forward(name, x.contiguous(), bias, high_precision=False,
                                                             fp8_dtype=fp8_dtype, scale=scale, amax_out=amax_out,
                                                             transpose=transpose)
        return _float8(data, data_t, scale)
    scale = scale.detach().to(torch.float32).reshape(())
    return quantize(bias_activation_torch(name, x, bias), scale, fp8_dtype, amax_out=amax_out, transpose=transpose)


def dbias_dactivation_fp8(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                          scale: torch.Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[torch.Tensor] = None,
                          transpose: bool = True, need_dbias: bool = True, fp8_out: Optional[torch.Tensor] = None,
                          dbias_out: Optional[torch.Tensor] = None
                          ) -> Tuple[Optional[Float8Tensor], Optional[torch.Tensor]]:
    """(FP8 dx with its transpose, dbias or None) for a 2-D x: the dact + dbias + cast-transpose fusion that
    feeds fc1's FP8 dgrad and wgrad GEMMs. PyTorch ops where the kernels cannot run. fp8_out / dbias_out:
    as in te_parallel.native.activation.dbias_dactivation_backward (rows of a backward done in chunks;
    FP8 dx is then None)."""
    if x.dim() != 2:
        raise ValueError(f"dbias_dactivation_fp8: x is {tuple(x.shape)}; need a 2-D [rows, cols] tensor")
    if native_act.usable(name, x, bias):
        scale = scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
        # (the PyTorch path's autograd casts a gradient of another dtype to x's too)
        _, dbias, data, data_t = native_act.dbias_dactivation_backward(
            name, dy.to(x.dtype).contiguous(), x.contiguous(), bias, need_dbias=need_dbias, high_precision=False,
            fp8_dtype=fp8_dtype, scale=scale, amax_out=amax_out, transpose=transpose, fp8_out=fp8_out,
            dbias_out=dbias_out)
        return (None if fp8_out is not None else _float8(data, data_t, scale)), dbias
    scale = scale.detach().to(torch.float32).reshape(())
    dx = dactivation_torch(name, dy, x, bias)
    dbias = None
    if need_dbias:
        dbias = dx.float().sum(0).to(dx.dtype) if dbias_out is None else dbias_out.copy_(dx.float().sum(0))
    q = quantize(dx, scale, fp8_dtype, amax_out=amax_out, transpose=transpose and fp8_out is None)
    if fp8_out is None:
        return q, dbias
    fp8_out.copy_(q.data)
    return None, dbias


# ------------------------------------------------------------------------------------------------
# PyTorch paths and fp64 references

def bias_activation_torch(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same op with PyTorch ops in x.dtype (x + bias rounded, then the activation): torch's own path."""
    return apply_activation_torch(name, x if bias is None else x + bias)


def dactivation_torch(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """dx of bias_activation_torch at x (and bias) for the output gradient dy, by autograd through the
    same PyTorch ops (torch's own path)."""
    with torch.enable_grad():
        v = x.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(bias_activation_torch(name, v, bias), v, dy)
    return dx


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


def bias_activation_reference(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp64 act(x + bias) from the formulas of activation_reference."""
    v = x.double() if bias is None else x.double() + bias.double()
    return activation_reference(name, v)


def dbias_dactivation_reference(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 (dx, dbias) by autograd through activation_reference at x + bias."""
    with torch.enable_grad():
        v = (x.double() if bias is None else x.double() + bias.double()).detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(activation_reference(name, v), v, dy.double())
    return dx, dx.sum(0)


# ------------------------------------------------------------------------------------------------
# CPU kernels of the native activation ops (te_parallel::bias_activation_fwd / dbias_dactivation_bwd,
# which compiled graphs call): this module's PyTorch path, so that the ops run (and torch.library.opcheck
# checks them) without a GPU. The FP8 bytes are quantize's of the rounded high-precision value, as the
# kernels'.

def _none_as_empty(t: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype) if t is None else t


@torch.library.register_kernel("te_parallel::bias_activation_fwd", "cpu")
def _bias_activation_fwd_cpu(name, x, bias, high_precision, fp8_dtype, scale, amax_out, transpose):
    y = bias_activation_torch(name, x, bias)
    data = data_t = None
    if fp8_dtype is not None:
        q = quantize(y, scale.reshape(()), fp8_dtype, amax_out=amax_out, transpose=transpose)
        data, data_t = q.data, q.data_t
    elif amax_out is not None:
        torch.maximum(amax_out, amax_torch(y).view_as(amax_out), out=amax_out)
    return (y if high_precision else x.new_empty((0,)), _none_as_empty(data, x, torch.uint8),
            _none_as_empty(data_t, x, torch.uint8))


def _act_and_slope(name: str, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(act(v), act'(v)) of a base activation from the formulas (as the kernels compute them), in v's dtype."""
    if name in ("gelu", "geglu"):
        k = (2 / torch.pi) ** 0.5
        t = torch.tanh(k * (v + 0.044715 * v ** 3))
        return 0.5 * v * (1 + t), 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v)
    if name in ("relu", "reglu"):
        return torch.relu(v), (v > 0).to(v.dtype)
    if name in ("srelu", "sreglu"):
        return torch.relu(v) ** 2, 2 * torch.relu(v)
    c = 1.702 if name in ("qgelu", "qgeglu") else 1.0  # qgelu: v·σ(1.702v); silu: v·σ(v)
    sig = torch.sigmoid(c * v)
    return v * sig, sig + c * v * sig * (1 - sig)


@torch.library.register_kernel("te_parallel::dbias_dactivation_bwd", "cpu")
def _dbias_dactivation_bwd_cpu(name, dy, x, bias, need_dbias, high_precision, fp8_dtype, scale, amax_out, transpose):
    # (a kernel runs below autograd: the derivative from the formulas, in fp32 and rounded once, as the kernels')
    v = x.float() if bias is None else x.float() + bias.float()
    g = dy.float()
    if name in _GATED:
        a, b = v.chunk(2, dim=-1)
        act, slope = _act_and_slope(name, a)
        dx = torch.cat([g * b * slope, g * act], dim=-1).to(x.dtype)
    else:
        dx = (g * _act_and_slope(name, v)[1]).to(x.dtype)
    dbias = dx.float().sum(0).to(dx.dtype) if need_dbias else None
    data = data_t = None
    if fp8_dtype is not None:
        q = quantize(dx, scale.reshape(()), fp8_dtype, amax_out=amax_out, transpose=transpose)
        data, data_t = q.data, q.data_t
    elif amax_out is not None:
        torch.maximum(amax_out, amax_torch(dx).view_as(amax_out), out=amax_out)
    return (dx if high_precision else x.new_empty((0,)), _none_as_empty(dbias, x, x.dtype),
            _none_as_empty(data, x, torch.uint8), _none_as_empty(data_t, x, torch.uint8))
