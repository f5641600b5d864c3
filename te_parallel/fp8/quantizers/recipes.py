"""A recipe's quantizers: the quantizer of each GEMM operand of a linear layer.

    fprop  y  = x · Wᵀ    reads x and W rowwise
    dgrad  dx = dy · W    reads dy rowwise and W columnwise (Wᵀ)
    wgrad  dW = dyᵀ · x   reads dy and x columnwise

Per operand kind (TE's `QuantizerRole.tensor_type`): input / output use the recipe's forward format and x
settings, weight its forward format and w settings, grad_output / grad_input its backward format and grad
settings. The factory of each recipe is looked up by `Recipe.scaling`; nothing else asks which recipe it is.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional

import torch

from te_parallel.fp8.quantizers.base import Quantizer
from te_parallel.fp8.quantizers.blackwell import MXFP8Quantizer, NVFP4Quantizer
from te_parallel.fp8.quantizers.block import Float8BlockQuantizer
from te_parallel.fp8.quantizers.per_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from te_parallel.recipe import Recipe

__all__ = ["QuantizerRole", "LinearQuantizers", "make_quantizer", "recipe_quantizers", "TENSOR_TYPES"]


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Which tensor a quantizer is for (TE's QuantizerRole): `module_type` ("linear", ...), `tensor_type`
    (one of TENSOR_TYPES), `name` (the module instance's name, for a caller's own bookkeeping)."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v]
        return "|".join(parts) if parts else "QuantizerRole()"


# tensor_type -> the recipe's settings it uses ("x", "w", "grad": te_parallel.recipe.Float8BlockScaling's names)
TENSOR_TYPES = {"input": "x", "output": "x", "weight": "w", "grad_output": "grad", "grad_input": "grad"}


def _fp8_dtype(recipe: Recipe, kind: str) -> torch.dtype:
    return recipe.fp8_format.bwd_dtype if kind == "grad" else recipe.fp8_format.fwd_dtype


def _delayed(recipe, kind, usage, scale, amax, device) -> Quantizer:
    if scale is None or amax is None:
        raise ValueError("DelayedScaling quantizers need the operand's scale and amax tensors (its delayed-scaling "
                         "state); pass scale= and amax=")
    return Float8Quantizer(scale, amax, _fp8_dtype(recipe, kind), **usage)


def _current(recipe, kind, usage, scale, amax, device) -> Quantizer:
    return Float8CurrentScalingQuantizer(_fp8_dtype(recipe, kind), device, **usage)


def _block(recipe, kind, usage, scale, amax, device) -> Quantizer:
    q = recipe.qparams(kind)
    return Float8BlockQuantizer(_fp8_dtype(recipe, kind), amax_epsilon=q.amax_epsilon,
                                force_pow_2_scales=q.power_2_scale, block_scaling_dim=recipe.block_dim(kind), **usage)


def _mxfp8(recipe, kind, usage, scale, amax, device) -> Quantizer:
    return MXFP8Quantizer()


def _nvfp4(recipe, kind, usage, scale, amax, device) -> Quantizer:
    return NVFP4Quantizer()


_FACTORIES: Dict[str, Callable[..., Quantizer]] = {"delayed": _delayed, "current": _current, "block": _block,
                                                   "mxfp8": _mxfp8, "nvfp4": _nvfp4}


def make_quantizer(recipe: Recipe, role: QuantizerRole, *, rowwise: bool = True, columnwise: bool = True,
                   scale: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None,
                   device=None) -> Quantizer:
    """The quantizer `recipe` gives the tensor `role` names, writing the given usages. scale / amax: the
    operand's delayed-scaling state (DelayedScaling only: the quantizer casts with that scale and records
    amaxes there)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"make_quantizer: recipe must be a te_parallel recipe, got {type(recipe).__name__}")
    kind = TENSOR_TYPES.get(role.tensor_type)
    if kind is None:
        raise ValueError(f"make_quantizer: role.tensor_type must be one of {sorted(TENSOR_TYPES)}, got "
                         f"{role.tensor_type!r}")
    factory = _FACTORIES.get(recipe.scaling)
    if factory is None:
        raise ValueError(f"make_quantizer: no quantizer for {type(recipe).__name__} (scaling {recipe.scaling!r})")
    return factory(recipe, kind, dict(rowwise=rowwise, columnwise=columnwise), scale, amax, device)


@dataclasses.dataclass(frozen=True)
class LinearQuantizers:
    """The quantizer of each GEMM operand of a linear layer (module doc), each writing only the direction its
    GEMM reads. A caller that casts x once for fprop and wgrad takes `fprop_input.copy()` and adds
    `set_usage(columnwise=True)`: same settings, both directions from one read."""

    fprop_input: Quantizer
    fprop_weight: Quantizer
    dgrad_grad_output: Quantizer
    dgrad_weight: Quantizer
    wgrad_grad_output: Quantizer
    wgrad_input: Quantizer


def recipe_quantizers(recipe: Recipe, *, scales: Optional[Mapping[str, torch.Tensor]] = None,
                      amaxes: Optional[Mapping[str, torch.Tensor]] = None, device=None,
                      module_type: str = "linear", name: str = "") -> LinearQuantizers:
    """`recipe`'s quantizers of a linear layer's GEMM operands. scales / amaxes (DelayedScaling): the
    delayed-scaling state of "input", "weight" and "grad_output", each a one-element fp32 tensor."""
    scales, amaxes = scales or {}, amaxes or {}

    def q(tensor_type: str, rowwise: bool) -> Quantizer:
        return make_quantizer(recipe, QuantizerRole(module_type, tensor_type, name), rowwise=rowwise,
                              columnwise=not rowwise, scale=scales.get(tensor_type), amax=amaxes.get(tensor_type),
                              device=device)

    return LinearQuantizers(fprop_input=q("input", True), fprop_weight=q("weight", True),
                            dgrad_grad_output=q("grad_output", True), dgrad_weight=q("weight", False),
                            wgrad_grad_output=q("grad_output", False), wgrad_input=q("input", False))
