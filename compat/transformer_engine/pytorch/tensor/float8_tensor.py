"""TE's `transformer_engine.pytorch.tensor.float8_tensor`."""
from transformer_engine.pytorch.tensor.quantized_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

__all__ = ["Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"]
