"""fc1 → activation → fc2 as one autograd Function, with the activation's FP8 output fused both ways.

Under delayed scaling the scales of fc2's input and of fc1's output gradient are known before the
pass, so the activation kernels can emit the FP8 operands themselves:

    forward   h = fc1(x)                        (high precision, fc1's bias in the GEMM)
              a8, a8ᵀ = fp8(act(h))             one pass over h: fc2's input and its wgrad copy
              y = fc2(a8)
    backward  da = fc2 dgrad(dy)                (high precision)
              g8, g8ᵀ, db1 = fp8(da * act'(h))  one pass over da and h: fc1's dgrad/wgrad operands + dbias
              dx, dW1 = fc1 backward(g8)

Unfused, act(h) is written in high precision and read again by fc2's cast, and so is the
activation's gradient by fc1's gradient cast: 2 × (write + read) of [tokens, ffn] per step
(docs/benchmarks.md, "redundant passes"), and a [tokens, ffn] high-precision tensor less in flight.
The FP8 bytes are those of the unfused path (the kernels quantize the rounded high-precision value);
only fc1's bias gradient may differ in its last bits (another fp32 summation order).

Each GEMM keeps everything LinearFunction does (TP, SP, comm-GEMM overlap, fused wgrad
accumulation): this Function calls the same linear_fwd / linear_bwd.
"""
from __future__ import annotations

from typing import Optional

import torch

from te_parallel.ops.fp8_gemm_config import GemmFP8
from te_parallel.ops.linear import LinearParallel, keep_graph, linear_bwd, linear_fwd


def can_fuse(fc1: Optional[GemmFP8], fc2: Optional[GemmFP8], fc1_par: LinearParallel) -> bool:
    """True when both GEMMs run in FP8 under delayed scaling (fc1's output gradient is not gathered)."""
    return (fc1 is not None and fc2 is not None and fc1.compute and fc2.compute and fc1.delayed and fc2.delayed
            and not fc1_par.gathers_grad and not torch.compiler.is_compiling())


class FusedMLPFunction(torch.autograd.Function):
    """y = fc2(act(fc1(x))) with FP8 activation casts (see the module doc); inputs as LinearFunction's."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan):
        # plan: (activation name, fc1 plan, fc2 plan); a GEMM plan is LinearFunction's
        # (GemmFP8, wgrad targets, LinearParallel, grad mode)
        name, plan1, plan2 = plan
        fp8_1, fp8_2, grad = plan1[0], plan2[0], plan2[3]
        dtype = x.dtype
        h, s1 = linear_fwd(x.reshape(-1, w1.shape[1]), w1, b1, plan1, dtype)  # [M, fc1 out]
        need_wgrad2 = grad and (w2.requires_grad or bool(plan2[1]))
        a8 = fp8_2.cast_activation(name, h, transpose=need_wgrad2)  # fc2's input (+ its transpose)
        y, s2 = linear_fwd(None, w2, b2, plan2, dtype, x_q=a8)
        ctx.s1, ctx.s2, ctx.name, ctx.fp8_1, ctx.x_shape = s1, s2, name, fp8_1, x.shape
        ctx.h = h if grad else None
        return y.reshape(-1, *x.shape[1:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        # Saved tensors are dropped as soon as they are used (unless the graph is kept): fc2's operands
        # after its backward, h and fc2's dgrad output after the activation's backward.
        free = not keep_graph()
        s1, s2 = ctx.s1, ctx.s2
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_w1 = need_w1 or bool(s1.targets)
        need_fc1 = need_x or need_w1 or need_b1
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(s2.act_dtype)
        da, dw2, db2 = linear_bwd(s2, dy, need_fc1, need_w2 or bool(s2.targets), s2.has_bias and need_b2)
        del dy, s2
        if free:
            ctx.s2 = None
        dx = dw1 = db1 = None
        if need_fc1:
            g8, db1 = ctx.fp8_1.cast_dactivation(ctx.name, da, ctx.h, transpose=need_w1,
                                                 need_dbias=s1.has_bias and need_b1)
            del da
            if free:
                ctx.h = None
            dx, dw1, db1 = linear_bwd(s1, None, need_x, need_w1, db1 is not None, dy_q=g8, dbias=db1)
        if free:
            ctx.s1 = ctx.h = None
        dx = None if dx is None else dx.reshape(ctx.x_shape)
        return dx, dw1, db1, dw2, db2, None
