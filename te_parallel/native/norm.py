"""LayerNorm / RMSNorm kernels (csrc/kernels/norm*.cu; C API te_parallel/norm.h): checked forward and
backward wrappers. The autograd Functions over them are in te_parallel.ops.norm.

Math (fp32 whatever the storage dtypes; g = 1 + gamma with zero_centered_gamma):
    LayerNorm  mu = mean(x), rsigma = 1/sqrt(var(x) + eps), y = (x - mu) * rsigma * g + beta
    RMSNorm    rsigma = 1/sqrt(mean(x^2) + eps),              y = x * rsigma * g
The forward reads x once and also returns mu (LayerNorm) and rsigma, fp32 [rows], which the backward
takes. With `fp8=FP8NormOutput(...)` the output is fp8(y * scale) (te_parallel.ops.cast's rounding
and saturation, bit for bit) plus an optional transposed copy, and amax_out receives max |y|.
Norms are named as in the extension's NORM_TYPES table: "layer_norm", "rms_norm".

Under torch.compile `forward` and `backward` are the custom ops te_parallel::norm_fwd / norm_bwd
(opaque nodes of the graph, with fake kernels for tracing), which run these same kernels when the graph
runs; te_parallel.ops.norm registers their CPU kernels (its PyTorch path).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple, Union

import torch

from te_parallel.native import DTYPES, FP8_DTYPES, HIGH_PRECISION_DTYPES, NORM_TYPES, describe, launch_on, require

__all__ = ["FP8NormOutput", "usable", "forward", "backward", "layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd",
           "rms_norm_bwd"]

Output = Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]


class FP8NormOutput(NamedTuple):
    """Ask a norm forward for FP8 output: data = fp8(y * scale), data_t = its [hidden, rows] copy.

    scale: 1-element fp32 tensor on x's device. amax_out: None or a 1-element fp32 tensor there that
    receives max(amax_out, max |y|) (pre-scale y; NaN propagates). transpose: also make data_t.
    """

    scale: torch.Tensor
    fp8_dtype: torch.dtype
    amax_out: Optional[torch.Tensor] = None
    transpose: bool = False


def usable(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """True if the kernels normalise x [..., hidden] with this weight (and bias): a non-empty CUDA x and a
    1-D weight on its device, of dtypes the kernels read, the bias of the weight's dtype; the extension
    loaded (NORM_TYPES is empty without it). Checked cheaply, for every call."""
    dtypes = HIGH_PRECISION_DTYPES
    return (bool(NORM_TYPES) and x.is_cuda and x.dtype in dtypes and x.numel() > 0 and weight.dtype in dtypes
            and weight.dim() == 1 and weight.device == x.device
            and (bias is None or (bias.dtype == weight.dtype and bias.device == x.device)))


def _code(fn: str, norm: str) -> int:
    """The tep_norm_type of `norm` (after the extension was found: the table is empty without it)."""
    code = NORM_TYPES.get(norm)
    if code is None:
        raise ValueError(f"{fn}: norm {norm!r}; need one of {tuple(NORM_TYPES)}")
    return code


def _scalar_ok(t: object, device: torch.device) -> bool:
    return (isinstance(t, torch.Tensor) and t.device == device and t.dtype == torch.float32 and t.numel() == 1
            and t.is_contiguous())


# ------------------------------------------------------------------------------------------------
# Checks: one line each, what was given and what is needed

def _check_x(fn: str, name: str, x: object) -> None:
    ok = (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.numel() > 0
          and x.dtype in HIGH_PRECISION_DTYPES)
    if not ok:
        raise ValueError(f"{fn}: {name} is {describe(x)}; need a contiguous non-empty 2-D [rows, hidden] "
                         f"float32/float16/bfloat16 CUDA tensor")


def _check_param(fn: str, name: str, t: object, x: torch.Tensor) -> None:
    h = x.shape[1]
    ok = (isinstance(t, torch.Tensor) and t.device == x.device and t.dim() == 1 and t.shape[0] == h
          and t.is_contiguous() and t.dtype in HIGH_PRECISION_DTYPES)
    if not ok:
        raise ValueError(f"{fn}: {name} is {describe(t)}; need a contiguous ({h},) float32/float16/bfloat16 "
                         f"tensor on {x.device} (x is {tuple(x.shape)})")


def _check_params(fn: str, x: torch.Tensor, gamma: object, beta: object) -> None:
    _check_param(fn, "gamma", gamma, x)
    if beta is not None:
        _check_param(fn, "beta", beta, x)
        if beta.dtype != gamma.dtype:
            raise ValueError(f"{fn}: gamma is {gamma.dtype} and beta {beta.dtype}; need one dtype for both")


def _check_fp8(fn: str, fp8: object, x: torch.Tensor) -> FP8NormOutput:
    if not isinstance(fp8, tuple) or len(fp8) != 4:
        raise ValueError(f"{fn}: fp8 is {fp8!r}; need None or FP8NormOutput(scale, fp8_dtype, amax_out, transpose)")
    spec = FP8NormOutput(*fp8)
    if spec.fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{fn}: fp8.fp8_dtype is {spec.fp8_dtype}; need torch.float8_e4m3fn or torch.float8_e5m2")
    if not _scalar_ok(spec.scale, x.device) or not (spec.amax_out is None or _scalar_ok(spec.amax_out, x.device)):
        raise ValueError(f"{fn}: fp8.scale is {describe(spec.scale)}, fp8.amax_out {describe(spec.amax_out)}; need "
                         f"1-element float32 tensors on {x.device} (amax_out may be None)")
    return spec


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


# ------------------------------------------------------------------------------------------------
# Forward / backward (no autograd)

def forward(norm: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float,
            zero_centered_gamma: bool = False, fp8: Optional[FP8NormOutput] = None,
            out_dtype: Optional[torch.dtype] = None) -> Tuple[Output, Optional[torch.Tensor], torch.Tensor]:
    """Forward of `norm` ("layer_norm" or "rms_norm") of a contiguous CUDA [rows, hidden] x: (out, mu or
    None, rsigma). out: y in out_dtype (default x.dtype), or with fp8 the pair (data, data_t or None).
    gamma, beta (beta may be None; always None for rms_norm): [hidden] float32/float16/bfloat16, one dtype."""
    if torch.compiler.is_compiling():
        return _forward_in_graph(norm, x, gamma, beta, eps, zero_centered_gamma, fp8, out_dtype)
    fn = f"{norm}_fwd"
    _check_x(fn, "x", x)
    _check_params(fn, x, gamma, beta)
    spec = None if fp8 is None else _check_fp8(fn, fp8, x)
    if spec is not None and out_dtype is not None:
        raise ValueError(f"{fn}: out_dtype={out_dtype} and fp8 both given; the FP8 output's dtype is fp8.fp8_dtype")
    if spec is None and out_dtype is not None and out_dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"{fn}: out_dtype is {out_dtype}; need None (x's dtype), float32, float16 or bfloat16")
    module = require(fn, "norm")
    code = _code(fn, norm)
    rows, hidden = x.shape
    dtype = spec.fp8_dtype if spec is not None else (out_dtype or x.dtype)
    out = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    out_t = torch.empty(hidden, rows, dtype=dtype, device=x.device) if spec is not None and spec.transpose else None
    mu = torch.empty(rows, dtype=torch.float32, device=x.device) if norm == "layer_norm" else None
    rsigma = torch.empty(rows, dtype=torch.float32, device=x.device)
    guard, stream = launch_on(x.device)
    with guard:
        module.norm_fwd(code, rows, hidden, float(eps), bool(zero_centered_gamma), gamma.data_ptr(), _ptr(beta),
                        DTYPES[gamma.dtype], x.data_ptr(), DTYPES[x.dtype], out.data_ptr(), DTYPES[dtype],
                        _ptr(spec.scale if spec else None), _ptr(out_t), _ptr(spec.amax_out if spec else None),
                        _ptr(mu), rsigma.data_ptr(), stream)
    return (out if spec is None else (out, out_t)), mu, rsigma


def layer_norm_fwd(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float,
                   zero_centered_gamma: bool = False, *, fp8: Optional[FP8NormOutput] = None,
                   out_dtype: Optional[torch.dtype] = None) -> Tuple[Output, torch.Tensor, torch.Tensor]:
    """LayerNorm of a contiguous CUDA [rows, hidden] x: (out, mu, rsigma).

    out: y in out_dtype (default x.dtype), or with fp8 the pair (data, data_t or None).
    gamma, beta (beta may be None): [hidden] float32/float16/bfloat16, one dtype.
    """
    return forward("layer_norm", x, gamma, beta, eps, zero_centered_gamma, fp8, out_dtype)


def rms_norm_fwd(x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered_gamma: bool = False, *,
                 fp8: Optional[FP8NormOutput] = None,
                 out_dtype: Optional[torch.dtype] = None) -> Tuple[Output, torch.Tensor]:
    """RMSNorm of a contiguous CUDA [rows, hidden] x: (out, rsigma); out as in layer_norm_fwd."""
    out, _, rsigma = forward("rms_norm", x, gamma, None, eps, zero_centered_gamma, fp8, out_dtype)
    return out, rsigma


@functools.lru_cache(maxsize=256)
def _workspace_bytes(code: int, rows: int, hidden: int, w_code: int, x_code: int, device_index: int) -> int:
    # Depends on the device (SM count, occupancy) and the shape only: cached, so a training step pays
    # for the query once per shape (and a CUDA-graph capture makes no query at all after warm-up).
    with torch.cuda.device(device_index):
        return require("norm_bwd", "norm").norm_bwd_workspace_size(code, rows, hidden, w_code, x_code)


def backward(norm: str, dy: torch.Tensor, x: torch.Tensor, mu: Optional[torch.Tensor], rsigma: torch.Tensor,
             gamma: torch.Tensor, zero_centered_gamma: bool = False,
             with_dbeta: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Backward of forward(norm, ...): (dx in x's dtype, dgamma and dbeta in gamma's dtype; dbeta None
    unless layer_norm with_dbeta). dy: [rows, hidden] in x's dtype; mu None for rms_norm. dgamma/dbeta
    are deterministic."""
    if torch.compiler.is_compiling():
        dx, dgamma, dbeta = _norm_bwd_op(norm, dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta)
        return dx, dgamma, dbeta if with_dbeta and norm == "layer_norm" else None
    fn = f"{norm}_bwd"
    _check_x(fn, "x", x)
    _check_x(fn, "dy", dy)
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(f"{fn}: dy is {describe(dy)} and x {describe(x)}; need the same shape, dtype and device")
    _check_param(fn, "gamma", gamma, x)
    rows = x.shape[0]
    for name, t in (("rsigma", rsigma), ("mu", mu)):
        if name == "mu" and norm == "rms_norm":
            continue
        ok = (isinstance(t, torch.Tensor) and t.device == x.device and t.dtype == torch.float32
              and t.shape == (rows,) and t.is_contiguous())
        if not ok:
            raise ValueError(f"{fn}: {name} is {describe(t)}; need the forward's contiguous float32 ({rows},) "
                             f"tensor on {x.device}")
    module = require(fn, "norm")
    code = _code(fn, norm)
    hidden = x.shape[1]
    dx = torch.empty_like(x)
    dgamma = torch.empty_like(gamma)
    dbeta = torch.empty_like(gamma) if with_dbeta and norm == "layer_norm" else None
    nbytes = _workspace_bytes(code, rows, hidden, DTYPES[gamma.dtype], DTYPES[x.dtype], x.device.index)
    workspace = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=x.device)
    guard, stream = launch_on(x.device)
    with guard:
        module.norm_bwd(code, rows, hidden, bool(zero_centered_gamma), gamma.data_ptr(), DTYPES[gamma.dtype],
                        dy.data_ptr(), x.data_ptr(), DTYPES[x.dtype], 0 if mu is None else mu.data_ptr(),
                        rsigma.data_ptr(), dx.data_ptr(), dgamma.data_ptr(), _ptr(dbeta), workspace.data_ptr(),
                        workspace.numel(), stream)
    return dx, dgamma, dbeta


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                   zero_centered_gamma: bool = False, *,
                   with_dbeta: bool = True) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Backward of layer_norm_fwd: (dx in x's dtype, dgamma and dbeta in gamma's dtype; dbeta None
    unless with_dbeta). dy: [rows, hidden] in x's dtype. dgamma/dbeta are deterministic."""
    return backward("layer_norm", dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                 zero_centered_gamma: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backward of rms_norm_fwd: (dx in x's dtype, dgamma in gamma's dtype)."""
    dx, dgamma, _ = backward("rms_norm", dy, x, None, rsigma, gamma, zero_centered_gamma, False)
    return dx, dgamma


# ------------------------------------------------------------------------------------------------
# The custom ops of compiled graphs: the same kernels, behind torch's dispatcher. Absent outputs are
# empty tensors (an op returns tensors only): out_t [0, rows], mu [0], dbeta [0].

def _forward_in_graph(norm, x, gamma, beta, eps, zero_centered_gamma, fp8, out_dtype):
    spec = None if fp8 is None else FP8NormOutput(*fp8)
    out, out_t, mu, rsigma = _norm_fwd_op(norm, x, gamma, beta, float(eps), bool(zero_centered_gamma),
                                          None if spec is None else spec.scale,
                                          None if spec is None else spec.fp8_dtype,
                                          None if spec is None else spec.amax_out,
                                          spec is not None and bool(spec.transpose), out_dtype)
    if spec is not None:
        out = (out, out_t if spec.transpose else None)
    return out, (mu if norm == "layer_norm" else None), rsigma


@torch.library.custom_op("te_parallel::norm_fwd", mutates_args=("amax_out",), device_types="cuda")
def _norm_fwd_op(norm: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float,
                 zero_centered_gamma: bool, scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype],
                 amax_out: Optional[torch.Tensor], transpose: bool,
                 out_dtype: Optional[torch.dtype]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = None if fp8_dtype is None else FP8NormOutput(scale, fp8_dtype, amax_out, transpose)
    out, mu, rsigma = forward(norm, x, gamma, beta, eps, zero_centered_gamma, spec, out_dtype)
    if spec is not None:
        out, out_t = out
    rows = x.shape[0]
    return (out, x.new_empty((0, rows), dtype=out.dtype) if spec is None or out_t is None else out_t,
            x.new_empty((0,), dtype=torch.float32) if mu is None else mu, rsigma)


@_norm_fwd_op.register_fake
def _(norm, x, gamma, beta, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose, out_dtype):
    rows, hidden = x.shape
    dtype = fp8_dtype if fp8_dtype is not None else (out_dtype or x.dtype)
    return (x.new_empty((rows, hidden), dtype=dtype),
            x.new_empty((hidden, rows) if fp8_dtype is not None and transpose else (0, rows), dtype=dtype),
            x.new_empty((rows if norm == "layer_norm" else 0,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@torch.library.custom_op("te_parallel::norm_bwd", mutates_args=(), device_types="cuda")
def _norm_bwd_op(norm: str, dy: torch.Tensor, x: torch.Tensor, mu: Optional[torch.Tensor], rsigma: torch.Tensor,
                 gamma: torch.Tensor, zero_centered_gamma: bool,
                 with_dbeta: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dgamma, dbeta = backward(norm, dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta)
    return dx, dgamma, gamma.new_empty((0,)) if dbeta is None else dbeta


@_norm_bwd_op.register_fake
def _(norm, dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta):
    return (torch.empty_like(x), torch.empty_like(gamma),
            torch.empty_like(gamma) if with_dbeta and norm == "layer_norm" else gamma.new_empty((0,)))
