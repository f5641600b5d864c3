"""FP8 parameters: GEMM weights held as FP8 bytes + scale (TE's `quantized_model_init` / `fp8_model_init`).

A GEMM module built inside `quantized_model_init(enabled=True)` holds each weight as a `Float8Weight`:
a torch.Tensor subclass whose value is `data * scale_inv`, `data` the FP8 bytes (1 byte per element)
and `scale_inv` one fp32 number. The forward GEMM uses the bytes as they are: no cast of the weight
per step. There is no high-precision copy in the module; it lives on the optimizer's side
(`MasterWeights`, TE's FusedAdam(master_weights=True) for any torch optimizer), which writes the
updated values back after each step (`write_fp8_weights`: one quantization per weight per step).

Writing a high-precision value into a Float8Weight (`copy_`, `.data.copy_`, any in-place op,
`load_state_dict`) quantizes it: the scale is the module's FP8 state (delayed scaling: the weight
slot's scale, the value's amax recorded there) or the value's own amax (current scaling). Either way
the amax is all-reduced (MAX) first over every group holding a piece of the weight: the module's TP
group and FSDP2's shard group, so all shards of one weight share one scale.

FSDP2: `fsdp_pre_all_gather` hands FSDP the FP8 bytes (as uint8) and keeps the scale as metadata (all
shards share it), so FSDP all-gathers 1 byte per element, half of bf16's 2; `fsdp_post_all_gather`
wraps the gathered bytes into the unsharded Float8Weight (its nominal dtype is FSDP's param_dtype).

The pieces of a parameters_split weight (query/key/value) share one scale tensor, so the GEMM sees one
FP8 weight; they are written together (MasterWeights does); one piece written alone keeps the shared
scale. The quantization itself (ops.fp8_weight.WeightQuantizer) is below this layer: a Float8Weight
only calls its `_quantizer`.

Block scaling (Float8BlockScaling): the bytes are quantized in 128x128 blocks (or 1x128 tiles,
w_block_scaling_dim=1), one scale_inv per block, and `_scales` holds the scale_inv of every block of
the weight's storage in the GEMM's layout (`BlockLayout`); a view (a split piece, an FSDP shard) reads
the blocks of its rows. Each block's scale comes from its own amax, so nothing is all-reduced and any
subset of the pieces or shards is written on its own. 128x128 blocks cannot straddle two pieces or
shards: a view starting inside a block is refused (split pieces and FSDP2 shards must be multiples of
128 rows). FSDP2 gathers the bytes and the shards' block scales (even shards only: with uneven ones
FSDP2 requires every gathered tensor to have the shard's shape, which the scales cannot have).
"""
from __future__ import annotations

import copy
import threading
from contextlib import ContextDecorator
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from te_parallel.fp8.blockwise import BLOCK, ceil_div, dequantize_blockwise
from te_parallel.recipe import DelayedScaling, Recipe

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch without distributed
    DTensor, Shard = (), ()

__all__ = ["Float8Weight", "BlockLayout", "quantized_model_init", "fp8_model_init", "QuantizedInit",
           "current_model_init", "is_fp8_weight", "write_fp8_weights", "MasterWeights"]

aten = torch.ops.aten


# --- the model-init region ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class QuantizedInit:
    """What `quantized_model_init` tells the GEMM modules built inside it."""

    enabled: bool = True
    recipe: Recipe = DelayedScaling()
    preserve_high_precision_init_val: bool = False


class _InitStack(threading.local):
    def __init__(self) -> None:
        self.frames: List[QuantizedInit] = []


# The second piece of dynamic state of the library besides fp8_autocast's region stack, for the same
# reason: TE's API is a context manager. Per-thread; read by a module's constructor only.
_INIT = _InitStack()


def current_model_init() -> Optional[QuantizedInit]:
    """The innermost `quantized_model_init` region, or None outside any (or inside enabled=False)."""
    frame = _INIT.frames[-1] if _INIT.frames else None
    return frame if frame is not None and frame.enabled else None


class quantized_model_init(ContextDecorator):  # noqa: N801 (TE's name)
    """GEMM modules (Linear, LayerNormLinear, LayerNormMLP and those built from them) created inside hold
    their weights in FP8 (`Float8Weight`). recipe: the recipe the model will run with (its kind and
    forward FP8 format; None: DelayedScaling()). preserve_high_precision_init_val: keep a CPU copy of
    each weight's initial high-precision value (`get_high_precision_init_val()`) to start fp32 master
    weights from it (MasterWeights does) instead of from the quantized value."""

    def __init__(self, enabled: bool = True, recipe: Optional[Recipe] = None,
                 preserve_high_precision_init_val: bool = False) -> None:
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"quantized_model_init: recipe must be a te_parallel recipe (DelayedScaling, "
                            f"Float8CurrentScaling, Float8BlockScaling) or None, got {recipe!r}")
        self.config = QuantizedInit(enabled=bool(enabled), recipe=recipe if recipe is not None else DelayedScaling(),
                                    preserve_high_precision_init_val=bool(preserve_high_precision_init_val))

    def __enter__(self) -> None:
        _INIT.frames.append(self.config)

    def __exit__(self, *exc) -> None:
        _INIT.frames.pop()


fp8_model_init = quantized_model_init  # TE 1.x's name for the same region


# --- block scales -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockLayout:
    """Where the block scales of a block-scaled Float8Weight's storage are (te_parallel.fp8.blockwise's
    GEMM layouts). The storage holds rows of `cols` elements from element `base` on; `_scales` holds the
    scale_inv of every block of it: [ceil(cols/128), rows] for 1x128 tiles (block_dim 1), [ceil(rows/128),
    ceil(cols/128)] for 128x128 blocks (block_dim 2). A view of whole rows (a split piece, an FSDP shard)
    reads the blocks of its rows; with 128x128 blocks it starts at a multiple of 128 rows."""

    block_dim: int
    cols: int
    base: int = 0

    @property
    def name(self) -> str:
        return "1x128 tiles" if self.block_dim == 1 else "128x128 blocks"

    def scales_shape(self, rows: int) -> Tuple[int, int]:
        col_tiles = ceil_div(self.cols, BLOCK)
        return (col_tiles, rows) if self.block_dim == 1 else (ceil_div(rows, BLOCK), col_tiles)

    def rows_of(self, data: torch.Tensor) -> Optional[Tuple[int, int]]:
        """The storage rows [r0, r1) that `data` (a view of the storage) covers; None when it is not whole
        contiguous rows (a column slice, a transpose)."""
        offset, numel = data.storage_offset() - self.base, data.numel()
        if not data.is_contiguous() or offset % self.cols or numel % self.cols:
            return None
        return offset // self.cols, (offset + numel) // self.cols

    def tiles(self, scales: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """The scale_inv of rows [r0, r1) (a view of `scales`, in the GEMM's layout)."""
        return scales[:, r0:r1] if self.block_dim == 1 else scales[r0 // BLOCK:ceil_div(r1, BLOCK)]


def _new_block_scales(blocks: BlockLayout, data: torch.Tensor) -> Tuple[BlockLayout, torch.Tensor]:
    """The layout and scale_inv (ones) of a new storage holding `data`'s elements as whole rows."""
    layout = BlockLayout(blocks.block_dim, blocks.cols, data.storage_offset())
    shape = layout.scales_shape(ceil_div(data.numel(), blocks.cols))
    return layout, torch.ones(shape, dtype=torch.float32, device=data.device)


# --- the tensor --------------------------------------------------------------------------------------
class Float8Weight(torch.Tensor):
    """An FP8 weight parameter: `_data` (FP8 bytes, this tensor's shape and strides), `_scales` (fp32
    [scale, scale_inv], shared by every piece, view and FSDP shard of one GEMM's weight; under block
    scaling the scale_inv of every block of `_data`'s storage, laid out as `_blocks` says), `_quantizer`
    (encodes high-precision values; None for a copy detached from its module), `_pieces` (how many
    parameters share `_scales`), `_hp_init` (optional CPU copy of the initial value, same layout),
    `_blocks` (a BlockLayout; None for one scale per tensor). Made for a quantizer of block-scaled
    weights without `blocks`, it gets new block scales (ones) for `data`'s rows in place of `scales`.
    Its dtype is the nominal high-precision dtype: gradients, FSDP's mixed precision and the module's
    activation dtype follow it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, scales, dtype, quantizer=None, pieces=1, hp_init=None, requires_grad=False, blocks=None):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)

    def __init__(self, data, scales, dtype, quantizer=None, pieces=1, hp_init=None, requires_grad=False, blocks=None):
        if blocks is None and quantizer is not None and quantizer.block_dim:
            blocks, scales = _new_block_scales(BlockLayout(quantizer.block_dim, data.shape[-1]), data)
        self._data, self._scales, self._quantizer = data, scales, quantizer
        self._pieces, self._hp_init, self._blocks = pieces, hp_init, blocks

    def __repr__(self) -> str:
        blocks = "" if self._blocks is None else f", {self._blocks.name}"
        return (f"Float8Weight(shape={tuple(self.shape)}, fp8={self._data.dtype}{blocks}, dtype={self.dtype}, "
                f"device={self.device})")

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def scale_inv(self) -> torch.Tensor:
        """The fp32 scalar the bytes decode with (value = data * scale_inv); under block scaling the
        scale_inv of this tensor's blocks ([ceil(K/128), N] for 1x128 tiles, [ceil(N/128), ceil(K/128)] for
        128x128 blocks of an [N, K] weight)."""
        return self._scales[1] if self._blocks is None else self._tiles()

    def _rows(self) -> Tuple[int, int]:
        """The rows of the storage this block-scaled tensor covers."""
        return self._blocks.rows_of(self._data)

    def _tiles(self) -> torch.Tensor:
        return self._blocks.tiles(self._scales, *self._rows())

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The value as a plain tensor (the nominal dtype unless given)."""
        if self._blocks is None:
            return (self._data.to(torch.float32) * self._scales[1]).to(dtype or self.dtype)
        r0, r1 = self._rows()
        tiles = self._tiles()
        data = self._data.reshape(r1 - r0, self._blocks.cols)
        rowwise = tiles.t() if self._blocks.block_dim == 1 else tiles  # [rows' tiles, cols' tiles]
        value = dequantize_blockwise(data, rowwise, self._blocks.block_dim)
        return value.reshape(self.shape).to(dtype or self.dtype)

    def get_high_precision_init_val(self) -> Optional[torch.Tensor]:
        """The initial high-precision value kept on the CPU (quantized_model_init(preserve_high_precision_init_val=True))."""
        return self._hp_init

    def clear_high_precision_init_val(self) -> None:
        self._hp_init = None

    # (TE's pattern) nn.Module._apply (.to(device), to_empty) assigns `.data`; the wrapper's own fields
    # must follow, not only its metadata
    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, Float8Weight):
            raise TypeError(f"Float8Weight.data: assign a Float8Weight (or write a value with .data.copy_(x)), "
                            f"got {type(new).__name__}")
        if (new.shape, new.stride(), new.dtype, new.device) != (self.shape, self.stride(), self.dtype, self.device):
            dummy = torch.Tensor._make_wrapper_subclass(Float8Weight, new.shape, strides=new.stride(),
                                                        storage_offset=new.storage_offset(), dtype=new.dtype,
                                                        device=new.device)
            torch.Tensor.data.__set__(self, dummy)
        self._data, self._scales, self._quantizer = new._data, new._scales, new._quantizer
        self._pieces, self._hp_init, self._blocks = new._pieces, new._hp_init, new._blocks

    def _like(self, data, hp_init=None, scales=None) -> "Float8Weight":
        """A Float8Weight of other bytes (and initial value) sharing this one's scale and quantizer."""
        return Float8Weight(data, self._scales if scales is None else scales, self.dtype, self._quantizer,
                            self._pieces, hp_init, blocks=self._blocks)

    def __tensor_flatten__(self):
        return ["_data", "_scales"], (self.dtype, self._quantizer, self._pieces, self._blocks)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        dtype, quantizer, pieces, blocks = meta
        return Float8Weight(inner["_data"], inner["_scales"], dtype, quantizer, pieces, blocks=blocks)

    def __deepcopy__(self, memo):
        # the copy's quantizer refers to the copied module (memo), split pieces keep one shared scale
        out = Float8Weight(copy.deepcopy(self._data, memo), copy.deepcopy(self._scales, memo), self.dtype,
                           copy.deepcopy(self._quantizer, memo), self._pieces, copy.deepcopy(self._hp_init, memo),
                           requires_grad=self.requires_grad, blocks=self._blocks)
        own = ("_data", "_scales", "_quantizer", "_pieces", "_hp_init", "_blocks")
        for key, value in self.__dict__.items():  # nn.Parameter's mark and markers such as sequence_parallel
            if key not in own:
                setattr(out, key, copy.deepcopy(value, memo))
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        # saved without its quantizer (a module reference): loading copies the bytes and scale into a live one
        return _rebuild, (self._data, self._scales.clone(), self.dtype, self._blocks)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        schema_args = func._schema.arguments
        if (args and isinstance(args[0], Float8Weight) and schema_args and schema_args[0].alias_info is not None
                and schema_args[0].alias_info.is_write):
            return _in_place(func, args, kwargs)
        # everything else computes on the value (a plain tensor of the nominal dtype)
        return func(*_values(args), **_values(kwargs))

    # --- FSDP2's all-gather extension -----------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The FP8 bytes (as uint8) of this shard, padded to FSDP's shard rows; the scale (the same on
        every shard) goes as metadata, not through the all-gather. Block scaling: the bytes and the
        shard's block scales (`_block_pre_all_gather`)."""
        if self._blocks is not None:
            return _block_pre_all_gather(self, mesh, orig_size)
        if self._quantizer is not None and mesh.size() > 1:
            self._quantizer.join_shard_group(mesh.get_group(), self._scales)
        rows = -(-orig_size[0] // mesh.size())
        data = self._data
        if data.shape[0] != rows:  # uneven sharding: FSDP allocated the padded rows behind this shard
            data = data.as_strided((rows, *data.shape[1:]), data.stride(), data.storage_offset())
        return (data.view(torch.uint8),), (self._scales, self._quantizer, self._pieces, self._data.dtype)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if isinstance(metadata, _BlockGather):
            return _block_post_all_gather(all_gather_outputs, metadata, param_dtype, out)
        (gathered,) = all_gather_outputs
        scales, quantizer, pieces, fp8_dtype = metadata
        if out is not None:  # the same unsharded tensor: its bytes are the re-filled gather output
            out._scales = scales
            return None
        return Float8Weight(gathered.view(fp8_dtype), scales, param_dtype, quantizer, pieces), (gathered,)


def _rebuild(data, scales, dtype, blocks=None):
    return Float8Weight(data, scales, dtype, blocks=blocks)


def is_fp8_weight(t) -> bool:
    """True for a Float8Weight, or an FSDP2 (DTensor) parameter whose local shard is one."""
    return isinstance(_local(t), Float8Weight)


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _values(tree):
    return tree_map_only(Float8Weight, lambda t: t.dequantize(), tree)


# --- dispatch handlers ---------------------------------------------------------------------------------
def _layout(func, args, kwargs):
    """Views (detach, view, as_strided, slice, split): the same op on the bytes (and the kept initial
    value), the scale shared. Block scaling: views of whole rows only (others give the value)."""
    t = args[0]
    out = func(t._data, *args[1:], **kwargs)
    if t._blocks is not None and not _whole_rows(t, out):
        return func(t.dequantize(), *args[1:], **kwargs)
    hp = None if t._hp_init is None else func(t._hp_init, *args[1:], **kwargs)
    if isinstance(out, (list, tuple)):
        hps = hp if hp is not None else [None] * len(out)
        return type(out)(t._like(o, h) for o, h in zip(out, hps))
    return t._like(out, hp)


def _whole_rows(t: Float8Weight, out) -> bool:
    """Whether the views `out` of a block-scaled t's bytes are whole rows (then they carry their blocks).
    A view of 128x128 blocks that would start inside a block is refused: its first block's scale is
    shared with rows outside it (split pieces and FSDP2 shards are such views)."""
    blocks = t._blocks
    spans = [blocks.rows_of(o) for o in (out if isinstance(out, (list, tuple)) else (out,))]
    if any(span is None for span in spans):
        return False
    t0 = t._rows()[0]
    for r0, r1 in spans:
        if blocks.block_dim == 2 and r0 % BLOCK and r1 > r0:
            raise ValueError(
                f"Float8Weight of shape {tuple(t.shape)} in 128x128 blocks: a view of its rows {r0 - t0}..{r1 - t0} "
                f"would start inside a block; parameters_split pieces and FSDP2 shards (ceil(rows / world size) rows "
                f"each) of such a weight must be multiples of 128 rows; use such sizes, or build the model under "
                f"Float8BlockScaling(w_block_scaling_dim=1), whose 1x128 tiles take any rows")
    return True


def _storage_like(t, size, device=None):
    device = t.device if device is None else torch.device(device)
    data = torch.empty(size, dtype=torch.uint8, device=device).view(t._data.dtype)
    hp = None if t._hp_init is None else torch.zeros(size, dtype=t._hp_init.dtype)
    if t._blocks is not None:  # a new storage: blocks of its own
        blocks, scales = _new_block_scales(t._blocks, data)
        return Float8Weight(data, scales, t.dtype, t._quantizer, t._pieces, hp, blocks=blocks)
    scales = t._scales
    if device != t.device:
        scales = t._quantizer.scales_on(device, t._scales) if t._quantizer is not None else t._scales.to(device)
    return t._like(data, hp, scales)


def _new(func, args, kwargs):
    """new_zeros / new_empty / empty_like: a Float8Weight (FSDP's padded shards, to_empty); with another
    dtype a plain tensor."""
    t = args[0]
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != t.dtype:
        return func(t.dequantize(), *args[1:], **kwargs)
    size = t.shape if func is aten.empty_like.default else args[1]
    out = _storage_like(t, size, kwargs.get("device"))
    if func is aten.new_zeros.default:
        out._data.view(torch.uint8).zero_()
    return out


def _to_copy(func, args, kwargs):
    """.to(device) / .to(float dtype) keep the FP8 bytes and scale (module.to / cuda / bfloat16 keep an
    FP8 model FP8; the dtype is the nominal one computations use). `dequantize(dtype)` gives the value."""
    t = args[0]
    dtype = kwargs.get("dtype") or t.dtype
    if not dtype.is_floating_point:
        return func(t.dequantize(), **kwargs)
    device = torch.device(kwargs.get("device") or t.device)
    out = _storage_like(t, t.shape, device)
    out._data.copy_(t._data)
    if t._blocks is not None:
        out._tiles().copy_(t._tiles())
    elif out._scales is not t._scales:
        out._scales.copy_(t._scales)
    return Float8Weight(out._data, out._scales, dtype, t._quantizer, t._pieces, t._hp_init, blocks=out._blocks)


def _clone(func, args, kwargs):
    t = args[0]
    hp = None if t._hp_init is None else t._hp_init.clone()
    if t._blocks is None:
        return Float8Weight(t._data.clone(), t._scales.clone(), t.dtype, None, 1, hp)
    out = _storage_like(t, t.shape)
    out._data.copy_(t._data)
    out._scales.copy_(t._tiles())
    return Float8Weight(out._data, out._scales, t.dtype, None, 1, hp, blocks=out._blocks)


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, Float8Weight):  # a plain tensor takes the value
        dst.copy_(src.dequantize(dst.dtype) if isinstance(src, Float8Weight) else src)
        return dst
    if _same_encoding(dst, src):  # bytes and scale as they are
        dst._data.copy_(src._data)
        if dst._blocks is not None:
            dst._tiles().copy_(src._tiles())
        elif dst._scales is not src._scales:
            dst._scales.copy_(src._scales)
        if dst._hp_init is not None and src._hp_init is not None:
            dst._hp_init.copy_(src._hp_init)
        return dst
    value = src.dequantize(torch.float32) if isinstance(src, Float8Weight) else src
    write_fp8_weights([(dst, value.expand(dst.shape))])
    return dst


def _same_encoding(dst: Float8Weight, src) -> bool:
    """Whether src's bytes and scales mean the same in dst: the same FP8 dtype and scaling (one scale, or
    the same blocks over the same rows, with dst's last 128x128 block not shared with rows beyond it)."""
    if not isinstance(src, Float8Weight) or src.fp8_dtype != dst.fp8_dtype:
        return False
    if dst._blocks is None or src._blocks is None:
        return dst._blocks is None and src._blocks is None
    return (dst._blocks.block_dim == src._blocks.block_dim and dst._blocks.cols == src._blocks.cols
            and dst.shape == src.shape and _owns_last_block(dst))


def _owns_last_block(w: Float8Weight) -> bool:
    """Whether every block w's rows touch holds only w's rows (1x128 tiles always do)."""
    if w._blocks.block_dim == 1:
        return True
    r1 = w._rows()[1]
    return r1 % BLOCK == 0 or r1 == (w._data.untyped_storage().nbytes() - w._blocks.base) // w._blocks.cols


def _in_place(func, args, kwargs):
    """An in-place op on a Float8Weight (init functions, a plain optimizer): on the value, then written
    back quantized."""
    target = args[0]
    value = target.dequantize()
    func(value, *_values(args[1:]), **_values(kwargs))
    write_fp8_weights([(target, value)])
    return target


_HANDLERS = {aten.copy_.default: _copy, aten._to_copy.default: _to_copy, aten.clone.default: _clone,
             aten.new_zeros.default: _new, aten.new_empty.default: _new, aten.empty_like.default: _new}
for _op in (aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
            aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default):
    _HANDLERS[_op] = _layout


# --- FSDP2 with block scales ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _BlockGather:
    """What fsdp_post_all_gather needs besides the gathered bytes and scales (the same on every shard)."""

    quantizer: object
    pieces: int
    fp8_dtype: torch.dtype
    blocks: BlockLayout
    world: int


def _block_pre_all_gather(w: Float8Weight, mesh, orig_size):
    """The shard's bytes (uint8 [N/world, K]) and its blocks' scale_inv. FSDP2 shards dim 0; the gathered
    scales are the weight's when the shards are equal and, for 128x128 blocks, whole blocks. Refused
    otherwise on every rank (the sizes are the same everywhere), before any collective."""
    world, rows, blocks = mesh.size(), orig_size[0], w._blocks
    if tuple(w.shape[1:]) != tuple(orig_size[1:]):
        raise ValueError(f"FSDP2: the FP8 weight of shape {tuple(orig_size)} in {blocks.name} is sharded along dim 1 "
                         f"(shard {tuple(w.shape)}); block-scaled FP8 weights shard along dim 0, FSDP2's default")
    multiple = world * (BLOCK if blocks.block_dim == 2 else 1)
    if world > 1 and rows % multiple:
        unit = "whole 128-row blocks" if blocks.block_dim == 2 else "rows"
        raise ValueError(
            f"FSDP2 over {world} ranks: the FP8 weight of shape {tuple(orig_size)} in {blocks.name} needs equal shards "
            f"of {unit} (rows a multiple of {multiple}), but its {rows} rows shard into {ceil_div(rows, world)}-row "
            f"pieces; use such sizes or another FSDP2 mesh (FSDP2 gathers the block scales beside the bytes only for "
            f"equal shards)")
    meta = _BlockGather(w._quantizer, w._pieces, w.fp8_dtype, BlockLayout(blocks.block_dim, blocks.cols), world)
    return (w._data.view(torch.uint8), w._tiles().contiguous()), meta


def _block_post_all_gather(outputs, meta: _BlockGather, param_dtype, out):
    """The unsharded Float8Weight over the gathered bytes [N, K]: 128x128 blocks' scales are the shards' in
    order; 1x128 tiles' come shard by shard as [world * ceil(K/128), N/world] and are laid out as [ceil(K/128), N]."""
    gathered, gathered_scales = outputs
    scales = gathered_scales
    if meta.blocks.block_dim == 1:
        col_tiles = ceil_div(meta.blocks.cols, BLOCK)
        scales = out._scales if out is not None else torch.empty(
            (col_tiles, gathered.numel() // meta.blocks.cols), dtype=torch.float32, device=gathered.device)
        scales.view(col_tiles, meta.world, -1).copy_(gathered_scales.view(meta.world, col_tiles, -1).transpose(0, 1))
    if out is not None:  # the same unsharded tensor: bytes and scales re-filled in place
        out._scales = scales
        return None
    weight = Float8Weight(gathered.view(meta.fp8_dtype), scales, param_dtype, meta.quantizer, meta.pieces,
                          blocks=meta.blocks)
    return weight, (gathered, scales)


# --- writing values ----------------------------------------------------------------------------------
def write_fp8_weights(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Quantize high-precision values into FP8 weights: (Float8Weight or FSDP2 DTensor parameter, value of
    the same shape and kind). The pieces of one GEMM's weight written together get a new scale (delayed
    scaling: the module's weight scale, the amax recorded in its state; current scaling: from the amax);
    a subset of the pieces keeps the scale they share. Amaxes are all-reduced (MAX) over the weight's
    TP group and FSDP shard group first, in one call per group: every rank holding a piece of a
    weight encodes it with the same scale. Block-scaled weights: each block from its own amax, nothing
    reduced; any piece or shard is written on its own."""
    jobs: Dict[int, list] = {}
    blocks = []
    for param, value in pairs:
        w, v = _local_pair(param, value)
        if w._blocks is not None:
            blocks.append((w, v))
        else:
            jobs.setdefault(id(w._quantizer), []).append((w, v))
    plans = []
    for pieces in jobs.values():
        q = pieces[0][0]._quantizer
        amaxes = [q.amax(v) for _, v in pieces]
        amax = amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).amax(0)
        plans.append([q, pieces, len(pieces) >= pieces[0][0]._pieces, amax])
    _reduce_amaxes(plans)
    with torch.no_grad():
        for q, pieces, whole, amax in plans:
            scale = q.scale(amax, None if whole else pieces[0][0]._scales)
            for w, v in pieces:
                q.encode(v, scale, w._data, w._scales)
        for w, v in blocks:
            w, v = _whole_blocks(w, v)
            w._quantizer.encode_blocks(v, w._data, w._tiles())


def _local_pair(param, value):
    w = _local(param)
    if not isinstance(w, Float8Weight):
        raise TypeError(f"write_fp8_weights: expected an FP8 weight (Float8Weight), got {type(w).__name__}")
    if w._quantizer is None:
        raise TypeError("write_fp8_weights: this Float8Weight was detached from its module (a copy or a loaded "
                        "tensor) and has no quantizer; copy it into the module's parameter instead")
    if isinstance(param, DTensor):
        if isinstance(value, DTensor):
            value = value._local_tensor
        mesh = param.device_mesh
        if (w._blocks is None and mesh.ndim == 1 and mesh.size() > 1
                and any(isinstance(p, Shard) for p in param.placements)):
            w._quantizer.join_shard_group(mesh.get_group(), None)
    if value.shape != w.shape:
        raise ValueError(f"write_fp8_weights: value of shape {tuple(value.shape)} for a weight of shape {tuple(w.shape)}")
    return w, value.detach()


def _whole_blocks(w: Float8Weight, value: torch.Tensor) -> Tuple[Float8Weight, torch.Tensor]:
    """A write into rows of 128x128 blocks that ends inside a block holding later rows of the storage
    (FSDP2's zero padding, a slice of a weight): the block is encoded again with those rows' current values
    (its scale is theirs too)."""
    if _owns_last_block(w):
        return w, value
    blocks, (r0, r1) = w._blocks, w._rows()
    end = min(ceil_div(r1, BLOCK) * BLOCK, (w._data.untyped_storage().nbytes() - blocks.base) // blocks.cols)
    data = w._data.as_strided((end - r0, blocks.cols), (blocks.cols, 1), blocks.base + r0 * blocks.cols)
    whole = w._like(data)
    rest = whole.dequantize(value.dtype)[r1 - r0:]
    return whole, torch.cat([value.reshape(r1 - r0, blocks.cols), rest])


def _reduce_amaxes(plans) -> None:
    """All-reduce (MAX) each plan's amax over its quantizer's groups, one call per distinct group list."""
    by_groups: Dict[tuple, list] = {}
    for plan in plans:
        groups = plan[0].groups()
        if groups:
            by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(plan)
    for groups, members in by_groups.values():
        flat = torch.cat([m[3].reshape(1) for m in members])
        for g in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=g)
        for m, a in zip(members, flat.split(1)):
            m[3] = a.reshape(m[3].shape)


from te_parallel.fp8.masters import MasterWeights  # noqa: E402,F401 (its own module; exported here, its old home)
