"""TE 2.9's `transformer_engine.pytorch.tensor.storage`: the storage classes, as types (quantized_tensor.py)."""
from transformer_engine.pytorch.tensor.quantized_tensor import (Float8BlockwiseQTensorStorage, Float8TensorStorage,
                                                                MXFP8TensorStorage, NVFP4TensorStorage)

__all__ = ["Float8TensorStorage", "Float8BlockwiseQTensorStorage", "MXFP8TensorStorage", "NVFP4TensorStorage"]
