"""TE 2.9's `transformer_engine.pytorch.quantization` (its name for `.fp8`): autocast regions, model init, support
checks, QuantizerRole; TE's RecipeState classes and delayed-scaling update function are import-only
(te_parallel's modules keep their FP8 state themselves; `te_parallel.recipe_quantizers` gives a recipe's
quantizers)."""
from transformer_engine.pytorch._missing import missing_class, missing_function
from transformer_engine.pytorch.fp8 import *  # noqa: F401,F403
from transformer_engine.pytorch.fp8 import __all__ as _FP8_ALL

_STATES = ("TE's per-module recipe state (te_parallel's modules keep their own; te_parallel.recipe_quantizers makes "
           "quantizers)")
RecipeState = missing_class("quantization.RecipeState", _STATES)
DelayedScalingRecipeState = missing_class("quantization.DelayedScalingRecipeState", _STATES, RecipeState)
Float8CurrentScalingRecipeState = missing_class("quantization.Float8CurrentScalingRecipeState", _STATES, RecipeState)
Float8BlockScalingRecipeState = missing_class("quantization.Float8BlockScalingRecipeState", _STATES, RecipeState)
MXFP8BlockScalingRecipeState = missing_class("quantization.MXFP8BlockScalingRecipeState", _STATES, RecipeState)
NVFP4BlockScalingRecipeState = missing_class("quantization.NVFP4BlockScalingRecipeState", _STATES, RecipeState)
_amax_and_scale_update = missing_function("quantization._amax_and_scale_update",
                                          "TE's delayed-scaling update of an fp8_meta (te_parallel updates its own "
                                          "scales when the outermost autocast exits)")

__all__ = [*_FP8_ALL, "RecipeState", "DelayedScalingRecipeState", "Float8CurrentScalingRecipeState",
           "Float8BlockScalingRecipeState", "MXFP8BlockScalingRecipeState", "NVFP4BlockScalingRecipeState"]
