"""Quantize / dequantize: high precision <-> (FP8 bytes, scale_inv), with amax and a transposed copy.

value ≈ data * scale_inv, data = fp8(clamp(fp32(x) * scale, -fp8_max, fp8_max)) rounded to nearest
even. The product is one fp32 multiplication, so the fp64 reference (`quantize_reference`) is
bit-exact: a product of two fp32 numbers is exact in fp64, and rounding it to fp32 gives the fp32
product. Saturation is explicit because CUDA's conversion turns out-of-range values into NaN (E4M3)
or inf (E5M2) while the CPU's saturates.
"""
from __future__ import annotations

from typing import Optional

import torch

from te_parallel.fp8.scaling import current_scale
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import FP8_DTYPES
from te_parallel.native import cast as native_cast
from te_parallel.native import scaling as native_scaling
from te_parallel.native import torch_ops as native_ops
from te_parallel.recipe import fp8_max


def _check_fp8_dtype(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar tensor (NaN if x holds a NaN), from one read of x: min and max in one
    reduction, no |x| temporary (x.abs().amax() writes and reads a copy of x: at [tokens, ffn] a 256 MiB
    tensor and two extra passes per current-scaling cast)."""
    if native_scaling.current_usable(x):  # one read by the scaling kernel, no torch ops around it
        return native_scaling.current_scale_of(x.detach(), 1.0, amax_only=True)[2]
    return amax_torch(x)


def amax_torch(x: torch.Tensor) -> torch.Tensor:
    """amax_of in torch ops (the reference of the native kernel, and the CPU path)."""
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(hi, lo.neg()).to(torch.float32)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_out: Optional[torch.Tensor] = None,
    transpose: bool = False,
    dbias_out: Optional[torch.Tensor] = None,
    rowwise: bool = True,
    keep_scale: bool = False,
) -> Float8Tensor:
    """Cast a 2-D tensor to FP8 with `scale` (fp32 scalar tensor).

    amax_out: a 1-element fp32 tensor (e.g. a view into an amax history row) that receives
    max(amax_out, amax(x)). transpose: also emit the contiguous [cols, rows] copy.
    dbias_out: a [cols] tensor that receives the column sums of x (x is an output gradient; the sums
    are its bias gradient), from the same read of x on CUDA. rowwise=False (with transpose): only
    the transposed copy is written (`data` is then a view of it). keep_scale: also return a snapshot
    of `scale` as the result's `.scale` (written by the same launch on CUDA).
    """
    _check_fp8_dtype(fp8_dtype)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not (rowwise or transpose):
        raise ValueError("quantize: rowwise=False needs transpose=True (nothing would be written)")
    if x.requires_grad:
        x = x.detach()
    if scale.dim() or scale.dtype is not torch.float32 or scale.requires_grad:  # (a state's slot view is not)
        scale = scale.detach().to(torch.float32).reshape(())
    if native_cast.usable(x):
        if dbias_out is None and native_ops.usable():  # one call through torch's dispatcher (host time)
            return _cast_op(x, scale, amax_out, fp8_dtype, rowwise, transpose, keep_scale)
        # written by the kernel: 1 / scale (and the scale's snapshot beside it, when asked for)
        if keep_scale:
            scales = torch.empty(2, dtype=torch.float32, device=x.device)
            scale_inv, snapshot = scales[0], scales[1]
        else:
            scale_inv, snapshot = torch.empty((), dtype=torch.float32, device=x.device), None
        data, data_t = native_cast.cast_transpose_amax(x, scale, fp8_dtype, amax_out, transpose, scale_inv,
                                                       dbias_out, rowwise=rowwise, scale_out=snapshot)
        return Float8Tensor(data=data_t.t() if data is None else data, scale_inv=scale_inv, data_t=data_t,
                            scale=snapshot)
    if dbias_out is not None:
        dbias_out.copy_(x.sum(0))
    if amax_out is not None:
        torch.maximum(amax_out, amax_of(x).view_as(amax_out), out=amax_out)
    limit = fp8_max(fp8_dtype)
    data = (x.to(torch.float32) * scale).clamp_(-limit, limit).to(fp8_dtype)
    data_t = data.t().contiguous() if transpose else None
    return Float8Tensor(data=data if rowwise else data_t.t(), scale_inv=1.0 / scale, data_t=data_t,
                        scale=scale.clone() if keep_scale else None)


def quantize_current(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, amax: Optional[torch.Tensor] = None, transpose: bool = False,
    dbias_out: Optional[torch.Tensor] = None, keep_scale: bool = False,
) -> Float8Tensor:
    """Current scaling: scale = fp8_max / amax(x) (or a given amax, e.g. one all-reduced across ranks)."""
    _check_fp8_dtype(fp8_dtype)
    if amax is None and dbias_out is None and x.dim() == 2 and native_cast.usable(x) and native_ops.usable():
        return _cast_op(x.detach(), None, None, fp8_dtype, True, transpose, keep_scale)  # amax, scale, cast: one call
    if amax is None and native_scaling.current_usable(x):  # amax and scale in two launches
        scale = native_scaling.current_scale_of(x.detach(), fp8_max(fp8_dtype))[0]
    else:
        scale = current_scale(amax_of(x) if amax is None else amax, fp8_max(fp8_dtype))
    return quantize(x, scale, fp8_dtype, transpose=transpose, dbias_out=dbias_out,
                    keep_scale=keep_scale)


def _cast_op(x, scale, amax_out, fp8_dtype, rowwise: bool, transpose: bool, keep_scale: bool) -> Float8Tensor:
    """quantize by te_parallel::cast_fp8 (scale None: current scaling inside the op)."""
    data, data_t, scale_inv, snapshot = native_ops.cast_fp8(x, scale, amax_out, fp8_dtype, rowwise, transpose,
                                                            keep_scale)
    return Float8Tensor(data=data if rowwise else data_t.t(), scale_inv=scale_inv,
                        data_t=data_t if transpose else None, scale=snapshot.view(()) if keep_scale else None)


def dequantize(t: Float8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return t.dequantize(dtype)


# ------------------------------------------------------------------------------------------
# fp64 references (used by the tests)
def quantize_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes of x computed through fp64: product exact in fp64, rounded once to fp32, clamped."""
    limit = fp8_max(fp8_dtype)
    prod = (x.detach().double() * scale.detach().double().reshape(())).to(torch.float32)
    return prod.clamp(-limit, limit).to(fp8_dtype)


def dequantize_reference(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.double() * scale_inv.double().reshape(())


# ------------------------------------------------------------------------------------------
# CPU kernels of the native cast ops (te_parallel::cast_transpose_amax / transpose_fp8, which compiled
# graphs call): quantize's PyTorch path, so that the ops run (and torch.library.opcheck checks them)
# without a GPU
@torch.library.register_kernel("te_parallel::cast_transpose_amax", "cpu")
def _cast_transpose_amax_cpu(x, scale, fp8_dtype, amax_out, transpose, rowwise, keep_scale, dbias_dtype):
    dbias = None if dbias_dtype is None else x.new_empty((x.shape[1],), dtype=dbias_dtype)
    q = quantize(x, scale, fp8_dtype, amax_out=amax_out, transpose=transpose, dbias_out=dbias, rowwise=rowwise,
                 keep_scale=keep_scale)
    empty = x.new_empty((0,), dtype=fp8_dtype)
    return (q.data if rowwise else empty, q.data_t if transpose else empty.clone(),
            q.scale_inv.reshape(()).clone(), q.scale.reshape(()) if keep_scale else x.new_empty((0,), dtype=torch.float32),
            x.new_empty((0,)) if dbias is None else dbias)


@torch.library.register_kernel("te_parallel::transpose_fp8", "cpu")
def _transpose_fp8_cpu(data):
    return data.t().contiguous()
