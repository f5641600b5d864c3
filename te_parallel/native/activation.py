"""Bias + activation kernels (csrc/kernels/activation*.cu; C API te_parallel/activation.h): checked wrappers.

Forward  y = act(x + bias) of a row-major x [rows, cols] (gated: y [rows, cols/2] = act(a + bias_a) * (b + bias_b)
for the halves a, b of each row), as x.dtype and/or straight to FP8 (with the transposed copy and the amax)
in one read of x.
Backward dx = dy * act'(x + bias) at the saved x, with dbias (column sums of dx, deterministic) and the FP8
cast + transpose + amax of dx in the same pass: the operands of fc1's FP8 dgrad and wgrad GEMMs.

Everything is computed in fp32 and rounded once to x.dtype; the FP8 bytes and the amax are those of the
rounded value, so a fused FP8 output is exactly `quantize` of the high-precision output. FP8 outputs are
returned as plain tensors (bytes, transposed bytes); te_parallel.ops.activation wraps them, and holds the
autograd Function, the FP8 entry points with their PyTorch fallbacks and the fp64 references.

Activations are named as in the extension's ACTIVATIONS table (TE's names); which are gated, the
extension says (tep_activation_is_gated).

Under torch.compile the two wrappers are the custom ops te_parallel::bias_activation_fwd /
dbias_dactivation_bwd (opaque nodes of the graph, with fake kernels for tracing), which run these same
kernels when the graph runs; te_parallel.ops.activation registers their CPU kernels (its PyTorch path).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from te_parallel.native import (ACTIVATIONS, DTYPES, FP8_DTYPES, GATED_ACTIVATIONS, HIGH_PRECISION_DTYPES, describe,
                                launch_on, require)

__all__ = ["usable", "bias_activation_forward", "dbias_dactivation_backward"]

Opt = Optional[torch.Tensor]


def usable(name: str, x: torch.Tensor, bias: Opt = None) -> bool:
    """True if the kernels compute act(x + bias) for this x [..., cols] (and would accept it): a known
    activation (ACTIVATIONS is empty without the extension), a non-empty CUDA x of a dtype they read, an
    even number of columns for a gated one, a bias [cols] of x's dtype on its device. Checked cheaply, for
    every call."""
    if not (name in ACTIVATIONS and isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in HIGH_PRECISION_DTYPES
            and x.dim() >= 1 and x.numel() > 0):
        return False
    cols = x.shape[-1]
    if name in GATED_ACTIVATIONS and cols % 2:
        return False
    return bias is None or (bias.device == x.device and bias.dtype == x.dtype and bias.shape == (cols,))


# ------------------------------------------------------------------------------------------------
# Checks (each failure is one line: what was given, what is needed)

def _check_hp(where: str, what: str, t: torch.Tensor, like: Opt, shape: Tuple[int, ...]) -> None:
    ok = (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and t.dtype in HIGH_PRECISION_DTYPES
          and tuple(t.shape) == shape and (like is None or (t.device == like.device and t.dtype == like.dtype)))
    if not ok:
        need = f"{like.dtype} on {like.device}" if like is not None else "fp32/fp16/bf16 on CUDA"
        raise ValueError(f"{where}: {what} is {describe(t)}; need a contiguous {list(shape)} {need}")


def _check_inputs(where: str, name: str, x: torch.Tensor, bias: Opt) -> Tuple[int, int, int]:
    """(rows, cols, out_cols) of a valid (name, x, bias)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: activation {name!r}; need one of {tuple(ACTIVATIONS)}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.numel() > 0):
        raise ValueError(f"{where}: x is {describe(x)}; need a non-empty 2-D [rows, cols] tensor")
    rows, cols = x.shape
    _check_hp(where, "x", x, None, (rows, cols))
    gated = name in GATED_ACTIVATIONS
    if gated and cols % 2:
        raise ValueError(f"{where}: {name} is gated and x has {cols} columns; need an even number (a | b halves)")
    if bias is not None:
        _check_hp(where, "bias", bias, x, (cols,))
    return rows, cols, cols // 2 if gated else cols


def _check_fp8(where: str, x: torch.Tensor, fp8_dtype, scale, amax_out) -> None:
    if fp8_dtype is not None and fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{where}: fp8_dtype is {fp8_dtype}; need torch.float8_e4m3fn, torch.float8_e5m2 or None")
    if fp8_dtype is not None and not (isinstance(scale, torch.Tensor) and scale.device == x.device
                                      and scale.dtype == torch.float32 and scale.numel() == 1):
        raise ValueError(f"{where}: scale is {describe(scale)}; an FP8 output needs a 1-element torch.float32 "
                         f"tensor on {x.device}")
    if amax_out is not None and not (isinstance(amax_out, torch.Tensor) and amax_out.device == x.device
                                     and amax_out.dtype == torch.float32 and amax_out.numel() == 1):
        raise ValueError(f"{where}: amax_out is {describe(amax_out)}; need None or a 1-element torch.float32 "
                         f"tensor on {x.device}")


def _fp8_outputs(rows: int, cols: int, fp8_dtype, transpose: bool, device) -> Tuple[Opt, Opt]:
    if fp8_dtype is None:
        return None, None
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=device)
    data_t = torch.empty(cols, rows, dtype=fp8_dtype, device=device) if transpose else None
    return data, data_t


def _ptr(t: Opt) -> int:
    return 0 if t is None else t.data_ptr()


def _fp8_code(fp8_dtype: Optional[torch.dtype]) -> int:
    # Without an FP8 output (amax only) the kernels read no bytes' type; any valid FP8 code will do.
    return DTYPES[fp8_dtype if fp8_dtype is not None else FP8_DTYPES[0]]


# ------------------------------------------------------------------------------------------------
# Kernels

def bias_activation_forward(
    name: str,
    x: torch.Tensor,
    bias: Opt = None,
    *,
    high_precision: bool = True,
    fp8_dtype: Optional[torch.dtype] = None,
    scale: Opt = None,
    amax_out: Opt = None,
    transpose: bool = False,
) -> Tuple[Opt, Opt, Opt]:
    """y = act(x + bias) of a contiguous CUDA x [rows, cols] in one pass: (y or None, FP8 y or None, its
    transpose or None).

    high_precision: return y in x.dtype ([rows, cols], gated [rows, cols/2]). fp8_dtype (with `scale`, a
    float32 CUDA scalar): also return the FP8 bytes fp8(y * scale), and with `transpose` their
    [out_cols, rows] transpose. amax_out: a 1-element float32 CUDA tensor that receives
    max(amax_out, max |y|) (NaN propagates). Runs on the current stream.
    """
    if torch.compiler.is_compiling():
        out, data, data_t = _act_fwd_op(name, x, bias, high_precision, fp8_dtype, scale, amax_out, transpose)
        fp8 = fp8_dtype is not None
        return (out if high_precision else None, data if fp8 else None, data_t if fp8 and transpose else None)
    where = "bias_activation_forward"
    module = require(where, "activation")
    rows, cols, out_cols = _check_inputs(where, name, x, bias)
    _check_fp8(where, x, fp8_dtype, scale, amax_out)
    if not high_precision and fp8_dtype is None and amax_out is None:
        raise ValueError(f"{where}: high_precision=False, fp8_dtype=None and amax_out=None ask for nothing; "
                         f"need at least one output")
    out = torch.empty(rows, out_cols, dtype=x.dtype, device=x.device) if high_precision else None
    data, data_t = _fp8_outputs(rows, out_cols, fp8_dtype, transpose, x.device)
    guard, stream = launch_on(x.device)
    with guard:
        module.bias_activation_fwd(ACTIVATIONS[name], x.data_ptr(), _ptr(bias), DTYPES[x.dtype], rows, cols,
                                   _ptr(out), _ptr(data), _ptr(data_t), _ptr(scale) if data is not None else 0,
                                   _ptr(amax_out), _fp8_code(fp8_dtype), stream)
    return out, data, data_t


def dbias_dactivation_backward(
    name: str,
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: Opt = None,
    *,
    need_dbias: bool = False,
    high_precision: bool = True,
    fp8_dtype: Optional[torch.dtype] = None,
    scale: Opt = None,
    amax_out: Opt = None,
    transpose: bool = False,
    fp8_out: Opt = None,
    dbias_out: Opt = None,
    dx_out: Opt = None,
) -> Tuple[Opt, Opt, Opt, Opt]:
    """Backward of bias_activation_forward at the saved x (and bias): (dx or None, dbias or None, FP8 dx or
    None, its transpose or None).

    dy: [rows, cols] ([rows, cols/2] for a gated act) in x.dtype. dx [rows, cols] in x.dtype if
    high_precision; dbias [cols] in x.dtype (column sums of dx, fp32 accumulation in a fixed order) if
    need_dbias, with or without a `bias` (fc1's bias may have been added in the GEMM); fp8_dtype / scale /
    amax_out / transpose as in bias_activation_forward, of dx. One pass over dy and x, plus a small
    reduction kernel for dbias. For a backward done in row chunks: fp8_out, a contiguous [rows, cols]
    tensor of fp8_dtype (e.g. rows of a larger one) receives the FP8 bytes (then None is returned for
    them, and no transpose is made); dbias_out, a contiguous [cols] float tensor, receives dbias; dx_out,
    a contiguous [rows, cols] tensor of x's dtype, receives dx (with high_precision).
    """
    if torch.compiler.is_compiling():
        return _backward_in_graph(name, dy, x, bias, need_dbias, high_precision, fp8_dtype, scale, amax_out,
                                  transpose, fp8_out, dbias_out, dx_out)
    where = "dbias_dactivation_backward"
    module = require(where, "activation")
    rows, cols, out_cols = _check_inputs(where, name, x, bias)
    _check_hp(where, "dy", dy, x, (rows, out_cols))
    _check_fp8(where, x, fp8_dtype, scale, amax_out)
    if not (high_precision or need_dbias or fp8_dtype is not None or amax_out is not None):
        raise ValueError(f"{where}: high_precision=False, need_dbias=False, fp8_dtype=None and amax_out=None ask "
                         f"for nothing; need at least one output")
    if fp8_out is not None and not (fp8_out.dtype == fp8_dtype and fp8_out.shape == (rows, cols)
                                    and fp8_out.is_contiguous() and fp8_out.device == x.device and not transpose):
        raise ValueError(f"{where}: fp8_out is {describe(fp8_out)} with transpose={transpose}; need a contiguous "
                         f"[{rows}, {cols}] {fp8_dtype} tensor on {x.device} and transpose=False")
    if dbias_out is not None and not (need_dbias and dbias_out.shape == (cols,) and dbias_out.is_contiguous()
                                      and dbias_out.dtype in HIGH_PRECISION_DTYPES and dbias_out.device == x.device):
        raise ValueError(f"{where}: dbias_out is {describe(dbias_out)} with need_dbias={need_dbias}; need "
                         f"need_dbias=True and a contiguous [{cols}] float tensor on {x.device}")
    if dx_out is not None:
        _check_hp(where, "dx_out", dx_out, x, (rows, cols))
        if not high_precision:
            raise ValueError(f"{where}: dx_out was given with high_precision=False; dx_out receives the "
                             f"high-precision dx")
    dx = None
    if high_precision:
        dx = torch.empty(rows, cols, dtype=x.dtype, device=x.device) if dx_out is None else dx_out
    data, data_t = (fp8_out, None) if fp8_out is not None else _fp8_outputs(rows, cols, fp8_dtype, transpose,
                                                                          x.device)
    dbias = workspace = None
    if need_dbias:
        dbias = torch.empty(cols, dtype=x.dtype, device=x.device) if dbias_out is None else dbias_out
        workspace = torch.empty(module.dbias_dactivation_workspace_size(rows, cols), dtype=torch.uint8,
                                device=x.device)
    guard, stream = launch_on(x.device)
    with guard:
        module.dbias_dactivation(ACTIVATIONS[name], dy.data_ptr(), x.data_ptr(), _ptr(bias), DTYPES[x.dtype], rows,
                                 cols, _ptr(dx), _ptr(data), _ptr(data_t), _ptr(scale) if data is not None else 0,
                                 _ptr(amax_out), _fp8_code(fp8_dtype), _ptr(dbias), DTYPES[dbias.dtype]
                                 if dbias is not None else 0, _ptr(workspace),
                                 0 if workspace is None else workspace.numel(), stream)
    if fp8_out is not None:
        return dx, dbias, None, None
    return dx, dbias, data, data_t


# ------------------------------------------------------------------------------------------------
# The custom ops of compiled graphs: the same kernels, behind torch's dispatcher. Absent outputs are
# empty tensors (an op returns tensors only), and the wrappers' out tensors (fp8_out, dbias_out, dx_out)
# are filled from the op's results (a graph holds no writes into tensors the kernel does not own).

def _empty(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return x.new_empty((0,), dtype=dtype or x.dtype)


@torch.library.custom_op("te_parallel::bias_activation_fwd", mutates_args=("amax_out",), device_types="cuda")
def _act_fwd_op(name: str, x: torch.Tensor, bias: Optional[torch.Tensor], high_precision: bool,
                fp8_dtype: Optional[torch.dtype], scale: Optional[torch.Tensor], amax_out: Optional[torch.Tensor],
                transpose: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, data, data_t = bias_activation_forward(name, x, bias, high_precision=high_precision, fp8_dtype=fp8_dtype,
                                                scale=scale, amax_out=amax_out, transpose=transpose)
    return (_empty(x) if out is None else out, _empty(x, torch.uint8) if data is None else data,
            _empty(x, torch.uint8) if data_t is None else data_t)


@_act_fwd_op.register_fake
def _(name, x, bias, high_precision, fp8_dtype, scale, amax_out, transpose):
    rows, cols = x.shape
    out_cols = cols // 2 if name in GATED_ACTIVATIONS else cols
    fp8 = fp8_dtype is not None
    return (x.new_empty((rows, out_cols)) if high_precision else _empty(x),
            x.new_empty((rows, out_cols), dtype=fp8_dtype) if fp8 else _empty(x, torch.uint8),
            x.new_empty((out_cols, rows), dtype=fp8_dtype) if fp8 and transpose else _empty(x, torch.uint8))


def _backward_in_graph(name, dy, x, bias, need_dbias, high_precision, fp8_dtype, scale, amax_out, transpose,
                       fp8_out, dbias_out, dx_out):
    fp8 = fp8_dtype is not None
    dx, dbias, data, data_t = _act_bwd_op(name, dy, x, bias, need_dbias, high_precision, fp8_dtype, scale, amax_out,
                                          transpose and fp8_out is None)
    dx = dx if high_precision else None
    dbias = dbias if need_dbias else None
    if dx_out is not None and dx is not None:
        dx = dx_out.copy_(dx)
    if dbias_out is not None and dbias is not None:
        dbias = dbias_out.copy_(dbias)
    if fp8_out is not None:
        fp8_out.copy_(data)
        return dx, dbias, None, None
    return dx, dbias, data if fp8 else None, data_t if fp8 and transpose else None


@torch.library.custom_op("te_parallel::dbias_dactivation_bwd", mutates_args=("amax_out",), device_types="cuda")
def _act_bwd_op(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], need_dbias: bool,
                high_precision: bool, fp8_dtype: Optional[torch.dtype], scale: Optional[torch.Tensor],
                amax_out: Optional[torch.Tensor],
                transpose: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dbias, data, data_t = dbias_dactivation_backward(name, dy, x, bias, need_dbias=need_dbias,
                                                         high_precision=high_precision, fp8_dtype=fp8_dtype,
                                                         scale=scale, amax_out=amax_out, transpose=transpose)
    return (_empty(x) if dx is None else dx, _empty(x) if dbias is None else dbias,
            _empty(x, torch.uint8) if data is None else data, _empty(x, torch.uint8) if data_t is None else data_t)


@_act_bwd_op.register_fake
def _(name, dy, x, bias, need_dbias, high_precision, fp8_dtype, scale, amax_out, transpose):
    rows, cols = x.shape
    fp8 = fp8_dtype is not None
    return (x.new_empty((rows, cols)) if high_precision else _empty(x),
            x.new_empty((cols,)) if need_dbias else _empty(x),
            x.new_empty((rows, cols), dtype=fp8_dtype) if fp8 else _empty(x, torch.uint8),
            x.new_empty((cols, rows), dtype=fp8_dtype) if fp8 and transpose else _empty(x, torch.uint8))
