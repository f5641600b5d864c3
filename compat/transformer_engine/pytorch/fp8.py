"""TE's `transformer_engine.pytorch.fp8` (TE 2.9: `.quantization`): autocast regions, model init, support checks.

The regions are te_parallel's (`te_parallel.fp8_autocast`); recipes given as TE-style objects are
converted to te_parallel's at entry. FP8GlobalStateManager answers what clients ask about the current
region; the parts of it that drive TE's own amax buffers (CUDA-graph capture in Megatron) raise
NotImplementedError: te_parallel reduces amaxes and updates scales by itself when the outermost region
exits and when backward ends.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import te_parallel
from te_parallel.fp8 import autocast as _regions
from te_parallel.fp8.params import current_model_init
from te_parallel.fp8.quantizers import QuantizerRole

from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                              MXFP8BlockScaling, NVFP4BlockScaling, Recipe, to_te_parallel)

__all__ = ["fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init", "FP8GlobalStateManager",
           "check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support", "check_nvfp4_support",
           "check_recipe_support", "get_default_fp8_recipe", "get_default_recipe", "is_fp8_available",
           "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available", "QuantizerRole",
           "DelayedScaling"]


def check_fp8_support() -> Tuple[bool, str]:
    """(True, "") on the CPU and on CUDA GPUs of compute capability >= 8.9; else (False, reason)."""
    return te_parallel.is_fp8_available(return_reason=True)


def check_mxfp8_support() -> Tuple[bool, str]:
    """(False, reason): MXFP8 is a Blackwell format te_parallel does not implement."""
    return te_parallel.is_mxfp8_available(return_reason=True)


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """(True, "") on the CPU and on sm_90 with CUDA >= 12.9 (te_parallel.is_fp8_block_scaling_available)."""
    return te_parallel.is_fp8_block_scaling_available(return_reason=True)


def check_nvfp4_support() -> Tuple[bool, str]:
    """(False, reason): NVFP4 is a Blackwell format te_parallel does not implement."""
    return te_parallel.is_nvfp4_available(return_reason=True)


_RECIPE_CHECKS = ((DelayedScaling, check_fp8_support), (Float8CurrentScaling, check_fp8_support),
                  (Float8BlockScaling, check_fp8_block_scaling_support), (MXFP8BlockScaling, check_mxfp8_support),
                  (NVFP4BlockScaling, check_nvfp4_support))


def check_recipe_support(recipe: Recipe) -> None:
    """TE's check: RuntimeError with the reason when this machine cannot run `recipe`."""
    check = next((c for cls, c in _RECIPE_CHECKS if isinstance(recipe, cls)), None)
    ok, reason = check() if check is not None else (True, "")
    if not ok:
        raise RuntimeError(reason)


def _availability(check):
    def available(return_reason: bool = False):
        ok, reason = check()
        return (ok, reason) if return_reason else ok
    available.__doc__ = f"TE 2.9's is_*_available: {check.__name__}()[0], or the pair with return_reason=True."
    return available


is_fp8_available = _availability(check_fp8_support)
is_mxfp8_available = _availability(check_mxfp8_support)
is_fp8_block_scaling_available = _availability(check_fp8_block_scaling_support)
is_nvfp4_available = _availability(check_nvfp4_support)


def get_default_fp8_recipe() -> Recipe:
    """TE's default recipe: DelayedScaling() (a new mutable object each call, as TE)."""
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe  # TE 2.9's name


class _Stack(threading.local):
    def __init__(self) -> None:
        self.recipes: list = []   # the recipe objects the client passed, innermost last
        self.first_module = False


_STACK = _Stack()


class autocast(te_parallel.autocast):  # noqa: N801 (TE 2.9's name)
    """FP8 region (te_parallel.autocast) taking TE-style recipes; `_graph` is accepted and ignored."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None,
                 _graph: bool = False) -> None:
        self.te_recipe = recipe
        super().__init__(enabled=enabled, calibrating=calibrating, recipe=to_te_parallel(recipe),
                         amax_reduction_group=amax_reduction_group)

    def __enter__(self) -> None:
        super().__enter__()
        _STACK.recipes.append(self.te_recipe)
        _STACK.first_module = True

    def __exit__(self, *exc) -> None:
        _STACK.recipes.pop()
        super().__exit__(*exc)


class fp8_autocast(autocast):  # noqa: N801 (TE's name before 2.9)
    """FP8 region with TE's older argument names: fp8_recipe, fp8_group."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None,
                 _graph: bool = False) -> None:
        super().__init__(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)


class quantized_model_init(te_parallel.quantized_model_init):  # noqa: N801 (TE 2.9's name)
    """GEMM weights of modules built inside are held in FP8 (te_parallel.quantized_model_init)."""

    def __init__(self, enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False) -> None:
        super().__init__(enabled=enabled, recipe=to_te_parallel(recipe),
                         preserve_high_precision_init_val=preserve_high_precision_init_val)


fp8_model_init = quantized_model_init  # TE's name before 2.9


class FP8GlobalStateManager:
    """What TE's clients ask about the FP8 region they run in."""

    @staticmethod
    def is_fp8_available() -> Tuple[bool, str]:
        return check_fp8_support()

    @staticmethod
    def is_mxfp8_available() -> Tuple[bool, str]:
        return check_mxfp8_support()

    @staticmethod
    def is_fp8_block_scaling_available() -> Tuple[bool, str]:
        return check_fp8_block_scaling_support()

    @staticmethod
    def is_nvfp4_available() -> Tuple[bool, str]:
        return check_nvfp4_support()

    @staticmethod
    def is_fp8_enabled() -> bool:
        frame = _regions.current_frame()
        return bool(frame is not None and frame.enabled)

    @staticmethod
    def is_fp8_calibration() -> bool:
        frame = _regions.current_frame()
        return bool(frame is not None and frame.calibrating)

    @staticmethod
    def get_fp8_recipe():
        """The recipe of the innermost region, as its caller passed it (TE-style), else te_parallel's."""
        frame = _regions.current_frame()
        if frame is None:
            return get_default_fp8_recipe()
        passed = _STACK.recipes[-1] if _STACK.recipes else None
        return passed if passed is not None else frame.recipe

    @staticmethod
    def get_fp8_group():
        frame = _regions.current_frame()
        return None if frame is None else frame.group

    @staticmethod
    def with_fp8_parameters() -> bool:
        return current_model_init() is not None

    @staticmethod
    def is_first_fp8_module() -> bool:
        """True for the first caller after a region was entered (TE: the first FP8 module of a pass)."""
        first, _STACK.first_module = _STACK.first_module, False
        return first

    @staticmethod
    def fp8_graph_capturing() -> bool:
        return False

    @staticmethod
    def reset() -> None:
        """Nothing to reset: te_parallel keeps no global FP8 buffers."""

    @staticmethod
    def _not_here(name: str):
        raise NotImplementedError(f"FP8GlobalStateManager.{name}: te_parallel keeps no global amax buffers (it reduces "
                                  f"amaxes and updates scales when the outermost autocast exits and when backward "
                                  f"ends), so TE's CUDA-graph buffer hooks do not exist")

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, *args, **kwargs):
        cls._not_here("add_fp8_tensors_to_global_buffer")

    @classmethod
    def reduce_and_update_fp8_tensors(cls, *args, **kwargs):
        cls._not_here("reduce_and_update_fp8_tensors")

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, *args, **kwargs):
        cls._not_here("set_skip_fp8_weight_update_tensor")

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls, *args, **kwargs):
        cls._not_here("get_skip_fp8_weight_update_tensor")


def current_te_recipe(frame: Optional[_regions.FP8Frame] = None):
    """The TE-style recipe object of the innermost region (None outside one)."""
    frame = _regions.current_frame() if frame is None else frame
    if frame is None:
        return None
    return FP8GlobalStateManager.get_fp8_recipe()
