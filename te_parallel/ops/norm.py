"""LayerNorm and RMSNorm (functional), with TE's zero-centred gamma, and fp64 references.

zero_centered_gamma: the stored weight is γ − 1 (initialised to 0), so weight decay pulls γ
towards 1 rather than 0; the math uses (1 + weight).

One rule decides between the native kernels (te_parallel.native.norm: one read of x, fp32 math,
1 + weight taken in fp32, deterministic γ/β gradients) and torch's ops: the kernels make the FP8
outputs (`layer_norm_fp8` / `rms_norm_fp8`, where native.norm.usable says they can run; LayerNormLinear
and LayerNormMLP feed them to their first FP8 GEMM under delayed scaling), and a high-precision norm
runs torch's forward (faster there) with the native backward (faster than torch's) where the kernels
run, torch's alone elsewhere (docs/benchmarks.md, "Kernels"). The native
high-precision path stays callable (`native_layer_norm`, `native_rms_norm`: tests and benchmarks).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import norm as norm_kernels
from te_parallel.ops.cast import quantize

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight + 1 if zero_centered_gamma else weight


def layer_norm(x, weight, bias, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    h = x.shape[-1]
    w = _gamma(weight, zero_centered_gamma).to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    if _native_backward(x, w, b):
        return _TorchNormNativeBackward.apply(_as_rows(x), w, b, eps, "layer_norm").view(x.shape)
    return F.layer_norm(x, (h,), w, b, eps)


def rms_norm(x, weight, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    h = x.shape[-1]
    w = _gamma(weight, zero_centered_gamma).to(x.dtype)
    if _FUSED_RMS is not None and _native_backward(x, w, None):
        return _TorchNormNativeBackward.apply(_as_rows(x), w, None, eps, "rms_norm").view(x.shape)
    return F.rms_norm(x, (h,), w, eps)


def _native_backward(x, w, b) -> bool:
    """A high-precision norm whose gradient is wanted, where the native backward runs (1.6-1.9x faster than
    torch's on an H100; torch's forward is the faster one for a high-precision output)."""
    return ((x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)) and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and norm_kernels.usable(x, w, b) and w.is_contiguous()
            and (b is None or b.is_contiguous()))


_FUSED_RMS = getattr(torch.ops.aten, "_fused_rms_norm", None)  # (output, rstd): F.rms_norm's kernel


def apply_norm(normalization: str, x, weight, bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool):
    if normalization == "LayerNorm":
        return layer_norm(x, weight, bias, eps, zero_centered_gamma)
    return rms_norm(x, weight, eps, zero_centered_gamma)


# ------------------------------------------------------------------------------------------------
# Autograd over the native kernels (norm: "layer_norm" or "rms_norm", the kernels' names)

def _backward(ctx, dy: torch.Tensor):
    x, gamma, mu, rsigma = ctx.saved_tensors
    dy = dy.to(x.dtype).contiguous()  # an expanded or other-dtype gradient: the kernel takes x's layout
    dx, dgamma, dbeta = norm_kernels.backward(ctx.norm, dy, x, mu, rsigma, gamma, ctx.zero_centered_gamma,
                                              ctx.has_beta)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, dgamma if needs[1] else None, dbeta if needs[2] else None)


class _NormFunction(torch.autograd.Function):
    """y = norm(x) for a [rows, hidden] x: the native forward; backward: the native backward."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps, zero_centered_gamma, norm):
        out, mu, rsigma = norm_kernels.forward(norm, x, gamma, beta, eps, zero_centered_gamma, None, None)
        ctx.save_for_backward(x, gamma, mu, rsigma)
        ctx.norm, ctx.zero_centered_gamma, ctx.has_beta = norm, zero_centered_gamma, beta is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return (*_backward(ctx, dy), None, None, None)


class _TorchNormNativeBackward(torch.autograd.Function):
    """y = norm(x) for a [rows, hidden] x by torch's forward kernel, which also returns the row statistics;
    backward: the native backward on them. gamma (and beta) in x's dtype, as torch's F.layer_norm takes them."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps, norm):
        h = x.shape[-1]
        if norm == "rms_norm":
            y, rsigma = _FUSED_RMS(x, [h], gamma, eps)
            mu = None
        else:
            y, mu, rsigma = torch.ops.aten.native_layer_norm(x, [h], gamma, beta, eps)
            mu = mu.reshape(-1).float()
        ctx.save_for_backward(x, gamma, mu, rsigma.reshape(-1).float())
        ctx.norm, ctx.zero_centered_gamma, ctx.has_beta = norm, False, beta is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return (*_backward(ctx, dy), None, None)


class _NormFP8Function(torch.autograd.Function):
    """The FP8 forward (data, data_t) with a gradient carrier: a zero-storage [rows, hidden] tensor in
    x's dtype through which the consumer of the FP8 bytes returns d(norm output)."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps, zero_centered_gamma, norm, spec):
        (data, data_t), mu, rsigma = norm_kernels.forward(norm, x, gamma, beta, eps, zero_centered_gamma, spec,
                                                          None)
        ctx.save_for_backward(x, gamma, mu, rsigma)
        ctx.norm, ctx.zero_centered_gamma, ctx.has_beta = norm, zero_centered_gamma, beta is not None
        carrier = x.new_zeros(()).expand(x.shape)  # [rows, hidden], stride (0, 0)
        outs = (carrier, data) if data_t is None else (carrier, data, data_t)
        ctx.mark_non_differentiable(*outs[1:])
        ctx.set_materialize_grads(False)  # no zero-filled "gradients" of the FP8 bytes
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *_fp8_grads):
        if dy is None:  # nothing reached the carrier
            return (None,) * 7
        return (*_backward(ctx, dy), None, None, None, None)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [..., h] -> [rows, h]


def native_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                      zero_centered_gamma: bool = False) -> torch.Tensor:
    """LayerNorm by the native kernels (autograd), over the last dim of a CUDA x of any leading shape,
    output in x's dtype. Not what layer_norm runs (torch's ops are faster for a high-precision output)."""
    b = None if bias is None else bias.contiguous()
    out = _NormFunction.apply(_as_rows(x), weight.contiguous(), b, eps, zero_centered_gamma, "layer_norm")
    return out.view(x.shape)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm by the native kernels (autograd), as native_layer_norm."""
    out = _NormFunction.apply(_as_rows(x), weight.contiguous(), None, eps, zero_centered_gamma, "rms_norm")
    return out.view(x.shape)


def _fp8(norm: str, x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose):
    scale = scale.detach().to(torch.float32).reshape(())
    if not norm_kernels.usable(x, weight, bias):
        # PyTorch: the high-precision y (autograd through torch's norm) is itself the carrier
        y = layer_norm(x, weight, bias, eps, zero_centered_gamma) if norm == "layer_norm" else \
            rms_norm(x, weight, eps, zero_centered_gamma)
        y = y.reshape(-1, x.shape[-1])
        return quantize(y, scale, fp8_dtype, amax_out=amax_out, transpose=transpose), y
    spec = norm_kernels.FP8NormOutput(scale, fp8_dtype, amax_out, transpose)
    outs = _NormFP8Function.apply(_as_rows(x), weight.contiguous(), None if bias is None else bias.contiguous(), eps,
                                  zero_centered_gamma, norm, spec)
    carrier, data = outs[0], outs[1]
    data_t = outs[2] if len(outs) > 2 else None
    return Float8Tensor(data=data, scale_inv=torch.reciprocal(scale), data_t=data_t), carrier


def fp8_norm_fused(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True where norm_fp8 runs the native pass (no high-precision y); elsewhere it runs torch's norm
    and a separate cast."""
    return norm_kernels.usable(x, weight, bias)


def norm_fp8(normalization: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             zero_centered_gamma: bool = False, *, scale: torch.Tensor, fp8_dtype: torch.dtype,
             amax_out: Optional[torch.Tensor] = None, transpose: bool = True) -> Tuple[Float8Tensor, torch.Tensor]:
    """layer_norm_fp8 or rms_norm_fp8 by the module's `normalization` ("LayerNorm" / "RMSNorm")."""
    norm = "rms_norm" if normalization == "RMSNorm" else "layer_norm"
    return _fp8(norm, x, weight, None if norm == "rms_norm" else bias, eps, zero_centered_gamma, scale, fp8_dtype,
                amax_out, transpose)


def layer_norm_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   zero_centered_gamma: bool = False, *, scale: torch.Tensor, fp8_dtype: torch.dtype,
                   amax_out: Optional[torch.Tensor] = None,
                   transpose: bool = True) -> Tuple[Float8Tensor, torch.Tensor]:
    """LayerNorm straight to FP8, for a consumer that fuses it with its GEMM: (y8, carrier).

    y8: Float8Tensor [rows, hidden] (rows = x.numel() // hidden) with data = fp8(y * scale), its
    transposed copy when `transpose`, and scale_inv = 1 / scale; amax_out receives max |y|.
    carrier: a [rows, hidden] tensor in x's dtype that carries the gradient: the consumer's autograd
    Function takes it as an input and returns dL/dy (high precision) for it, which runs the norm's
    backward into x, weight and bias. With the native kernels (native.norm.usable) the carrier has no
    storage and y is never written in high precision; elsewhere y is torch's norm (the carrier) and
    y8 its `quantize`.
    """
    return _fp8("layer_norm", x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False, *,
                 scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: Optional[torch.Tensor] = None,
                 transpose: bool = True) -> Tuple[Float8Tensor, torch.Tensor]:
    """RMSNorm straight to FP8: (y8, carrier) as in layer_norm_fp8."""
    return _fp8("rms_norm", x, weight, None, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose)


# ------------------------------------------------------------------------------------------------
# fp64 references

def layer_norm_reference(x, weight, bias, eps, zero_centered_gamma=False):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    g = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    y = (x - mu) / torch.sqrt(var + eps) * g
    return y if bias is None else y + bias.double()


def rms_norm_reference(x, weight, eps, zero_centered_gamma=False):
    x = x.double()
    g = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def _grads_fp64(fn, dy, x, params):
    """(dx, d params...) of fn(x, *params) by fp64 autograd (None for a None parameter)."""
    with torch.enable_grad():  # also inside no_grad regions / backward passes
        xr = x.detach().double().requires_grad_(True)
        pr = [None if p is None else p.detach().double().requires_grad_(True) for p in params]
        fn(xr, *pr).backward(dy.detach().double())
    return (xr.grad, *[None if p is None else p.grad for p in pr])


def layer_norm_bwd_reference(dy, x, weight, bias, eps, zero_centered_gamma=False):
    """(dx, dweight, dbias or None) of layer_norm_reference, in fp64."""
    return _grads_fp64(lambda x_, w, b: layer_norm_reference(x_, w, b, eps, zero_centered_gamma), dy, x, (weight, bias))


def rms_norm_bwd_reference(dy, x, weight, eps, zero_centered_gamma=False):
    """(dx, dweight) of rms_norm_reference, in fp64."""
    return _grads_fp64(lambda x_, w: rms_norm_reference(x_, w, eps, zero_centered_gamma), dy, x, (weight,))


# ------------------------------------------------------------------------------------------------
# CPU kernels of the native norm ops (te_parallel::norm_fwd / norm_bwd, which compiled graphs call):
# this module's PyTorch path, so that the ops run (and torch.library.opcheck checks them) without a GPU

def _torch_norm(norm: str, x, gamma, beta, eps, zero_centered_gamma):
    if norm == "layer_norm":
        return layer_norm(x, gamma, beta, eps, zero_centered_gamma)
    return rms_norm(x, gamma, eps, zero_centered_gamma)


@torch.library.register_kernel("te_parallel::norm_fwd", "cpu")
def _norm_fwd_cpu(norm, x, gamma, beta, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose, out_dtype):
    xf = x.float()
    rows = x.shape[0]
    mu = xf.mean(-1) if norm == "layer_norm" else x.new_empty((0,), dtype=torch.float32)
    centred = xf - mu[:, None] if norm == "layer_norm" else xf
    rsigma = torch.rsqrt((centred * centred).mean(-1) + eps)
    y = _torch_norm(norm, x, gamma, beta, eps, zero_centered_gamma)
    if fp8_dtype is None:
        return y.to(out_dtype or x.dtype), x.new_empty((0, rows), dtype=out_dtype or x.dtype), mu, rsigma
    q = quantize(y, scale.reshape(()), fp8_dtype, amax_out=amax_out, transpose=transpose)
    return q.data, q.data_t if transpose else x.new_empty((0, rows), dtype=fp8_dtype), mu, rsigma


@torch.library.register_kernel("te_parallel::norm_bwd", "cpu")
def _norm_bwd_cpu(norm, dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta):
    # the kernels' math from the saved statistics, in fp32
    xf, dyf = x.float(), dy.float()
    xhat = ((xf - mu[:, None]) if norm == "layer_norm" else xf) * rsigma[:, None]
    dxhat = dyf * _gamma(gamma.float(), zero_centered_gamma)
    inner = dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)
    if norm == "layer_norm":
        inner = inner - dxhat.mean(-1, keepdim=True)
    dx = (inner * rsigma[:, None]).to(x.dtype)
    dgamma = (dyf * xhat).sum(0).to(gamma.dtype)
    dbeta = dyf.sum(0).to(gamma.dtype) if with_dbeta and norm == "layer_norm" else gamma.new_empty((0,))
    return dx, dgamma, dbeta
