"""TE's te.GroupedLinear (one GEMM per MoE expert): import-only in te_parallel."""
import torch

from transformer_engine.pytorch._missing import missing_class

GroupedLinear = missing_class("GroupedLinear", "GroupedLinear (MoE grouped GEMMs)", torch.nn.Module)

__all__ = ["GroupedLinear"]
