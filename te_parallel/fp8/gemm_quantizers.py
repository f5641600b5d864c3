"""The quantizers of the GEMM modules: what a recipe does to each GEMM operand, behind one interface.

A recipe makes a `GemmQuantizers`: one `OperandQuantizer` per operand kind of a linear layer's GEMMs,

    fprop  y  = x · Wᵀ    input (x), weight (W)
    dgrad  dx = dy · W    grad (dy), weight (Wᵀ)
    wgrad  dW = dyᵀ · x   grad (dyᵀ), input (xᵀ)

Each quantizer turns a high-precision tensor into the GEMM operand of its granularity (per tensor:
fp8.tensor.Float8Tensor; 1x128 tiles or 128x128 blocks: fp8.blockwise.BlockwiseTensor), with the
transposed copy / columnwise tiles that wgrad (and a tiled weight's dgrad) reads, from one read of the
source. The code around the GEMMs asks a quantizer what it needs to know, never which recipe made it:

* `granularity`: where the scales sit (Granularity); the GEMMs dispatch on the pair of their operands'.
* `scale_known_before_cast`: the scale exists before the tensor is read, so a producer (the norm, the
  activation kernel) can write the FP8 operand in its own pass (`scale_cell`).
* `scale_from_amax`: the scale is fp8_max / amax(tensor) (the amax all-reduced over the split GEMM's
  ranks), as ops.cast.quantize_current computes it, so a kernel that computes the amax itself (the one-call
  native Linear, the MLP activation's two passes) may cast in the quantizer's place.
* `has_state`: scales and amax histories live in the module's FP8ScalingState and are updated after each
  pass (the module registers the pending update with the autocast region).
* `row_alignment`: the multiple of rows each group of an operand's rows (one expert's tokens) is padded to
  (te.Fp8Padding): 16 for one scale per tensor, 128 for tiles (a columnwise tile along the rows must not
  straddle two experts; GroupedLinear requires it of tiled inputs and gradients when it computes dW).
* `gives_expert_scales` / `expert_scales(amax, cfg, amax_group)`: per-tensor scales of G tensors cast in
  one pass from their amaxes [G] (GroupedLinear's experts' weights, expert g being GEMM g).
* `quantize_columnwise(x, cfg, amax_group)`: the columnwise direction alone (a gradient only wgrad reads).

Families: `DelayedScalingQuantizer` (per tensor, scale from the amax history of earlier passes),
`CurrentScalingQuantizer` (per tensor, scale from the tensor's own amax), `BlockScalingQuantizer` (one
scale per tile or block, each from its own amax). All of them cast through ops.cast and
fp8.blockwise, the casts TE's public quantizers (fp8.quantizers) use.

A recipe type maps to its family through fp8.recipe_registry's `register_recipe`, one call that also gives
the recipe's TE-API quantizer factory (fp8.quantizers.recipes); the built-in recipes are registered at the end
of this module (the extension point: docs/architecture.md, "Adding a scaling recipe"). `gemm_quantizers(recipe)`
makes a recipe's set once and returns the same objects for the same recipe object (the autocast region holds
them for its forward).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BlockwiseTensor, quantize_blockwise
from te_parallel.fp8.quantizers.recipes import (block_quantizer, current_quantizer, delayed_quantizer,
                                                mxfp8_quantizer, nvfp4_quantizer)
from te_parallel.fp8.recipe_registry import factories_of, register_recipe, registered_names
from te_parallel.fp8.scaling import current_scale_torch
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops import cast as _cast
from te_parallel.parallel.groups import group_size
from te_parallel.recipe import (UNSUPPORTED_SCALING, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                MXFP8BlockScaling, NVFP4BlockScaling, QParams, Recipe, fp8_max)

__all__ = ["Granularity", "OperandQuantizer", "DelayedScalingQuantizer", "CurrentScalingQuantizer",
           "BlockScalingQuantizer", "GemmQuantizers", "register_recipe", "gemm_quantizers", "WeightSource",
           "BlockWeightSource"]


class Granularity(enum.Enum):
    """Where an operand's scales sit. The value is the block dim of Float8BlockScaling (0: per tensor)."""

    TENSOR = 0         # one scale for the whole tensor
    TILE_1x128 = 1     # one per 128 consecutive elements of a row (and of a column, columnwise)
    BLOCK_128x128 = 2  # one per 128x128 block

    @property
    def block_dim(self) -> int:
        return self.value

    @property
    def words(self) -> str:
        """How error messages name it."""
        return ("one scale per tensor", "1x128 tiles", "128x128 blocks")[self.value]


class OperandQuantizer:
    """The cast of one operand kind ("x": GEMM input, "w": weight, "grad": output gradient) of a recipe.

    `cfg` in the methods is the GemmFP8 of the GEMM being run (or the GroupedFP8 of a grouped layer, as
    GEMM 0): it carries the per-call state a quantizer with `has_state` reads (the module's FP8ScalingState,
    the GEMM's index, a recompute's forward scales, whether this pass records amaxes).

    What the code around the GEMMs asks of a quantizer (a new family declares each; the defaults are the
    safe answers):

    * `granularity` (Granularity): where the scales sit; `quantize` returns a Float8Tensor for TENSOR and
      an fp8.blockwise.BlockwiseTensor for the tiled ones.
    * `scale_known_before_cast` (False): the scale exists before the tensor is read; `scale_cell(cfg)`
      gives it to a producer that writes the FP8 operand in its own pass.
    * `scale_from_amax` (False): the scale is fp8_max / amax(tensor) (all-reduced over the split GEMM's
      ranks), so a kernel that computes the amax itself may cast in the quantizer's place.
    * `has_state` (False): scales and amax histories live in the module's FP8ScalingState and are
      updated after each pass; the casts record amaxes there.
    * `row_alignment` (16 per tensor, 128 tiled): the multiple of rows each group of this operand's rows
      (an expert's tokens) is padded to by te.Fp8Padding: FP8 GEMM dimensions are multiples of 16, and a
      tile's columnwise direction runs 128 rows, which must all be one expert's (GroupedLinear requires it
      of tiled inputs and gradients when it computes the weight gradient).
    * `gives_expert_scales` / `expert_scales(amax, cfg, amax_group)`: per-tensor families, the [G] scales
      of G tensors of this kind cast in one pass from their amaxes [G] (GroupedLinear casts all its
      experts' weights at once, one scale per expert, expert g being GEMM g). Given here for families
      with `scale_from_amax` and by the delayed family (each expert's slot, recording the amaxes there;
      `record_expert_amax` when calibrating); another per-tensor family defines `expert_scales`, or
      GroupedLinear refuses it in one line.
    * `quantize_columnwise(x, cfg, amax_group)`: the columnwise direction alone (a gradient that only
      wgrad reads); by default `quantize(..., transpose=True)`, which writes both.
    * `quantize_blocks(x, rowwise, columnwise)`: tiled families, the cast in the directions asked for
      (GroupedLinear quantizes its experts' weights through it as one tensor with per-expert rows).
    """

    __slots__ = ("role", "fp8_dtype", "backward", "granularity", "cache_key")
    scale_known_before_cast: ClassVar[bool] = False
    scale_from_amax: ClassVar[bool] = False
    has_state: ClassVar[bool] = False

    def __init__(self, role: str, fp8_dtype: torch.dtype, granularity: Granularity = Granularity.TENSOR) -> None:
        if role not in ("x", "w", "grad"):
            raise ValueError(f"{type(self).__name__}: role must be 'x', 'w' or 'grad', got {role!r}")
        self.role, self.fp8_dtype, self.backward = role, fp8_dtype, role == "grad"
        self.granularity = granularity
        # what a cached cast of this operand depends on besides the values and the FP8 dtype
        self.cache_key = (type(self).__name__, granularity)

    def quantize(self, x: torch.Tensor, cfg, transpose: bool = False, amax_group=None, dbias_out=None,
                 keep_scale: bool = False):
        """x [M, K] as a GEMM operand. transpose: also the columnwise direction (xᵀ / dyᵀ for wgrad).
        amax_group: the ranks over which a scale computed from the tensor is agreed (all-reduce MAX).
        dbias_out: receives the column sums of x (fp32 accumulation). keep_scale: a per-tensor operand
        keeps a snapshot of its scale (the weight: backward re-encodes Wᵀ with it)."""
        raise NotImplementedError(f"{type(self).__name__}.quantize")

    def scale_cell(self, cfg) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scale, amax cell or None) of a cast whose scale is known before it (scale_known_before_cast):
        what a producer that writes the FP8 operand in its own pass takes."""
        raise TypeError(f"{type(self).__name__}: the scale is computed from the tensor itself, not known before the "
                        f"cast (check scale_known_before_cast)")

    def record_amax(self, x: torch.Tensor, cfg) -> None:
        """Calibration (GEMMs in high precision): record the amax this cast would have recorded."""

    @property
    def row_alignment(self) -> int:
        """Rows per group (an expert's tokens) te.Fp8Padding pads to for this operand (class doc)."""
        return 16 if self.granularity is Granularity.TENSOR else 128

    def quantize_columnwise(self, x: torch.Tensor, cfg, amax_group=None):
        """x [M, K] as an operand of which only the columnwise direction (xᵀ / dyᵀ for wgrad) is read; a
        family that can skip the rowwise bytes does."""
        return self.quantize(x, cfg, True, amax_group)

    @property
    def gives_expert_scales(self) -> bool:
        """Whether `expert_scales` gives this per-tensor family's scales (class doc)."""
        return (self.granularity is Granularity.TENSOR
                and (self.scale_from_amax or type(self).expert_scales is not OperandQuantizer.expert_scales))

    def expert_scales(self, amax: torch.Tensor, cfg, amax_group=None) -> torch.Tensor:
        """[G] fp32: the scales of G tensors of this operand kind cast in one pass (a grouped layer's experts,
        expert g being GEMM g), from their amaxes [G] fp32 (this rank's; all-reduced MAX over amax_group
        first). Here: fp8_max / amax for a family with `scale_from_amax`."""
        if not self.scale_from_amax:
            raise TypeError(f"{type(self).__name__}: gives no per-expert scales (its scale is not fp8_max / amax); "
                            f"define expert_scales(amax, cfg, amax_group)")
        if spans_ranks(amax_group):
            amax = reduce_amax(amax, amax_group)
        return current_scale_torch(amax, fp8_max(self.fp8_dtype))

    def record_expert_amax(self, amax: torch.Tensor, cfg) -> None:
        """Calibration: record the amaxes [G] that expert_scales would have recorded (families with state)."""

    def backward_source(self, w, weight_src: Optional[torch.Tensor]):
        """What backward keeps of this GEMM's quantized weight `w`: w itself, or (weight_src given: the module
        does not keep W) a source that re-encodes dgrad's direction from the high-precision weight."""
        return w

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, fp8_dtype={self.fp8_dtype}, {self.granularity.name})"


class _PerTensorQuantizer(OperandQuantizer):
    __slots__ = ()

    def backward_source(self, w, weight_src):
        if weight_src is None or w.scale is None:
            return w
        return WeightSource(weight_src, w.scale, w.scale_inv, w.fp8_dtype)


class DelayedScalingQuantizer(_PerTensorQuantizer):
    """Per-tensor scale from the amax history (DelayedScaling). The scale of this pass is the one the last
    update computed, so it is known before the cast; the cast records the tensor's amax into row 0 of the
    history, folded into the next update (after the outermost autocast region, or at the end of backward)."""

    __slots__ = ()
    scale_known_before_cast = True
    has_state = True

    def _slot(self, gemm: int) -> int:
        if self.backward:
            return gemm
        return FP8ScalingState.input_slot(gemm) if self.role == "x" else FP8ScalingState.weight_slot(gemm)

    def scale_cell(self, cfg):
        slot, backward = self._slot(cfg.gemm), self.backward
        scale, cell = cfg.state.slot_views(backward, slot)
        if cfg.fwd_scale is not None and not backward:  # recompute: the original pass's scales
            scale = cfg.fwd_scale[slot]
        return scale, cell if (cfg.record or backward) else None

    def quantize(self, x, cfg, transpose=False, amax_group=None, dbias_out=None, keep_scale=False):
        scale, amax_out = self.scale_cell(cfg)
        return _cast.quantize(x, scale, self.fp8_dtype, amax_out=amax_out, transpose=transpose, dbias_out=dbias_out,
                              keep_scale=keep_scale)

    def record_amax(self, x, cfg) -> None:
        if cfg.record or self.backward:
            cell = cfg.state.slot_views(self.backward, self._slot(cfg.gemm))[1]
            torch.maximum(cell, _cast.amax_of(x).view(1), out=cell)

    def quantize_columnwise(self, x, cfg, amax_group=None):
        scale, amax_out = self.scale_cell(cfg)
        return _cast.quantize(x, scale, self.fp8_dtype, amax_out=amax_out, transpose=True, rowwise=False)

    def _expert_slots(self, count: int) -> slice:
        # GEMMs 0..count-1's slots of this kind: forward slots interleave input and weight (2g, 2g + 1)
        step = 1 if self.backward else 2
        first = self._slot(0)
        return slice(first, first + step * count, step)

    def expert_scales(self, amax, cfg, amax_group=None):
        """Each expert's scale from its own slot (GEMM g's), recording amax[g] there when this pass records;
        no all-reduce here (the update after the pass reduces the histories)."""
        slots = self._expert_slots(amax.numel())
        self.record_expert_amax(amax, cfg)
        if self.backward:
            return cfg.state.bwd_scale[slots]
        return (cfg.fwd_scale if cfg.fwd_scale is not None else cfg.state.fwd_scale)[slots]

    def record_expert_amax(self, amax, cfg) -> None:
        if cfg.record or self.backward:
            cells = cfg.state.history_row0(self.backward)[self._expert_slots(amax.numel())]
            cells.copy_(torch.maximum(cells, amax))


class CurrentScalingQuantizer(_PerTensorQuantizer):
    """Per-tensor scale from the tensor's own amax, just before the cast (Float8CurrentScaling); the amax of
    an operand of a split GEMM is all-reduced first, so that every rank encodes with the same scale."""

    __slots__ = ()
    scale_from_amax = True  # (a subclass with another cast sets it False)

    def quantize(self, x, cfg, transpose=False, amax_group=None, dbias_out=None, keep_scale=False):
        amax = reduce_amax(_cast.amax_of(x), amax_group) if spans_ranks(amax_group) else None
        return _cast.quantize_current(x, self.fp8_dtype, amax=amax, transpose=transpose, dbias_out=dbias_out,
                                      keep_scale=keep_scale)


class BlockScalingQuantizer(OperandQuantizer):
    """One scale per 1x128 tile or 128x128 block, each from its own amax (Float8BlockScaling). No state, and
    nothing to agree on across ranks: a tile's scale travels with its bytes. The columnwise direction of a
    tiled operand is quantized from the source (tiles along the other dim), not transposed from the bytes."""

    __slots__ = ("qparams",)

    def __init__(self, role: str, fp8_dtype: torch.dtype, block_dim: int, qparams: QParams) -> None:
        if block_dim not in (1, 2):
            raise ValueError(f"BlockScalingQuantizer: block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
        super().__init__(role, fp8_dtype, Granularity(block_dim))
        self.qparams = qparams

    def quantize(self, x, cfg=None, transpose=False, amax_group=None, dbias_out=None, keep_scale=False):
        if dbias_out is not None:
            dbias_out.copy_(x.sum(0, dtype=torch.float32))
        # (a 1x128-tiled weight: dgrad reads its tiles along N, made now with the rowwise ones)
        columnwise = transpose or (self.role == "w" and self.granularity is Granularity.TILE_1x128)
        return self.quantize_blocks(x, rowwise=True, columnwise=columnwise)

    def quantize_columnwise(self, x, cfg=None, amax_group=None):
        return self.quantize_blocks(x, rowwise=False, columnwise=True)

    def quantize_blocks(self, x: torch.Tensor, rowwise: bool = True, columnwise: bool = False) -> BlockwiseTensor:
        """x [M, K] in this operand's tiles / blocks, the directions asked for."""
        qp = self.qparams
        return quantize_blockwise(x, self.fp8_dtype, self.granularity.block_dim, rowwise=rowwise,
                                  columnwise=columnwise, pow2=qp.power_2_scale, eps=qp.amax_epsilon)

    def backward_source(self, w, weight_src):
        if weight_src is not None and w.data_t is None:
            return BlockWeightSource(weight_src, w, self)
        return w


@dataclass(frozen=True, slots=True)
class GemmQuantizers:
    """A recipe's quantizer of each operand kind of a linear layer's GEMMs (module doc)."""

    input: OperandQuantizer
    weight: OperandQuantizer
    grad: OperandQuantizer
    # every operand has one scale per tensor (comm-GEMM overlap, the one-call native linear, FP8 gathers of
    # bytes with one shared scale_inv take only these)
    per_tensor: bool = field(init=False)
    # some operand keeps state in the module's FP8ScalingState (its updates are registered with the region)
    has_state: bool = field(init=False)
    # the native one-call linear (te_parallel::linear_fp8_fwd: x cast with a given per-tensor scale, or with
    # fp8_max / amax(x) computed inside) makes this recipe's fprop operands
    native_fprop: bool = field(init=False)

    def __post_init__(self) -> None:
        ops = (self.input, self.weight, self.grad)
        per_tensor = all(q.granularity is Granularity.TENSOR for q in ops)
        object.__setattr__(self, "per_tensor", per_tensor)
        object.__setattr__(self, "has_state", any(q.has_state for q in ops))
        object.__setattr__(self, "native_fprop", per_tensor and (self.input.scale_known_before_cast
                                                                 or self.input.scale_from_amax))


def _delayed(recipe: DelayedScaling) -> GemmQuantizers:
    fmt = recipe.fp8_format
    return GemmQuantizers(DelayedScalingQuantizer("x", fmt.fwd_dtype), DelayedScalingQuantizer("w", fmt.fwd_dtype),
                          DelayedScalingQuantizer("grad", fmt.bwd_dtype))


def _current(recipe: Float8CurrentScaling) -> GemmQuantizers:
    fmt = recipe.fp8_format
    return GemmQuantizers(CurrentScalingQuantizer("x", fmt.fwd_dtype), CurrentScalingQuantizer("w", fmt.fwd_dtype),
                          CurrentScalingQuantizer("grad", fmt.bwd_dtype))


def _block(recipe: Float8BlockScaling) -> GemmQuantizers:
    fmt = recipe.fp8_format

    def q(role: str, dtype: torch.dtype) -> BlockScalingQuantizer:
        return BlockScalingQuantizer(role, dtype, recipe.block_dim(role), recipe.qparams(role))

    return GemmQuantizers(q("x", fmt.fwd_dtype), q("w", fmt.fwd_dtype), q("grad", fmt.bwd_dtype))


# id(recipe) -> (recipe, the factory that made them, its quantizers): made once per recipe object (recipes are
# frozen); the recipe is held so that its id is not reused while the entry exists, the factory so that a type
# registered again makes new ones
_MADE: Dict[int, Tuple[Recipe, Callable[[Recipe], GemmQuantizers], GemmQuantizers]] = {}
_MADE_MAX = 64


def gemm_quantizers(recipe: Recipe) -> GemmQuantizers:
    """`recipe`'s GemmQuantizers (the same objects for the same recipe object), from the `gemm` factory its
    type registered (fp8.recipe_registry); one line naming the recipe and the ones that run when there is none."""
    entry = factories_of(recipe)
    make = None if entry is None else entry.gemm
    if make is None:
        what = UNSUPPORTED_SCALING.get(recipe.scaling, type(recipe).__name__)
        raise NotImplementedError(f"fp8_autocast: {what} is not implemented in te_parallel; use "
                                  f"{registered_names('gemm', last=' or ')}")
    hit = _MADE.get(id(recipe))
    if hit is not None and hit[0] is recipe and hit[1] is make:
        return hit[2]
    made = make(recipe)
    ops = (made.input, made.weight, made.grad)
    if len({q.granularity is Granularity.TENSOR for q in ops}) > 1:  # (the GEMMs pair like with like: ops/gemm.py)
        sets = ", ".join(f"{name} {q.granularity.words}" for name, q in zip(("input", "weight", "gradient"), ops))
        raise ValueError(f"fp8_autocast: {type(recipe).__name__}'s quantizers mix one scale per tensor with tiled "
                         f"scales ({sets}); te_parallel's GEMMs take one scale per tensor for every operand, or "
                         f"tiles and blocks for every operand")
    if len(_MADE) >= _MADE_MAX:
        _MADE.clear()
    _MADE[id(recipe)] = (recipe, make, made)
    return made


# the built-in recipes: each registers its GEMM family and its TE-API quantizer (fp8.quantizers) in one call
register_recipe(DelayedScaling, gemm=_delayed, quantizer=delayed_quantizer)
register_recipe(Float8CurrentScaling, gemm=_current, quantizer=current_quantizer)
register_recipe(Float8BlockScaling, gemm=_block, quantizer=block_quantizer)
register_recipe(MXFP8BlockScaling, gemm=None, quantizer=mxfp8_quantizer)  # (Blackwell: the modules refuse it)
register_recipe(NVFP4BlockScaling, gemm=None, quantizer=nvfp4_quantizer)


def spans_ranks(group) -> bool:
    return group_size(group) > 1


def reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """Current scaling of an operand of a split GEMM: the max over the group's ranks (in place), so that
    every rank encodes with the same scale."""
    if spans_ranks(group):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _check_unchanged(weight: torch.Tensor, version: int) -> None:
    # (a version counter is not traceable: under torch.compile the check is eager's alone)
    if not torch.compiler.is_compiling() and weight._version != version:
        raise RuntimeError(
            f"an FP8 weight of shape {tuple(weight.shape)} was modified in place between forward and backward "
            f"(version {version} -> {weight._version}); update weights after backward")


class WeightSource:
    """Backward's handle on a per-tensor FP8 weight that was not kept after forward.

    `with_transpose()` casts the high-precision weight again with the scale snapshot of the forward's
    cast: the bytes are those of the forward's W, transposed (the cast is a pure function of source and
    scale), written straight into the [K, N] layout dgrad reads. Costs one more read of the
    high-precision weight in backward; saves holding every FP8 weight from forward to backward.
    """

    __slots__ = ("weight", "scale", "scale_inv", "fp8_dtype", "version")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype):
        self.weight, self.scale, self.scale_inv, self.fp8_dtype = weight, scale, scale_inv, fp8_dtype
        self.version = weight._version

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def with_transpose(self) -> Float8Tensor:
        _check_unchanged(self.weight, self.version)
        q = _cast.quantize(self.weight.detach(), self.scale, self.fp8_dtype, transpose=True, rowwise=False)
        return Float8Tensor(q.data, self.scale_inv, q.data_t)


class BlockWeightSource:
    """Backward's handle on a block-scaled FP8 weight that was not kept after forward: `with_transpose()`
    quantizes the high-precision weight again, columnwise only. Block scales are a pure function of the
    values, so the bytes are those of the forward's W, transposed (128x128 blocks) or tiled along the other
    dim (1x128), written straight into the [K, N] layout dgrad reads."""

    __slots__ = ("weight", "quantizer", "version", "shape", "fp8_dtype")

    def __init__(self, weight: torch.Tensor, w: BlockwiseTensor, quantizer: BlockScalingQuantizer) -> None:
        self.weight, self.quantizer, self.version = weight, quantizer, weight._version
        self.shape, self.fp8_dtype = w.shape, w.fp8_dtype

    def with_transpose(self) -> BlockwiseTensor:
        _check_unchanged(self.weight, self.version)
        return self.quantizer.quantize_blocks(self.weight.detach(), rowwise=False, columnwise=True)
