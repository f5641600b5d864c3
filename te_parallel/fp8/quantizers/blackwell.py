"""MXFP8 and NVFP4: TE's names for Blackwell formats te_parallel does not run. They exist so that code naming
them imports and type checks work; a quantizer can be made (as in TE, which refuses it when it is used) and
raises one line when it quantizes; making a tensor raises."""
from __future__ import annotations

from te_parallel.fp8.quantizers.base import QuantizedTensor, Quantizer

__all__ = ["MXFP8Quantizer", "NVFP4Quantizer", "MXFP8Tensor", "NVFP4Tensor"]

_FORMATS = {"MXFP8": "MXFP8 (32-element blocks, E8M0 scales)", "NVFP4": "NVFP4 (FP4 E2M1, 16-element blocks)"}


def _refuse(name: str, fmt: str):
    raise NotImplementedError(f"{name}: {_FORMATS[fmt]} is a Blackwell (sm_100) format, not implemented in "
                              f"te_parallel; use Float8BlockQuantizer (1x128 / 128x128 block scaling), "
                              f"Float8CurrentScalingQuantizer or Float8Quantizer")


class _BlackwellQuantizer(Quantizer):
    """A quantizer that can be made (TE's tests and clients build them in parameter lists and configs) and
    refuses in one line when it is used."""

    FORMAT = ""

    def __init__(self, *args, rowwise: bool = True, columnwise: bool = True, **kwargs) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    def quantize(self, *args, **kwargs):
        _refuse(type(self).__name__, self.FORMAT)

    __call__ = update_quantized = make_empty = _quantize = _empty = quantize

    def _tensor_type(self):
        _refuse(type(self).__name__, self.FORMAT)

    def copy(self):
        return self


class MXFP8Quantizer(_BlackwellQuantizer):
    """TE's MXFP8 quantizer (Blackwell): it can be made; using it raises."""

    FORMAT = "MXFP8"


class NVFP4Quantizer(_BlackwellQuantizer):
    """TE's NVFP4 quantizer (Blackwell): it can be made; using it raises."""

    FORMAT = "NVFP4"


class MXFP8Tensor(QuantizedTensor):
    """TE's MXFP8 tensor (Blackwell): nothing is one; constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "MXFP8")


class NVFP4Tensor(QuantizedTensor):
    """TE's NVFP4 tensor (Blackwell): nothing is one; constructing one raises."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__, "NVFP4")
