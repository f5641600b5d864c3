"""Native bias + activation kernels (csrc/kernels/activation*.cu): checked wrappers and their references.

Forward  y = act(x + bias) of a row-major x [rows, cols] (gated: y [rows, cols/2] = act(a + bias_a) * (b + bias_b)
for the halves a, b of each row), as x.dtype and/or straight to FP8 (with the transposed copy and the amax)
in one read of x.
Backward dx = dy * act'(x + bias) at the saved x, with dbias (column sums of dx, deterministic) and the FP8
cast + transpose + amax of dx in the same pass: the operands of fc1's FP8 dgrad and wgrad GEMMs.

Everything is computed in fp32 and rounded once to x.dtype; the FP8 bytes and the amax are those of the
rounded value, so a fused FP8 output is exactly `quantize` of the high-precision output.

The kernels take raw pointers (STYLE.md rule 9), so every wrapper checks device, dtype, contiguity and
shapes first and says in one line what it got and what it needs. Each op has a pure-PyTorch reference
below (`bias_activation_reference`, `dbias_dactivation_reference`, in fp64, from the formulas of
te_parallel.ops.activation), and a same-precision PyTorch path (`bias_activation_torch`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from te_parallel import _native
from te_parallel._native import _DTYPES, _describe, load
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import activation as _act

__all__ = [
    "ACT_CODES", "supports", "bias_activation_forward", "dbias_dactivation_backward", "bias_activation_fp8",
    "dbias_dactivation_fp8", "bias_activation_torch", "dactivation_torch", "bias_activation_reference",
    "dbias_dactivation_reference",
]

# tep_activation codes (csrc/include/te_parallel/activation.h)
ACT_CODES = {"gelu": 0, "relu": 1, "silu": 2, "qgelu": 3, "srelu": 4,
             "geglu": 5, "reglu": 6, "swiglu": 7, "qgeglu": 8, "sreglu": 9}
_HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPES = _native.FP8_DTYPES


def _module():
    module = load()
    if module is None or not hasattr(module, "bias_activation_fwd"):
        raise RuntimeError("te_parallel._C has no activation kernels (absent, or built before they existed); "
                           "check native_activation.supports() and use the PyTorch path")
    return module


def supports(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """True if the kernels can compute act(x + bias) for this x [..., cols] (and would accept it)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in _HP_DTYPES and x.dim() >= 1
            and x.numel() > 0 and name in ACT_CODES):
        return False
    cols = x.shape[-1]
    if _act.is_gated(name) and cols % 2:
        return False
    if bias is not None and not (bias.device == x.device and bias.dtype == x.dtype and bias.shape == (cols,)):
        return False
    module = load()
    return module is not None and hasattr(module, "bias_activation_fwd")


# ------------------------------------------------------------------------------------------------
# Checks (each failure is one line: what was given, what is needed)

def _check_hp(where: str, what: str, t: torch.Tensor, like: Optional[torch.Tensor], shape: Tuple[int, ...]) -> None:
    ok = (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and t.dtype in _HP_DTYPES
          and tuple(t.shape) == shape and (like is None or (t.device == like.device and t.dtype == like.dtype)))
    if not ok:
        need = f"{like.dtype} on {like.device}" if like is not None else "fp32/fp16/bf16 on CUDA"
        raise ValueError(f"{where}: {what} is {_describe(t)}; need a contiguous {list(shape)} {need}")


def _check_inputs(where: str, name: str, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Tuple[int, int, int]:
    """(rows, cols, out_cols) of a valid (name, x, bias)."""
    if name not in ACT_CODES:
        raise ValueError(f"{where}: activation {name!r}; need one of {tuple(ACT_CODES)}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.numel() > 0):
        raise ValueError(f"{where}: x is {_describe(x)}; need a non-empty 2-D [rows, cols] tensor")
    rows, cols = x.shape
    _check_hp(where, "x", x, None, (rows, cols))
    gated = _act.is_gated(name)
    if gated and cols % 2:
        raise ValueError(f"{where}: {name} is gated and x has {cols} columns; need an even number (a | b halves)")
    if bias is not None:
        _check_hp(where, "bias", bias, x, (cols,))
    return rows, cols, cols // 2 if gated else cols


def _check_fp8(where: str, x: torch.Tensor, fp8_dtype, scale, amax_out) -> None:
    if fp8_dtype is not None and fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"{where}: fp8_dtype is {fp8_dtype}; need torch.float8_e4m3fn, torch.float8_e5m2 or None")
    if fp8_dtype is not None and not (isinstance(scale, torch.Tensor) and scale.device == x.device
                                      and scale.dtype == torch.float32 and scale.numel() == 1):
        raise ValueError(f"{where}: scale is {_describe(scale)}; an FP8 output needs a 1-element torch.float32 "
                         f"tensor on {x.device}")
    if amax_out is not None and not (isinstance(amax_out, torch.Tensor) and amax_out.device == x.device
                                     and amax_out.dtype == torch.float32 and amax_out.numel() == 1):
        raise ValueError(f"{where}: amax_out is {_describe(amax_out)}; need None or a 1-element torch.float32 "
                         f"tensor on {x.device}")


def _fp8_outputs(rows: int, cols: int, fp8_dtype, transpose: bool, device) -> Tuple[Optional[torch.Tensor], ...]:
    if fp8_dtype is None:
        return None, None
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=device)
    data_t = torch.empty(cols, rows, dtype=fp8_dtype, device=device) if transpose else None
    return data, data_t


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _float8(data, data_t, scale) -> Optional[Float8Tensor]:
    if data is None:
        return None
    return Float8Tensor(data=data, scale_inv=1.0 / scale.detach().reshape(()), data_t=data_t)


# ------------------------------------------------------------------------------------------------
# Kernels

def bias_activation_forward(
    name: str,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    high_precision: bool = True,
    fp8_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    amax_out: Optional[torch.Tensor] = None,
    transpose: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[Float8Tensor]]:
    """y = act(x + bias) of a contiguous CUDA x [rows, cols] in one pass: (y or None, FP8 y or None).

    high_precision: return y in x.dtype ([rows, cols], gated [rows, cols/2]). fp8_dtype (with `scale`, a
    float32 CUDA scalar): also return y as a Float8Tensor (data = fp8(y * scale), scale_inv = 1/scale,
    data_t its [out_cols, rows] transpose if `transpose`). amax_out: a 1-element float32 CUDA tensor
    that receives max(amax_out, max |y|) (NaN propagates). Runs on the current stream.
    """
    where = "bias_activation_forward"
    rows, cols, out_cols = _check_inputs(where, name, x, bias)
    _check_fp8(where, x, fp8_dtype, scale, amax_out)
    if not high_precision and fp8_dtype is None and amax_out is None:
        raise ValueError(f"{where}: high_precision=False, fp8_dtype=None and amax_out=None ask for nothing; "
                         f"need at least one output")
    module = _module()
    out = torch.empty(rows, out_cols, dtype=x.dtype, device=x.device) if high_precision else None
    data, data_t = _fp8_outputs(rows, out_cols, fp8_dtype, transpose, x.device)
    guard, stream = _native.launch_on(x.device)
    with guard:
        module.bias_activation_fwd(ACT_CODES[name], x.data_ptr(), _ptr(bias), _DTYPES[x.dtype], rows, cols,
                                   _ptr(out), _ptr(data), _ptr(data_t), _ptr(scale) if data is not None else 0,
                                   _ptr(amax_out), _DTYPES.get(fp8_dtype, 3), stream)
    return out, _float8(data, data_t, scale)


def dbias_dactivation_backward(
    name: str,
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    need_dbias: bool = False,
    high_precision: bool = True,
    fp8_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    amax_out: Optional[torch.Tensor] = None,
    transpose: bool = False,
    fp8_out: Optional[torch.Tensor] = None,
    dbias_out: Optional[torch.Tensor] = None,
    dx_out: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[Float8Tensor]]:
    """Backward of bias_activation_forward at the saved x (and bias): (dx or None, dbias or None, FP8 dx or None).

    dy: [rows, cols] ([rows, cols/2] for a gated act) in x.dtype. dx [rows, cols] in x.dtype if
    high_precision; dbias [cols] in x.dtype (column sums of dx, fp32 accumulation in a fixed order) if
    need_dbias, with or without a `bias` (fc1's bias may have been added in the GEMM); fp8_dtype / scale /
    amax_out / transpose as in bias_activation_forward, of dx. One pass over dy and x, plus a small
    reduction kernel for dbias. For a backward done in row chunks: fp8_out, a contiguous [rows, cols]
    tensor of fp8_dtype (e.g. rows of a larger one) receives the FP8 bytes (then no Float8Tensor is
    returned, and no transpose); dbias_out, a contiguous [cols] float tensor, receives dbias; dx_out, a
    contiguous [rows, cols] tensor of x's dtype, receives dx (with high_precision).
    """
    where = "dbias_dactivation_backward"
    rows, cols, out_cols = _check_inputs(where, name, x, bias)
    _check_hp(where, "dy", dy, x, (rows, out_cols))
    _check_fp8(where, x, fp8_dtype, scale, amax_out)
    if not (high_precision or need_dbias or fp8_dtype is not None or amax_out is not None):
        raise ValueError(f"{where}: high_precision=False, need_dbias=False, fp8_dtype=None and amax_out=None ask "
                         f"for nothing; need at least one output")
    if fp8_out is not None and not (fp8_out.dtype == fp8_dtype and fp8_out.shape == (rows, cols)
                                    and fp8_out.is_contiguous() and fp8_out.device == x.device and not transpose):
        raise ValueError(f"{where}: fp8_out is {_describe(fp8_out)} with transpose={transpose}; need a contiguous "
                         f"[{rows}, {cols}] {fp8_dtype} tensor on {x.device} and transpose=False")
    if dbias_out is not None and not (need_dbias and dbias_out.shape == (cols,) and dbias_out.is_contiguous()
                                      and dbias_out.dtype in _HP_DTYPES and dbias_out.device == x.device):
        raise ValueError(f"{where}: dbias_out is {_describe(dbias_out)} with need_dbias={need_dbias}; need "
                         f"need_dbias=True and a contiguous [{cols}] float tensor on {x.device}")
    if dx_out is not None:
        _check_hp(where, "dx_out", dx_out, x, (rows, cols))
        if not high_precision:
            raise ValueError(f"{where}: dx_out was given with high_precision=False; dx_out receives the high-precision dx")
    module = _module()
    dx = (torch.empty(rows, cols, dtype=x.dtype, device=x.device) if dx_out is None else dx_out) if high_precision else None
    data, data_t = (fp8_out, None) if fp8_out is not None else _fp8_outputs(rows, cols, fp8_dtype, transpose,
                                                                          x.device)
    dbias = workspace = None
    if need_dbias:
        dbias = torch.empty(cols, dtype=x.dtype, device=x.device) if dbias_out is None else dbias_out
        workspace = torch.empty(module.dbias_dactivation_workspace_size(rows, cols), dtype=torch.uint8,
                                device=x.device)
    guard, stream = _native.launch_on(x.device)
    with guard:
        module.dbias_dactivation(ACT_CODES[name], dy.data_ptr(), x.data_ptr(), _ptr(bias), _DTYPES[x.dtype], rows,
                                 cols, _ptr(dx), _ptr(data), _ptr(data_t), _ptr(scale) if data is not None else 0,
                                 _ptr(amax_out), _DTYPES.get(fp8_dtype, 3), _ptr(dbias), _DTYPES[dbias.dtype]
                                 if dbias is not None else 0, _ptr(workspace),
                                 0 if workspace is None else workspace.numel(), stream)
    return dx, dbias, (None if fp8_out is not None else _float8(data, data_t, scale))


# ------------------------------------------------------------------------------------------------
# FP8 entry points (for fusing the activation into fc2's FP8 Linear; they fall back to PyTorch)

def bias_activation_fp8(name: str, x: torch.Tensor, bias: Optional[torch.Tensor], scale: torch.Tensor,
                        fp8_dtype: torch.dtype, *, amax_out: Optional[torch.Tensor] = None,
                        transpose: bool = True) -> Float8Tensor:
    """act(x + bias) of a 2-D x straight to FP8 (+ transpose, + amax): the same bytes as
    quantize(act(x + bias)) of the kernels' high-precision output. PyTorch ops where the kernels cannot run."""
    scale = scale.detach().to(torch.float32).reshape(())
    if x.dim() == 2 and x.is_contiguous() and supports(name, x, bias) and scale.device == x.device:
        _, fp8 = bias_activation_forward(name, x, bias, high_precision=False, fp8_dtype=fp8_dtype, scale=scale,
                                         amax_out=amax_out, transpose=transpose)
        return fp8
    from te_parallel.ops.cast import quantize

    return quantize(bias_activation_torch(name, x, bias), scale, fp8_dtype, amax_out=amax_out, transpose=transpose)


def dbias_dactivation_fp8(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                          scale: torch.Tensor, fp8_dtype: torch.dtype, *, amax_out: Optional[torch.Tensor] = None,
                          transpose: bool = True, need_dbias: bool = True, fp8_out: Optional[torch.Tensor] = None,
                          dbias_out: Optional[torch.Tensor] = None
                          ) -> Tuple[Optional[Float8Tensor], Optional[torch.Tensor]]:
    """(FP8 dx with its transpose, dbias or None) for a 2-D x: the dact + dbias + cast-transpose fusion that
    feeds fc1's FP8 dgrad and wgrad GEMMs. PyTorch ops where the kernels cannot run. fp8_out / dbias_out:
    as in dbias_dactivation_backward (rows of a backward done in chunks; FP8 dx is then None)."""
    scale = scale.detach().to(torch.float32).reshape(())
    if (x.dim() == 2 and x.is_contiguous() and dy.is_contiguous() and dy.dtype == x.dtype
            and supports(name, x, bias) and scale.device == x.device):
        _, dbias, fp8 = dbias_dactivation_backward(name, dy, x, bias, need_dbias=need_dbias, high_precision=False,
                                                   fp8_dtype=fp8_dtype, scale=scale, amax_out=amax_out,
                                                   transpose=transpose, fp8_out=fp8_out, dbias_out=dbias_out)
        return fp8, dbias
    from te_parallel.ops.cast import quantize

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
# References

def bias_activation_torch(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same op with PyTorch ops in x.dtype (x + bias rounded, then the activation): torch's own path."""
    return _act.apply_activation_torch(name, x if bias is None else x + bias)


def dactivation_torch(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """dx of bias_activation_torch at x (and bias) for the output gradient dy, by autograd through the
    same PyTorch ops (torch's own path)."""
    with torch.enable_grad():
        v = x.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(bias_activation_torch(name, v, bias), v, dy)
    return dx


def bias_activation_reference(name: str, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp64 act(x + bias) from the formulas of activation_reference."""
    v = x.double() if bias is None else x.double() + bias.double()
    return _act.activation_reference(name, v)


def dbias_dactivation_reference(name: str, dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 (dx, dbias) by autograd through activation_reference at x + bias."""
    with torch.enable_grad():
        v = (x.double() if bias is None else x.double() + bias.double()).detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(_act.activation_reference(name, v), v, dy.double())
    return dx, dx.sum(0)
