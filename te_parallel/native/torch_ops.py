"""te_parallel's torch custom ops (csrc/torch_ops, namespace `te_parallel`): the C++ host path.

The extension registers the ops' schemas and CUDA kernels on torch's stable ABI when it is built beside
torch (setup.py). This module adds what torch needs besides: a fake kernel per op (shapes and dtypes
only, for torch.compile's tracing and meta tensors) and a CPU kernel per op (the PyTorch reference,
bit-identical to the CUDA kernel's math; it also lets `torch.library.opcheck` run them on the CPU).

    cast_fp8(x, scale?, amax!?, fp8_dtype, rowwise, transpose, keep_scale)
        -> (data [M, K] | [0, K], data_t [K, M] | [0, M], scale_inv [], scale snapshot [1] | [0])
        delayed scaling with `scale` (amax, when given, receives max(amax, max|x|)); without a scale,
        current scaling: scale = fp8_max / max|x| (amax, when given, receives max|x|)
    fp8_gemm(a [M, K], a_scale_inv, b [N, K], b_scale_inv, out_dtype, bias?, accumulate?, fast_accum)
        -> a·bᵀ·a_scale_inv·b_scale_inv (+ bias) (+ accumulate) [M, N]; M, N, K multiples of 16
    linear_fp8_fwd(x, x_scale?, x_amax!?, x_fp8_dtype, x_transpose, w [N, K] FP8, w_scale_inv, bias?, fast_accum)
        -> (y [M, N] in x's dtype, x data, x data_t | [0, M], x scale_inv): cast_fp8 of x, then fp8_gemm

`usable()` is this family's one rule; without the ops (no extension, or one built without torch)
the callers take the pybind11 path (te_parallel.native.cast / gemm).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from te_parallel.native import FP8_DTYPES, HIGH_PRECISION_DTYPES, load

__all__ = ["usable", "linear_usable", "cast_fp8", "fp8_gemm", "linear_fp8_fwd", "OP_NAMES"]

OP_NAMES = ("cast_fp8", "fp8_gemm", "linear_fp8_fwd")
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_ops: dict = {}


def usable() -> bool:
    """True if the extension registered the ops (and this module their fake and CPU kernels)."""
    ok = _ops.get("usable")
    if ok is None:
        ok = _ops["usable"] = load() is not None and _register()
    return ok


def linear_usable(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True if linear_fp8_fwd's CUDA kernel takes this forward: contiguous CUDA x [M, K] of a high
    precision dtype, FP8 w [N, K] on its device, M, K, N multiples of 16, and a bias (if any) that
    cuBLASLt adds in its epilogue (x's dtype, not fp32)."""
    return (x.is_cuda and x.dtype in HIGH_PRECISION_DTYPES and x.is_contiguous()
            and not ((x.shape[0] | x.shape[1] | w.shape[0]) & 15) and w.is_contiguous()
            and (bias is None or (bias.dtype is x.dtype and x.dtype is not torch.float32))
            and usable())


def _register() -> bool:
    """Fake and CPU kernels of the ops the extension defined; False if it defined none (a build without
    torch's headers)."""
    namespace = torch.ops.te_parallel
    try:
        ops = {name: getattr(namespace, name).default for name in OP_NAMES}
    except (AttributeError, RuntimeError):
        return False
    lib = torch.library
    lib.register_fake("te_parallel::cast_fp8")(_cast_fake)
    lib.register_fake("te_parallel::fp8_gemm")(_gemm_fake)
    lib.register_fake("te_parallel::linear_fp8_fwd")(_linear_fake)
    lib.register_kernel("te_parallel::cast_fp8", "cpu")(_cast_cpu)
    lib.register_kernel("te_parallel::fp8_gemm", "cpu")(_gemm_cpu)
    lib.register_kernel("te_parallel::linear_fp8_fwd", "cpu")(_linear_cpu)
    _ops.update(ops)
    return True


# ---- calls ---------------------------------------------------------------------------------------
def cast_fp8(x: torch.Tensor, scale: Optional[torch.Tensor], amax: Optional[torch.Tensor], fp8_dtype: torch.dtype,
             rowwise: bool = True, transpose: bool = False, keep_scale: bool = False):
    return _ops["cast_fp8"](x, scale, amax, fp8_dtype, rowwise, transpose, keep_scale)


def fp8_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, accumulate: Optional[torch.Tensor] = None,
             fast_accum: bool = False) -> torch.Tensor:
    return _ops["fp8_gemm"](a, a_scale_inv, b, b_scale_inv, out_dtype, bias, accumulate, fast_accum)


def linear_fp8_fwd(x: torch.Tensor, x_scale: Optional[torch.Tensor], x_amax: Optional[torch.Tensor],
                   x_fp8_dtype: torch.dtype, x_transpose: bool, w: torch.Tensor, w_scale_inv: torch.Tensor,
                   bias: Optional[torch.Tensor], fast_accum: bool) -> Tuple[torch.Tensor, ...]:
    return _ops["linear_fp8_fwd"](x, x_scale, x_amax, x_fp8_dtype, x_transpose, w, w_scale_inv, bias, fast_accum)


# ---- fake kernels: shapes and dtypes ----------------------------------------------------------------
def _cast_fake(x, scale, amax, fp8_dtype, rowwise, transpose, keep_scale):
    rows, cols = x.shape
    return (x.new_empty((rows if rowwise else 0, cols), dtype=fp8_dtype),
            x.new_empty((cols if transpose else 0, rows), dtype=fp8_dtype),
            x.new_empty((), dtype=torch.float32), x.new_empty((1 if keep_scale else 0,), dtype=torch.float32))


def _gemm_fake(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, accumulate, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _linear_fake(x, x_scale, x_amax, x_fp8_dtype, x_transpose, w, w_scale_inv, bias, fast_accum):
    data, data_t, scale_inv, _ = _cast_fake(x, x_scale, x_amax, x_fp8_dtype, True, x_transpose, False)
    return x.new_empty((x.shape[0], w.shape[0])), data, data_t, scale_inv


# ---- CPU kernels: the references (the CUDA kernels' math in torch ops) --------------------------------
def _check(what: str, ok: bool, given: str, need: str) -> None:
    if not ok:
        raise ValueError(f"te_parallel::{what}: got {given}; need {need}")


def _cast_cpu(x, scale, amax, fp8_dtype, rowwise, transpose, keep_scale):
    _check("cast_fp8", x.dim() == 2 and x.dtype in HIGH_PRECISION_DTYPES and fp8_dtype in FP8_DTYPES
           and (rowwise or transpose), f"x {tuple(x.shape)} {x.dtype}, fp8_dtype {fp8_dtype}",
           "a 2-D fp32/fp16/bf16 x, an FP8 dtype and at least one output")
    limit = _FP8_MAX[fp8_dtype]
    lo, hi = torch.aminmax(x)
    x_amax = torch.maximum(hi, lo.neg()).to(torch.float32).reshape(1)
    if scale is None:  # current scaling: fp8_max / amax; 1 where amax is 0, inf or NaN, or the quotient is inf
        quotient = torch.div(torch.full_like(x_amax, limit), x_amax)  # one rounding (limit / t is t⁻¹·limit)
        ok = torch.isfinite(x_amax) & (x_amax > 0) & torch.isfinite(quotient)
        scale = torch.where(ok, quotient, torch.ones_like(quotient))
        if amax is not None:
            amax.copy_(x_amax.reshape(amax.shape))
    elif amax is not None:
        torch.maximum(amax, x_amax.reshape(amax.shape), out=amax)
    scale = scale.reshape(()).to(torch.float32)
    data = (x.to(torch.float32) * scale).clamp_(-limit, limit).to(fp8_dtype)
    rows, cols = x.shape
    return (data if rowwise else data.new_empty((0, cols)),
            data.t().contiguous() if transpose else data.new_empty((0, rows)),
            torch.reciprocal(scale), scale.reshape(1).clone() if keep_scale else scale.new_empty((0,)))


def _gemm_cpu(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, accumulate, fast_accum):
    _check("fp8_gemm", a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1] and a.dtype in FP8_DTYPES
           and b.dtype in FP8_DTYPES and out_dtype in HIGH_PRECISION_DTYPES,
           f"a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, out_dtype {out_dtype}",
           "FP8 a [m, k] and b [n, k] and a high-precision out_dtype")
    # FP8 values and their products are exact in fp32: an fp32-accumulated FP8 GEMM, like cuBLASLt's
    out = (a.to(torch.float32) @ b.to(torch.float32).t()) * (a_scale_inv.to(torch.float32) * b_scale_inv.to(torch.float32)).reshape(())
    if bias is not None:
        out = out + bias.to(torch.float32)
    if accumulate is not None:
        out = out + accumulate.to(torch.float32)
    return out.to(out_dtype)


def _linear_cpu(x, x_scale, x_amax, x_fp8_dtype, x_transpose, w, w_scale_inv, bias, fast_accum):
    data, data_t, scale_inv, _ = _cast_cpu(x, x_scale, x_amax, x_fp8_dtype, True, x_transpose, False)
    return _gemm_cpu(data, scale_inv, w, w_scale_inv, x.dtype, bias, None, fast_accum), data, data_t, scale_inv
