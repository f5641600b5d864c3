"""MXFP8 and NVFP4: TE's names for Blackwell formats te_parallel does not run. They exist so that code naming
them imports and type checks work; making one raises one line."""
from __future__ import annotations

from te_parallel.fp8.quantizers.base import QuantizedTensor, Quantizer

__all__ = ["MXFP8Quantizer", "NVFP4Quantizer", "MXFP8Tensor", "NVFP4Tensor"]

_FORMATS = {"MXFP8": "MXFP8 (32-element blocks, E8M0 scales)", "NVFP4": "NVFP4 (FP4 E2M1, 16-element blocks)"}


def _refuse(name: str, fmt: str):
    raise NotImplementedError(f"{name}: {_FORMATS[fmt]} is a Blackwell (sm_100) format, not implemented in "
                              f"te_parallel; use Float8BlockQuantizer (1x128 / 128x128 block scaling), "
                              f"Float8CurrentScalingQuantizer or Float8Quantizer")


class MXFP8Quantizer(Quantizer):
    """TE's MXFP8 quantizer (Blackwell): constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "MXFP8")


class NVFP4Quantizer(Quantizer):
    """TE's NVFP4 quantizer (Blackwell): constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "NVFP4")


class MXFP8Tensor(QuantizedTensor):
    """TE's MXFP8 tensor (Blackwell): nothing is one; constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "MXFP8")


class NVFP4Tensor(QuantizedTensor):
    """TE's NVFP4 tensor (Blackwell): nothing is one; constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "NVFP4")
