"""TE's `transformer_engine.pytorch.tensor.float8_tensor`: per-tensor FP8 (te_parallel.fp8.quantizers)."""
from transformer_engine.pytorch.tensor.quantized_tensor import (Float8CurrentScalingQuantizer, Float8Quantizer,
                                                                Float8Tensor, Float8TensorStorage)

__all__ = ["Float8Tensor", "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer"]
