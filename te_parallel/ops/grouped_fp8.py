"""GroupedFP8: how a grouped linear layer (one GEMM per expert) quantizes its operands in this pass.

The grouped layer's FP8 counterpart of ops.fp8_gemm_config.GemmFP8. The casts are of whole operands, never a
loop over experts:
* x [M, K] and dy [M, N], the rows of all experts at once, are cast ONCE each, by the recipe's input and
  gradient quantizers as GEMM 0's operands (a quantizer with state reads GEMM 0's input / gradient slot of
  the module's FP8ScalingState). Per tensor: one scale for the grouped operand. 1x128 tiles: along K they
  are per row, hence per expert, whatever the split; the columnwise tiles that wgrad reads run along M, so an
  expert's tiles are its own only where every expert's rows are a multiple of the quantizer's row_alignment
  (GroupedLinear checks it where m_splits is on the host).
* W [G, N, K], the stacked experts' weights, gets one scale PER EXPERT: per-tensor weight quantizers give the
  G scales from one amax reduction of all the experts' weights at once (`expert_scales`; the delayed family
  takes GEMM g's weight slot for expert g, so each expert's history is its own); a tiled weight quantizer
  casts W as one [G·N, K] tensor whose 128-row blocks are each one expert's (`quantize_blocks`; rows padded
  to a multiple of 128 per expert where N is not one).
Per-expert weight scales cost nothing in the grouped GEMM (torch._scaled_grouped_mm takes one scale per
column of each B[g]), follow each expert's own range, and are what a per-expert te.Linear would use.

Nothing here asks which recipe made the quantizers: `missing_for_grouped(quantizers)` says in words what a
recipe's quantizers lack for these casts and GEMMs (None: they run), from what the quantizers declare.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BLOCK, quantize_blockwise
from te_parallel.fp8.gemm_quantizers import GemmQuantizers, Granularity, OperandQuantizer, gemm_quantizers
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.ops import grouped_cast
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
                           eps: float = 0.0, cast: Optional[Callable] = None) -> GroupedBlockWeight:
    """Block-quantize W [G, N, K] per expert in one cast (both directions for 1x128 tiles). cast: a tiled
    quantizer's `quantize_blocks(x, rowwise=, columnwise=)` (None: fp8.blockwise's, with pow2 and eps)."""
    g, n, k = w3.shape
    w2 = _per_expert_rows(w3, BLOCK)
    np_ = w2.shape[0] // max(g, 1)
    if cast is None:
        q = quantize_blockwise(w2, fp8_dtype, block_dim, rowwise=True, columnwise=block_dim == 1, pow2=pow2,
                               eps=eps)
    else:
        q = cast(w2, rowwise=True, columnwise=block_dim == 1)
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


def _scales_of(q: OperandQuantizer) -> str:
    if q.granularity is Granularity.TENSOR:
        return q.granularity.words
    return f"{q.granularity.words} ({q.role}_block_scaling_dim={q.granularity.block_dim})"


# id(quantizers) -> (quantizers, what they lack): a recipe's set is made once (and frozen), so its answer is
# worked out once, not on every call (the set is held so that its id is not reused while the entry exists)
_MISSING: Dict[int, Tuple[GemmQuantizers, Optional[str]]] = {}


def missing_for_grouped(quantizers: GemmQuantizers) -> Optional[str]:
    """What `quantizers` lack for a grouped linear layer's casts and GEMMs, in words (None: nothing). The
    grouped GEMMs take one scale per tensor for all three operands (each expert's weight its own:
    `expert_scales`), or 1x128 tiles of the input and gradient with 1x128 / 128x128 weights cast through
    `quantize_blocks`."""
    hit = _MISSING.get(id(quantizers))
    if hit is not None and hit[0] is quantizers:
        return hit[1]
    if len(_MISSING) >= 64:
        _MISSING.clear()
    missing = _missing(quantizers)
    _MISSING[id(quantizers)] = (quantizers, missing)
    return missing


def _missing(quantizers: GemmQuantizers) -> Optional[str]:
    x, w, dy = quantizers.input, quantizers.weight, quantizers.grad
    if quantizers.per_tensor:
        if not w.gives_expert_scales:
            return (f"its weight quantizer {type(w).__name__} gives no per-expert scales (expert_scales: one scale "
                    f"per expert's weight, all cast at once)")
        return None
    tile = Granularity.TILE_1x128
    if x.granularity is not tile or dy.granularity is not tile or w.granularity is Granularity.TENSOR:
        return (f"grouped GEMMs take 1x128 tiles of the input and gradient with tiled weights, or one scale per "
                f"tensor for all three; its input has {_scales_of(x)}, its weight {_scales_of(w)}, its gradient "
                f"{_scales_of(dy)}")
    if not callable(getattr(w, "quantize_blocks", None)):
        return (f"its tiled weight quantizer {type(w).__name__} has no quantize_blocks(x, rowwise, columnwise) to "
                f"cast the experts' weights as one tensor")
    return None


@dataclass(slots=True)
class GroupedFP8:
    """A grouped layer's FP8 plan of one call: each cast is its operand's quantizer's (the recipe's
    GemmQuantizers, `quantizers`; the module checks them with missing_for_grouped first). For the quantizers
    it is the GEMM config of GEMM 0 (`state`, `gemm`, `fwd_scale`, `record`), as GemmFP8 is for a linear layer."""

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
    gemm: int = 0  # the weight cache's key; GEMM 0 to the quantizers (its slots are the grouped operands')
    # the recipe's quantizer of each operand kind (te_parallel.fp8.gemm_quantizers; None: looked up here)
    quantizers: Optional[GemmQuantizers] = None

    def __post_init__(self) -> None:
        if self.quantizers is None:
            self.quantizers = gemm_quantizers(self.recipe)

    # weights ----------------------------------------------------------------------------------------
    def quantize_weight(self, w2d: torch.Tensor, amax_group=None):
        """The experts' weights ([G·N, K], rows of expert g at g·N) quantized per expert."""
        w3 = w2d.view(self.num_gemms, -1, w2d.shape[1])
        q = self.quantizers.weight
        if q.granularity is not Granularity.TENSOR:
            return quantize_grouped_block(w3, q.fp8_dtype, q.granularity.block_dim, cast=q.quantize_blocks)
        scale = q.expert_scales(expert_amax(w3), self, amax_group)
        return quantize_grouped(w3, scale, q.fp8_dtype)

    def record_weight_amax(self, w2d: torch.Tensor) -> None:
        """Calibration: the experts' weight amaxes, where the weight quantizer keeps state."""
        q = self.quantizers.weight
        if q.has_state:
            q.record_expert_amax(expert_amax(w2d.view(self.num_gemms, -1, w2d.shape[1])), self)

    # activations and gradients -----------------------------------------------------------------------
    def cast_input(self, x: torch.Tensor, transpose: bool):
        """x [M, K] (all experts' rows), with its transposed copy (per tensor) or columnwise tiles when wgrad
        will read it."""
        return self.quantizers.input.quantize(x, self, transpose, self.group)

    def cast_grad(self, dy: torch.Tensor, rowwise: bool, transpose: bool):
        """dy [M, N]: rowwise for dgrad, transposed / columnwise for wgrad."""
        q = self.quantizers.grad
        if rowwise or not transpose:
            out = q.quantize(dy, self, transpose, self.group)
        else:
            out = q.quantize_columnwise(dy, self, self.group)
        self.on_backward()
        return out

    def record_amax(self, t: torch.Tensor, backward: bool) -> None:
        """Calibration: record the amax the input (or gradient) cast would have recorded."""
        (self.quantizers.grad if backward else self.quantizers.input).record_amax(t, self)
        if backward:
            self.on_backward()

    def on_backward(self) -> None:
        if self.backward_done is not None:
            self.backward_done()

