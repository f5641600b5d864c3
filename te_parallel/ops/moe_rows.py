"""The two row movements of MoE token routing, each one pass over the rows (Triton), with torch references.

    gather_rows(x [R, H], index [M])              out[j] = scale[j] · x[index[j]], zeros where index[j] < 0;
                                                  optionally dots[j] = <x[index[j]], other[j]>
    segment_sum_rows(x [R, H], perm, offsets)     out[t] = Σ_{offsets[t] <= i < offsets[t+1]} w[i] · x[perm[i]]

moe_permute is a gather (its backward a segment sum: each token's row gradients); moe_unpermute is a segment sum
(its backward a gather scaled by the merging probs, with the probs' gradients as the dot products of the same
pass); moe_sort_chunks_by_index, a permutation of whole rows, stays on index_select. The kernels read each moved row once and write it once:
the products and sums are taken in fp32 (fp64 for fp64 rows) in registers and rounded once on the store, so no
fp32 copy of the rows is ever written, no atomics are used, and a token's rows are summed in a fixed order (the
order of perm), which makes the sums deterministic.

Route (decided here, once per call): the kernels for CUDA tensors of bf16 / fp16 / fp32 / fp64 with triton
importable, outside traced code; the torch reference elsewhere (CPU, compiled graphs).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch reference runs
    triton = None

__all__ = ["usable", "gather_rows", "gather_rows_reference", "segment_sum_rows", "segment_sum_rows_reference"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def usable(x: torch.Tensor) -> bool:
    """True where the kernels run: a CUDA tensor of a dtype they handle, triton importable, outside traced code."""
    return x.is_cuda and triton is not None and x.dtype in _DTYPES and not torch.compiler.is_compiling()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along the hidden dim (rows may be strided)."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------------
# gather_rows
# ----------------------------------------------------------------------------------------------------

def gather_rows_reference(x: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None,
                          dot_with: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The torch form of gather_rows (one zero row appended to x stands for every index < 0)."""
    num_rows, hidden = x.shape
    padded = torch.cat([x, x.new_zeros((1, hidden))])
    rows = padded.index_select(0, torch.where(index >= 0, index, num_rows))  # [M, H]
    acc = _acc_dtype(x.dtype)
    dots = None if dot_with is None else torch.linalg.vecdot(rows.to(acc), dot_with.to(acc))
    if scale is not None:  # (product in acc, one rounding to x's dtype)
        rows = torch.mul(rows, scale.to(acc).unsqueeze(1), out=torch.empty_like(rows))
    return rows, dots


def gather_rows(x: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None,
                dot_with: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [M, H] in x's dtype, dots [M] in fp32 / fp64 or None) for x [R, H] and index [M] int64:
    out[j] = scale[j] · x[index[j]] (zeros where index[j] < 0), dots[j] = <x[index[j]], dot_with[j]> when
    dot_with [M, H] is given. index values must be < R."""
    if not usable(x):
        return gather_rows_reference(x, index, scale, dot_with)
    return _gather_launch(x, index, scale, dot_with)


def _gather_launch(x, index, scale, dot_with):
    num_out, hidden = index.shape[0], x.shape[1]
    acc = _acc_dtype(x.dtype)
    out = torch.empty((num_out, hidden), dtype=x.dtype, device=x.device)
    dots = None if dot_with is None else torch.empty(num_out, dtype=acc, device=x.device)
    if num_out == 0 or hidden == 0:
        return out, None if dots is None else dots.zero_()
    x = _rows(x)
    other = x if dot_with is None else _rows(dot_with)
    block = min(triton.next_power_of_2(hidden), 2048)
    rows = min(16, max(1, 8192 // block))  # rows per program: 8192 elements (16 KiB of bf16) in flight
    with _on_device(x):
        _gather_kernel[(triton.cdiv(num_out, rows),)](
            x, x.stride(0), index.contiguous(), x if scale is None else scale.contiguous(), other, other.stride(0),
            out, out.stride(0), x if dots is None else dots, num_out, hidden, HAS_SCALE=scale is not None,
            HAS_DOT=dots is not None, ACC_F64=acc == torch.float64, BLOCK_M=rows, BLOCK_H=block,
            NUM_TILES=triton.cdiv(hidden, block), num_warps=8 if rows * block >= 8192 else 4)
    return out, dots


# ----------------------------------------------------------------------------------------------------
# segment_sum_rows
# ----------------------------------------------------------------------------------------------------

def segment_sum_rows_reference(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor,
                               weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch form of segment_sum_rows: an index_add_ in fp32 / fp64, rounded once."""
    num_tokens = offsets.shape[0] - 1
    acc = _acc_dtype(x.dtype)
    rows = x.index_select(0, perm).to(acc)  # [P, H]
    if weight is not None:
        rows = rows * weight.to(acc).unsqueeze(1)
    position = torch.arange(perm.shape[0], device=x.device)
    token = torch.searchsorted(offsets, position, right=True) - 1  # num_tokens past offsets[-1]
    out = torch.zeros((num_tokens + 1, x.shape[1]), dtype=acc, device=x.device)
    return out.index_add_(0, token.clamp(0, num_tokens), rows)[:num_tokens].to(x.dtype)


def segment_sum_rows(x: torch.Tensor, perm: torch.Tensor, offsets: torch.Tensor,
                     weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [N, H] in x's dtype, N = len(offsets) - 1, for x [R, H], perm [P] int64 (rows of x) and offsets
    [N + 1] int64 (non-decreasing, offsets[0] = 0, offsets[N] <= P): out[t] = Σ_{offsets[t] <= i < offsets[t+1]}
    weight[i] · x[perm[i]] (weight [P], or 1), summed in fp32 / fp64 in the order of i and rounded once."""
    if not usable(x):
        return segment_sum_rows_reference(x, perm, offsets, weight)
    return _segment_sum_launch(x, perm, offsets, weight)


def _segment_sum_launch(x, perm, offsets, weight):
    num_tokens, hidden = offsets.shape[0] - 1, x.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or hidden == 0:
        return out
    x = _rows(x)
    block = min(triton.next_power_of_2(hidden), 1024)
    with _on_device(x):
        _segment_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
            x, x.stride(0), perm.contiguous(), offsets.contiguous(), x if weight is None else weight.contiguous(),
            out, out.stride(0), hidden, HAS_W=weight is not None, ACC_F64=_acc_dtype(x.dtype) == torch.float64,
            BLOCK_H=block, num_warps=4)
    return out


def _on_device(x: torch.Tensor):
    """Triton launches on the current device: switch to x's where it differs."""
    if x.is_cuda and x.get_device() != _current_device():
        return torch.cuda.device(x.get_device())
    return contextlib.nullcontext()


if triton is not None:

    @triton.jit
    def _gather_kernel(x_ptr, stride_x, index_ptr, scale_ptr, other_ptr, stride_other, out_ptr, stride_out, dot_ptr,
                       M, H, HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, ACC_F64: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, NUM_TILES: tl.constexpr):
        acc_ty = tl.float64 if ACC_F64 else tl.float32
        j = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] output rows
        jmask = j < M
        src = tl.load(index_ptr + j, mask=jmask, other=-1).to(tl.int64)
        valid = (src >= 0)[:, None]
        src_off = tl.maximum(src, 0)[:, None] * stride_x
        out_off = j[:, None] * stride_out
        other_off = j[:, None] * stride_other
        if HAS_SCALE:
            scale = tl.load(scale_ptr + j, mask=jmask, other=0.0).to(acc_ty)[:, None]
        cols = tl.arange(0, BLOCK_H)[None, :]
        dot = tl.zeros([BLOCK_M, BLOCK_H], dtype=acc_ty)
        for tile in range(NUM_TILES):
            h = tile * BLOCK_H + cols
            mask = jmask[:, None] & (h < H)
            v = tl.load(x_ptr + src_off + h, mask=mask & valid, other=0.0)
            if HAS_DOT:
                o = tl.load(other_ptr + other_off + h, mask=mask, other=0.0)
                dot += v.to(acc_ty) * o.to(acc_ty)
            if HAS_SCALE:
                v = v.to(acc_ty) * scale
            tl.store(out_ptr + out_off + h, v.to(out_ptr.dtype.element_ty), mask=mask)
        if HAS_DOT:
            tl.store(dot_ptr + j, tl.sum(dot, axis=1), mask=jmask)

    @triton.jit
    def _segment_sum_kernel(x_ptr, stride_x, perm_ptr, offsets_ptr, w_ptr, out_ptr, stride_out, H,
                            HAS_W: tl.constexpr, ACC_F64: tl.constexpr, BLOCK_H: tl.constexpr):
        acc_ty = tl.float64 if ACC_F64 else tl.float32
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = cols < H
        start = tl.load(offsets_ptr + t)
        end = tl.load(offsets_ptr + t + 1)
        acc = tl.zeros([BLOCK_H], dtype=acc_ty)
        # two rows per step (two loads in flight), added in order; a while loop, as the interpreter takes no
        # loaded bounds in range()
        i = start
        while i < end:
            two = i + 1 < end
            row0 = tl.load(perm_ptr + i).to(tl.int64)
            row1 = tl.load(perm_ptr + i + 1, mask=two, other=0).to(tl.int64)
            v0 = tl.load(x_ptr + row0 * stride_x + cols, mask=hmask, other=0.0).to(acc_ty)
            v1 = tl.load(x_ptr + row1 * stride_x + cols, mask=hmask & two, other=0.0).to(acc_ty)
            if HAS_W:
                v0 = v0 * tl.load(w_ptr + i).to(acc_ty)
                v1 = v1 * tl.load(w_ptr + i + 1, mask=two, other=0.0).to(acc_ty)
            acc += v0
            acc += v1
            i += 2
        tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=hmask)
