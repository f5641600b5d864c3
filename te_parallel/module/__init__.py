from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.module.layernorm_linear import LayerNormLinear
from te_parallel.module.layernorm_mlp import LayerNormMLP
from te_parallel.module.linear import Linear

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP"]
