"""The per-expert FP8 cast of the stacked experts' weights in one kernel (Triton).

W [G, N, K] (high precision, any strides) with one encoding scale per expert, scale [G] fp32, becomes the bytes
fp8(clamp(fp32(W[g]) · scale[g], ±fp8_max)) [G, N, K], rounded to nearest even: te_parallel.ops.grouped_fp8's
quantize_grouped, whose torch form (the reference, and the CPU's path) runs four elementwise kernels over a
chunked fp32 temporary (about 27 bytes of traffic per weight against 3 here: for the 201M weights of a 128-expert
2048 -> 1536 layer, ~5.4 GB against ~0.6 GB per cast).

Bit for bit the torch form's bytes: one fp32 multiplication (round to nearest), a clamp by comparisons (NaN fails
both and stays NaN, as torch.clamp keeps it), and the hardware's nearest-even conversion (te_parallel.ops.
block_cast's _to_fp8). One program per BLOCK_R x BLOCK_C tile of the [G·N, K] rows; each row reads its expert's
scale (row // N).
"""
from __future__ import annotations

import contextlib

import torch

from te_parallel.recipe import fp8_max

try:
    import triton
    import triton.language as tl

    from te_parallel.ops.block_cast import _to_fp8
except ImportError:  # a CPU-only install: the torch form runs
    triton = None

__all__ = ["usable", "quantize_experts"]

_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_R, _BLOCK_C = 32, 256
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def usable(w3: torch.Tensor) -> bool:
    """True for a CUDA W of a dtype the kernel reads, with triton importable, outside traced code."""
    return (w3.is_cuda and triton is not None and w3.dtype in _IN_DTYPES and w3.dim() == 3
            and not torch.compiler.is_compiling())


def quantize_experts(w3: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bytes [G, N, K] of W [G, N, K] times scale [G] (fp32, any stride: e.g. every other slot of a
    delayed-scaling state), one launch."""
    if not usable(w3) or scale.device != w3.device:
        raise ValueError(f"quantize_experts: needs a CUDA W [G, N, K] of {', '.join(map(str, _IN_DTYPES))} with triton, "
                         f"outside a torch.compile trace, and the scale on W's device; got W {tuple(w3.shape)} "
                         f"{w3.dtype} on {w3.device}, scale on {scale.device} (quantize_grouped_reference runs elsewhere)")
    g, n, k = w3.shape
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale.shape != (g,):
        raise ValueError(f"quantize_experts: got W {tuple(w3.shape)}, scale {tuple(scale.shape)}, {fp8_dtype}; need "
                         f"scale [{g}] (one per expert) and torch.float8_e4m3fn or torch.float8_e5m2")
    out = torch.empty((g, n, k), dtype=fp8_dtype, device=w3.device)
    if out.numel():
        _launch(w3, scale.to(torch.float32), out)
    return out


def _launch(w3: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    g, n, k = w3.shape
    guard = contextlib.nullcontext()
    if w3.is_cuda and w3.get_device() != _current_device():  # (Triton launches on the current device)
        guard = torch.cuda.device(w3.get_device())
    grid = (-(-(g * n) // _BLOCK_R), -(-k // _BLOCK_C))
    with guard:
        # (scale may be a strided view: delayed scaling's weight slots are every other entry of the state)
        _experts_cast_kernel[grid](w3, scale, out, g * n, n, k, *w3.stride(), scale.stride(0),
                                   FP8_MAX=fp8_max(out.dtype), E5M2=out.dtype == torch.float8_e5m2,
                                   BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=4)


if triton is not None:

    @triton.jit
    def _experts_cast_kernel(w_ptr, scale_ptr, out_ptr, ROWS, N, K, stride_g, stride_n, stride_k, stride_s,
                             FP8_MAX: tl.constexpr, E5M2: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        # out[r, c] = fp8(clamp(fp32(w[r // N, r % N, c]) * scale[r // N])) over rows r of [G·N, K]; scale[g] sits
        # at g * stride_s
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < ROWS
        mask = row_ok[:, None] & (cols[None, :] < K)
        expert = rows // N
        src = w_ptr + (expert * stride_g + (rows - expert * N) * stride_n)[:, None] + cols[None, :] * stride_k
        w = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + expert * stride_s, mask=row_ok, other=0.0)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], _to_fp8(w * s[:, None], FP8_MAX, E5M2), mask=mask)
