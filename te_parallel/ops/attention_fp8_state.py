"""FP8 attention's scaling state and scale bookkeeping: which scale each FP8 tensor is cast with, where its amax
is recorded, and which update rule fp8_autocast applies afterwards.

The state (`AttentionScalingState`, a DotProductAttention's `fp8_attention_state`) is an FP8ScalingState of
NUM_GEMMS = 5: forward slots Q, K, V, O (of 10; the rest stay at scale 1) and backward slots dO, dP, dQ, dK,
dV. The layer makes it at construction, so its state dict always holds `fp8_attention_state.*` with these
shapes and `load_state_dict` / torch.distributed.checkpoint load a saved state into a freshly built layer
(the amax histories travel at any length, as every FP8ScalingState's do). A checkpoint without these keys
(a layer saved in TE's layout) loads as a fresh state, silently: FP8 attention's scales then restart.

How the recipe scales the tensors is read from its GEMM quantizers (te_parallel.fp8.gemm_quantizers), never
from the recipe's type (`scaling_of`): the input quantizer decides Q, K, V, O and the grad quantizer dO, dP,
dQ, dK, dV (their dtypes too). Both must keep one scale per tensor (Granularity.TENSOR) and either
  * take it from the amax history (has_state, scale_known_before_cast): every scale from its history,
    updated by the recipe's own rule (its length, margin, algorithm, interval), or
  * compute it from the tensor's amax (scale_from_amax): Q, K, V and dO from their own amax just before the
    cast; O, dP, dQ, dK, dV are written inside the kernels, so their scales must exist before the tensors
    do: they are delayed, from the previous pass's amax (a history of one pass, margin 0).
Anything else (tile or block scales, a per-tensor rule other than fp8_max / amax) is refused in one line
naming the recipe.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.gemm_quantizers import GemmQuantizers, Granularity, OperandQuantizer
from te_parallel.fp8.state import DEFAULT_HISTORY_LEN, FP8ScalingState
from te_parallel.ops.cast import quantize, quantize_current
from te_parallel.recipe import DelayedScaling, Format, FormatPair, Recipe, fp8_max

__all__ = ["Q", "K", "V", "O", "DO", "DP", "DQ", "DK", "DV", "NUM_GEMMS", "AttentionScalingState", "new_state",
           "Scaling", "scaling_of", "Plan", "make_plan", "e4m3_backward", "cast", "record", "record_backward"]

# slots of the state (forward: 2·NUM_GEMMS slots, of which Q, K, V, O are used; backward: NUM_GEMMS)
Q, K, V, O = 0, 1, 2, 3
DO, DP, DQ, DK, DV = 0, 1, 2, 3, 4
NUM_GEMMS = 5


class AttentionScalingState(FP8ScalingState):
    """FP8ScalingState of FP8 attention's tensors (module doc). Saved and loaded as every FP8ScalingState is,
    except that a checkpoint without it loads as a fresh state without a warning: a layer that never ran FP8
    attention (or was saved in TE's layout) has nothing to restore there."""

    def __init__(self, device=None) -> None:
        super().__init__(NUM_GEMMS, device=device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not any(key.startswith(prefix) for key in state_dict):
            if not self.in_extra_state and not self.fwd_scale.is_meta:
                self.reset()
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def reset_fresh(self) -> None:
        """The state of a layer just built (reset_parameters; nothing to do on the meta device)."""
        if not self.fwd_scale.is_meta:
            self.reset(DEFAULT_HISTORY_LEN)


def new_state(device=None) -> AttentionScalingState:
    return AttentionScalingState(device)


# -- what the recipe's quantizers say --------------------------------------------------------------------------

@dataclass(frozen=True)
class Scaling:
    """How FP8 attention scales its tensors under one recipe (`scaling_of`)."""
    current: bool            # Q, K, V, dO scaled from their own amax (else every scale from its amax history)
    update: DelayedScaling   # the rule fp8_autocast applies to the state (the recipe itself when delayed)
    fwd_dtype: torch.dtype   # Q, K, V, P, O
    bwd_dtype: torch.dtype   # dO, dP, dQ, dK, dV


_UPDATE_RECIPES: Dict[Format, DelayedScaling] = {}


def _current_update_recipe(fmt: Format) -> DelayedScaling:
    """Current scaling: the rule of the kernel-written tensors' delayed scales (the previous pass's amax)."""
    if fmt not in _UPDATE_RECIPES:
        _UPDATE_RECIPES[fmt] = DelayedScaling(fp8_format=fmt, amax_history_len=1, amax_compute_algo="max")
    return _UPDATE_RECIPES[fmt]


def _from_history(q: OperandQuantizer) -> bool:
    return q.granularity is Granularity.TENSOR and q.has_state and q.scale_known_before_cast


def _from_amax(q: OperandQuantizer) -> bool:
    return q.granularity is Granularity.TENSOR and q.scale_from_amax and not q.has_state


def _describe(q: OperandQuantizer) -> str:
    if q.granularity is not Granularity.TENSOR:
        return f"{q.granularity.name} scales"
    return "a per-tensor scale from neither an amax history nor fp8_max / amax"


def scaling_of(recipe: Recipe, quantizers: GemmQuantizers) -> Scaling:
    """FP8 attention's scaling under `recipe`, from its quantizers (module doc); one-line ValueError where they
    keep no per-tensor scale FP8 attention can use."""
    fwd, bwd = quantizers.input, quantizers.grad
    if _from_history(fwd) and _from_history(bwd):
        return Scaling(False, recipe, fwd.fp8_dtype, bwd.fp8_dtype)
    if _from_amax(fwd) and _from_amax(bwd):
        fmt = Format(FormatPair(fwd.fp8_dtype, bwd.fp8_dtype))
        return Scaling(True, _current_update_recipe(fmt), fwd.fp8_dtype, bwd.fp8_dtype)
    bad = fwd if not (_from_history(fwd) or _from_amax(fwd)) else bwd
    raise ValueError(f"FP8 attention (fp8_dpa / fp8_mha) needs one scale per tensor, from an amax history or from "
                     f"the tensor's amax, for inputs and gradients alike; {type(recipe).__name__}'s {bad.role!r} "
                     f"quantizer ({type(bad).__name__}) keeps {_describe(bad)}; set fp8_dpa=False and "
                     f"fp8_mha=False, or use a per-tensor recipe (DelayedScaling, Float8CurrentScaling)")


# -- one call's plan -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One call's FP8 attention: the recipe's dtypes, where the scales live, how they are updated."""
    state: FP8ScalingState
    update: DelayedScaling      # the rule fp8_autocast applies to `state` (the recipe itself when delayed)
    group: object               # amaxes are all-reduced over it (None: this rank only)
    current: bool               # Q, K, V, dO scaled from their own amax
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    kernel: bool                # cuDNN's kernels (else the emulation)

    @property
    def scale_s(self) -> float:
        return fp8_max(self.fwd_dtype)


def make_plan(scaling: Scaling, state: FP8ScalingState, group, kernel: bool) -> Plan:
    """The plan of one forward; registers `state` for the forward update at autocast exit (a pass that records
    no amax leaves every scale as it is)."""
    state.ensure_history_len(scaling.update.amax_history_len)
    _autocast.record_forward(state, scaling.update, group)
    return Plan(state, scaling.update, group, scaling.current, scaling.fwd_dtype, scaling.bwd_dtype, kernel)


_E4M3_UPDATES: Dict[DelayedScaling, DelayedScaling] = {}


def e4m3_backward(plan: Plan) -> Plan:
    """The plan with E4M3 backward tensors, updated by the same rule with E4M3's fp8_max (the forward dtype
    of HYBRID is E4M3 already, so the forward update is unchanged)."""
    update = _E4M3_UPDATES.get(plan.update)
    if update is None:
        update = _E4M3_UPDATES[plan.update] = dataclasses.replace(plan.update, fp8_format=Format.E4M3)
    return dataclasses.replace(plan, update=update, bwd_dtype=torch.float8_e4m3fn)


# -- casts and amaxes ------------------------------------------------------------------------------------------

def cast(plan: Plan, x: torch.Tensor, slot: int, backward: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(FP8 bytes of x, contiguous in x's shape; descale: fp32 0-d). From the history: the slot's scale, amax
    recorded in its history; current: the scale from amax(x)."""
    dtype = plan.bwd_dtype if backward else plan.fwd_dtype
    x2 = x.reshape(-1, x.shape[-1])
    if plan.current:
        t = quantize_current(x2, dtype)
    else:
        scale, cell = plan.state.slot_views(backward, slot)
        t = quantize(x2, scale, dtype, amax_out=cell)
    return t.data.view(x.shape), t.scale_inv.reshape(())


def record(plan: Plan, slot: int, backward: bool, amax: torch.Tensor) -> None:
    """A kernel-reported amax into the slot's history row 0."""
    cell = plan.state.slot_views(backward, slot)[1]
    torch.maximum(cell, amax.reshape(1).to(cell.dtype), out=cell)


def record_backward(plan: Plan, amaxes: torch.Tensor) -> None:
    """amaxes [4] of dP, dQ, dK, dV (slots 1..4, adjacent in the history's row 0) into the history, one launch."""
    cells = plan.state.history_row0(True)[DP:DV + 1]
    torch.maximum(cells, amaxes.to(cells.dtype), out=cells)
