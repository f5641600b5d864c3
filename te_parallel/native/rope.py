"""The RoPE kernel (csrc/kernels/rope.cu; C API te_parallel/rope.h): q or k rotated by its angles in one
pass, forward or backward, computed in fp32 and rounded once.

Under torch.compile `rope` is the custom op te_parallel::rope (an opaque node of the graph, with a fake
kernel for tracing), which runs this kernel when the graph runs; te_parallel.ops.rope registers its CPU
kernel (its PyTorch path)."""
from __future__ import annotations

import torch

from typing import Optional

from te_parallel.native import DTYPES, HIGH_PRECISION_DTYPES, describe, launch_on, require

__all__ = ["usable", "rope"]


def usable(x: torch.Tensor, freqs: torch.Tensor) -> bool:
    """True if the kernel takes x [S, B, H, D] (last dim contiguous, fp32/fp16/bf16 on CUDA) and angles
    freqs [S, rot] (fp32, last dim contiguous, on x's device), with the extension loaded."""
    return (x.is_cuda and x.dim() == 4 and x.numel() > 0 and x.stride(-1) == 1 and x.dtype in DTYPES
            and x.dtype in HIGH_PRECISION_DTYPES and freqs.dim() == 2 and freqs.dtype is torch.float32
            and freqs.device == x.device and freqs.stride(-1) == 1 and freqs.shape[0] == x.shape[0]
            and 2 <= freqs.shape[1] <= x.shape[3] and freqs.shape[1] % 2 == 0)


def rope(x: torch.Tensor, freqs: torch.Tensor, backward: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [S, B, H, D] rotated by freqs [S, rot] (rope.h's map, or its transpose when `backward`), into `out`
    (x's shape and dtype, D contiguous, any other strides) or a new contiguous tensor."""
    if torch.compiler.is_compiling():
        y = _rope_op(x, freqs, backward)
        return y if out is None else out.copy_(y)
    module = require("rope", "rope")
    if not usable(x, freqs):
        raise ValueError(f"rope: got x {describe(x)} (strides {tuple(x.stride())}) and freqs {describe(freqs)}; "
                         "need x [S, B, H, D] fp32/fp16/bf16 on CUDA with D contiguous, and fp32 freqs [S, rot] on "
                         "its device with rot even, 2 <= rot <= D")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif not (out.shape == x.shape and out.dtype == x.dtype and out.device == x.device and out.stride(-1) == 1):
        raise ValueError(f"rope: out is {describe(out)} (strides {tuple(out.stride())}); need {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} with the last dim contiguous")
    s, b, h, d = x.shape
    guard, stream = launch_on(x.device)
    with guard:
        module.rope(x.data_ptr(), out.data_ptr(), freqs.data_ptr(), DTYPES[x.dtype], s, b, h, d, x.stride(0),
                    x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), freqs.stride(0),
                    freqs.shape[1], backward, stream)
    return out


@torch.library.custom_op("te_parallel::rope", mutates_args=(), device_types="cuda")
def _rope_op(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    return rope(x, freqs, backward)


@_rope_op.register_fake
def _(x, freqs, backward):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
