"""TE's `transformer_engine.pytorch.attention`."""
import torch

from transformer_engine.pytorch._missing import missing_class
from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

InferenceParams = missing_class("attention.InferenceParams", "KV-cache inference (InferenceParams)")


class _SplitAlongDim:
    """TE's split of a fused QKV tensor into views: `_SplitAlongDim.apply(x, dim, sizes)` -> tuple."""

    @staticmethod
    def apply(mixed: torch.Tensor, dim: int, split_sizes, *args):
        return tuple(torch.split(mixed, list(split_sizes), dim=dim))


__all__ = ["DotProductAttention", "MultiheadAttention", "InferenceParams", "RotaryPositionEmbedding",
           "apply_rotary_pos_emb", "_SplitAlongDim"]
