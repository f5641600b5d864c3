"""TE's `transformer_engine.pytorch.tensor.float8_blockwise_tensor` (types only)."""
from transformer_engine.pytorch.tensor.quantized_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor

__all__ = ["Float8BlockwiseQTensor", "Float8BlockQuantizer"]
