"""TE's quantized tensor types, as types: isinstance works on te_parallel's FP8 tensors.

te_parallel holds FP8 weights as `te_parallel.Float8Weight` (quantized_model_init) and FP8 GEMM operands
as `te_parallel.Float8Tensor`; both are instances of QuantizedTensor and Float8Tensor here, so client
checks such as Megatron's `is_float8tensor` see them. MXFP8 / block-scaled / NVFP4 tensors do not
exist in te_parallel: nothing is an instance of those, and constructing TE's classes raises.
"""
from __future__ import annotations

import abc

import te_parallel

from transformer_engine.pytorch._missing import not_implemented

__all__ = ["QuantizedTensor", "QuantizedTensorBase", "Quantizer", "Float8Tensor", "Float8Quantizer",
           "Float8CurrentScalingQuantizer", "MXFP8Tensor", "MXFP8Quantizer", "Float8BlockwiseQTensor",
           "Float8BlockQuantizer", "NVFP4Tensor", "NVFP4Quantizer"]


class QuantizedTensorBase(abc.ABC):
    """Base of TE's quantized tensors (a type for isinstance; te_parallel's FP8 tensors are registered)."""

    def __init__(self, *args, **kwargs) -> None:
        not_implemented(type(self).__name__, f"constructing TE's {type(self).__name__}")


class QuantizedTensor(QuantizedTensorBase):
    """TE 2.x's base of all quantized tensors."""


class Float8Tensor(QuantizedTensor):
    """FP8 data with a per-tensor scale: te_parallel.Float8Weight and te_parallel.Float8Tensor."""


for _cls in (te_parallel.Float8Weight, te_parallel.Float8Tensor):
    Float8Tensor.register(_cls)


class MXFP8Tensor(QuantizedTensor):
    """MXFP8 (not in te_parallel)."""


class Float8BlockwiseQTensor(QuantizedTensor):
    """FP8 with block scales (not in te_parallel)."""


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 (not in te_parallel)."""


class Quantizer(abc.ABC):
    """TE's quantizer objects: te_parallel's casts are functions of the recipe, not objects; import-only."""

    def __init__(self, *args, **kwargs) -> None:
        not_implemented(type(self).__name__, f"TE's quantizer objects ({type(self).__name__})")


class Float8Quantizer(Quantizer):
    pass


class Float8CurrentScalingQuantizer(Quantizer):
    pass


class MXFP8Quantizer(Quantizer):
    pass


class Float8BlockQuantizer(Quantizer):
    pass


class NVFP4Quantizer(Quantizer):
    pass
