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

Backward in row chunks: fc2's dgrad output `da` is as large as h ([tokens, ffn], high precision).
Made whole, it is live together with h and fc1's FP8 gradient, which is the step's peak of memory. So
fc2's wgrad runs first (its operands are freed), then da is made BWD_CHUNK_BYTES of rows at a time,
each chunk turned into FP8 gradient rows by the activation's kernel before the next chunk exists; the
gradient's transposed copy (for fc1's wgrad) is made after h is freed, by the one-pass byte transpose.
Same bytes as one piece where cuBLASLt multiplies a row chunk as it multiplies those rows of the whole;
fc1's bias gradient is summed per chunk in fp32, then over the chunks.

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


# The fused backward makes fc2's dgrad output (the activation's gradient, [tokens, ffn] in high
# precision) in row chunks of about this many bytes, each consumed by the activation's backward before
# the next exists, when there are at least two (docs/design-notes.md, "MLP backward in row chunks").
BWD_CHUNK_BYTES = 64 << 20


def _chunk_rows(h: torch.Tensor, s2) -> Optional[int]:
    """Rows per chunk of fc2's dgrad output (a multiple of 16, the FP8 GEMM's), or None for one piece."""
    if s2.par.overlap_dgrad or h.shape[0] % 16:
        return None
    per_row = s2.w_saved.shape[1] * h.element_size()  # fc2's input features, in the activation dtype
    chunk = BWD_CHUNK_BYTES // per_row // 16 * 16
    return chunk if 16 <= chunk < h.shape[0] else None


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
        need_dw2, need_db2, need_db1 = need_w2 or bool(s2.targets), s2.has_bias and need_b2, s1.has_bias and need_b1
        chunk = _chunk_rows(ctx.h, s2) if need_fc1 else None
        if chunk is None:
            da, dw2, db2 = linear_bwd(s2, dy, need_fc1, need_dw2, need_db2)
        else:  # fc2's dgrad output is made and consumed by the activation's backward a row chunk at a time
            fp8_1, h, name = ctx.fp8_1, ctx.h, ctx.name
            g8_bytes = torch.empty(h.shape, dtype=fp8_1.recipe.fp8_format.bwd_dtype, device=h.device)
            parts = h.new_empty((-(-h.shape[0] // chunk), h.shape[1]), dtype=torch.float32) if need_db1 else None

            def dact_rows(r0, da_rows):
                r1 = r0 + da_rows.shape[0]
                fp8_1.cast_dactivation_rows(name, da_rows, h[r0:r1], g8_bytes[r0:r1],
                                            None if parts is None else parts[r0 // chunk])

            _, dw2, db2 = linear_bwd(s2, dy, True, need_dw2, need_db2, dx_rows=(chunk, dact_rows))
            del h, dact_rows
        del dy, s2
        if free:
            ctx.s2 = None
        dx = dw1 = db1 = None
        if need_fc1:
            if chunk is None:
                g8, db1 = ctx.fp8_1.cast_dactivation(ctx.name, da, ctx.h, transpose=need_w1, need_dbias=need_db1)
                del da
            if free:
                ctx.h = None
            if chunk is not None:  # h is gone: room for the transposed copy wgrad needs
                g8 = ctx.fp8_1.dactivation_fp8(g8_bytes)
                del g8_bytes
                if need_w1:
                    g8.transposed()
                db1 = None if parts is None else parts.sum(0).to(s1.act_dtype)
            dx, dw1, db1 = linear_bwd(s1, None, need_x, need_w1, db1 is not None, dy_q=g8, dbias=db1)
        if free:
            ctx.s1 = ctx.h = None
        dx = None if dx is None else dx.reshape(ctx.x_shape)
        return dx, dw1, db1, dw2, db2, None
