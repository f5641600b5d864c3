"""TE 1.x's path `transformer_engine.pytorch.float8_tensor`."""
from transformer_engine.pytorch.tensor.quantized_tensor import Float8Tensor

__all__ = ["Float8Tensor"]
