"""GemmFP8: how one GEMM of a module quantizes its operands in this pass.

The module builds one per GEMM call from the innermost `fp8_autocast` region; the autograd
Function only asks it to cast (`cast_input`, `cast_grad`) and never looks at recipes itself. It holds
no reference to the autocast machinery: the module hands it `backward_done`, the callback that
schedules the backward scale update once a backward cast has recorded its amax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BlockwiseTensor, quantize_blockwise
from te_parallel.fp8.scaling import current_scale
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import activation as native_act
from te_parallel.native import torch_ops as native_ops
from te_parallel.ops import activation as _act
from te_parallel.ops.cast import amax_of, quantize, quantize_current
from te_parallel.recipe import Recipe, fp8_max
from te_parallel.parallel.groups import group_size


@dataclass(slots=True)
class GemmFP8:
    recipe: Recipe
    state: FP8ScalingState
    gemm: int                           # index of this GEMM among the module's GEMMs
    weight: Optional[Float8Tensor]      # the quantized weight (None while only calibrating)
    compute: bool                       # False: calibrating, record amaxes but multiply in high precision
    group: Optional[dist.ProcessGroup]  # amaxes are all-reduced over it
    fwd_scale: Optional[torch.Tensor] = None  # recompute: the forward scales of the original pass
    record: bool = True                 # recompute: amaxes were recorded by the original pass
    # The high-precision weight that `weight` was cast from, when the module does not keep `weight`
    # after this forward: backward then re-encodes Wᵀ from it (weight_for_backward).
    weight_src: Optional[torch.Tensor] = None
    # Delayed scaling: called after each backward cast (the backward scales are updated when the
    # backward pass ends; te_parallel.fp8.autocast.record_backward bound to this GEMM's state).
    backward_done: Optional[Callable[[], None]] = None

    @property
    def delayed(self) -> bool:
        return self.recipe.scaling == "delayed"

    @property
    def block(self) -> bool:
        return self.recipe.scaling == "block"

    def _cast_block(self, x: torch.Tensor, role: str, dtype: torch.dtype, columnwise: bool, dbias_out=None):
        """Block scaling: x quantized in its role's tiles ("x", "w", "grad"), with the columnwise direction
        when a GEMM over its rows needs it (wgrad's x and dy; a 1x128-tiled weight's dgrad). dbias_out: the
        column sums of x, as the per-tensor casts fuse them."""
        recipe = self.recipe
        dim, qp = recipe.block_dim(role), recipe.qparams(role)
        if dbias_out is not None:
            dbias_out.copy_(x.sum(0, dtype=torch.float32))
        return quantize_blockwise(x, dtype, dim, rowwise=True, columnwise=columnwise or (role == "w" and dim == 1),
                                  pow2=qp.power_2_scale, eps=qp.amax_epsilon)

    def _slot(self, backward: bool) -> int:
        return self.gemm if backward else FP8ScalingState.input_slot(self.gemm)

    def _cast(self, x: torch.Tensor, slot: int, backward: bool, transpose: bool, amax_group=None,
              dbias_out=None, keep_scale: bool = False) -> Float8Tensor:
        """amax_group: for current scaling of a tensor that will be gathered, the ranks whose amaxes
        are all-reduced first so that every shard is encoded with the same scale. dbias_out: receives
        the column sums of x (see quantize)."""
        fmt = self.recipe.fp8_format
        dtype = fmt.bwd_dtype if backward else fmt.fwd_dtype
        if self.block:
            return self._cast_block(x, "grad" if backward else "x", dtype, transpose, dbias_out)
        if not self.delayed:
            amax = _reduce_amax(amax_of(x), amax_group) if _spans_ranks(amax_group) else None
            return quantize_current(x, dtype, amax=amax, transpose=transpose, dbias_out=dbias_out,
                                    keep_scale=keep_scale)
        scale, amax_out = self._delayed_scale(slot, backward)
        return quantize(x, scale, dtype, amax_out=amax_out, transpose=transpose, dbias_out=dbias_out,
                        keep_scale=keep_scale)

    def _delayed_scale(self, slot: int, backward: bool):
        """(scale, amax cell or None) of a delayed-scaling cast into `slot`."""
        scale, cell = self.state.slot_views(backward, slot)
        if self.fwd_scale is not None and not backward:
            scale = self.fwd_scale[slot]
        return scale, cell if (self.record or backward) else None

    def cast_activation(self, name: str, h: torch.Tensor, transpose: bool) -> Float8Tensor:
        """act(h) (fc1's output h [M, cols]) cast as this GEMM's input in the activation's own pass
        (delayed scaling only: the scale is known before the pass)."""
        scale, amax_out = self._delayed_scale(self._slot(False), False)
        return _act.bias_activation_fp8(name, h, None, scale, self.recipe.fp8_format.fwd_dtype, amax_out=amax_out,
                                        transpose=transpose)

    def cast_activation_current(self, name: str, h: torch.Tensor, transpose: bool, amax_group=None) -> Float8Tensor:
        """act(h) cast as this GEMM's input under current scaling, in two passes of the activation
        kernel over h: the amax (all-reduced over amax_group, as cast_input does), then the FP8 bytes
        with the scale it gives. The bytes of quantize_current(act(h)): both passes quantize the
        rounded high-precision value."""
        dtype = self.recipe.fp8_format.fwd_dtype
        amax = torch.zeros(1, dtype=torch.float32, device=h.device)
        native_act.bias_activation_forward(name, h, None, high_precision=False, amax_out=amax)
        scale = current_scale(_reduce_amax(amax, amax_group).view(()), fp8_max(dtype))
        return _act.bias_activation_fp8(name, h, None, scale, dtype, transpose=transpose)

    def cast_dactivation(self, name: str, dact: torch.Tensor, h: torch.Tensor, transpose: bool, need_dbias: bool):
        """(FP8 dy, dbias or None) of this GEMM (fc1) from the activation's backward at h, given the
        gradient `dact` of the activation's output: dy = dact * act'(h), cast as this GEMM's output
        gradient in the same pass (delayed scaling only)."""
        scale, amax_out = self._delayed_scale(self._slot(True), True)
        q, dbias = _act.dbias_dactivation_fp8(name, dact, h, None, scale, self.recipe.fp8_format.bwd_dtype,
                                              amax_out=amax_out, transpose=transpose, need_dbias=need_dbias)
        self.on_backward()
        return q, dbias

    def cast_dactivation_rows(self, name: str, dact: torch.Tensor, h: torch.Tensor, out: torch.Tensor,
                              dbias_out: Optional[torch.Tensor]) -> None:
        """cast_dactivation of some rows of h (a backward done in row chunks): the FP8 bytes go into
        `out` (those rows of the whole FP8 gradient, no transpose) and the rows' bias-gradient sums into
        dbias_out (fp32) when given. The whole gradient's Float8Tensor is `dactivation_fp8(bytes)`."""
        scale, amax_out = self._delayed_scale(self._slot(True), True)
        _act.dbias_dactivation_fp8(name, dact, h, None, scale, self.recipe.fp8_format.bwd_dtype, amax_out=amax_out,
                                   transpose=False, need_dbias=dbias_out is not None, fp8_out=out,
                                   dbias_out=dbias_out)
        self.on_backward()

    def dactivation_fp8(self, data: torch.Tensor) -> Float8Tensor:
        """The Float8Tensor of FP8 bytes written by cast_dactivation_rows (scale_inv = 1 / its scale)."""
        scale = self._delayed_scale(self._slot(True), True)[0]
        return Float8Tensor(data, torch.reciprocal(scale.detach().reshape(())))

    def quantize_weight(self, w: torch.Tensor, amax_group=None) -> Float8Tensor:
        """The weight W [N, K] (a shard under TP), with a snapshot of its scale; its transpose is made
        when dgrad needs it."""
        if self.block:  # (each block's scale is its own: no amax to agree on across ranks)
            return self._cast_block(w, "w", self.recipe.fp8_format.fwd_dtype, False)
        slot = FP8ScalingState.weight_slot(self.gemm)
        return self._cast(w, slot, backward=False, transpose=False, amax_group=amax_group, keep_scale=True)

    def weight_for_backward(self):
        """What dgrad will need of this GEMM's FP8 weight, called once its forward GEMM has run: the
        FP8 W itself while the module keeps it anyway (its cache), else a WeightSource that re-encodes
        Wᵀ from the high-precision weight. This plan forgets W either way, so an uncached W is freed
        with the forward instead of living until backward (docs/fp8.md, "FP8 weights are not kept
        from forward to backward")."""
        w, self.weight = self.weight, None
        if self.block and self.weight_src is not None and w.data_t is None:
            return BlockWeightSource(self.weight_src, w, self.recipe)
        if self.block or self.weight_src is None or w.scale is None:
            return w
        return WeightSource(self.weight_src, w.scale, w.scale_inv, w.fp8_dtype)

    def record_weight_amax(self, w: torch.Tensor) -> None:
        self._record(w, FP8ScalingState.weight_slot(self.gemm), backward=False)

    def input_scale(self):
        """(scale, amax cell or None) of this GEMM's input under delayed scaling, for a producer that casts
        the input in its own pass (the norm before a LayerNormLinear's GEMM)."""
        return self._delayed_scale(self._slot(False), False)

    def cast_input(self, x: torch.Tensor, transpose: bool, amax_group=None) -> Float8Tensor:
        return self._cast(x, self._slot(False), backward=False, transpose=transpose, amax_group=amax_group)

    def fused_fprop(self, x: torch.Tensor, bias: Optional[torch.Tensor], transpose: bool):
        """(y, x as cast) of y = x·Wᵀ (+ bias) with x cast as this GEMM's input, in one native call
        (te_parallel::linear_fp8_fwd) where it takes the case; None where it does not. One rank's operands
        only: a current-scaling cast whose amax is reduced across ranks takes cast_input."""
        w, mm = self.weight, self.recipe.fp8_gemm_fprop
        if mm.backend != "native" or type(w) is not Float8Tensor or not native_ops.linear_usable(x, w.data, bias):
            return None
        y, data, data_t, scale_inv = self.linear_op(x, bias, transpose)
        return y, Float8Tensor(data, scale_inv, data_t if transpose else None)

    def linear_op(self, x: torch.Tensor, bias: Optional[torch.Tensor], transpose: bool):
        """te_parallel::linear_fp8_fwd of x [M, K] with this GEMM's input scale (or current scaling), weight and
        fprop accumulation, for a caller that has checked that the op takes them: (y [M, N], x data, x data_t
        or [0, M], x scale_inv)."""
        recipe, w = self.recipe, self.weight
        scale, amax = self._delayed_scale(self._slot(False), False) if recipe.delayed() else (None, None)
        return native_ops.linear_fp8_fwd(x, scale, amax, recipe.fp8_format.fwd_dtype, transpose, w.data, w.scale_inv,
                                         bias, not recipe.fp8_gemm_fprop.use_split_accumulator)

    def cast_grad(self, dy: torch.Tensor, transpose: bool, amax_group=None, dbias_out=None) -> Float8Tensor:
        q = self._cast(dy, self._slot(True), backward=True, transpose=transpose, amax_group=amax_group,
                       dbias_out=dbias_out)
        self.on_backward()
        return q

    def record_amax(self, x: torch.Tensor, backward: bool) -> None:
        """Calibration: record the amax the input (or gradient) cast would have recorded."""
        self._record(x, self._slot(backward), backward)
        if backward:
            self.on_backward()

    def _record(self, x: torch.Tensor, slot: int, backward: bool) -> None:
        if self.delayed and (self.record or backward):
            cell = self.state.slot_views(backward, slot)[1]
            torch.maximum(cell, amax_of(x).view(1), out=cell)

    def on_backward(self) -> None:
        if self.backward_done is not None:
            self.backward_done()


def _spans_ranks(group) -> bool:
    return group_size(group) > 1


def _reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """Current scaling of an operand of a split GEMM: the max over the group's ranks (in place), so that
    every rank encodes with the same scale."""
    if _spans_ranks(group):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


class WeightSource:
    """Backward's handle on an FP8 weight that was not kept after forward.

    `with_transpose()` casts the high-precision weight again with the scale snapshot of the forward's
    cast: the bytes are those of the forward's W, transposed (the cast is a pure function of source and
    scale), written straight into the [K, N] layout dgrad reads. Costs one more read of the
    high-precision weight in backward; saves holding every FP8 weight from forward to backward.
    """

    __slots__ = ("weight", "scale", "scale_inv", "fp8_dtype", "version")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype):
        self.weight, self.scale, self.scale_inv, self.fp8_dtype = weight, scale, scale_inv, fp8_dtype
        self.version = weight._version

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def with_transpose(self) -> Float8Tensor:
        # (a version counter is not traceable: under torch.compile the check is eager's alone)
        if not torch.compiler.is_compiling() and self.weight._version != self.version:
            raise RuntimeError(
                f"an FP8 weight of shape {tuple(self.weight.shape)} was modified in place between forward and "
                f"backward (version {self.version} -> {self.weight._version}); update weights after backward")
        q = quantize(self.weight.detach(), self.scale, self.fp8_dtype, transpose=True, rowwise=False)
        return Float8Tensor(q.data, self.scale_inv, q.data_t)


class BlockWeightSource:
    """Backward's handle on a block-scaled FP8 weight that was not kept after forward: `with_transpose()`
    quantizes the high-precision weight again, columnwise only. Block scales are a pure function of the
    values, so the bytes are those of the forward's W, transposed (128x128 blocks) or tiled along the other
    dim (1x128), written straight into the [K, N] layout dgrad reads."""

    __slots__ = ("weight", "recipe", "version", "shape", "fp8_dtype")

    def __init__(self, weight: torch.Tensor, w: BlockwiseTensor, recipe) -> None:
        self.weight, self.recipe, self.version = weight, recipe, weight._version
        self.shape, self.fp8_dtype = w.shape, w.fp8_dtype

    def with_transpose(self) -> BlockwiseTensor:
        if not torch.compiler.is_compiling() and self.weight._version != self.version:
            raise RuntimeError(
                f"an FP8 weight of shape {tuple(self.weight.shape)} was modified in place between forward and "
                f"backward (version {self.version} -> {self.weight._version}); update weights after backward")
        qp = self.recipe.qparams("w")
        return quantize_blockwise(self.weight.detach(), self.fp8_dtype, self.recipe.block_dim("w"), rowwise=False,
                                  columnwise=True, pow2=qp.power_2_scale, eps=qp.amax_epsilon)
