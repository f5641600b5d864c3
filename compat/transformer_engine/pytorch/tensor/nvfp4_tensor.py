"""TE's `transformer_engine.pytorch.tensor.nvfp4_tensor` (types only)."""
from transformer_engine.pytorch.tensor.quantized_tensor import NVFP4Quantizer, NVFP4Tensor

__all__ = ["NVFP4Tensor", "NVFP4Quantizer"]
