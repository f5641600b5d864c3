"""TE's recipes as TE's clients see them: mutable objects with TE 2.9's fields and keywords.

te_parallel's own recipes are frozen dataclasses (its configuration rule); these are converted to them
where FP8 is used (`to_te_parallel`, called by fp8_autocast / autocast / quantized_model_init), so a
client may build a recipe, change a field and pass it again. Keywords TE defines are honoured or,
where te_parallel has no such choice, ignored with one warning naming them; keywords TE's recipes
silently drop (TE's recipes are pydantic dataclasses, which ignore extra keywords: Megatron passes
`params_dtype` and `device`) are dropped here too, with one warning. Recipes te_parallel does not
implement (MXFP8, NVFP4, custom) can be built, and raise NotImplementedError when used.
"""
from __future__ import annotations

import enum
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Tuple

import te_parallel.recipe as tp_recipe

__all__ = ["Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "to_te_parallel"]


class _FormatHelper(NamedTuple):
    """Largest FP8 value of a format's forward and backward tensors (TE's pickled Format value)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """E4M3 / E5M2: every FP8 tensor in that format; HYBRID: E4M3 forward, E5M2 gradients; E2M1 (FP4)."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class _OverrideLinearPrecision(NamedTuple):
    """TE 1.x / early 2.x: run the (fprop, dgrad, wgrad) GEMM in high precision instead of FP8."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


@dataclass(frozen=True)
class MMParams:
    """use_split_accumulator: False is cuBLASLt's FP8 fast accumulation."""

    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    """How one tensor kind's scales are computed (Float8BlockScaling: power-of-two scales, an amax floor;
    the FP4 options are not implemented)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


_WARNED = set()


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


class Recipe:
    """Base of the recipes: fields set by keyword, mutable; TE's kind predicates."""

    _FIELDS: Dict[str, Any] = {}
    _ACCEPTED_NOT_TE: Tuple[str, ...] = ()

    def __init__(self, **kwargs) -> None:
        unknown = sorted(k for k in kwargs if k not in self._FIELDS)
        if unknown:
            _warn_once((type(self).__name__, tuple(unknown)),
                       f"transformer_engine.common.recipe.{type(self).__name__}: ignoring keyword(s) {', '.join(unknown)} "
                       f"(not fields of this recipe; TE drops them too)")
        for name, default in self._FIELDS.items():
            setattr(self, name, kwargs.get(name, default))
        self.__post_init__()

    def __post_init__(self) -> None:
        if getattr(self, "fp8_format", None) == Format.E5M2:
            raise ValueError(f"{type(self).__name__}: fp8_format=Format.E5M2 (pure E5M2 training) is not supported, as in "
                             f"TE; use Format.HYBRID or Format.E4M3")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._FIELDS)
        return f"recipe_type={type(self).__name__}, {fields}"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = object.__hash__  # mutable, compared by fields, hashed by identity (as TE's)

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)


class DelayedScaling(Recipe):
    """Scales from an amax history (te_parallel.recipe.DelayedScaling). TE 2.9's fields, plus
    `interval` (TE < 1.8; honoured) and `override_linear_precision` (TE < 2.x; only all-False runs)."""

    _FIELDS = {"margin": 0, "fp8_format": Format.HYBRID, "amax_history_len": 1024, "amax_compute_algo": "max",
               "scaling_factor_compute_algo": None, "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False,
               "override_linear_precision": _OverrideLinearPrecision(), "interval": 1, "backward_override": None}

    def __init__(self, margin: int = 0, fp8_format: Format = Format.HYBRID, amax_history_len: int = 1024,
                 amax_compute_algo="max", scaling_factor_compute_algo=None, reduce_amax: bool = True,
                 fp8_dpa: bool = False, fp8_mha: bool = False, **kwargs) -> None:
        super().__init__(margin=margin, fp8_format=fp8_format, amax_history_len=amax_history_len,
                         amax_compute_algo=amax_compute_algo, scaling_factor_compute_algo=scaling_factor_compute_algo,
                         reduce_amax=reduce_amax, fp8_dpa=fp8_dpa, fp8_mha=fp8_mha, **kwargs)


class Float8CurrentScaling(Recipe):
    """Scale from each tensor's own amax (te_parallel.recipe.Float8CurrentScaling); TE 2.9's fields."""

    _FIELDS = {"use_power_2_scales": False, "fp8_format": Format.HYBRID, "fp8_quant_fwd_inp": QParams(),
               "fp8_quant_fwd_weight": QParams(), "fp8_quant_bwd_grad": QParams(),
               "fp8_gemm_fprop": MMParams(use_split_accumulator=False), "fp8_gemm_dgrad": MMParams(),
               "fp8_gemm_wgrad": MMParams(), "fp8_dpa": False, "fp8_mha": False, "backward_override": None}


class MXFP8BlockScaling(Recipe):
    """MXFP8 (32-element blocks, E8M0 scales): not implemented in te_parallel; raises when used."""

    _FIELDS = {"margin": 0, "fp8_format": Format.E4M3, "fp8_dpa": False, "fp8_mha": False, "backward_override": None}


# TE's default block QParams: power-of-two scales unless its switch asks for fp32 ones (read once, as TE)
_BLOCK_QPARAMS = QParams(power_2_scale=os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1")


class Float8BlockScaling(Recipe):
    """FP8 with one scale per 1x128 tile / 128x128 block (te_parallel.recipe.Float8BlockScaling); TE's fields."""

    _FIELDS = {"fp8_format": Format.E4M3, "fp8_quant_fwd_inp": _BLOCK_QPARAMS,
               "fp8_quant_fwd_weight": _BLOCK_QPARAMS, "fp8_quant_bwd_grad": _BLOCK_QPARAMS,
               "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
               "grad_block_scaling_dim": 1, "fp8_gemm_fprop": MMParams(), "fp8_gemm_dgrad": MMParams(),
               "fp8_gemm_wgrad": MMParams(), "fp8_dpa": False, "fp8_mha": False, "backward_override": None}


class NVFP4BlockScaling(Recipe):
    """NVFP4 (FP4 E2M1 with block scales): not implemented in te_parallel; raises when used."""

    _FIELDS = {"fp4_format": Format.E2M1, "fp8_format": Format.E4M3, "fp8_dpa": False, "fp8_mha": False,
               "backward_override": None}


class CustomRecipe(Recipe):
    """A user-supplied quantizer factory (`qfactory`): not implemented in te_parallel; raises when used."""

    _FIELDS = {"qfactory": None, "fp8_dpa": False, "fp8_mha": False}


# --- conversion to te_parallel's frozen recipes -----------------------------------------------------
_FORMATS = {Format.E4M3: tp_recipe.Format.E4M3, Format.E5M2: tp_recipe.Format.E5M2, Format.HYBRID: tp_recipe.Format.HYBRID}
_CACHE: Dict[int, tuple] = {}


def _format(recipe: Recipe) -> tp_recipe.Format:
    fmt = recipe.fp8_format
    if isinstance(fmt, tp_recipe.Format):
        return fmt
    if fmt not in _FORMATS:
        raise NotImplementedError(f"{type(recipe).__name__}: fp8_format={fmt} is not implemented in te_parallel; "
                                  f"use Format.HYBRID or Format.E4M3")
    return _FORMATS[fmt]


def _common_checks(recipe: Recipe) -> None:
    if getattr(recipe, "backward_override", None) is not None:
        raise NotImplementedError(f"{type(recipe).__name__}: backward_override={recipe.backward_override!r} is not "
                                  f"implemented in te_parallel; leave it None")


def _delayed(recipe: DelayedScaling) -> tp_recipe.DelayedScaling:
    override = tuple(recipe.override_linear_precision)
    if any(override):
        raise NotImplementedError(f"DelayedScaling: override_linear_precision={override} asks for a GEMM in high "
                                  f"precision under FP8, which te_parallel does not do; pass (False, False, False) "
                                  f"(Megatron: keep fp8_wgrad=True)")
    return tp_recipe.DelayedScaling(
        margin=recipe.margin, interval=recipe.interval, fp8_format=_format(recipe),
        amax_history_len=recipe.amax_history_len, amax_compute_algo=recipe.amax_compute_algo,
        scaling_factor_compute_algo=recipe.scaling_factor_compute_algo, reduce_amax=recipe.reduce_amax,
        fp8_dpa=bool(recipe.fp8_dpa), fp8_mha=bool(recipe.fp8_mha))


def _current(recipe: Float8CurrentScaling) -> tp_recipe.Float8CurrentScaling:
    qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
    if recipe.use_power_2_scales or any(q != QParams() for q in qparams):
        _warn_once("qparams", "Float8CurrentScaling: use_power_2_scales / QParams ignored: te_parallel's current scaling "
                              "uses fp8_max / amax as is")
    return tp_recipe.Float8CurrentScaling(fp8_format=_format(recipe), fp8_dpa=bool(recipe.fp8_dpa),
                                          fp8_mha=bool(recipe.fp8_mha), **_mm_params(recipe))


def _mm_params(recipe: Recipe) -> Dict[str, tp_recipe.MMParams]:
    split = {g: bool(getattr(recipe, f"fp8_gemm_{g}").use_split_accumulator) for g in ("fprop", "dgrad", "wgrad")}
    return {f"fp8_gemm_{g}": tp_recipe.MMParams(use_split_accumulator=s) for g, s in split.items()}


def _qparams(recipe: Recipe, name: str) -> tp_recipe.QParams:
    q = getattr(recipe, name)
    fp4 = [k for k in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization") if getattr(q, k)]
    if fp4:
        raise NotImplementedError(f"{type(recipe).__name__}.{name}: {', '.join(fp4)} (NVFP4 options) not implemented "
                                  f"in te_parallel; leave them False")
    return tp_recipe.QParams(power_2_scale=bool(q.power_2_scale), amax_epsilon=float(q.amax_epsilon))


def _block(recipe: Float8BlockScaling) -> tp_recipe.Float8BlockScaling:
    dims = {f"{r}_block_scaling_dim": getattr(recipe, f"{r}_block_scaling_dim") for r in ("x", "w", "grad")}
    qparams = {n: _qparams(recipe, n) for n in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")}
    return tp_recipe.Float8BlockScaling(fp8_format=_format(recipe), **qparams, **dims, **_mm_params(recipe),
                                        fp8_dpa=bool(recipe.fp8_dpa), fp8_mha=bool(recipe.fp8_mha))


_CONVERT = ((DelayedScaling, _delayed), (Float8CurrentScaling, _current), (Float8BlockScaling, _block))


def to_te_parallel(recipe) -> tp_recipe.Recipe:
    """te_parallel's frozen recipe for a TE-style one (made once per recipe object and field values)."""
    if recipe is None or isinstance(recipe, tp_recipe.Recipe):
        return recipe
    convert = next((fn for cls, fn in _CONVERT if isinstance(recipe, cls)), None)
    if convert is None:
        if isinstance(recipe, Recipe):
            raise NotImplementedError(f"{type(recipe).__name__} is not implemented in te_parallel, which runs "
                                      f"per-tensor FP8 scaling (DelayedScaling, Float8CurrentScaling) and FP8 block "
                                      f"scaling (Float8BlockScaling)")
        raise TypeError(f"expected a transformer_engine.common.recipe recipe, got {type(recipe).__name__}")
    fields = tuple(recipe.__dict__.items())
    hit = _CACHE.get(id(recipe))
    if hit is not None and hit[0] is type(recipe) and hit[1] == fields:
        return hit[2]
    _common_checks(recipe)
    converted = convert(recipe)
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[id(recipe)] = (type(recipe), fields, converted)
    return converted
