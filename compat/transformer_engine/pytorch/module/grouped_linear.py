"""TE's te.GroupedLinear (one GEMM per MoE expert): import-only in te_parallel."""
import torch

from transformer_engine.pytorch._missing import missing_class

GroupedLinear = missing_class("GroupedLinear", "GroupedLinear (MoE grouped GEMMs)", torch.nn.Module)


def is_module_grouped_tensor_path_supported(recipe, dtype: torch.dtype) -> bool:
    """TE's check for GroupedLinear's grouped-tensor GEMM path: False for every recipe and dtype, since
    te_parallel has no GroupedLinear."""
    return False


__all__ = ["GroupedLinear", "is_module_grouped_tensor_path_supported"]
