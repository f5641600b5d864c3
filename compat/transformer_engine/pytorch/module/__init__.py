"""TE's `transformer_engine.pytorch.module`."""
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, get_workspace, initialize_ub
from transformer_engine.pytorch.module.fp8_padding import Fp8Padding, Fp8Unpadding
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear, is_module_grouped_tensor_path_supported
from transformer_engine.pytorch.module.layernorm import LayerNorm
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.module.rmsnorm import RMSNorm

__all__ = ["TransformerEngineBaseModule", "get_workspace", "initialize_ub", "Fp8Padding", "Fp8Unpadding",
           "GroupedLinear", "is_module_grouped_tensor_path_supported", "LayerNorm", "LayerNormLinear", "LayerNormMLP",
           "Linear", "RMSNorm"]
