"""The one registry of scaling recipes: a recipe type registers, in one call, both kinds of quantizer it makes.

    register_recipe(Float8BlockScaling, gemm=_block, quantizer=block_quantizer)

* `gemm(recipe) -> GemmQuantizers`: the quantizer family of the modules' GEMMs (te_parallel.fp8.gemm_quantizers),
  read by `gemm_quantizers(recipe)` (fp8_autocast, FP8 weight parameters, te.Fp8Padding's alignment). The
  library asks those quantizers what it needs (OperandQuantizer's doc: granularity, when the scale is known,
  state, row alignment, per-expert scales...), never the recipe's type; a module that needs what they lack
  (GroupedLinear: per-expert weight scales) refuses the recipe in one line. None: the modules do not run the
  recipe, and fp8_autocast refuses it in one line.
* `quantizer(recipe, kind, *, rowwise, columnwise, scale, amax, device) -> Quantizer`: TE's public quantizer of
  one operand kind ("x": input / output, "w": weight, "grad": grad_output / grad_input) writing the given
  usages, read by `make_quantizer` / `recipe_quantizers` (te_parallel.fp8.quantizers.recipes). scale / amax are
  the operand's delayed-scaling state where the caller has one (None otherwise). None: no public quantizer.

Both readers find a recipe's entry by its type: the type itself or its nearest registered base class (a
subclass of a registered recipe takes its base's entry, as a whole). The built-in recipes are registered in
te_parallel.fp8.gemm_quantizers, beside their GEMM families. Registering a type again replaces its entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from te_parallel.recipe import Recipe

__all__ = ["RecipeFactories", "register_recipe", "factories_of", "registered_names"]


@dataclass(frozen=True)
class RecipeFactories:
    """What one registered recipe type makes (module doc): `gemm` and `quantizer`, either may be None."""

    recipe_type: type
    gemm: Optional[Callable[[Recipe], Any]]
    quantizer: Optional[Callable[..., Any]]


# recipe type -> its factories, in registration order (the order the error messages list them in)
_REGISTERED: Dict[type, RecipeFactories] = {}


def register_recipe(recipe_type: type, *, gemm: Optional[Callable[[Recipe], Any]],
                    quantizer: Optional[Callable[..., Any]]) -> None:
    """Register `recipe_type`'s GEMM family factory and public quantizer factory together (module doc)."""
    if not (isinstance(recipe_type, type) and issubclass(recipe_type, Recipe)):
        raise TypeError(f"register_recipe: recipe_type must be a subclass of te_parallel.recipe.Recipe, got "
                        f"{recipe_type!r}")
    for name, make in (("gemm", gemm), ("quantizer", quantizer)):
        if make is not None and not callable(make):
            raise TypeError(f"register_recipe: {name} of {recipe_type.__name__} must be a callable or None, got "
                            f"{make!r}")
    if gemm is None and quantizer is None:
        raise ValueError(f"register_recipe: {recipe_type.__name__} was given neither gemm= nor quantizer=; give at "
                         f"least one factory")
    _REGISTERED[recipe_type] = RecipeFactories(recipe_type, gemm, quantizer)


def factories_of(recipe: Recipe) -> Optional[RecipeFactories]:
    """The entry of `recipe`'s type or of its nearest registered base class; None when there is none."""
    for t in type(recipe).__mro__:
        entry = _REGISTERED.get(t)
        if entry is not None:
            return entry
    return None


def registered_names(kind: str, last: str = ", ") -> str:
    """The registered recipe types that have a `kind` ("gemm" or "quantizer") factory, named in one line:
    "A, B, C", or with last=" or ": "A, B or C"."""
    if kind not in ("gemm", "quantizer"):
        raise ValueError(f"registered_names: kind must be 'gemm' or 'quantizer', got {kind!r}")
    names = [t.__name__ for t, entry in _REGISTERED.items()
             if (entry.gemm if kind == "gemm" else entry.quantizer) is not None]
    if not names:
        return "none"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + last + names[-1]
