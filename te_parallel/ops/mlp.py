"""fc1 → activation → fc2 as one autograd Function: the activation's FP8 casts fused both ways (delayed
scaling), and the backward's largest tensor made in row chunks (every recipe).

FP8 activation. Under delayed scaling the scales of fc2's input and of fc1's output gradient are
known before the pass, so the activation kernels can emit the FP8 operands themselves:

    forward   h = fc1(x)                        (high precision, fc1's bias in the GEMM)
              a8, a8ᵀ = fp8(act(h))             one pass over h: fc2's input and its wgrad copy
              y = fc2(a8)
    backward  da = fc2 dgrad(dy)                (high precision)
              g8, db1 = fp8(da * act'(h))       one pass over da and h: fc1's dgrad operand + dbias
              dx, dW1 = fc1 backward(g8)        (g8ᵀ for wgrad, see below)

Unfused, act(h) is written in high precision and read again by fc2's cast, and so is the
activation's gradient by fc1's gradient cast: 2 × (write + read) of [tokens, ffn] per step
(docs/fp8.md, "fc1 → activation → fc2 is one autograd Function"), and a [tokens, ffn]
high-precision tensor less in flight.
The FP8 bytes are those of the unfused path (the kernels quantize the rounded high-precision value);
only fc1's bias gradient may differ in its last bits (another fp32 summation order). Current scaling
needs the whole tensor's amax before its cast: forward runs the activation kernel twice over h (its
amax, then its FP8 bytes with the scale that amax gives; act(h) is never written in high precision),
backward makes the activation's gradient in high precision and fc1 casts it. bf16 and calibration run
the unfused math: act(h) in high precision, each GEMM casting (or not) its own operands. Without the
FP8 activation everything is bit-exact with the separate Functions.

Backward in row chunks. fc2's dgrad output `da` is as large as h ([tokens, ffn], high precision).
Made whole, it is live together with h and the activation's gradient, which is the step's peak of
memory. So fc2's wgrad runs first (its operands are freed), then da is made `bwd_chunk_bytes` of rows
at a time (LayerNormMLP's argument), each chunk turned into the activation's gradient rows (FP8, or high precision) before the next
exists. The FP8 gradient's transposed copy (for fc1's wgrad) is made after h is freed, by the
one-pass byte transpose. A high-precision gradient is written into h itself (each element of h is
read once, by the thread that then writes it), unless the graph is kept for another backward. Same bytes as one piece wherever cuBLASLt multiplies a row chunk as it
multiplies those rows of the whole; with the FP8 activation, fc1's bias gradient is summed per chunk
in fp32, then over the chunks.

Each GEMM keeps everything LinearFunction does (TP, SP, comm-GEMM overlap, fused wgrad
accumulation): this Function calls the same linear_fwd / linear_bwd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from te_parallel.fp8.blockwise import BlockwiseTensor
from te_parallel.fp8.gemm_quantizers import Granularity
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import activation as native_act
from te_parallel.ops import activation as _act
from te_parallel.ops.fp8_gemm_config import GemmFP8
from te_parallel.ops.linear import GemmPlan, LinearParallel, keep_graph, linear_bwd, linear_fwd

# The backward makes fc2's dgrad output (the activation's gradient input, [tokens, ffn] in high
# precision) in row chunks of about this many bytes by default, each consumed by the activation's
# backward before the next exists, when there are at least two (docs/fp8.md, "MLP backward in row
# chunks").
DEFAULT_BWD_CHUNK_BYTES = 64 << 20


def can_fuse(name: str, x: torch.Tensor) -> bool:
    """True when LayerNormMLP runs as FusedMLPFunction on input x: always in eager mode; under
    torch.compile when the activation kernels take x's kind (their op is what the traced backward
    calls; the PyTorch fallback differentiates through torch.autograd.grad, which a traced backward
    cannot hold). Otherwise fc1, the activation and fc2 run as separate Functions."""
    return not torch.compiler.is_compiling() or native_act.usable(name, x)


def fp8_activation(fc1: Optional[GemmFP8], fc2: Optional[GemmFP8]) -> bool:
    """True when the activation kernels cast fc2's input and fc1's output gradient themselves: both
    GEMMs in FP8 with per-tensor scales known before the casts (delayed scaling)."""
    return (fc1 is not None and fc2 is not None and fc1.compute and fc2.compute
            and fc1.quantizers.grad.scale_known_before_cast and fc2.quantizers.input.scale_known_before_cast)


def _chunk_rows(h: torch.Tensor, s2, fc2_in: int, chunk_bytes: int) -> Optional[int]:
    """Rows per chunk of fc2's dgrad output, or None for one piece: the fewest chunks of at most about
    chunk_bytes, of equal rows rounded up to a multiple of 128 (the GEMM's tile; 16, the FP8 GEMM's
    multiple, for chunks under 128 rows), so that no chunk is a sliver of a GEMM."""
    rows = h.shape[0]
    # (Not in a torch.compile graph: functionalized, the chunks' writes into the FP8 gradient become a
    # concatenation of FP8 rows, which inductor cannot generate.)
    if s2.par.overlap_dgrad or rows % 16 or torch.compiler.is_compiling():
        return None
    per_row = fc2_in * h.element_size()  # fc2's input features, in the activation dtype
    most = chunk_bytes // per_row
    if most < 16 or most >= rows:
        return None
    chunk = -(-rows // -(-rows // most))  # rows / the number of chunks, rounded up
    align = 128 if chunk >= 128 else 16
    chunk = -(-chunk // align) * align
    return chunk if chunk < rows else None


def _two_pass_fp8(name: str, h: torch.Tensor, fc2: Optional[GemmFP8], fc2_par: LinearParallel) -> bool:
    """fc2 casts its input with one scale computed from the tensor (current scaling) and the kernels can run:
    the activation is computed twice, once for the amax and once straight to FP8, instead of writing act(h) in
    high precision and reading it twice (amax, cast). Not when fc2's input is gathered (fc2 is row-parallel:
    it never is)."""
    if fc2 is None or not fc2.compute or fc2_par.gathers_input:
        return False
    q = fc2.quantizers.input
    return q.granularity is Granularity.TENSOR and q.scale_from_amax and native_act.usable(name, h)


def _act_forward(name: str, h: torch.Tensor) -> torch.Tensor:
    """act(h) [M, cols] in h's dtype, as the unfused path computes it (no autograd record)."""
    if native_act.usable(name, h):
        return native_act.bias_activation_forward(name, h)[0]
    return _act.apply_activation_torch(name, h)


def _dact_into(name: str, da: torch.Tensor, h: torch.Tensor, out: torch.Tensor) -> None:
    """out = da * act'(h) (rows of the activation's gradient, high precision), as the unfused path."""
    if native_act.usable(name, h):
        native_act.dbias_dactivation_backward(name, da.contiguous(), h, None, high_precision=True, dx_out=out)
    else:
        out.copy_(_act.dactivation_torch(name, da, h))


@dataclass(frozen=True, slots=True)
class MLPPlan:
    """How LayerNormMLP's fc1 → activation → fc2 runs in this call: the activation's name, each GEMM's
    GemmPlan, and the rows of the backward's chunks in bytes (LayerNormMLP.bwd_chunk_bytes)."""

    activation: str
    fc1: GemmPlan
    fc2: GemmPlan
    chunk_bytes: int


class FusedMLPFunction(torch.autograd.Function):
    """y = fc2(act(fc1(x))) (+ residual) (see the module doc); inputs as LinearFunction's."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, plan, x_q=None, residual=None, lead=None):
        # plan: an MLPPlan (the activation, each GEMM's GemmPlan, the backward's chunk bytes). x_q: x already cast as
        # fc1's input (LinearFunction's x_q). residual: y's shape, added in fc2's epilogue (only where
        # linear.residual_in_gemm holds for fc2); its gradient is y's. lead: y's leading dims (default:
        # x's), where x is a 2-D carrier of an input of another shape.
        name, plan1, plan2, ctx.chunk_bytes = plan.activation, plan.fc1, plan.fc2, plan.chunk_bytes
        fp8_1, fp8_2, grad = plan1.fp8, plan2.fp8, plan2.grad
        dtype = x.dtype
        acc = None if residual is None else residual.view(-1, w2.shape[0])
        ctx.res_shape = None if residual is None else residual.shape
        h, s1 = linear_fwd(x.reshape(-1, w1.shape[1]), w1, b1, plan1, dtype, x_q)  # [M, fc1 out]
        ctx.fp8_act = fp8_activation(fp8_1, fp8_2)
        if ctx.fp8_act:
            need_wgrad2 = grad and (w2.requires_grad or bool(plan2.targets))
            a8 = fp8_2.cast_activation(name, h, transpose=need_wgrad2)  # fc2's input (+ its transpose)
            y, s2 = linear_fwd(None, w2, b2, plan2, dtype, a8, acc)
        elif _two_pass_fp8(name, h, fp8_2, plan2.par):  # current scaling: amax pass, then the FP8 pass
            need_wgrad2 = grad and (w2.requires_grad or bool(plan2.targets))
            a8 = fp8_2.cast_activation_current(name, h, transpose=need_wgrad2, amax_group=plan2.par.amax_group)
            y, s2 = linear_fwd(None, w2, b2, plan2, dtype, a8, acc)
        else:
            y, s2 = linear_fwd(_act_forward(name, h), w2, b2, plan2, dtype, None, acc)
        ctx.s1, ctx.s2, ctx.name, ctx.fp8_1, ctx.x_shape, ctx.fc2_in = s1, s2, name, fp8_1, x.shape, w2.shape[1]
        ctx.h = h if grad else None
        # A tensor of its own in the input's leading shape, not a view of the 2-D GEMM result: autograd
        # forbids in-place ops on a view made inside a Function, and FSDP2 warns when a wrapped module
        # returns a view (an in-place op on one would lose its pre-backward hook). Nothing else holds y.
        lead = tuple(x.shape[:-1]) if lead is None else tuple(lead)
        return y.reshape(*lead, w2.shape[0]).detach()

    @staticmethod
    def backward(ctx, grad_out):
        # Saved tensors are dropped as soon as they are used (unless the graph is kept): fc2's operands
        # after its wgrad, h after the activation's backward.
        free = not keep_graph()
        s1, s2, name, h = ctx.s1, ctx.s2, ctx.name, ctx.h
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_w1 = need_w1 or bool(s1.targets)
        need_fc1 = need_x or need_w1 or need_b1
        need_dw2, need_db2, need_db1 = need_w2 or bool(s2.targets), s2.has_bias and need_b2, s1.has_bias and need_b1
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(s2.act_dtype)
        chunk = _chunk_rows(h, s2, ctx.fc2_in, ctx.chunk_bytes) if need_fc1 else None
        g = db1 = None  # the activation's gradient (FP8, or high precision); fc1's dbias
        if chunk is None:
            da, dw2, db2 = linear_bwd(s2, dy, need_fc1, need_dw2, need_db2)
            dy = s2 = None  # fc2's saved operands (its input's FP8 transpose, Wᵀ) go before the activation's backward
            if free:
                ctx.s2 = None
            if need_fc1 and ctx.fp8_act:
                g, db1 = ctx.fp8_1.cast_dactivation(name, da, h, transpose=need_w1, need_dbias=need_db1)
            elif need_fc1:
                g = h if free else torch.empty_like(h)  # (in place: each element of h is read once, first)
                _dact_into(name, da, h, g)
            da = None
        else:  # fc2's dgrad output is made and consumed a row chunk at a time
            grad_rows = _ActivationGradRows(ctx, chunk, need_db1, in_place=free)
            _, dw2, db2 = linear_bwd(s2, dy, True, need_dw2, need_db2, dx_rows=(chunk, grad_rows))
        dy = s2 = h = None
        if free:
            ctx.s2 = ctx.h = None
        if chunk is not None:  # h is gone: room for the FP8 gradient's transposed copy
            g, db1 = grad_rows.result(transpose=need_w1, dbias_dtype=s1.act_dtype)
            grad_rows = None
        dx = dw1 = None
        if need_fc1:
            g, db1 = _fc1_operand(ctx, s1, g, db1, need_w1, need_db1)  # (a high-precision g is freed here)
            if isinstance(g, (Float8Tensor, BlockwiseTensor)):
                dx, dw1, db1 = linear_bwd(s1, None, need_x, need_w1, db1 is not None, dy_q=g, dbias=db1)
            else:
                dx, dw1, db1 = linear_bwd(s1, g, need_x, need_w1, need_db1)
        g = None
        if free:
            ctx.s1 = None
        dx = None if dx is None else dx.reshape(ctx.x_shape)
        needs = ctx.needs_input_grad  # (the residual is the eighth input, where apply() was given one)
        dres = grad_out.reshape(ctx.res_shape) if len(needs) > 7 and needs[7] else None
        return dx, dw1, db1, dw2, db2, None, None, dres, None


class _ActivationGradRows:
    """linear_bwd's dx_rows consumer: turns each row chunk of fc2's dgrad output `da` into those rows of
    the activation's gradient da·act'(h). FP8 bytes with the FP8 activation (fc1's dbias summed per
    chunk in fp32), else high precision. When `in_place` (the graph is not kept) the gradient is written
    into h's own memory, whose rows are consumed chunk by chunk (_spent_h_bytes); otherwise it is
    allocated at the first chunk, after fc2's wgrad has released its operands."""

    def __init__(self, ctx, chunk: int, need_dbias: bool, in_place: bool):
        self.name, self.h, self.fp8_1, self.fp8_act = ctx.name, ctx.h, ctx.fp8_1, ctx.fp8_act
        self.chunk, self.need_dbias, self.in_place = chunk, need_dbias, in_place
        self.g = self.parts = self.first = self.spent = None

    def __call__(self, r0: int, da_rows: torch.Tensor) -> None:
        h, r1 = self.h, r0 + da_rows.shape[0]
        if self.g is None:
            self._allocate(h)
        if self.first is not None and r0 > 0:  # chunk 0's bytes go to their place, now spent
            self.g[: self.first.shape[0]].copy_(self.first)
            self.first = None
        if self.fp8_act:
            out = self.g[r0:r1]
            if self.spent is not None and r0 == 0:
                out = self.first = torch.empty_like(out)
            self.fp8_1.cast_dactivation_rows(self.name, da_rows, h[r0:r1], out,
                                             None if self.parts is None else self.parts[r0 // self.chunk])
        else:
            _dact_into(self.name, da_rows, h[r0:r1], self.g[r0:r1])

    def _allocate(self, h: torch.Tensor) -> None:
        if not self.fp8_act:
            self.g = h if self.in_place else torch.empty_like(h)
            return
        dtype = self.fp8_1.quantizers.grad.fp8_dtype
        self.spent = _spent_h_bytes(h, dtype) if self.in_place else None
        if self.spent is None:
            self.g = torch.empty(h.shape, dtype=dtype, device=h.device)
        else:  # rows [0, n) of the FP8 gradient over the first bytes of h
            self.g = self.spent[: h.numel()].view(h.shape)
        if self.need_dbias:
            self.parts = h.new_empty((-(-h.shape[0] // self.chunk), h.shape[1]), dtype=torch.float32)

    def result(self, transpose: bool, dbias_dtype: torch.dtype):
        """(the whole gradient, fc1's dbias or None), releasing h: the FP8 one as a Float8Tensor with its
        transposed copy when fc1's wgrad needs it, made now by the byte transpose; or, when the gradient
        lives in h's memory, by fc1's backward after its dgrad, which then drops the row-major bytes and
        with them h's memory before wgrad allocates dW (ops/linear.py, _release_dgrad_operands)."""
        if self.first is not None:
            self.g[: self.first.shape[0]].copy_(self.first)
        g, in_h = self.g, self.spent is not None
        self.g = self.h = self.first = self.spent = None
        if not self.fp8_act:
            return g, None
        g = self.fp8_1.dactivation_fp8(g)
        if transpose and not in_h:
            g.transposed()
        return g, None if self.parts is None else self.parts.sum(0).to(dbias_dtype)


def _spent_h_bytes(h: torch.Tensor, fp8_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """h's memory as a flat FP8 tensor, for the FP8 gradient to be written over h as its rows are
    consumed; None where h does not own all of its memory or is not at least 2 bytes per element.
    Chunk k ≥ 1 (rows [r0, r1), r0 ≥ the chunk) writes gradient bytes [r0·n, r1·n) (n
    columns), which hold h's rows below r1/2 ≤ r0: rows already consumed; chunk 0's bytes would overlap
    the rows it reads, so they go to a chunk-sized buffer and move into place when chunk 1 starts. This
    saves the [tokens, ffn] FP8 gradient's allocation while h is still live, the MLP backward's memory
    peak."""
    storage = h.untyped_storage()
    if (h.element_size() < 2 or not h.is_contiguous() or h.storage_offset() != 0
            or storage.nbytes() != h.numel() * h.element_size()):
        return None
    return torch.empty(0, dtype=fp8_dtype, device=h.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _fc1_operand(ctx, s1, g, db1, need_w1: bool, need_db1: bool):
    """(fc1's output gradient as its GEMMs take it, its dbias or None). The FP8 activation's is ready.
    Under FP8 without it, the high-precision g is cast here, as linear_bwd would cast it (fc1 is
    column-parallel: its output gradient is never gathered), so that the caller's g is freed before
    fc1's GEMMs. In high precision (or calibration) g goes to linear_bwd as it is."""
    if ctx.fp8_act or ctx.fp8_1 is None or not ctx.fp8_1.compute:
        return g, db1
    db1 = g.new_empty(g.shape[1]) if need_db1 else None
    return ctx.fp8_1.cast_grad(g, transpose=need_w1, amax_group=s1.par.amax_group, dbias_out=db1), db1
