"""TE's dtype codes (`transformer_engine_torch.DType`'s values), as TE's quantizers take them."""
from __future__ import annotations

import enum

import torch

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "fp8_dtype_of", "torch_dtype"]


class DType(enum.IntEnum):
    """TE's dtype codes. A quantizer's `fp8_dtype` may be given as kFloat8E4M3 / kFloat8E5M2, as the torch
    dtypes, or as any enum with these codes (TE's own `transformer_engine_torch.DType`)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


# torch dtype <-> TE code, TE's names (transformer_engine.pytorch.constants)
TE_DType = {torch.uint8: DType.kByte, torch.int32: DType.kInt32, torch.float32: DType.kFloat32,
            torch.float16: DType.kFloat16, torch.bfloat16: DType.kBFloat16, torch.float8_e4m3fn: DType.kFloat8E4M3,
            torch.float8_e5m2: DType.kFloat8E5M2}
TE_DType_To_Torch = {code: dtype for dtype, code in TE_DType.items()}

_FP8 = (DType.kFloat8E4M3, DType.kFloat8E5M2)


def fp8_dtype_of(value, owner: str) -> DType:
    """The FP8 code of `value` (a torch FP8 dtype, a DType, or an enum / int with an FP8 code); else one line
    naming `owner` and what it takes."""
    code = None
    if isinstance(value, torch.dtype):
        code = TE_DType.get(value)
    elif not isinstance(value, (bool, float, str)):
        try:
            code = DType(int(value))
        except (TypeError, ValueError):
            code = None
    if code not in _FP8:
        raise ValueError(f"{owner}: fp8_dtype must be torch.float8_e4m3fn, torch.float8_e5m2, DType.kFloat8E4M3 or "
                         f"DType.kFloat8E5M2; got {value!r}")
    return code


def torch_dtype(code: DType) -> torch.dtype:
    return TE_DType_To_Torch[code]
