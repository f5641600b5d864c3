"""TE's `transformer_engine.pytorch.tensor.mxfp8_tensor` (types only: no MXFP8 in te_parallel)."""
from transformer_engine.pytorch.tensor.quantized_tensor import MXFP8Quantizer, MXFP8Tensor

__all__ = ["MXFP8Tensor", "MXFP8Quantizer"]
