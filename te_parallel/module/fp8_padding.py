"""Fp8Padding / Fp8Unpadding (TE's modules): pad each expert's rows to the alignment FP8 grouped GEMMs need.

The permuted tokens [sum(m_splits), H] hold num_gemms groups of m_splits[i] rows. Fp8Padding appends zero
rows to each group so its size becomes a multiple of align_size: the output is [sum(padded_m_splits), H],
group i at rows sum(padded_m_splits[:i]) + [0, m_splits[i]), then zeros. Fp8Unpadding drops those rows
again. Each is the other's adjoint, so the backward of one is the forward of the other (autograd builds
both from the index_copy / index_select below).

align_size None: taken from the recipe of the innermost `fp8_autocast` region on the first forward (as TE
does), and kept: the `row_alignment` its GEMM input and gradient quantizers declare
(te_parallel.fp8.gemm_quantizers), the larger of the two: 16 for one scale per tensor (FP8 GEMMs need
dimensions that are multiples of 16), 128 for 1x128 tiles (Float8BlockScaling: a tile along the token dim of
the weight-gradient operands must not straddle two experts); 16 outside any region, and for a recipe the
modules do not run (no GEMM quantizers registered: MXFP8, NVFP4).

m_splits is a host list (TE's contract), so the sizes are known without a device sync; the row map is built
on the device from one small host-to-device copy that does not block.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple

import torch

from te_parallel.fp8.autocast import current_frame
from te_parallel.fp8.gemm_quantizers import gemm_quantizers
from te_parallel.fp8.recipe_registry import factories_of
from te_parallel.ops.moe_permute import host_to_device

__all__ = ["Fp8Padding", "Fp8Unpadding", "align_size_for_recipe"]

_DEFAULT_ALIGN = 16


def align_size_for_recipe(recipe) -> int:
    """The row alignment grouped GEMMs need under `recipe`: the larger `row_alignment` of its GEMM input and
    gradient quantizers (module doc); 16 for None (no FP8 region) or a recipe without GEMM quantizers."""
    entry = None if recipe is None else factories_of(recipe)
    if entry is None or entry.gemm is None:
        return _DEFAULT_ALIGN
    quantizers = gemm_quantizers(recipe)
    return max(quantizers.input.row_alignment, quantizers.grad.row_alignment)


def _check_args(owner: str, num_gemms: int, align_size: Optional[int]) -> None:
    if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
        raise ValueError(f"{owner}: num_gemms must be an int >= 1, got {num_gemms!r}")
    if align_size is not None and (isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1):
        raise ValueError(f"{owner}: align_size must be None (from the recipe) or an int >= 1, got {align_size!r}")


def _splits(owner: str, m_splits, num_gemms: int) -> List[int]:
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.is_floating_point():
            raise ValueError(f"{owner}: m_splits is a {tuple(m_splits.shape)} {m_splits.dtype} tensor; need a list of "
                             f"{num_gemms} ints")
        m_splits = m_splits.tolist()  # (a device tensor costs a host sync; TE takes a list)
    if (not isinstance(m_splits, Sequence) or len(m_splits) != num_gemms
            or any(isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0 for m in m_splits)):
        raise ValueError(f"{owner}: m_splits is {m_splits!r}; need {num_gemms} ints >= 0 (one per GEMM)")
    return [int(m) for m in m_splits]


def _rows_2d(owner: str, inp: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
        raise ValueError(f"{owner}: inp must be a tensor [rows, hidden], got {type(inp).__name__}")
    flat = inp.reshape(-1, inp.shape[-1]) if inp.dim() != 2 else inp
    if flat.shape[0] != rows:
        raise ValueError(f"{owner}: inp has {flat.shape[0]} rows; {what} sum to {rows}")
    return flat


def _padded_rows(m_splits: List[int], padded: List[int], device: torch.device) -> torch.Tensor:
    """dst [sum(m_splits)]: the padded buffer's row for each unpadded row."""
    shifts, pad_start, start = [], 0, 0
    for m, p in zip(m_splits, padded):
        shifts.append(pad_start - start)
        start, pad_start = start + m, pad_start + p
    sizes = host_to_device(torch.tensor([m_splits, shifts], dtype=torch.int64), device)  # [2, G]: one copy
    shift = torch.repeat_interleave(sizes[1], sizes[0], output_size=start)  # [rows]
    return torch.arange(start, device=device) + shift


class _AlignedSplits(torch.nn.Module):
    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        _check_args(type(self).__name__, num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def _plan(self, m_splits) -> Tuple[List[int], List[int]]:
        m_splits = _splits(type(self).__name__, m_splits, self.num_gemms)
        if self.align_size is None:  # (TE's rule: the recipe of the first forward decides, once)
            frame = current_frame()
            self.align_size = align_size_for_recipe(None if frame is None else frame.recipe)
        a = self.align_size
        return m_splits, [(m + a - 1) // a * a for m in m_splits]

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Padding(_AlignedSplits):
    """Pad each of num_gemms row groups to a multiple of align_size (module doc).

    forward(inp [sum(m_splits), H], m_splits) -> (out [sum(padded_m_splits), H], padded_m_splits); inp itself
    (and m_splits) when no group needs padding."""

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, List[int]]:
        m_splits, padded = self._plan(m_splits)
        flat = _rows_2d("Fp8Padding", inp, sum(m_splits), "m_splits")
        if padded == m_splits:
            return inp, m_splits
        dst = _padded_rows(m_splits, padded, flat.device)
        out = flat.new_zeros((sum(padded), flat.shape[1]))
        return out.index_copy(0, dst, flat), padded


class Fp8Unpadding(_AlignedSplits):
    """Drop the rows Fp8Padding added (module doc).

    forward(inp [sum(padded_m_splits), H], m_splits) -> out [sum(m_splits), H], m_splits being the unpadded
    sizes; inp itself when no group was padded."""

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> torch.Tensor:
        m_splits, padded = self._plan(m_splits)
        flat = _rows_2d("Fp8Unpadding", inp, sum(padded), "the padded m_splits")
        if padded == m_splits:
            return inp
        return flat.index_select(0, _padded_rows(m_splits, padded, flat.device))
