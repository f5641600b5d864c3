"""A recipe's quantizers: the quantizer of each GEMM operand of a linear layer.

    fprop  y  = x · Wᵀ    reads x and W rowwise
    dgrad  dx = dy · W    reads dy rowwise and W columnwise (Wᵀ)
    wgrad  dW = dyᵀ · x   reads dy and x columnwise

Per operand kind (TE's `QuantizerRole.tensor_type`): input / output use the recipe's forward format and x
settings, weight its forward format and w settings, grad_output / grad_input its backward format and grad
settings. Each recipe type's factory is the `quantizer` it registered, with its GEMM family, in one call to
te_parallel.fp8.recipe_registry.register_recipe (a subclass takes its base's); the factories of the built-in
recipes are below (`delayed_quantizer`, ...), registered in te_parallel.fp8.gemm_quantizers. Nothing else
asks which recipe it is.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from te_parallel.fp8.quantizers.base import Quantizer
from te_parallel.fp8.quantizers.blackwell import MXFP8Quantizer, NVFP4Quantizer
from te_parallel.fp8.quantizers.block import Float8BlockQuantizer
from te_parallel.fp8.quantizers.per_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from te_parallel.fp8.recipe_registry import factories_of, registered_names
from te_parallel.recipe import Recipe

__all__ = ["QuantizerRole", "LinearQuantizers", "make_quantizer", "recipe_quantizers", "TENSOR_TYPES",
           "fp8_dtype_of_kind", "delayed_quantizer", "current_quantizer", "block_quantizer", "mxfp8_quantizer", "nvfp4_quantizer"]


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


def fp8_dtype_of_kind(recipe: Recipe, kind: str) -> torch.dtype:
    """The FP8 dtype `recipe` gives an operand kind: its backward format for "grad", else its forward one."""
    return recipe.fp8_format.bwd_dtype if kind == "grad" else recipe.fp8_format.fwd_dtype


# The built-in recipes' public quantizer factories (te_parallel.fp8.recipe_registry: the `quantizer` signature).
def delayed_quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer:
    if scale is None or amax is None:
        raise ValueError("DelayedScaling quantizers need the operand's scale and amax tensors (its delayed-scaling "
                         "state); pass scale= and amax=")
    return Float8Quantizer(scale, amax, fp8_dtype_of_kind(recipe, kind), rowwise=rowwise, columnwise=columnwise)


def current_quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer:
    return Float8CurrentScalingQuantizer(fp8_dtype_of_kind(recipe, kind), device, rowwise=rowwise,
                                         columnwise=columnwise)


def block_quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer:
    q = recipe.qparams(kind)
    return Float8BlockQuantizer(fp8_dtype_of_kind(recipe, kind), rowwise=rowwise, columnwise=columnwise,
                                amax_epsilon=q.amax_epsilon, force_pow_2_scales=q.power_2_scale,
                                block_scaling_dim=recipe.block_dim(kind))


def mxfp8_quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer:
    return MXFP8Quantizer()  # (made with both usages, as TE makes it; using it raises)


def nvfp4_quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer:
    return NVFP4Quantizer()


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
    entry = factories_of(recipe)
    if entry is None or entry.quantizer is None:
        raise ValueError(f"make_quantizer: no quantizer is registered for {type(recipe).__name__} (registered: "
                         f"{registered_names('quantizer')}); register one with "
                         f"te_parallel.fp8.recipe_registry.register_recipe(..., quantizer=...)")
    return entry.quantizer(recipe, kind, rowwise=rowwise, columnwise=columnwise, scale=scale, amax=amax,
                           device=device)


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
