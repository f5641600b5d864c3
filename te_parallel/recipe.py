"""FP8 recipes: which FP8 formats the GEMM operands use and how their scales are chosen.

`te_parallel.recipe` is also importable as `te_parallel.common.recipe` (TE's path).

Recipes are frozen, keyword-only dataclasses (configuration is explicit: docs/architecture.md).
Two families:

* `DelayedScaling`: the scale of each tensor is derived from a history of amaxes (absolute maxima)
  recorded in earlier passes; the current pass quantizes with the scale computed at the end of the
  previous one. Cheap (no extra pass over the tensor before the cast) but one step behind.
* `Float8CurrentScaling`: the scale is computed from the amax of the tensor itself, just before the
  cast. Exact range, one extra read of the tensor.
* `Float8BlockScaling`: one scale per 1x128 tile (activations, gradients) or 128x128 block (weights),
  computed from the tile's own amax (DeepSeek-V3's recipe; Megatron's `fp8_recipe="blockwise"`).

A recipe holds settings; what it does to the GEMM operands is its quantizers' (te_parallel.fp8.gemm_quantizers
for the modules' GEMMs, te_parallel.fp8.quantizers for TE's API), both registered once per recipe type in
te_parallel.fp8.recipe_registry. `Recipe.scaling` ("delayed", "current", "block") names the kind for TE's
helpers below; the GEMM path asks the quantizers what it needs, never which recipe it runs.
"""
from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple, Optional, Union

import torch

__all__ = ["Format", "MMParams", "QParams", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "Recipe", "FormatPair"]


class FormatPair(NamedTuple):
    """The FP8 dtypes of a format: forward operands (inputs, weights) and backward (gradients)."""

    fwd: torch.dtype
    bwd: torch.dtype


class Format(enum.Enum):
    """FP8 format of the forward and backward operands.

    E4M3: every FP8 tensor is E4M3 (max 448).  E5M2: every FP8 tensor is E5M2 (max 57344).
    HYBRID: E4M3 in the forward pass (more mantissa for activations and weights), E5M2 for
    gradients in the backward pass (more range).
    """

    E4M3 = FormatPair(torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = FormatPair(torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = FormatPair(torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self) -> torch.dtype:
        return self.value.fwd

    @property
    def bwd_dtype(self) -> torch.dtype:
        return self.value.bwd


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


GEMM_BACKENDS = ("native", "torch")


@dataclass(frozen=True, kw_only=True)
class MMParams:
    """How one FP8 GEMM of a linear layer runs (TE's name; a recipe holds one per GEMM).

    use_split_accumulator: True promotes the tensor cores' partial sums to fp32 registers at
    intervals along K (cuBLASLt's default, the more exact sum); False is cuBLASLt's FAST_ACCUM.
    As in TE, a recipe runs its forward GEMMs with False (Recipe.fp8_gemm_fprop) and dgrad / wgrad
    with True (docs/fp8.md, "Accumulation").
    backend: "native" issues the GEMM through te_parallel's own cuBLASLt call (cached plans, about
    half the host time of torch._scaled_mm); "torch" through torch._scaled_mm. Both run cuBLASLt's
    FP8 kernels. A GEMM that adds a C matrix in its epilogue (comm-GEMM overlap) always takes the
    native call where it is usable. Without the compiled extension both mean torch._scaled_mm.
    """

    use_split_accumulator: bool = True
    backend: str = "native"

    def __post_init__(self) -> None:
        if not isinstance(self.use_split_accumulator, bool):
            raise TypeError(f"MMParams.use_split_accumulator must be a bool, got {self.use_split_accumulator!r}")
        if self.backend not in GEMM_BACKENDS:
            raise ValueError(f"MMParams.backend must be one of {GEMM_BACKENDS}, got {self.backend!r}")

    @property
    def fast_accum(self) -> bool:
        return not self.use_split_accumulator


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base class of the recipes.

    fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: how the forward, data-gradient and
    weight-gradient GEMMs run (MMParams). TE's defaults: the forward GEMM with fast accumulation,
    the gradient GEMMs with the exact sum.
    min_fp8_gemm: 0 (the default, as in TE): under fp8_autocast every GEMM runs in FP8. An opt-in
    M·K·N lets smaller GEMMs on CUDA run in the activation dtype (bf16/fp16) instead, where the casts
    cost more GPU time than FP8 saves; "auto" takes the break-even measured for this GPU architecture
    and recipe (te_parallel.fp8.gemm_size; 0 where none was measured). The choice and each GEMM it
    sends to bf16 are logged (logger "te_parallel", INFO).
    """

    scaling: ClassVar[str] = ""  # "delayed", "current" or "block": what the recipe's quantizers do

    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()
    min_fp8_gemm: Union[int, str] = 0

    def delayed(self) -> bool:
        """TE's helper: True for delayed scaling."""
        return self.scaling == "delayed"

    def float8_current_scaling(self) -> bool:
        """TE's helper: True for per-tensor current scaling."""
        return self.scaling == "current"

    current = float8_current_scaling

    def float8_block_scaling(self) -> bool:
        """TE's helper: True for 1x128 / 128x128 block scaling."""
        return self.scaling == "block"

    def float8_per_tensor_scaling(self) -> bool:
        """TE's helper: one scale per tensor (delayed or current scaling)."""
        return self.scaling in ("delayed", "current")

    def mxfp8(self) -> bool:
        return False

    def nvfp4(self) -> bool:
        return False

    def __post_init__(self) -> None:
        if not (self.min_fp8_gemm == "auto" or (isinstance(self.min_fp8_gemm, int)
                                                and not isinstance(self.min_fp8_gemm, bool) and self.min_fp8_gemm >= 0)):
            raise ValueError(f"min_fp8_gemm must be an int >= 0 (M·K·N; 0: every GEMM in FP8) or 'auto', got "
                             f"{self.min_fp8_gemm!r}")
        if not isinstance(self.fp8_format, Format):
            raise TypeError(
                f"fp8_format must be a te_parallel.recipe.Format (E4M3, E5M2, HYBRID), got {self.fp8_format!r}"
            )
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not isinstance(getattr(self, name), MMParams):
                raise TypeError(f"{name} must be a te_parallel.recipe.MMParams, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class DelayedScaling(Recipe):
    """Scale from the amax history of earlier passes.

    After every pass (forward: at the exit of the outermost `fp8_autocast`; backward: when the
    backward pass ends) each tensor's scale becomes

        scale = (fp8_max / amax) / 2 ** margin

    with `amax` = max over the last `amax_history_len` passes ("max"), the last pass only
    ("most_recent"), or `amax_compute_algo(history)` for a callable taking the history
    `[amax_history_len, num_tensors]` (row 0 = the pass just finished, row i = i passes before)
    and returning `[num_tensors]`. A zero or non-finite amax (or resulting scale) never changes a
    scale. The scale is recomputed every `interval` passes; the history is recorded every pass.
    `scaling_factor_compute_algo(amax, scale, fp8_max, recipe) -> new scale` replaces the formula.
    `reduce_amax`: all-reduce (MAX) the amaxes over the fp8 group before the update so every
    rank computes the same scale.
    `fp8_dpa`: DotProductAttention runs in FP8 (cuDNN's FP8 attention; docs/attention.md, "FP8
    attention"); `fp8_mha`: the same here (the QKV projection does not hand FP8 tensors to attention).
    """

    scaling: ClassVar[str] = "delayed"

    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[ScaleAlgo] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_attention_fields(self)
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"DelayedScaling margin must be a finite number >= 0, got {self.margin!r}")
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"DelayedScaling interval must be an int >= 1, got {self.interval!r}")
        if not (isinstance(self.amax_history_len, int) and self.amax_history_len >= 1):
            raise ValueError(
                f"DelayedScaling amax_history_len must be an int >= 1, got {self.amax_history_len!r}"
            )
        algo = self.amax_compute_algo
        if not (callable(algo) or algo in ("max", "most_recent")):
            raise ValueError(
                f"DelayedScaling amax_compute_algo must be 'max', 'most_recent' or a callable, got {algo!r}"
            )
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError(
                "DelayedScaling scaling_factor_compute_algo must be None or a callable, "
                f"got {self.scaling_factor_compute_algo!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
    """Scale from the tensor itself: scale = fp8_max / amax(tensor), computed just before the cast.
    fp8_dpa / fp8_mha: FP8 attention, as in DelayedScaling (q, k, v and dO current-scaled; the tensors the
    attention kernels write take the previous pass's amax)."""

    scaling: ClassVar[str] = "current"

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_attention_fields(self)


def _check_attention_fields(recipe: Recipe) -> None:
    for name in ("fp8_dpa", "fp8_mha"):
        if not isinstance(getattr(recipe, name), bool):
            raise TypeError(f"{type(recipe).__name__} {name} must be a bool, got {getattr(recipe, name)!r}")


@dataclass(frozen=True, kw_only=True)
class QParams:
    """How one operand's block scales are computed (TE's name). power_2_scale: each scale is rounded down
    to a power of two (the FP8 values then carry no rounding of the scale itself); amax_epsilon: a floor
    under each tile's amax."""

    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.power_2_scale, bool):
            raise TypeError(f"QParams.power_2_scale must be a bool, got {self.power_2_scale!r}")
        if not (isinstance(self.amax_epsilon, (int, float)) and math.isfinite(self.amax_epsilon)
                and self.amax_epsilon >= 0):
            raise ValueError(f"QParams.amax_epsilon must be a finite number >= 0, got {self.amax_epsilon!r}")


_FP32_BLOCK_SCALES = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
_BLOCK_QPARAMS = QParams(power_2_scale=not _FP32_BLOCK_SCALES)


@dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
    """One scale per 1x128 tile or 128x128 block, each from its own amax (TE's recipe and arguments).

    x_block_scaling_dim / w_block_scaling_dim / grad_block_scaling_dim: 1 for 1x128 tiles (one scale per
    128 consecutive elements of a row), 2 for 128x128 blocks. Defaults (DeepSeek-V3's): inputs and output
    gradients in 1x128 tiles, weights in 128x128 blocks. Two operands of one GEMM cannot both be 2-D.
    A tile's scale is fp8_max / amax, rounded down to a power of two unless fp32 scales are asked for
    (QParams.power_2_scale=False, or NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 for the defaults, TE's switch).
    A 1x128-tiled operand used by two GEMMs along different dims (x: rows in fprop, columns in wgrad) is
    quantized twice from the high-precision tensor, once per direction, in one pass (docs/fp8.md).
    Every GEMM accumulates with split accumulation, as TE enforces. fp8_format: E4M3 (default) or
    HYBRID (E5M2 gradients); all-E5M2 is refused, as in TE.
    """

    scaling: ClassVar[str] = "block"

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = _BLOCK_QPARAMS
    fp8_quant_fwd_weight: QParams = _BLOCK_QPARAMS
    fp8_quant_bwd_grad: QParams = _BLOCK_QPARAMS
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling {name} must be 1 (1x128 tiles) or 2 (128x128 blocks), "
                                 f"got {getattr(self, name)!r}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if getattr(self, f"{a}_block_scaling_dim") == 2 and getattr(self, f"{b}_block_scaling_dim") == 2:
                raise ValueError(f"Float8BlockScaling: {a}_block_scaling_dim=2 and {b}_block_scaling_dim=2 make a "
                                 f"GEMM of two 128x128-block operands, which no kernel runs; make one of them 1")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                raise ValueError(f"Float8BlockScaling needs split accumulation: {name}.use_split_accumulator "
                                 f"must be True, got False")
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(f"Float8BlockScaling {name} must be a te_parallel.recipe.QParams, got "
                                f"{getattr(self, name)!r}")
        if self.fp8_format is Format.E5M2:
            raise ValueError("Float8BlockScaling takes fp8_format=Format.E4M3 or Format.HYBRID; all-E5M2 training "
                             "is not supported (as in TE)")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("Float8BlockScaling: fp8_dpa / fp8_mha (FP8 attention) are not supported under block "
                             "scaling; leave them False")
        if self.backward_override is not None:
            raise ValueError(f"Float8BlockScaling backward_override={self.backward_override!r} is not supported by "
                             f"te_parallel; leave it None")

    def block_dim(self, role: str) -> int:
        """1 (1x128 tiles) or 2 (128x128 blocks) for the operand role "x", "w" or "grad"."""
        return getattr(self, f"{role}_block_scaling_dim")

    def qparams(self, role: str) -> QParams:
        return {"x": self.fp8_quant_fwd_inp, "w": self.fp8_quant_fwd_weight, "grad": self.fp8_quant_bwd_grad}[role]


@dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (32-element blocks with E8M0 scales): Blackwell only; te_parallel does not run it. The name exists
    for TE's clients; fp8_autocast refuses it in one line."""

    scaling: ClassVar[str] = "mxfp8"
    fp8_format: Format = Format.E4M3

    def mxfp8(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4 (FP4 with 16-element blocks): Blackwell only; te_parallel does not run it. The name exists for TE's
    clients; fp8_autocast refuses it in one line."""

    scaling: ClassVar[str] = "nvfp4"
    fp8_format: Format = Format.E4M3

    def nvfp4(self) -> bool:
        return True


UNSUPPORTED_SCALING = {"mxfp8": "MXFP8BlockScaling (MXFP8, a Blackwell format)",
                       "nvfp4": "NVFP4BlockScaling (NVFP4, a Blackwell format)"}
