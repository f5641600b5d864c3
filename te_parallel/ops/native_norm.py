"""Native LayerNorm / RMSNorm (csrc/kernels/norm.cu): checked wrappers and the autograd Functions over them.

Layering (STYLE.md rule 9): the kernels know no torch (C API csrc/include/te_parallel/norm.h); this
module checks tensors, allocates outputs and passes raw pointers and the current stream. The
pure-PyTorch fp64 references sit beside it in te_parallel.ops.norm (layer_norm_reference,
rms_norm_reference and their *_bwd_reference), and so does the dispatch that picks these kernels for
CUDA inputs.

Math (fp32 whatever the storage dtypes; g = 1 + gamma with zero_centered_gamma):
    LayerNorm  mu = mean(x), rsigma = 1/sqrt(var(x) + eps), y = (x - mu) * rsigma * g + beta
    RMSNorm    rsigma = 1/sqrt(mean(x^2) + eps),              y = x * rsigma * g
The forward reads x once and also returns mu (LayerNorm) and rsigma, fp32 [rows], which the backward
takes. With `fp8=FP8NormOutput(...)` the output is fp8(y * scale) (te_parallel.ops.cast's rounding
and saturation, bit for bit) plus an optional transposed copy, and amax_out receives max |y|.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from te_parallel import _native
from te_parallel._native import _DTYPES, _describe
from te_parallel.fp8.tensor import Float8Tensor

__all__ = ["NORM_DTYPES", "FP8NormOutput", "available", "layer_norm_fwd", "rms_norm_fwd", "layer_norm_bwd",
           "rms_norm_bwd", "layer_norm", "rms_norm", "layer_norm_fp8", "rms_norm_fp8"]

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPES = _native.FP8_DTYPES
_LAYERNORM, _RMSNORM = 0, 1  # tep_norm_type
_NAMES = {_LAYERNORM: "layer_norm", _RMSNORM: "rms_norm"}

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


def available() -> bool:
    """True if te_parallel._C imports (warns once if it does not)."""
    return _native.available()


def _module():
    module = _native.load()
    if module is None:
        raise RuntimeError("te_parallel.ops.native_norm: te_parallel._C is absent; check "
                           "te_parallel._native.available() and use te_parallel.ops.norm's PyTorch path")
    return module


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _scalar_ok(t: object, device: torch.device) -> bool:
    return (isinstance(t, torch.Tensor) and t.device == device and t.dtype == torch.float32 and t.numel() == 1
            and t.is_contiguous())


# ------------------------------------------------------------------------------------------------
# Checks: one line each, what was given and what is needed

def _check_x(fn: str, name: str, x: object) -> None:
    ok = (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.numel() > 0
          and x.dtype in NORM_DTYPES)
    if not ok:
        raise ValueError(f"{fn}: {name} is {_describe(x)}; need a contiguous non-empty 2-D [rows, hidden] "
                         f"float32/float16/bfloat16 CUDA tensor")


def _check_param(fn: str, name: str, t: object, x: torch.Tensor) -> None:
    h = x.shape[1]
    ok = (isinstance(t, torch.Tensor) and t.device == x.device and t.dim() == 1 and t.shape[0] == h
          and t.is_contiguous() and t.dtype in NORM_DTYPES)
    if not ok:
        raise ValueError(f"{fn}: {name} is {_describe(t)}; need a contiguous ({h},) float32/float16/bfloat16 "
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
    if spec.fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"{fn}: fp8.fp8_dtype is {spec.fp8_dtype}; need torch.float8_e4m3fn or torch.float8_e5m2")
    if not _scalar_ok(spec.scale, x.device) or not (spec.amax_out is None or _scalar_ok(spec.amax_out, x.device)):
        raise ValueError(f"{fn}: fp8.scale is {_describe(spec.scale)}, fp8.amax_out {_describe(spec.amax_out)}; need "
                         f"1-element float32 tensors on {x.device} (amax_out may be None)")
    return spec


# ------------------------------------------------------------------------------------------------
# Forward / backward wrappers (no autograd)

def _fwd(norm: int, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float,
         zero_centered_gamma: bool, fp8: Optional[FP8NormOutput],
         out_dtype: Optional[torch.dtype]) -> Tuple[Output, Optional[torch.Tensor], torch.Tensor]:
    fn = f"{_NAMES[norm]}_fwd"
    _check_x(fn, "x", x)
    _check_params(fn, x, gamma, beta)
    spec = None if fp8 is None else _check_fp8(fn, fp8, x)
    if spec is not None and out_dtype is not None:
        raise ValueError(f"{fn}: out_dtype={out_dtype} and fp8 both given; the FP8 output's dtype is fp8.fp8_dtype")
    if spec is None and out_dtype is not None and out_dtype not in NORM_DTYPES:
        raise ValueError(f"{fn}: out_dtype is {out_dtype}; need None (x's dtype), float32, float16 or bfloat16")
    module = _module()
    rows, hidden = x.shape
    dtype = spec.fp8_dtype if spec is not None else (out_dtype or x.dtype)
    out = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    out_t = torch.empty(hidden, rows, dtype=dtype, device=x.device) if spec is not None and spec.transpose else None
    mu = torch.empty(rows, dtype=torch.float32, device=x.device) if norm == _LAYERNORM else None
    rsigma = torch.empty(rows, dtype=torch.float32, device=x.device)

    def ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    with torch.cuda.device(x.device):
        module.norm_fwd(norm, rows, hidden, float(eps), bool(zero_centered_gamma), gamma.data_ptr(), ptr(beta),
                        _DTYPES[gamma.dtype], x.data_ptr(), _DTYPES[x.dtype], out.data_ptr(), _DTYPES[dtype],
                        ptr(spec.scale if spec else None), ptr(out_t), ptr(spec.amax_out if spec else None), ptr(mu),
                        rsigma.data_ptr(), _stream(x.device))
    return (out if spec is None else (out, out_t)), mu, rsigma


def layer_norm_fwd(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float,
                   zero_centered_gamma: bool = False, *, fp8: Optional[FP8NormOutput] = None,
                   out_dtype: Optional[torch.dtype] = None) -> Tuple[Output, torch.Tensor, torch.Tensor]:
    """LayerNorm of a contiguous CUDA [rows, hidden] x: (out, mu, rsigma).

    out: y in out_dtype (default x.dtype), or with fp8 the pair (data, data_t or None).
    gamma, beta (beta may be None): [hidden] float32/float16/bfloat16, one dtype.
    """
    return _fwd(_LAYERNORM, x, gamma, beta, eps, zero_centered_gamma, fp8, out_dtype)


def rms_norm_fwd(x: torch.Tensor, gamma: torch.Tensor, eps: float, zero_centered_gamma: bool = False, *,
                 fp8: Optional[FP8NormOutput] = None,
                 out_dtype: Optional[torch.dtype] = None) -> Tuple[Output, torch.Tensor]:
    """RMSNorm of a contiguous CUDA [rows, hidden] x: (out, rsigma); out as in layer_norm_fwd."""
    out, _, rsigma = _fwd(_RMSNORM, x, gamma, None, eps, zero_centered_gamma, fp8, out_dtype)
    return out, rsigma


@functools.lru_cache(maxsize=256)
def _workspace_bytes(norm: int, rows: int, hidden: int, w_code: int, x_code: int, device_index: int) -> int:
    # Depends on the device (SM count, occupancy) and the shape only: cached, so a training step pays
    # for the query once per shape (and a CUDA-graph capture makes no query at all after warm-up).
    with torch.cuda.device(device_index):
        return _module().norm_bwd_workspace_size(norm, rows, hidden, w_code, x_code)


def _bwd(norm: int, dy: torch.Tensor, x: torch.Tensor, mu: Optional[torch.Tensor], rsigma: torch.Tensor,
         gamma: torch.Tensor, zero_centered_gamma: bool,
         with_dbeta: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    fn = f"{_NAMES[norm]}_bwd"
    _check_x(fn, "x", x)
    _check_x(fn, "dy", dy)
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise ValueError(f"{fn}: dy is {_describe(dy)} and x {_describe(x)}; need the same shape, dtype and device")
    _check_param(fn, "gamma", gamma, x)
    rows = x.shape[0]
    for name, t in (("rsigma", rsigma), ("mu", mu)):
        if name == "mu" and norm == _RMSNORM:
            continue
        ok = (isinstance(t, torch.Tensor) and t.device == x.device and t.dtype == torch.float32
              and t.shape == (rows,) and t.is_contiguous())
        if not ok:
            raise ValueError(f"{fn}: {name} is {_describe(t)}; need the forward's contiguous float32 ({rows},) "
                             f"tensor on {x.device}")
    module = _module()
    hidden = x.shape[1]
    dx = torch.empty_like(x)
    dgamma = torch.empty_like(gamma)
    dbeta = torch.empty_like(gamma) if with_dbeta and norm == _LAYERNORM else None
    nbytes = _workspace_bytes(norm, rows, hidden, _DTYPES[gamma.dtype], _DTYPES[x.dtype], x.device.index)
    workspace = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=x.device)
    with torch.cuda.device(x.device):
        module.norm_bwd(norm, rows, hidden, bool(zero_centered_gamma), gamma.data_ptr(), _DTYPES[gamma.dtype],
                        dy.data_ptr(), x.data_ptr(), _DTYPES[x.dtype], 0 if mu is None else mu.data_ptr(),
                        rsigma.data_ptr(), dx.data_ptr(), dgamma.data_ptr(), 0 if dbeta is None else dbeta.data_ptr(),
                        workspace.data_ptr(), workspace.numel(), _stream(x.device))
    return dx, dgamma, dbeta


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                   zero_centered_gamma: bool = False, *,
                   with_dbeta: bool = True) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Backward of layer_norm_fwd: (dx in x's dtype, dgamma and dbeta in gamma's dtype; dbeta None
    unless with_dbeta). dy: [rows, hidden] in x's dtype. dgamma/dbeta are deterministic."""
    return _bwd(_LAYERNORM, dy, x, mu, rsigma, gamma, zero_centered_gamma, with_dbeta)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                 zero_centered_gamma: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backward of rms_norm_fwd: (dx in x's dtype, dgamma in gamma's dtype)."""
    dx, dgamma, _ = _bwd(_RMSNORM, dy, x, None, rsigma, gamma, zero_centered_gamma, False)
    return dx, dgamma


# ------------------------------------------------------------------------------------------------
# Autograd

def _backward(ctx, dy: torch.Tensor):
    x, gamma, mu, rsigma = ctx.saved_tensors
    dy = dy.to(x.dtype).contiguous()  # an expanded or other-dtype gradient: the kernel takes x's layout
    dx, dgamma, dbeta = _bwd(ctx.norm, dy, x, mu, rsigma, gamma, ctx.zero_centered_gamma, ctx.has_beta)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, dgamma if needs[1] else None, dbeta if needs[2] else None)


class _NormFunction(torch.autograd.Function):
    """y = norm(x) for a [rows, hidden] x: the native forward; backward: the native backward."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps, zero_centered_gamma, norm):
        out, mu, rsigma = _fwd(norm, x, gamma, beta, eps, zero_centered_gamma, None, None)
        ctx.save_for_backward(x, gamma, mu, rsigma)
        ctx.norm, ctx.zero_centered_gamma, ctx.has_beta = norm, zero_centered_gamma, beta is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return (*_backward(ctx, dy), None, None, None)


class _NormFP8Function(torch.autograd.Function):
    """The FP8 forward (data, data_t) with a gradient carrier: a zero-storage [rows, hidden] tensor in
    x's dtype through which the consumer of the FP8 bytes returns d(norm output)."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps, zero_centered_gamma, norm, spec):
        (data, data_t), mu, rsigma = _fwd(norm, x, gamma, beta, eps, zero_centered_gamma, spec, None)
        ctx.save_for_backward(x, gamma, mu, rsigma)
        ctx.norm, ctx.zero_centered_gamma, ctx.has_beta = norm, zero_centered_gamma, beta is not None
        carrier = x.new_zeros(()).expand(x.shape)  # [rows, hidden], stride (0, 0)
        outs = (carrier, data) if data_t is None else (carrier, data, data_t)
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *_fp8_grads):
        return (*_backward(ctx, dy), None, None, None, None)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [..., h] -> [rows, h]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               zero_centered_gamma: bool = False) -> torch.Tensor:
    """Autograd LayerNorm over the last dim of a CUDA x of any leading shape, output in x's dtype."""
    b = None if bias is None else bias.contiguous()
    out = _NormFunction.apply(_as_rows(x), weight.contiguous(), b, eps, zero_centered_gamma, _LAYERNORM)
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    """Autograd RMSNorm over the last dim of a CUDA x of any leading shape, output in x's dtype."""
    out = _NormFunction.apply(_as_rows(x), weight.contiguous(), None, eps, zero_centered_gamma, _RMSNORM)
    return out.view(x.shape)


def _fp8(norm: int, x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose):
    scale = scale.detach().to(torch.float32).reshape(())
    spec = FP8NormOutput(scale, fp8_dtype, amax_out, transpose)
    outs = _NormFP8Function.apply(_as_rows(x), weight.contiguous(), None if bias is None else bias.contiguous(), eps,
                                  zero_centered_gamma, norm, spec)
    carrier, data = outs[0], outs[1]
    data_t = outs[2] if len(outs) > 2 else None
    return Float8Tensor(data=data, scale_inv=1.0 / scale, data_t=data_t), carrier


def layer_norm_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   zero_centered_gamma: bool = False, *, scale: torch.Tensor, fp8_dtype: torch.dtype,
                   amax_out: Optional[torch.Tensor] = None,
                   transpose: bool = True) -> Tuple[Float8Tensor, torch.Tensor]:
    """LayerNorm straight to FP8, for a consumer that fuses it with its GEMM: (y8, carrier).

    y8: Float8Tensor [rows, hidden] (rows = x.numel() // hidden) with data = fp8(y * scale), its
    transposed copy when `transpose`, and scale_inv = 1 / scale; amax_out receives max |y|.
    carrier: a zero-storage [rows, hidden] tensor in x's dtype that carries the gradient: the
    consumer's autograd Function takes it as an input and returns dL/dy (high precision) for it,
    which runs the native backward into x, weight and bias.
    """
    return _fp8(_LAYERNORM, x, weight, bias, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False, *,
                 scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: Optional[torch.Tensor] = None,
                 transpose: bool = True) -> Tuple[Float8Tensor, torch.Tensor]:
    """RMSNorm straight to FP8: (y8, carrier) as in layer_norm_fp8."""
    return _fp8(_RMSNORM, x, weight, None, eps, zero_centered_gamma, scale, fp8_dtype, amax_out, transpose)
