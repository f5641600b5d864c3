from te_parallel.module.attention import DotProductAttention
from te_parallel.module.grouped_linear import GroupedLinear
from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.module.layernorm_linear import LayerNormLinear
from te_parallel.module.layernorm_mlp import LayerNormMLP
from te_parallel.module.linear import Linear
from te_parallel.module.multi_head_attention import MultiheadAttention
from te_parallel.module.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from te_parallel.module.transformer import TransformerLayer

__all__ = ["Linear", "GroupedLinear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
           "DotProductAttention", "MultiheadAttention", "TransformerLayer", "RotaryPositionEmbedding", "apply_rotary_pos_emb"]
