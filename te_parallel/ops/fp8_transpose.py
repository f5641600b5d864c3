"""The transposed copy of FP8 bytes: t [..., R, C] (any strides) -> a contiguous [..., C, R], byte for byte.

What needs it: dgrad of the grouped layers reads each expert's weight W[g] [N, K] as a column-major B, i.e. the
bytes of W[g]ᵀ; the cast writes W row-major (fprop's layout), so backward makes Wᵀ once per step. torch's
strided copy of a 1-byte [G, N, K] -> [G, K, N] moves the bytes with uncoalesced accesses (for the 128 experts of
a 2048 -> 1536 layer, 403 MB, it took 2.25 ms on an H200: ~0.36 TB/s). The Triton kernel here reads 64x64
tiles along C, and writes them along R (Triton moves the tile through shared memory between the two layouts):
one coalesced read and one coalesced write of every byte.

On the CPU, and in traced code (torch.compile generates its own transpose), torch's copy runs; both give the
same bytes. The bytes are moved as uint8 (any 1-byte dtype: e4m3, e5m2).
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: torch's copy runs
    triton = None

__all__ = ["transposed_copy", "transposed_copy_reference"]

_TILE = 64
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """t [..., R, C] of a 1-byte dtype -> contiguous [..., C, R] with the same bytes (one kernel on CUDA)."""
    if t.dim() < 2 or t.element_size() != 1:
        raise ValueError(f"transposed_copy: needs a tensor of 2 or more dims and a 1-byte dtype, got shape "
                         f"{tuple(t.shape)} {t.dtype}")
    if not t.is_cuda or triton is None or torch.compiler.is_compiling():
        return transposed_copy_reference(t)
    *batch, r, c = t.shape
    out = torch.empty((*batch, c, r), dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    _launch(t.reshape(-1, r, c), out.view(-1, c, r))
    return out


def transposed_copy_reference(t: torch.Tensor) -> torch.Tensor:
    """torch's copy: what transposed_copy computes."""
    return t.transpose(-2, -1).contiguous()


def _launch(src: torch.Tensor, dst: torch.Tensor) -> None:
    """src [B, R, C] (any strides) into dst [B, C, R] (contiguous); the grid's second axis runs over B."""
    b, r, c = src.shape
    guard = contextlib.nullcontext()
    if src.is_cuda and src.get_device() != _current_device():  # (Triton launches on the current device)
        guard = torch.cuda.device(src.get_device())
    tiles = -(-r // _TILE) * -(-c // _TILE)
    s, d = src.view(torch.uint8), dst.view(torch.uint8)
    with guard:
        for b0 in range(0, b, 65535):  # (the grid's second axis holds at most 65535 programs)
            nb = min(b - b0, 65535)
            _transpose_kernel[(tiles, nb)](s[b0:b0 + nb], d[b0:b0 + nb], r, c, *s.stride(), BLOCK_R=_TILE,
                                           BLOCK_C=_TILE, num_warps=4)


if triton is not None:

    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, R, C, stride_sb, stride_sr, stride_sc,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # dst[b, c, r] = src[b, r, c] for one BLOCK_R x BLOCK_C tile of src
        t = tl.program_id(0)
        bi = tl.program_id(1).to(tl.int64)
        c_tiles = tl.cdiv(C, BLOCK_C)
        r0 = (t // c_tiles).to(tl.int64) * BLOCK_R
        c0 = (t % c_tiles).to(tl.int64) * BLOCK_C
        rows = tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R - r0) & (cols[None, :] < C - c0)
        src = src_ptr + bi * stride_sb + r0 * stride_sr + c0 * stride_sc + (rows[:, None] * stride_sr
                                                                             + cols[None, :] * stride_sc)
        tile = tl.load(src, mask=mask)
        dst = dst_ptr + bi * R * C + c0 * R + r0 + (cols[None, :] * R + rows[:, None])
        tl.store(dst, tile, mask=mask)
