"""TE's quantizer and quantized-tensor classes: te_parallel's (te_parallel.fp8.quantizers), under TE's paths.

`Float8Quantizer`, `Float8CurrentScalingQuantizer` and `Float8BlockQuantizer` quantize for real (CPU and
CUDA); `Float8Tensor` and `Float8BlockwiseQTensor` carry TE's attributes and scale layouts. MXFP8 and NVFP4
(Blackwell formats) exist by name and raise when made.

te_parallel's own FP8 tensors are registered as instances of TE's types, so client checks such as
Megatron's `is_float8tensor` see them: `te_parallel.Float8Weight` (the FP8 weight parameter of
quantized_model_init) and te_parallel's GEMM operand `te_parallel.Float8Tensor` count as a `Float8Tensor`
(and so a `QuantizedTensor`). The registration is made when this module is imported.

TE's storage classes (`*TensorStorage`, TE 2.9; `QuantizedTensorBase` before) are types here: te_parallel's
quantizers always return the tensor classes, which are instances of them; making one directly raises.
"""
from __future__ import annotations

import abc

import te_parallel
from te_parallel.fp8.quantizers import (Float8BlockQuantizer, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer,
                                        Float8Quantizer, Float8Tensor, MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer,
                                        NVFP4Tensor, QuantizedTensor, Quantizer)

from transformer_engine.pytorch._missing import not_implemented

__all__ = ["QuantizedTensor", "QuantizedTensorStorage", "QuantizedTensorBase", "Quantizer", "Float8Tensor",
           "Float8TensorStorage", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Tensor",
           "MXFP8TensorStorage", "MXFP8Quantizer", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "Float8BlockQuantizer",
           "NVFP4Tensor", "NVFP4TensorStorage", "NVFP4Quantizer", "prepare_for_saving", "restore_from_saved"]

for _cls in (te_parallel.Float8Weight, te_parallel.Float8Tensor):
    Float8Tensor.register(_cls)


class QuantizedTensorStorage(abc.ABC):
    """TE's base of the storage classes (a type: te_parallel's quantized tensors are instances)."""

    def __new__(cls, *args, **kwargs):
        not_implemented(f"tensor.{cls.__name__}", f"constructing TE's storage class {cls.__name__} (te_parallel's "
                                                  f"quantizers return the tensor classes)")


QuantizedTensorBase = QuantizedTensorStorage  # TE 2.4-2.8's name


class Float8TensorStorage(QuantizedTensorStorage):
    """Type of per-tensor FP8 storage."""


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    """Type of block-scaled FP8 storage."""


class MXFP8TensorStorage(QuantizedTensorStorage):
    """Type of MXFP8 storage (nothing is one)."""


class NVFP4TensorStorage(QuantizedTensorStorage):
    """Type of NVFP4 storage (nothing is one)."""


for _storage, _tensor in ((QuantizedTensorStorage, QuantizedTensor), (Float8TensorStorage, Float8Tensor),
                          (Float8BlockwiseQTensorStorage, Float8BlockwiseQTensor), (MXFP8TensorStorage, MXFP8Tensor),
                          (NVFP4TensorStorage, NVFP4Tensor)):
    _storage.register(_tensor)


def prepare_for_saving(*tensors):
    """TE's helper for save_for_backward: te_parallel's quantized tensors are tensors, so they are saved as
    they are: (the tensors, a None per tensor)."""
    return list(tensors), [None] * len(tensors)


def restore_from_saved(tensors, saved_tensors, return_saved_tensors: bool = False):
    """The inverse of prepare_for_saving: the saved tensors, one per entry."""
    count = len(tensors)
    restored, rest = list(saved_tensors[:count]), list(saved_tensors[count:])
    return (restored, rest) if return_saved_tensors else restored
