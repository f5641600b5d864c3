"""TE's fused MoE router functions (`transformer_engine.pytorch.router`): te_parallel's, with TE's signatures."""
from te_parallel import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, fused_topk_with_score_function

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]
