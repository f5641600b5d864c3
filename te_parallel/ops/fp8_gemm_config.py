"""GemmFP8: how one GEMM of a module quantizes its operands in this pass.

The module builds one per GEMM call from the innermost `fp8_autocast` region: the recipe's quantizers
(te_parallel.fp8.gemm_quantizers, one per operand kind) and the per-call state they read. The autograd
Function only asks it to cast (`cast_input`, `cast_grad`, `quantize_weight`); each cast is its operand's
quantizer's, and nothing here asks which recipe made them. It holds no reference to the autocast
machinery: the module hands it `backward_done`, the callback that schedules the backward scale update
once a backward cast has recorded its amax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from te_parallel.fp8.gemm_quantizers import GemmQuantizers
from te_parallel.fp8.gemm_quantizers import reduce_amax as _reduce_amax
from te_parallel.fp8.scaling import current_scale
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.native import activation as native_act
from te_parallel.native import torch_ops as native_ops
from te_parallel.ops import activation as _act
from te_parallel.recipe import Recipe, fp8_max


@dataclass(slots=True)
class GemmFP8:
    recipe: Recipe                      # its formats and each GEMM's MMParams
    quantizers: GemmQuantizers          # the recipe's quantizer of each operand kind
    state: FP8ScalingState              # the module's scaling state (read by quantizers with has_state)
    gemm: int                           # index of this GEMM among the module's GEMMs
    weight: Optional[Float8Tensor]      # the quantized weight (None while only calibrating)
    compute: bool                       # False: calibrating, record amaxes but multiply in high precision
    group: Optional[dist.ProcessGroup]  # amaxes are all-reduced over it
    fwd_scale: Optional[torch.Tensor] = None  # recompute: the forward scales of the original pass
    record: bool = True                 # recompute: amaxes were recorded by the original pass
    # The high-precision weight that `weight` was cast from, when the module does not keep `weight`
    # after this forward: backward then re-encodes Wᵀ from it (weight_for_backward).
    weight_src: Optional[torch.Tensor] = None
    # Quantizers with state: called after each backward cast (the backward scales are updated when the
    # backward pass ends; te_parallel.fp8.autocast.record_backward bound to this GEMM's state).
    backward_done: Optional[Callable[[], None]] = None

    @property
    def tiled(self) -> bool:
        """The input and gradient have scales per tile (not per tensor): a shard is cast before a gather
        only where its tiles are the gathered tensor's, and the columnwise direction a GEMM over rows reads
        comes from the cast itself (tiles along the other dim), not from transposing bytes."""
        return not self.quantizers.per_tensor

    def cast_activation(self, name: str, h: torch.Tensor, transpose: bool) -> Float8Tensor:
        """act(h) (fc1's output h [M, cols]) cast as this GEMM's input in the activation's own pass (an input
        quantizer whose scale is known before the cast)."""
        q = self.quantizers.input
        scale, amax_out = q.scale_cell(self)
        return _act.bias_activation_fp8(name, h, None, scale, q.fp8_dtype, amax_out=amax_out, transpose=transpose)

    def cast_activation_current(self, name: str, h: torch.Tensor, transpose: bool, amax_group=None) -> Float8Tensor:
        """act(h) cast as this GEMM's per-tensor input whose scale comes from the tensor (current scaling), in
        two passes of the activation kernel over h: the amax (all-reduced over amax_group, as cast_input
        does), then the FP8 bytes with the scale it gives. The bytes of the input quantizer's cast of act(h):
        both passes quantize the rounded high-precision value."""
        dtype = self.quantizers.input.fp8_dtype
        amax = torch.zeros(1, dtype=torch.float32, device=h.device)
        native_act.bias_activation_forward(name, h, None, high_precision=False, amax_out=amax)
        scale = current_scale(_reduce_amax(amax, amax_group).view(()), fp8_max(dtype))
        return _act.bias_activation_fp8(name, h, None, scale, dtype, transpose=transpose)

    def cast_dactivation(self, name: str, dact: torch.Tensor, h: torch.Tensor, transpose: bool, need_dbias: bool):
        """(FP8 dy, dbias or None) of this GEMM (fc1) from the activation's backward at h, given the
        gradient `dact` of the activation's output: dy = dact * act'(h), cast as this GEMM's output
        gradient in the same pass (a gradient quantizer whose scale is known before the cast)."""
        q = self.quantizers.grad
        scale, amax_out = q.scale_cell(self)
        out = _act.dbias_dactivation_fp8(name, dact, h, None, scale, q.fp8_dtype, amax_out=amax_out,
                                         transpose=transpose, need_dbias=need_dbias)
        self.on_backward()
        return out

    def cast_dactivation_rows(self, name: str, dact: torch.Tensor, h: torch.Tensor, out: torch.Tensor,
                              dbias_out: Optional[torch.Tensor]) -> None:
        """cast_dactivation of some rows of h (a backward done in row chunks): the FP8 bytes go into
        `out` (those rows of the whole FP8 gradient, no transpose) and the rows' bias-gradient sums into
        dbias_out (fp32) when given. The whole gradient's Float8Tensor is `dactivation_fp8(bytes)`."""
        q = self.quantizers.grad
        scale, amax_out = q.scale_cell(self)
        _act.dbias_dactivation_fp8(name, dact, h, None, scale, q.fp8_dtype, amax_out=amax_out, transpose=False,
                                   need_dbias=dbias_out is not None, fp8_out=out, dbias_out=dbias_out)
        self.on_backward()

    def dactivation_fp8(self, data: torch.Tensor) -> Float8Tensor:
        """The Float8Tensor of FP8 bytes written by cast_dactivation_rows (scale_inv = 1 / its scale)."""
        scale = self.quantizers.grad.scale_cell(self)[0]
        return Float8Tensor(data, torch.reciprocal(scale.detach().reshape(())))

    def quantize_weight(self, w: torch.Tensor, amax_group=None):
        """The weight W [N, K] (a shard under TP) as the weight quantizer casts it, a per-tensor one with a
        snapshot of its scale; Wᵀ is made when dgrad needs it."""
        return self.quantizers.weight.quantize(w, self, amax_group=amax_group, keep_scale=True)

    def weight_for_backward(self):
        """What dgrad will need of this GEMM's FP8 weight, called once its forward GEMM has run: the
        FP8 W itself while the module keeps it anyway (its cache), else a source that re-encodes
        Wᵀ from the high-precision weight (the weight quantizer's backward_source). This plan forgets W
        either way, so an uncached W is freed with the forward instead of living until backward
        (docs/fp8.md, "FP8 weights are not kept from forward to backward")."""
        w, self.weight = self.weight, None
        return self.quantizers.weight.backward_source(w, self.weight_src)

    def record_weight_amax(self, w: torch.Tensor) -> None:
        self.quantizers.weight.record_amax(w, self)

    def input_scale(self):
        """(scale, amax cell or None) of this GEMM's input where its scale is known before the cast
        (quantizers.input.scale_known_before_cast), for a producer that casts the input in its own pass (the
        norm before a LayerNormLinear's GEMM)."""
        return self.quantizers.input.scale_cell(self)

    def cast_input(self, x: torch.Tensor, transpose: bool, amax_group=None):
        return self.quantizers.input.quantize(x, self, transpose, amax_group)

    def fused_fprop(self, x: torch.Tensor, bias: Optional[torch.Tensor], transpose: bool):
        """(y, x as cast) of y = x·Wᵀ (+ bias) with x cast as this GEMM's input, in one native call
        (te_parallel::linear_fp8_fwd) where it takes the case; None where it does not. One rank's operands
        only: a current-scaling cast whose amax is reduced across ranks takes cast_input."""
        w, mm = self.weight, self.recipe.fp8_gemm_fprop
        if (not self.quantizers.native_fprop or mm.backend != "native" or type(w) is not Float8Tensor
                or not native_ops.linear_usable(x, w.data, bias)):
            return None
        y, data, data_t, scale_inv = self.linear_op(x, bias, transpose)
        return y, Float8Tensor(data, scale_inv, data_t if transpose else None)

    def linear_op(self, x: torch.Tensor, bias: Optional[torch.Tensor], transpose: bool):
        """te_parallel::linear_fp8_fwd of x [M, K] with this GEMM's per-tensor input scale (None: the op
        computes fp8_max / amax(x), the input quantizer's scale_from_amax), weight and fprop accumulation, for
        a caller that has checked that the op takes them (quantizers.native_fprop and the operands): (y [M, N],
        x data, x data_t or [0, M], x scale_inv)."""
        q, w = self.quantizers.input, self.weight
        scale, amax = q.scale_cell(self) if q.scale_known_before_cast else (None, None)
        return native_ops.linear_fp8_fwd(x, scale, amax, q.fp8_dtype, transpose, w.data, w.scale_inv,
                                         bias, not self.recipe.fp8_gemm_fprop.use_split_accumulator)

    def cast_grad(self, dy: torch.Tensor, transpose: bool, amax_group=None, dbias_out=None):
        q = self.quantizers.grad.quantize(dy, self, transpose, amax_group, dbias_out)
        self.on_backward()
        return q

    def record_amax(self, x: torch.Tensor, backward: bool) -> None:
        """Calibration: record the amax the input (or gradient) cast would have recorded."""
        (self.quantizers.grad if backward else self.quantizers.input).record_amax(x, self)
        if backward:
            self.on_backward()

    def on_backward(self) -> None:
        if self.backward_done is not None:
            self.backward_done()
