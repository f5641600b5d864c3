"""FP8 bytes back to high precision in one kernel (Triton): out = dtype(fp32(t8) · descale).

The torch form `(t8.to(float32) * descale).to(dtype)` (the reference, and the CPU's path) runs three elementwise
kernels and moves 1 + 4 + 4 + 4 + 4 + dtype bytes per element through two fp32 temporaries; the kernel reads
the byte and the scalar descale and writes the result once (3 bytes per element for bf16). Bit for bit the torch
form: the FP8 -> fp32 conversion is exact, the product is one fp32 multiplication rounded to nearest, and the
conversion to bf16/fp16 rounds to nearest even. descale is read from device memory (a 0-d or 1-element fp32
tensor, e.g. a view into a vector of descales), so no host synchronisation and no separate reciprocal launch.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch form runs
    triton = None

__all__ = ["usable", "dequantize", "dequantize_torch"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 4096
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def usable(t8: torch.Tensor, dtype: torch.dtype) -> bool:
    """True for contiguous CUDA FP8 bytes and an output dtype the kernel writes, triton importable, outside
    traced code."""
    return (t8.is_cuda and triton is not None and t8.dtype in _FP8 and dtype in _OUT and t8.is_contiguous()
            and not torch.compiler.is_compiling())


def dequantize_torch(t8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: fp8 -> fp32, times descale in fp32, -> dtype."""
    return (t8.to(torch.float32) * descale.reshape(()).to(torch.float32)).to(dtype)


def dequantize(t8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dtype(fp32(t8) · descale) of FP8 bytes t8 (any shape) and a 1-element fp32 descale on t8's device: one
    launch where `usable`, the torch form elsewhere."""
    if t8.dtype not in _FP8 or descale.numel() != 1:
        raise ValueError(f"dequantize: got {t8.dtype} bytes and a descale of {descale.numel()} elements; need "
                         f"torch.float8_e4m3fn or torch.float8_e5m2 bytes and one descale")
    if not usable(t8, dtype) or descale.dtype is not torch.float32 or descale.device != t8.device:
        return dequantize_torch(t8, descale, dtype)
    out = torch.empty(t8.shape, dtype=dtype, device=t8.device)
    if out.numel():
        _launch(t8, descale, out)
    return out


def _launch(t8: torch.Tensor, descale: torch.Tensor, out: torch.Tensor) -> None:
    n = t8.numel()
    guard = contextlib.nullcontext()
    if t8.is_cuda and t8.get_device() != _current_device():  # (Triton launches on the current device)
        guard = torch.cuda.device(t8.get_device())
    with guard:
        _dequantize_kernel[(triton.cdiv(n, _BLOCK),)](t8.view(-1), descale, out.view(-1), n, BLOCK=_BLOCK,
                                                      num_warps=8)


if triton is not None:

    @triton.jit
    def _dequantize_kernel(src_ptr, descale_ptr, out_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        descale = tl.load(descale_ptr).to(tl.float32)
        x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32) * descale
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)
