"""TE's `transformer_engine.pytorch.tensor.nvfp4_tensor` (types only: NVFP4 is a Blackwell format te_parallel
does not run; making a quantizer or tensor raises)."""
from transformer_engine.pytorch.tensor.quantized_tensor import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage

__all__ = ["NVFP4Tensor", "NVFP4TensorStorage", "NVFP4Quantizer"]
