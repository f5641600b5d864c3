"""TE's `transformer_engine.pytorch.tensor`: te_parallel's quantizers and quantized tensors (quantized_tensor.py)."""
from transformer_engine.pytorch.tensor.quantized_tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                                                                Float8BlockwiseQTensorStorage,
                                                                Float8CurrentScalingQuantizer, Float8Quantizer,
                                                                Float8Tensor, Float8TensorStorage, MXFP8Quantizer,
                                                                MXFP8Tensor, MXFP8TensorStorage, NVFP4Quantizer,
                                                                NVFP4Tensor, NVFP4TensorStorage, QuantizedTensor,
                                                                QuantizedTensorBase, QuantizedTensorStorage, Quantizer)

__all__ = ["QuantizedTensor", "QuantizedTensorStorage", "QuantizedTensorBase", "Quantizer", "Float8Tensor",
           "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Tensor",
           "MXFP8TensorStorage", "MXFP8Quantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "Float8BlockQuantizer",
           "NVFP4Tensor", "NVFP4TensorStorage", "NVFP4Quantizer"]
