"""TE's fused MoE router kernels: import-only in te_parallel."""
from transformer_engine.pytorch._missing import missing_function

_WHAT = "the fused MoE router"
fused_topk_with_score_function = missing_function("router.fused_topk_with_score_function", _WHAT)
fused_compute_score_for_moe_aux_loss = missing_function("router.fused_compute_score_for_moe_aux_loss", _WHAT)
fused_moe_aux_loss = missing_function("router.fused_moe_aux_loss", _WHAT)

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]
