"""FP8 cast kernels (csrc/kernels/cast_transpose.cu; C API te_parallel/te_parallel.h): the cast with its
transposed copy, amax, scale_inv and dbias in one read of the source, and the one-pass FP8 transpose.

Bit-identical to te_parallel.ops.cast.quantize's PyTorch path (fp32 multiply by the scale, saturating
round-to-nearest-even).

Under torch.compile the two wrappers are the custom ops te_parallel::cast_transpose_amax /
transpose_fp8 (opaque nodes of the graph, with fake kernels for tracing), which run these same kernels
when the graph runs; te_parallel.ops.cast registers their CPU kernels (its PyTorch path).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from te_parallel.native import DTYPES, FP8_DTYPES, HIGH_PRECISION_DTYPES, describe, launch_on, require

__all__ = ["usable", "cast_transpose_amax", "transpose_fp8"]


def usable(x: torch.Tensor) -> bool:
    """True if the cast kernels take x: a contiguous non-empty CUDA tensor of a dtype they read (high
    precision for cast_transpose_amax, FP8 for transpose_fp8) and the extension is loaded (DTYPES is
    empty without it)."""
    return x.is_cuda and x.numel() > 0 and x.is_contiguous() and x.dtype in DTYPES


def cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                        amax_out: torch.Tensor | None, transpose: bool,
                        scale_inv_out: torch.Tensor | None = None,
                        dbias_out: torch.Tensor | None = None, *, rowwise: bool = True,
                        scale_out: torch.Tensor | None = None) -> Tuple[torch.Tensor | None, torch.Tensor | None]:
    """FP8 cast of a contiguous CUDA [rows, cols] matrix in one pass: (data or None, data_t or None).

    Bit-identical to te_parallel.ops.cast.quantize's PyTorch path (fp32 multiply by `scale`,
    saturating round-to-nearest-even); amax_out (a 1-element fp32 CUDA tensor) receives
    max(amax_out, max |x|) in the same pass; scale_inv_out (likewise) receives 1 / scale and
    scale_out the scale itself (a snapshot); dbias_out (a contiguous [cols] float tensor) receives the
    column sums of x (fp32, fixed order). rowwise=False: only the transposed copy is written.
    """
    if torch.compiler.is_compiling():
        return _cast_in_graph(x, scale, fp8_dtype, amax_out, transpose, scale_inv_out, dbias_out, rowwise,
                              scale_out)
    module = require("cast_transpose_amax", "cast")
    ok = (x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.dtype in HIGH_PRECISION_DTYPES and x.numel() > 0
          and scale is not None and _f32_cell(scale) and fp8_dtype in FP8_DTYPES and _f32_cell(amax_out)
          and _f32_cell(scale_inv_out) and _f32_cell(scale_out) and (rowwise or transpose))
    if not ok:
        raise ValueError(f"cast_transpose_amax: got x {describe(x)}, scale {describe(scale)}, amax_out "
                         f"{describe(amax_out)}, scale_inv_out {describe(scale_inv_out)}, scale_out "
                         f"{describe(scale_out)}, fp8_dtype {fp8_dtype}, rowwise={rowwise}, transpose={transpose}; "
                         "need a contiguous non-empty 2-D fp32/fp16/bf16 CUDA x, fp32 CUDA scalars, an FP8 fp8_dtype "
                         "and at least one output")
    rows, cols = x.shape
    device = x.device
    if dbias_out is not None and not (dbias_out.device == device and dbias_out.dtype in HIGH_PRECISION_DTYPES
                                      and dbias_out.shape == (cols,) and dbias_out.is_contiguous()):
        raise ValueError(f"cast_transpose_amax: dbias_out is {describe(dbias_out)}; need a contiguous "
                         f"[{cols}] fp32/fp16/bf16 tensor on {device}")
    if dbias_out is not None and (not rowwise or scale_out is not None):
        raise ValueError(f"cast_transpose_amax: dbias_out goes with the row-wise cast and no scale_out; got "
                         f"rowwise={rowwise}, scale_out {describe(scale_out)}")
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=device) if rowwise else None
    data_t = torch.empty(cols, rows, dtype=fp8_dtype, device=device) if transpose else None
    guard, stream = launch_on(device)
    if dbias_out is not None:
        ws_bytes = module.cast_transpose_dbias_workspace_size(rows, cols)
        workspace = torch.empty(ws_bytes // 4, dtype=torch.float32, device=device)
        with guard:
            module.cast_transpose_dbias(x.data_ptr(), DTYPES[x.dtype], rows, cols, scale.data_ptr(), data.data_ptr(),
                                        0 if data_t is None else data_t.data_ptr(),
                                        0 if amax_out is None else amax_out.data_ptr(),
                                        0 if scale_inv_out is None else scale_inv_out.data_ptr(), DTYPES[fp8_dtype],
                                        dbias_out.data_ptr(), DTYPES[dbias_out.dtype], workspace.data_ptr(), ws_bytes,
                                        stream)
        return data, data_t
    with guard:
        module.cast_transpose_amax(x.data_ptr(), DTYPES[x.dtype], rows, cols, scale.data_ptr(),
                                   0 if data is None else data.data_ptr(),
                                   0 if data_t is None else data_t.data_ptr(),
                                   0 if amax_out is None else amax_out.data_ptr(),
                                   0 if scale_inv_out is None else scale_inv_out.data_ptr(),
                                   0 if scale_out is None else scale_out.data_ptr(), DTYPES[fp8_dtype], stream)
    return data, data_t


def _f32_cell(t: torch.Tensor | None) -> bool:
    """None, or a 1-element fp32 CUDA tensor (a scale, an amax cell, a scale_inv out)."""
    return t is None or (t.is_cuda and t.dtype is torch.float32 and t.numel() == 1)


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """The contiguous [cols, rows] transpose of a contiguous CUDA [rows, cols] FP8 matrix, one pass."""
    if torch.compiler.is_compiling():
        return _transpose_op(data)
    module = require("transpose_fp8", "cast")
    if not (data.is_cuda and data.dim() == 2 and data.is_contiguous() and data.dtype in FP8_DTYPES
            and data.numel() > 0):
        raise ValueError(f"transpose_fp8: got {describe(data)}; need a contiguous non-empty 2-D FP8 CUDA tensor")
    rows, cols = data.shape
    out = torch.empty(cols, rows, dtype=data.dtype, device=data.device)
    guard, stream = launch_on(data.device)
    with guard:
        module.transpose_fp8(data.data_ptr(), rows, cols, out.data_ptr(), stream)
    return out


# ------------------------------------------------------------------------------------------------
# The custom ops of compiled graphs: the same kernels, behind torch's dispatcher. The cast op returns
# what the wrapper writes into its out tensors (scale_inv, the scale's snapshot, dbias: copied into
# them), absent outputs as empty tensors.

def _cast_in_graph(x, scale, fp8_dtype, amax_out, transpose, scale_inv_out, dbias_out, rowwise, scale_out):
    data, data_t, scale_inv, snapshot, dbias = _cast_op(
        x, scale, fp8_dtype, amax_out, transpose, rowwise, scale_out is not None,
        None if dbias_out is None else dbias_out.dtype)
    for out, value in ((scale_inv_out, scale_inv), (scale_out, snapshot), (dbias_out, dbias)):
        if out is not None:
            out.copy_(value.view_as(out))
    return (data if rowwise else None), (data_t if transpose else None)


@torch.library.custom_op("te_parallel::cast_transpose_amax", mutates_args=("amax_out",), device_types="cuda")
def _cast_op(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: Optional[torch.Tensor],
             transpose: bool, rowwise: bool, keep_scale: bool, dbias_dtype: Optional[torch.dtype]
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = x.shape[1]
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    snapshot = torch.empty((), dtype=torch.float32, device=x.device) if keep_scale else None
    dbias = None if dbias_dtype is None else torch.empty(cols, dtype=dbias_dtype, device=x.device)
    data, data_t = cast_transpose_amax(x, scale, fp8_dtype, amax_out, transpose, scale_inv, dbias, rowwise=rowwise,
                                       scale_out=snapshot)
    empty = x.new_empty((0,), dtype=fp8_dtype)
    return (empty if data is None else data, empty.clone() if data_t is None else data_t, scale_inv,
            x.new_empty((0,), dtype=torch.float32) if snapshot is None else snapshot,
            x.new_empty((0,)) if dbias is None else dbias)


@_cast_op.register_fake
def _(x, scale, fp8_dtype, amax_out, transpose, rowwise, keep_scale, dbias_dtype):
    rows, cols = x.shape
    return (x.new_empty((rows, cols) if rowwise else (0,), dtype=fp8_dtype),
            x.new_empty((cols, rows) if transpose else (0,), dtype=fp8_dtype),
            x.new_empty((), dtype=torch.float32), x.new_empty(() if keep_scale else (0,), dtype=torch.float32),
            x.new_empty((cols,) if dbias_dtype is not None else (0,), dtype=dbias_dtype or x.dtype))


@torch.library.custom_op("te_parallel::transpose_fp8", mutates_args=(), device_types="cuda")
def _transpose_op(data: torch.Tensor) -> torch.Tensor:
    return transpose_fp8(data)


@_transpose_op.register_fake
def _(data):
    return data.new_empty((data.shape[1], data.shape[0]))
