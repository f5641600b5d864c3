"""The dropout kernel (csrc/kernels/dropout.cu; C API te_parallel/dropout.h): out = residual + dropout(x)
in one pass, with a mask drawn from (seed, offset, element index) by Philox, so that the backward pass
regenerates it instead of reading a stored one."""
from __future__ import annotations

from typing import Optional

import torch

from te_parallel.native import DTYPES, HIGH_PRECISION_DTYPES, describe, launch_on, require

__all__ = ["usable", "dropout_add"]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def usable(x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> bool:
    """True if the kernel takes x (and residual: x's shape and dtype, on its device): contiguous,
    non-empty, 16-byte aligned fp32/fp16/bf16 CUDA tensors, with the extension loaded; not while
    torch.compile traces (it cannot trace into the extension)."""
    if torch.compiler.is_compiling() or not (x.is_cuda and x.dtype in DTYPES and x.dtype in HIGH_PRECISION_DTYPES
                                             and x.numel() > 0 and x.is_contiguous() and _aligned(x)):
        return False
    return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
                                and residual.is_contiguous() and _aligned(residual))


def dropout_add(x: torch.Tensor, residual: Optional[torch.Tensor], p: float, seed: int, offset: int,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """residual + dropout(x, p) (dropout alone without residual), the kept elements scaled by 1/(1 - p),
    with the mask of (seed, offset); the same call with x = the output's gradient and no residual is the
    backward. Into `out` (x's shape and dtype, contiguous; may be x or residual) or a new tensor."""
    module = require("dropout_add", "dropout")
    if not usable(x, residual) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_add: got x {describe(x)}, residual {describe(residual)}, p={p}; need contiguous "
                         "16-byte aligned fp32/fp16/bf16 CUDA tensors of one shape and dtype, 0 <= p < 1")
    if out is None:
        out = torch.empty_like(x)
    elif not (out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous()
              and _aligned(out)):
        raise ValueError(f"dropout_add: out is {describe(out)}; need {tuple(x.shape)} {x.dtype} on {x.device}, "
                         "contiguous and 16-byte aligned")
    guard, stream = launch_on(x.device)
    with guard:
        module.dropout_add(x.data_ptr(), 0 if residual is None else residual.data_ptr(), out.data_ptr(),
                           DTYPES[x.dtype], x.numel(), float(p), seed, offset, stream)
    return out
