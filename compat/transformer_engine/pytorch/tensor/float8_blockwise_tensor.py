"""TE's `transformer_engine.pytorch.tensor.float8_blockwise_tensor`: 1x128 / 128x128 block-scaled FP8
(te_parallel.fp8.quantizers)."""
from transformer_engine.pytorch.tensor.quantized_tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                                                                Float8BlockwiseQTensorStorage)

__all__ = ["Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "Float8BlockQuantizer"]
