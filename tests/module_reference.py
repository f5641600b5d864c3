"""fp64 references of the modules, with the FP8 GEMMs modelled as quantize→dequantize in fp64.

`Fp8Plan` says which scale each GEMM operand used: a fixed scale (delayed scaling: the module's
scale before the step) or None for current scaling (fp8_max / amax of the tensor itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from te_parallel.ops.activation import activation_reference
from te_parallel.ops.norm import layer_norm_reference, rms_norm_reference
from te_parallel.recipe import Format
from tests.reference import block_qdq, current_scale_ref, qdq


@dataclass
class GemmScales:
    fmt: Format
    x: Optional[torch.Tensor] = None   # None: current scaling
    w: Optional[torch.Tensor] = None
    dy: Optional[torch.Tensor] = None
    block: Optional[object] = None     # a Float8BlockScaling: each operand in its tiles (block_qdq)


def _tile(dim: int) -> tuple:
    return (1, 128) if dim == 1 else (128, 128)


def _bqdq(t, recipe, role: str, dtype, along_rows: bool = False):
    """Block quantize -> dequantize of operand t as the GEMM reading it sees it. along_rows: the GEMM runs over
    t's rows (wgrad's x and dy), so its 1x128 tiles run down the columns."""
    tile, pow2 = _tile(recipe.block_dim(role)), recipe.qparams(role).power_2_scale
    if along_rows and tile == (1, 128):
        return block_qdq(t.t(), dtype, tile, pow2).t()
    return block_qdq(t, dtype, tile, pow2)


def _qdq(t, scale, dtype):
    s = current_scale_ref(t, dtype) if scale is None else scale.cpu()
    return qdq(t, s, dtype)


class RefLinear(torch.autograd.Function):
    """y = q(x)·q(W)ᵀ + b; dx = q(dy)·q(W); dW = q(dy)ᵀ·q(x); db = Σdy, all in fp64."""

    @staticmethod
    def forward(ctx, x, w, b, scales: Optional[GemmScales]):
        if scales is not None and scales.block is not None:
            rec, fwd = scales.block, scales.fmt.fwd_dtype
            xq, wq = _bqdq(x, rec, "x", fwd), _bqdq(w, rec, "w", fwd)
            ctx.save_for_backward(_bqdq(x, rec, "x", fwd, along_rows=True), wq)
            ctx.scales, ctx.has_b = scales, b is not None
            y = xq @ wq.t()
            return y if b is None else y + b
        if scales is None:
            xq, wq = x, w
        else:
            xq = _qdq(x, scales.x, scales.fmt.fwd_dtype)
            wq = _qdq(w, scales.w, scales.fmt.fwd_dtype)
        ctx.save_for_backward(xq, wq)
        ctx.scales, ctx.has_b = scales, b is not None
        y = xq @ wq.t()
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        s = ctx.scales
        if s is not None and s.block is not None:
            bwd = s.fmt.bwd_dtype
            dyq_rows, dyq_cols = _bqdq(dy, s.block, "grad", bwd), _bqdq(dy, s.block, "grad", bwd, along_rows=True)
            return dyq_rows @ wq, dyq_cols.t() @ xq, (dy.sum(0) if ctx.has_b else None), None
        dyq = dy if s is None else _qdq(dy, s.dy, s.fmt.bwd_dtype)
        return dyq @ wq, dyq.t() @ xq, (dy.sum(0) if ctx.has_b else None), None


def ref_linear(x, w, b, scales):
    shape = x.shape
    y = RefLinear.apply(x.reshape(-1, shape[-1]), w, b, scales)
    return y.reshape(*shape[:-1], w.shape[0])


def ref_norm(normalization, x, g, beta, eps, zero_centered):
    if normalization == "LayerNorm":
        return layer_norm_reference(x, g, beta, eps, zero_centered)
    return rms_norm_reference(x, g, eps, zero_centered)


def dparams(module, names: Sequence[str]):
    """fp64 leaf copies of the module's parameters, by name (None where the parameter is None)."""
    out = {}
    for n in names:
        p = getattr(module, n)
        out[n] = None if p is None else p.detach().double().cpu().requires_grad_(True)
    return out


def grads_close(module, ref_params, names, tol, rel_err):
    for n in names:
        p = getattr(module, n)
        if p is None:
            continue
        err = rel_err(p.grad.cpu(), ref_params[n].grad)
        assert err < tol, f"grad of {n}: relative error {err:.2e} >= {tol:.0e}"


def scales_of(module, gemm: int, fmt: Format, delayed: bool, block=None) -> GemmScales:
    if block is not None:
        return GemmScales(fmt, block=block)
    if not delayed:
        return GemmScales(fmt)
    st = module.fp8_state
    return GemmScales(fmt, st.fwd_scale[2 * gemm].clone(), st.fwd_scale[2 * gemm + 1].clone(), st.bwd_scale[gemm].clone())


def ref_mlp(p, x, mod, scales):
    ln = ref_norm(mod.normalization, x, p["layer_norm_weight"], p["layer_norm_bias"], mod.eps, mod.zero_centered_gamma)
    h = ref_linear(ln, p["fc1_weight"], p["fc1_bias"], scales[0])
    a = activation_reference(mod.activation, h)
    return ref_linear(a, p["fc2_weight"], p["fc2_bias"], scales[1]), ln
