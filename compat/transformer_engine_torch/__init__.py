"""TE's compiled extension `transformer_engine_torch` (`tex`), as far as the stand-in has it.

te_parallel's kernels are reached through te_parallel.native, with other signatures, so this module is
not TE's extension: it gives TE's dtype codes (`DType`, te_parallel's) and, import-only, the names that
TE's clients and tests call (each raises NotImplementedError naming what is missing when called).
Any other name is an AttributeError, so `hasattr(tex, name)` answers False for what is not here.

Megatron-core imports this module guarded (`tex = None` when missing) and calls it only for context
parallelism with packed sequences (`thd_get_partitioned_indices`), which te_parallel does not implement.
"""
import transformer_engine  # noqa: F401  (refuses to load beside NVIDIA's TE, whose extension this would shadow)
from te_parallel.fp8.quantizers import DType

from transformer_engine.pytorch._missing import missing_class, missing_function

_PACKAGE = "transformer_engine_torch"
_STATE = "TE's per-module FP8 metadata and its fused update (te_parallel keeps FP8 state in each module's fp8_state)"

FP8TensorMeta = missing_class("FP8TensorMeta", _STATE, package=_PACKAGE)
fused_amax_and_scale_update_after_reduction = missing_function("fused_amax_and_scale_update_after_reduction", _STATE,
                                                               package=_PACKAGE)
thd_get_partitioned_indices = missing_function("thd_get_partitioned_indices",
                                               "context parallelism with packed (thd) sequences", package=_PACKAGE)

__all__ = ["DType", "FP8TensorMeta", "fused_amax_and_scale_update_after_reduction", "thd_get_partitioned_indices"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"transformer_engine_torch.{name}: TE's compiled extension is not part of te_parallel; the "
                         f"stand-in provides only {', '.join(__all__)} (docs/compat.md)")
