"""The linear autograd Function: y = x·Wᵀ + b, in FP8 or high precision, with TE's wgrad fusion.

Shapes: x [..., K] is viewed as [M, K] (M = tokens), W [N, K], y [..., N].
    fprop y  = x·Wᵀ   (needs x, W)
    dgrad dx = dy·W   (needs dy, Wᵀ copy)
    wgrad dW = dyᵀ·x  (needs dyᵀ copy, xᵀ copy)
In FP8 only the transposed input xᵀ is kept for backward (FP8: a quarter of fp32's bytes), and the
quantized weight comes from the module's cache, so it is cast once per step, not per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import gemm
from te_parallel.ops.fp8_gemm_config import GemmFP8


@dataclass(frozen=True)
class WgradTarget:
    """Where a fused wgrad accumulates: rows [start, end) of dW go into param.main_grad."""

    param: torch.nn.Parameter
    start: int
    end: int


def _accumulate_main_grad(targets: List[WgradTarget], dw: torch.Tensor) -> None:
    for t in targets:
        main_grad = getattr(t.param, "main_grad", None)
        if main_grad is None or main_grad.shape != t.param.shape:
            got = None if main_grad is None else tuple(main_grad.shape)
            raise RuntimeError(
                f"fuse_wgrad_accumulation=True needs weight.main_grad of shape {tuple(t.param.shape)} "
                f"(usually fp32) set before backward, got {got}"
            )
        main_grad.add_(dw[t.start : t.end].to(main_grad.dtype))
        if hasattr(t.param, "grad_added_to_main_grad"):
            t.param.grad_added_to_main_grad = True


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, fp8: Optional[GemmFP8], wgrad_targets: Optional[List[WgradTarget]]):
        out_features, in_features = weight.shape
        x2d = inp.reshape(-1, in_features)  # [M, K]
        act_dtype = inp.dtype
        need_wgrad = weight.requires_grad or bool(wgrad_targets)
        ctx.fp8, ctx.wgrad_targets, ctx.act_dtype = fp8, wgrad_targets, act_dtype
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        ctx.inp_shape = inp.shape
        if fp8 is not None and fp8.compute:
            x_q = fp8.cast_input(x2d, transpose=need_wgrad)
            y2d = gemm.fprop(x_q, fp8.weight, act_dtype, bias)
            # Keep only xᵀ (wgrad reads nothing else): data is a view of it, no extra bytes.
            ctx.x_saved = None if not need_wgrad else Float8Tensor(x_q.data_t.t(), x_q.scale_inv, x_q.data_t)
            ctx.w_saved = fp8.weight
            ctx.save_for_backward()
        else:
            if fp8 is not None:
                fp8.record_amax(x2d, backward=False)
            w = weight.to(act_dtype)
            y2d = torch.nn.functional.linear(x2d, w, None if bias is None else bias.to(act_dtype))
            ctx.save_for_backward(x2d if need_wgrad else None, w)
        return y2d.reshape(*inp.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        fp8, targets = ctx.fp8, ctx.wgrad_targets
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] or bool(targets)
        dy2d = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.act_dtype)  # [M, N]
        dx2d = dw = None
        if fp8 is not None and fp8.compute:
            dy_q = fp8.cast_grad(dy2d, transpose=need_dw)
            if need_dx:
                dx2d = gemm.dgrad(dy_q, ctx.w_saved, ctx.act_dtype)
            if need_dw:
                dw_dtype = torch.float32 if targets else ctx.weight_dtype
                dw = gemm.wgrad(dy_q, ctx.x_saved, dw_dtype)
        else:
            x2d, w = ctx.saved_tensors
            if fp8 is not None:
                fp8.record_amax(dy2d, backward=True)
            if need_dx:
                dx2d = dy2d @ w
            if need_dw:
                dw = dy2d.t() @ x2d
        dbias = dy2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if targets and dw is not None:
            _accumulate_main_grad(targets, dw)
            dw = None
        elif dw is not None:
            dw = dw.to(ctx.weight_dtype)
        dx = None if dx2d is None else dx2d.reshape(ctx.inp_shape)
        return dx, dw, dbias, None, None


def linear(inp, weight, bias=None, fp8: Optional[GemmFP8] = None, wgrad_targets=None) -> torch.Tensor:
    """Functional form of `LinearFunction` (inp already in the activation dtype)."""
    return LinearFunction.apply(inp, weight, bias, fp8, wgrad_targets)
