"""Scale updates: delayed scaling from an amax history, current scaling from the tensor itself.

All functions are on-device tensor math (no host synchronisation): a zero, NaN or infinite amax
keeps the previous scale via `torch.where`, never via a Python branch on a device value.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from te_parallel.native import scaling as native_scaling
from te_parallel.recipe import DelayedScaling

StateTensors = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (amax_history [L, n], scale [n], scale_inv [n])


def update_delayed_scaling_torch(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    fp8_max: float,
    scale_divisor: float,
    algo: str,
    update_scale: bool,
) -> None:
    """Reference update of one state, in place; the native kernel must match it bit for bit.

    Row 0 of the history holds the pass that just ended; after the update it is zeroed for the
    next pass and row i holds the amax of i passes ago.
    """
    amax = amax_history.amax(dim=0) if algo == "max" else amax_history[0].clone()
    if update_scale:
        new = _div(fp8_max, amax) / scale_divisor
        ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(new)
        scale.copy_(torch.where(ok, new, scale))
        scale_inv.copy_(1.0 / scale)
    _roll_history(amax_history)


def _div(numerator: float, amax: torch.Tensor) -> torch.Tensor:
    """numerator / amax as one IEEE fp32 division (`float / tensor` in torch is reciprocal-then-multiply,
    which rounds twice and would differ from the native kernel)."""
    return torch.full_like(amax, numerator) / amax


def _roll_history(amax_history: torch.Tensor) -> None:
    amax_history.copy_(torch.roll(amax_history, 1, 0))
    amax_history[0].zero_()


def _update_custom(states: Sequence[StateTensors], recipe: DelayedScaling, fp8_max: float, update_scale: bool) -> None:
    """Callable amax / scale algorithms: per state, in torch."""
    for hist, scale, scale_inv in states:
        algo = recipe.amax_compute_algo
        if callable(algo):
            amax = algo(hist).to(torch.float32)
        else:
            amax = hist.amax(dim=0) if algo == "max" else hist[0].clone()
        if update_scale:
            if recipe.scaling_factor_compute_algo is not None:
                new = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe).to(torch.float32)
            else:
                new = _div(fp8_max, amax) / (2.0 ** recipe.margin)
            ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(new)
            scale.copy_(torch.where(ok, new, scale))
            scale_inv.copy_(1.0 / scale)
        _roll_history(hist)


def update_delayed_scaling(
    states: Sequence[StateTensors], recipe: DelayedScaling, fp8_max: float, update_scale: bool
) -> None:
    """Update every state of one pass together: one kernel launch on CUDA with native kernels."""
    if not states:
        return
    custom = callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None
    if custom:
        _update_custom(states, recipe, fp8_max, update_scale)
        return
    kwargs = dict(
        fp8_max=fp8_max,
        scale_divisor=float(2.0 ** recipe.margin),
        algo=recipe.amax_compute_algo,
        update_scale=update_scale,
    )
    if native_scaling.usable(states):
        native_scaling.fused_delayed_scaling_update(list(states), **kwargs)
        return
    for hist, scale, scale_inv in states:
        update_delayed_scaling_torch(hist, scale, scale_inv, **kwargs)


def current_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Current scaling: fp8_max / amax, or 1 where that is not a finite positive number (the scaling
    kernel's scale_from_amax for one CUDA amax: one launch instead of seven torch ops)."""
    if amax.numel() == 1 and native_scaling.current_usable(amax) and amax.dtype is torch.float32:
        return native_scaling.scale_from_amax(amax, fp8_max)[0].view(amax.shape)
    return current_scale_torch(amax, fp8_max)


def current_scale_torch(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """current_scale in torch ops (the reference of the native kernel, and the CPU path)."""
    new = _div(fp8_max, amax)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(new)
    return torch.where(ok, new, torch.ones_like(new))
