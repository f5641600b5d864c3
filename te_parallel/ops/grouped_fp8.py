"""GroupedFP8: how a grouped linear layer (one GEMM per expert) quantizes its operands in this pass.

The grouped layer's FP8 counterpart of ops.fp8_gemm_config.GemmFP8. The casts are of whole operands, never a
loop over experts:
* x [M, K] and dy [M, N], the rows of all experts at once, are cast ONCE each. Per-tensor recipes give the
  grouped operand one scale (its slot is GEMM 0's input / gradient slot of the module's FP8ScalingState);
  block scaling gives it 1x128 tiles, which along K are per row, hence per expert, whatever the split. The
  columnwise tiles that wgrad reads run along M: an expert's tiles are its own only where every expert's rows
  are a multiple of 128 (GroupedLinear checks it where m_splits is on the host).
* W [G, N, K], the stacked experts' weights, gets one scale PER EXPERT (per-tensor recipes: expert g's weight
  takes GEMM g's weight slot, so each expert's delayed-scaling history is its own), from one amax reduction of
  all the experts' weights at once; block scaling quantizes W as one [G·N, K] tensor whose 128-row blocks are
  each one expert's (rows padded to a multiple of 128 per expert where N is not one).
Per-expert weight scales cost nothing in the grouped GEMM (torch._scaled_grouped_mm takes one scale per
column of each B[g]), follow each expert's own range, and are what a per-expert te.Linear would use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BLOCK, quantize_blockwise
from te_parallel.fp8.scaling import current_scale_torch
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.ops import grouped_cast
from te_parallel.ops.cast import amax_of, quantize, quantize_current
from te_parallel.ops.fp8_gemm_config import _reduce_amax, _spans_ranks
from te_parallel.ops.fp8_transpose import transposed_copy
from te_parallel.recipe import Recipe, fp8_max

_CAST_CHUNK = 1 << 24  # elements per step of the per-expert weight cast (a 64 MiB fp32 temporary)


@dataclass
class GroupedFloat8Weight:
    """The experts' weights W [G, N, K] in FP8 with one scale per expert (value = data[g] * scale_inv[g])."""

    data: torch.Tensor                    # [G, N, K]
    scale_inv: torch.Tensor               # [G] fp32
    scale: Optional[torch.Tensor] = None  # [G] fp32: the encoding scales (a snapshot)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    def transposed(self) -> torch.Tensor:
        """[G, K, N] contiguous: each expert's Wᵀ bytes (what dgrad reads as a column-major W[g]), made on use
        (ops.fp8_transpose: one coalesced kernel on CUDA)."""
        return transposed_copy(self.data)

    def dequantize(self) -> torch.Tensor:
        return self.data.to(torch.float32) * self.scale_inv.reshape(-1, 1, 1)


@dataclass
class GroupedBlockWeight:
    """The experts' weights W [G, N, K] block-scaled per expert (the layouts of fp8.blockwise, stacked on G).

    block_dim 2 (128x128 blocks): scale_inv [G, ceil(N/128), ceil(K/128)]; the transpose is exact.
    block_dim 1 (1x128 tiles): rowwise along K, scale_inv [G, ceil(K/128), N]; columnwise along N (dgrad),
    data_t [G, K, N] with scale_inv_t [G, ceil(N/128), K]."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: Optional[torch.Tensor]
    scale_inv_t: Optional[torch.Tensor]
    block_dim: int
    fp8_dtype: torch.dtype

    def rows_operand_b(self):
        """fprop's B: (W[g]ᵀ [G, K, N], each column-major; its scales per group; block dim)."""
        b = self.data.transpose(1, 2)
        return b, (self.scale_inv.transpose(1, 2) if self.block_dim == 2 else self.scale_inv), self.block_dim

    def cols_operand_b(self):
        """dgrad's B: (W[g] [G, N, K], each column-major from the columnwise bytes; its scales; block dim)."""
        if self.block_dim == 2:  # the blocks are square: Wᵀ's bytes, made on use, with the same scales
            return transposed_copy(self.data).transpose(1, 2), self.scale_inv, 2
        return self.data_t.transpose(1, 2), self.scale_inv_t, 1

    def dequantize(self) -> torch.Tensor:
        """[G, N, K] fp32, from the rowwise bytes."""
        g, n, k = self.data.shape
        s = self.scale_inv.to(torch.float32)
        if self.block_dim == 2:
            s = s.repeat_interleave(BLOCK, 1)[:, :n].repeat_interleave(BLOCK, 2)[:, :, :k]
        else:
            s = s.transpose(1, 2).repeat_interleave(BLOCK, 2)[:, :, :k]
        return self.data.to(torch.float32) * s


def _per_expert_rows(w3: torch.Tensor, multiple: int) -> torch.Tensor:
    """w3 [G, N, K] as [G·Np, K] with each expert's rows zero-padded to Np, a multiple of `multiple` (a view
    where N is one). Zero rows change no tile's amax: each expert's blocks are those of its weight alone."""
    g, n, k = w3.shape
    pad = -n % multiple
    if pad:
        w3 = torch.nn.functional.pad(w3, (0, 0, 0, pad))
    return w3.reshape(g * (n + pad), k)


def quantize_grouped_block(w3: torch.Tensor, fp8_dtype: torch.dtype, block_dim: int, *, pow2: bool = True,
                           eps: float = 0.0) -> GroupedBlockWeight:
    """Block-quantize W [G, N, K] per expert in one cast (both directions for 1x128 tiles)."""
    g, n, k = w3.shape
    w2 = _per_expert_rows(w3, BLOCK)
    np_ = w2.shape[0] // max(g, 1)
    q = quantize_blockwise(w2, fp8_dtype, block_dim, rowwise=True, columnwise=block_dim == 1, pow2=pow2, eps=eps)
    data = q.data.view(g, np_, k)[:, :n]
    data = data if np_ == n else data.contiguous()
    if block_dim == 2:
        return GroupedBlockWeight(data, q.scale_inv.view(g, np_ // BLOCK, -1), None, None, 2, fp8_dtype)
    kt = q.scale_inv.shape[0]
    scale_inv = q.scale_inv.view(kt, g, np_)[:, :, :n].permute(1, 0, 2)  # [G, K/128, N]
    data_t = q.data_t.view(k, g, np_)[:, :, :n].permute(1, 0, 2).contiguous()  # [G, K, N]
    return GroupedBlockWeight(data, scale_inv, data_t, q.scale_inv_t.view(g, np_ // BLOCK, k), 1, fp8_dtype)


def expert_amax(w3: torch.Tensor) -> torch.Tensor:
    """[G] fp32: max |W[g]| of each expert, one reduction over all of them (NaN propagates)."""
    lo, hi = torch.aminmax(w3.detach().reshape(w3.shape[0], -1), dim=1)
    return torch.maximum(hi, lo.neg()).to(torch.float32)


def quantize_grouped(w3: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> GroupedFloat8Weight:
    """W [G, N, K] cast with one scale per expert ([G] fp32): the per-expert form of ops.cast.quantize, bytes
    fp8(clamp(fp32(w) · scale_g)). On CUDA one kernel (ops.grouped_cast); elsewhere `quantize_grouped_reference`."""
    scale = scale.detach().to(torch.float32)
    w3 = w3.detach()
    if grouped_cast.usable(w3):
        data = grouped_cast.quantize_experts(w3, scale, fp8_dtype)
    else:
        data = quantize_grouped_reference(w3, scale, fp8_dtype)
    return GroupedFloat8Weight(data, torch.reciprocal(scale), scale.clone())


def quantize_grouped_reference(w3: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """quantize_grouped's bytes [G, N, K] in torch ops: row chunks of at most _CAST_CHUNK elements bound the fp32
    temporary."""
    w3 = w3.detach()
    g, n, k = w3.shape
    limit = fp8_max(fp8_dtype)
    data = torch.empty((g, n, k), dtype=fp8_dtype, device=w3.device)
    rows_in, rows_out = w3.reshape(g * n, k), data.view(g * n, k)
    row_scale = scale.to(torch.float32).repeat_interleave(n).unsqueeze(1)  # [G·N, 1]
    step = max(_CAST_CHUNK // max(k, 1), 1)
    for r in range(0, g * n, step):
        rows_out[r:r + step] = (rows_in[r:r + step].to(torch.float32) * row_scale[r:r + step]).clamp_(-limit, limit)
    return data


@dataclass(slots=True)
class GroupedFP8:
    recipe: Recipe
    state: FP8ScalingState
    num_gemms: int
    weight: Optional[object]            # GroupedFloat8Weight / GroupedBlockWeight (None while calibrating)
    compute: bool                       # False: calibrating, record amaxes but multiply in high precision
    group: Optional[dist.ProcessGroup]  # current scaling: the TP ranks whose amaxes are all-reduced first
    fwd_scale: Optional[torch.Tensor] = None  # recompute: the forward scales of the original pass
    record: bool = True                 # recompute: amaxes were recorded by the original pass
    weight_src: Optional[torch.Tensor] = None  # (set by the module's weight cache; W is kept to backward)
    # delayed scaling: called after the backward cast (te_parallel.fp8.autocast.record_backward)
    backward_done: Optional[Callable[[], None]] = None
    gemm: int = 0  # the weight cache's key

    @property
    def quantizers(self):
        """The recipe's quantizer of each operand kind (te_parallel.fp8.gemm_quantizers; the weight cache's key)."""
        from te_parallel.fp8.gemm_quantizers import gemm_quantizers

        return gemm_quantizers(self.recipe)

    @property
    def delayed(self) -> bool:
        return self.recipe.scaling == "delayed"

    @property
    def block(self) -> bool:
        return self.recipe.scaling == "block"

    def _scale(self, backward: bool, slot):
        """(scale, amax cells or None) of delayed-scaling slots: an int (one slot) or a slice (the experts')."""
        row0 = self.state.history_row0(backward)
        scales = self.state.bwd_scale if backward else (self.fwd_scale if self.fwd_scale is not None
                                                        else self.state.fwd_scale)
        if isinstance(slot, int):
            scale, cells = scales[slot], row0[slot: slot + 1]
        else:
            scale, cells = scales[slot], row0[slot]
        return scale, cells if (self.record or backward) else None

    # weights ----------------------------------------------------------------------------------------
    def quantize_weight(self, w2d: torch.Tensor, amax_group=None):
        """The experts' weights ([G·N, K], rows of expert g at g·N) quantized per expert."""
        w3 = w2d.view(self.num_gemms, -1, w2d.shape[1])
        dtype = self.recipe.fp8_format.fwd_dtype
        if self.block:
            qp = self.recipe.qparams("w")
            return quantize_grouped_block(w3, dtype, self.recipe.block_dim("w"), pow2=qp.power_2_scale,
                                          eps=qp.amax_epsilon)
        amax = expert_amax(w3)
        if self.delayed:
            scale, cells = self._scale(False, slice(1, None, 2))  # weight slots 2g+1
            if cells is not None:
                cells.copy_(torch.maximum(cells, amax))
        else:
            scale = current_scale_torch(_reduce_amax(amax, amax_group) if _spans_ranks(amax_group) else amax,
                                        fp8_max(dtype))
        return quantize_grouped(w3, scale, dtype)

    def record_weight_amax(self, w2d: torch.Tensor) -> None:
        """Calibration: the experts' weight amaxes (delayed scaling)."""
        if self.delayed:
            cells = self._scale(False, slice(1, None, 2))[1]
            if cells is not None:
                cells.copy_(torch.maximum(cells, expert_amax(w2d.view(self.num_gemms, -1, w2d.shape[1]))))

    # activations and gradients -----------------------------------------------------------------------
    def cast_input(self, x: torch.Tensor, transpose: bool):
        """x [M, K] (all experts' rows), with its transposed copy (per tensor) or columnwise tiles (block) when
        wgrad will read it."""
        return self._cast(x, False, rowwise=True, transpose=transpose)

    def cast_grad(self, dy: torch.Tensor, rowwise: bool, transpose: bool):
        """dy [M, N]: rowwise for dgrad, transposed / columnwise for wgrad."""
        q = self._cast(dy, True, rowwise=rowwise, transpose=transpose)
        self.on_backward()
        return q

    def _cast(self, t: torch.Tensor, backward: bool, rowwise: bool, transpose: bool):
        fmt = self.recipe.fp8_format
        dtype = fmt.bwd_dtype if backward else fmt.fwd_dtype
        if self.block:
            role = "grad" if backward else "x"
            qp = self.recipe.qparams(role)
            return quantize_blockwise(t, dtype, 1, rowwise=rowwise, columnwise=transpose, pow2=qp.power_2_scale,
                                      eps=qp.amax_epsilon)
        if self.delayed:
            scale, cell = self._scale(backward, 0)  # GEMM 0's input / gradient slot: the grouped operand's
            return quantize(t, scale, dtype, amax_out=cell, transpose=transpose, rowwise=rowwise or not transpose)
        amax = _reduce_amax(amax_of(t), self.group) if _spans_ranks(self.group) else None
        return quantize_current(t, dtype, amax=amax, transpose=transpose)

    def record_amax(self, t: torch.Tensor, backward: bool) -> None:
        """Calibration: record the amax the input (or gradient) cast would have recorded."""
        if self.delayed:
            cell = self._scale(backward, 0)[1]
            if cell is not None:
                torch.maximum(cell, amax_of(t).view(1), out=cell)
        if backward:
            self.on_backward()

    def on_backward(self) -> None:
        if self.backward_done is not None:
            self.backward_done()

