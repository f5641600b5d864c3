"""TE's `transformer_engine.pytorch.tensor` (types; see quantized_tensor.py)."""
from transformer_engine.pytorch.tensor.quantized_tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                                                                Float8CurrentScalingQuantizer, Float8Quantizer,
                                                                Float8Tensor, MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer,
                                                                NVFP4Tensor, QuantizedTensor, QuantizedTensorBase,
                                                                Quantizer)

__all__ = ["QuantizedTensor", "QuantizedTensorBase", "Quantizer", "Float8Tensor", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "MXFP8Tensor", "MXFP8Quantizer", "Float8BlockwiseQTensor",
           "Float8BlockQuantizer", "NVFP4Tensor", "NVFP4Quantizer"]
