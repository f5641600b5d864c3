"""How a GEMM's FP8 weight parameters (te_parallel.fp8.params.Float8Weight) are encoded and read.

`WeightQuantizer` is the per-GEMM object every piece, view and FSDP shard of one weight refers to:
it chooses the scale (the module's delayed-scaling state, or the value's own amax), knows the groups
over which amaxes must agree (the module's TP group; FSDP2's shard group, learned when FSDP first
gathers the weight or from a DTensor parameter), and casts with the same `quantize` the GEMMs use,
so an FP8 weight holds exactly the bytes a high-precision weight would be cast to with that scale.
`weight_operand` hands the bytes to a GEMM; `cat_fp8_weights` joins the pieces of a split weight.

The recipe's weight quantizer (te_parallel.fp8.gemm_quantizers) says what kind of weight this is: one
scale per tensor, kept in the module's scaling state (`has_state`, delayed scaling) or from the value's
amax; or scales per tile / block (`granularity`, block scaling), where the weight quantizer's own cast
(the recipe's blocks and QParams) encodes each value, so each block's scale comes from its own amax
and there is no scale to choose, share or agree on across ranks.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from te_parallel.fp8.blockwise import BlockwiseTensor
from te_parallel.fp8.gemm_quantizers import gemm_quantizers
from te_parallel.fp8.params import BlockLayout, Float8Weight
from te_parallel.fp8.scaling import current_scale
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.fp8.tensor import Float8Tensor
from te_parallel.ops.cast import amax_of, quantize
from te_parallel.parallel.groups import group_size
from te_parallel.recipe import Recipe, fp8_max


class WeightQuantizer:
    """Encodes high-precision values into the FP8 weight of GEMM `gemm` of `module` under `recipe`."""

    def __init__(self, module: torch.nn.Module, gemm: int, recipe: Recipe) -> None:
        self.module, self.gemm, self.recipe = module, gemm, recipe
        self.quantizer = gemm_quantizers(recipe).weight  # the recipe's cast of a GEMM's weight
        self.fp8_dtype = self.quantizer.fp8_dtype
        # 1 (1x128 tiles) or 2 (128x128 blocks), 0 for one scale per tensor
        self.block_dim = self.quantizer.granularity.block_dim
        self.shard_group: Optional[dist.ProcessGroup] = None  # FSDP2's: the ranks holding dim-0 shards
        self._scales_by_device: Dict[torch.device, torch.Tensor] = {}

    def groups(self) -> tuple:
        """The groups whose amaxes must agree: the module's TP group (now: set_tensor_parallel_group may
        change it), then the FSDP shard group; those of more than one rank."""
        tp = getattr(self.module, "tp_group", None)
        return tuple(g for g in (tp, self.shard_group) if g is not None and group_size(g) > 1)

    def join_shard_group(self, group: dist.ProcessGroup, scales: Optional[torch.Tensor]) -> None:
        """Learn the FSDP shard group (once). Given the shard's scales (at FSDP's first all-gather) under
        current scaling, check that every shard has the same scale: a value written into a shard before
        the group was known was scaled by its own shard's amax, and the gathered bytes would not decode
        with one scale (one scalar all-reduce pair, once per weight)."""
        if self.shard_group is not None:
            return
        self.shard_group = group
        if scales is None or self.quantizer.has_state:
            return
        both = torch.stack([scales[1], -scales[1]]).reshape(2)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if bool(both[0] != -both[1]):
            raise RuntimeError(
                f"{type(self.module).__name__}: the FSDP shards of an FP8 weight have different scales: it was written "
                f"(copy_) after fully_shard and before FSDP's first all-gather, each shard from its own amax; "
                f"write FP8 weights through te.MasterWeights / te_parallel.fp8.params.write_fp8_weights instead")

    def scales_on(self, device: torch.device, like: torch.Tensor) -> torch.Tensor:
        """The [scale, scale_inv] tensor this weight's pieces share on `device` (one per device, so that
        pieces moved one by one with .to / to_empty still share), holding `like`'s values."""
        scales = self._scales_by_device.get(device)
        if scales is None:
            scales = self._scales_by_device[device] = torch.empty(2, dtype=torch.float32, device=device)
        if not like.is_meta and not scales.is_meta:
            scales.copy_(like)
        return scales

    def amax(self, value: torch.Tensor) -> torch.Tensor:
        if value.numel() == 0:  # an FSDP shard of no rows
            return torch.zeros((), dtype=torch.float32, device=value.device)
        return amax_of(value)

    def scale(self, amax: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """The encoding scale for a value of this (all-reduced) amax. Delayed scaling: the weight slot's
        scale in the module's FP8 state, the amax recorded there (as the forward's cast of a
        high-precision weight records it). Current scaling: fp8_max / amax. keep: the pieces' shared
        [scale, scale_inv] when only some pieces are written: their scale stays."""
        if self.quantizer.has_state:
            state: FP8ScalingState = self.module._modules["fp8_state"]
            scale, cell = state.slot_views(False, FP8ScalingState.weight_slot(self.gemm))
            torch.maximum(cell, amax.reshape(1).to(cell.device), out=cell)
            return scale if keep is None else keep[0]
        if keep is not None:
            return keep[0]
        return current_scale(amax.reshape(()), fp8_max(self.fp8_dtype))

    def encode(self, value: torch.Tensor, scale: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
        encode(value, scale, data, scales)

    def encode_blocks(self, value: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Block scaling: data (FP8, whole rows of the weight) = value quantized in the recipe's weight
        blocks; scale_inv (the blocks of those rows, in the GEMM's layout) = the blocks' scale_inv."""
        if value.numel() == 0:
            return
        q = self.quantizer.quantize_blocks(value.reshape(-1, value.shape[-1]).contiguous())
        data.copy_(q.data.view(data.shape))
        scale_inv.copy_(q.scale_inv)


def encode(value: torch.Tensor, scale: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
    """data (FP8, value's shape) = value quantized with `scale` by the GEMMs' own cast; scales = [scale,
    1 / scale] as that cast writes them."""
    scale = scale.detach().reshape(()).to(torch.float32)
    if value.numel():
        flat = value.reshape(1, -1) if value.dim() < 2 else value.reshape(-1, value.shape[-1])
        q = quantize(flat.contiguous(), scale, data.dtype, keep_scale=True)
        data.copy_(q.data.reshape(data.shape))
        scales[0].copy_(q.scale.reshape(()))
        scales[1].copy_(q.scale_inv.reshape(()))
    else:
        scales[0].copy_(scale)
        scales[1].copy_(1.0 / scale)


def weight_operand(owner: str, weight: Float8Weight, recipe: Recipe):
    """The GEMM operand of an FP8 weight parameter: its bytes and scale_inv, no cast (a Float8Tensor; under
    block scaling a BlockwiseTensor). The autocast recipe must be of the kind, forward format and weight
    block shape the weight was built for (its scales are chosen by that kind)."""
    blocks, wq = weight._blocks, gemm_quantizers(recipe).weight
    built_dim = 0 if blocks is None else blocks.block_dim
    run_dim = wq.granularity.block_dim
    q = weight._quantizer
    kind_differs = built_dim != run_dim or (q is not None and type(q.quantizer) is not type(wq))
    if weight.fp8_dtype != recipe.fp8_format.fwd_dtype or kind_differs:
        running = _kind(type(recipe).__name__, run_dim)
        raise ValueError(f"{owner}: its FP8 weights were built for {_built_for(weight)} with {weight.fp8_dtype} and "
                         f"cannot run under {running} with {recipe.fp8_format.fwd_dtype}; build the model under "
                         f"quantized_model_init(recipe=...) with the recipe it runs with")
    data = weight._data if weight._data.dim() == 2 else weight._data.reshape(weight.shape[0], -1)
    if blocks is not None:
        return _block_operand(weight, data, wq)
    # scale_inv sits 4 bytes into the shared [scale, scale_inv] pair; cuBLASLt takes a scale pointer only
    # at an aligned address, so the GEMM gets its own copy (one 4-byte copy per forward)
    return Float8Tensor(data, weight._scales[1].clone())


def _block_operand(weight: Float8Weight, data: torch.Tensor, wq) -> BlockwiseTensor:
    """The rowwise bytes [N, K] and their blocks' scale_inv, as stored (no copy for a whole weight). dgrad
    of 128x128 blocks reads the transposed bytes (square blocks: exact). 1x128 tiles along K cannot give
    dgrad's tiles along N: when a backward will run, the columnwise direction is quantized now from the
    weight's value by the weight quantizer `wq`, as the cast of a high-precision weight holding that value makes it."""
    dim = weight._blocks.block_dim
    scale_inv = weight._tiles().contiguous()
    data_t = scale_inv_t = None
    if dim == 1 and torch.is_grad_enabled() and weight.requires_grad:
        cols = wq.quantize_blocks(weight.dequantize().reshape(data.shape), rowwise=False, columnwise=True)
        data_t, scale_inv_t = cols.data_t, cols.scale_inv_t
    return BlockwiseTensor(data.contiguous(), scale_inv, data_t, scale_inv_t, dim, data.dtype, data.shape)


def _kind(name: str, block_dim: int) -> str:
    return name if not block_dim else f"{name} ({'1x128 tiles' if block_dim == 1 else '128x128 blocks'})"


def _built_for(weight: Float8Weight) -> str:
    dim = 0 if weight._blocks is None else weight._blocks.block_dim
    if weight._quantizer is not None:
        return _kind(type(weight._quantizer.recipe).__name__, dim)
    return _kind("Float8BlockScaling", dim) if dim else "?"


class _CatFP8(torch.autograd.Function):
    """The pieces of a split FP8 weight as one Float8Weight (a view while they are adjacent pieces of one
    buffer, else the bytes concatenated); backward splits the gradient back."""

    @staticmethod
    def forward(ctx, *parts: Float8Weight):
        ctx.sizes = [p.shape[0] for p in parts]
        return _cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.split(grad, ctx.sizes))


def _cat(parts: Sequence[Float8Weight]) -> Float8Weight:
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    if first._blocks is not None:
        return _cat_blocks(parts, rows)
    if any(p._scales is not first._scales for p in parts):  # separately scaled: re-encode with the smallest scale
        scale = torch.stack([p._scales[0] for p in parts]).amin()
        value = torch.cat([p.dequantize(torch.float32) for p in parts])
        out = Float8Weight(torch.empty_like(value, dtype=first.fp8_dtype), torch.empty_like(first._scales), first.dtype)
        encode(value, scale, out._data, out._scales)
        return out
    datas = [p._data for p in parts]
    base = datas[0]
    if _adjacent(datas):
        data = base.as_strided((rows, *base.shape[1:]), base.stride(), base.storage_offset())
    else:
        data = torch.cat([d.view(torch.uint8) for d in datas]).view(base.dtype)
    return Float8Weight(data, first._scales, first.dtype, first._quantizer, 1)


def _cat_blocks(parts: Sequence[Float8Weight], rows: int) -> Float8Weight:
    """Block-scaled pieces: a view while they are adjacent rows of one storage, else the bytes and the
    blocks' scales concatenated (each piece but the last holds whole 128x128 blocks: they were refused
    otherwise when they were made)."""
    first = parts[0]
    base, datas = first._data, [p._data for p in parts]
    if _adjacent(datas) and all(p._scales is first._scales for p in parts):
        data = base.as_strided((rows, *base.shape[1:]), base.stride(), base.storage_offset())
        return Float8Weight(data, first._scales, first.dtype, first._quantizer, 1, blocks=first._blocks)
    data = torch.cat([d.reshape(d.shape[0], -1).view(torch.uint8) for d in datas]).view(base.dtype)
    scales = torch.cat([p._tiles() for p in parts], dim=1 if first._blocks.block_dim == 1 else 0)
    blocks = BlockLayout(first._blocks.block_dim, first._blocks.cols)
    return Float8Weight(data.reshape(rows, *base.shape[1:]), scales, first.dtype, first._quantizer, 1, blocks=blocks)


def _adjacent(datas: Sequence[torch.Tensor]) -> bool:
    """Whether the byte tensors are consecutive contiguous pieces of one storage."""
    base = datas[0]
    offset = base.storage_offset()
    for d in datas:
        if not (d.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and d.is_contiguous()
                and d.storage_offset() == offset):
            return False
        offset += d.numel()
    return True


def cat_fp8_weights(parts: Sequence[Float8Weight]) -> Float8Weight:
    return parts[0] if len(parts) == 1 else _CatFP8.apply(*parts)
