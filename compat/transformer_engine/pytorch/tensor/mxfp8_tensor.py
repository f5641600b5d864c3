"""TE's `transformer_engine.pytorch.tensor.mxfp8_tensor` (types only: MXFP8 is a Blackwell format te_parallel
does not run; making a quantizer or tensor raises)."""
from transformer_engine.pytorch.tensor.quantized_tensor import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage

__all__ = ["MXFP8Tensor", "MXFP8TensorStorage", "MXFP8Quantizer"]
