"""Mixture of Experts: te_parallel.MoELayer (router, token dispatch with expert parallelism, grouped SwiGLU
experts) and its pieces."""
from te_parallel.moe.dispatch import AllToAll, combine, dispatch, exchange_counts
from te_parallel.moe.experts import (ExpertLinear, ExpertRows, GatedGroupedLinear, GroupedMLP, fp8_row_alignment,
                                     pad_rows, unpad_rows)
from te_parallel.moe.layer import LayerNormMoE, MoEConfig, MoELayer, moe_aux_loss
from te_parallel.moe.router import Routing, TopKRouter

__all__ = ["MoELayer", "MoEConfig", "LayerNormMoE", "moe_aux_loss", "TopKRouter", "Routing", "GroupedMLP",
           "GatedGroupedLinear", "ExpertLinear", "ExpertRows", "fp8_row_alignment", "pad_rows", "unpad_rows",
           "AllToAll", "dispatch", "combine", "exchange_counts"]
