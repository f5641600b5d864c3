"""Where a rank's local parameter sits in the full (TP=1) parameter: one description per parameter,
shared by layout-independent initialisation (values are generated from full-tensor indices) and by
distributed checkpoints (shards are saved and loaded in full-tensor coordinates).

A `ShardLayout` names the parameter's full shape, the one dim split across the TP ranks (None:
the parameter is whole on every rank) and the pieces of the local tensor along that dim:
(local_start, global_start, length), in local order, covering the local tensor. A plain column
shard is one piece; LayerNormMLP's gated fc1 under TP holds [a_r; b_r], rows of both halves of the
full [2·ffn, hidden] weight, so it is two pieces.

Each te_parallel module with TP-sharded parameters answers `tp_shard_layouts()` for its own
parameters; `shard_layouts(model)` walks the tree and calls every other parameter replicated.

Expert parallelism splits a layer's experts, not a tensor: each rank of the "ep" group holds G of the
E experts as whole parameters (their TP shards under TP), named after their local index g
(GroupedLinear's weight{g}, bias{g}). An `ExpertShard` names where those sit among the layer's
experts: local expert g is expert offset + g, and its parameters' names in the whole model are
weight{offset + g}, bias{offset + g}. A module whose experts are split over an ep group answers
`ep_shard()` with one (None where it holds all of them) and keeps the group as `ep_group`; the
whole-tensor state dicts (te_parallel.parallel.dcp) and the gradient norm (te_parallel.parallel.clip)
read both, beside the TP layouts, which stay those of one expert's tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

Piece = Tuple[int, int, int]  # (local_start, global_start, length) along the split dim


@dataclass(frozen=True)
class ShardLayout:
    """This rank's local tensor inside the full (TP=1) tensor; see the module docstring."""

    full_shape: Tuple[int, ...]
    dim: Optional[int]
    pieces: Tuple[Piece, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.full_shape)
        pieces = tuple(tuple(int(v) for v in p) for p in self.pieces)
        object.__setattr__(self, "full_shape", shape)
        object.__setattr__(self, "pieces", pieces)
        if any(n < 0 for n in shape):
            raise ValueError(f"ShardLayout: full_shape must be non-negative sizes, got {shape}")
        if self.dim is None:
            if pieces:
                raise ValueError(f"ShardLayout: a replicated layout (dim=None) has no pieces, got {pieces}")
            return
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"ShardLayout: dim={self.dim} is not a dim of full_shape {shape}")
        _check_pieces(pieces, shape[self.dim])

    @property
    def local_shape(self) -> Tuple[int, ...]:
        """The shape of the local tensor this layout describes."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(p[2] for p in self.pieces)
        return tuple(shape)

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    def global_slices(self) -> List[Tuple[slice, Tuple[slice, ...]]]:
        """[(local index along `dim`, full-tensor index tuple)], one entry per piece: the local tensor's
        rows `local` along `dim` (all of it when dim is None) are the full tensor's `full[index]`."""
        whole = tuple(slice(0, n) for n in self.full_shape)
        if self.dim is None:
            return [(slice(None), whole)]
        out = []
        for local_start, global_start, length in self.pieces:
            index = list(whole)
            index[self.dim] = slice(global_start, global_start + length)
            out.append((slice(local_start, local_start + length), tuple(index)))
        return out


def _check_pieces(pieces: Sequence[Piece], extent: int) -> None:
    if not pieces:
        raise ValueError("ShardLayout: a split layout needs at least one piece (local_start, global_start, length)")
    expect = 0
    taken = []
    for local_start, global_start, length in pieces:
        if local_start != expect or length < 0:
            raise ValueError(f"ShardLayout: pieces {tuple(pieces)} must cover the local tensor in order from 0 "
                             f"(piece at local {local_start} of length {length}, expected local start {expect})")
        if global_start < 0 or global_start + length > extent:
            raise ValueError(f"ShardLayout: piece (global {global_start}, length {length}) lies outside the "
                             f"full extent {extent} of the split dim")
        expect += length
        taken.append((global_start, global_start + length))
    taken.sort()
    for (_, end), (start, _) in zip(taken, taken[1:]):
        if start < end:
            raise ValueError(f"ShardLayout: pieces {tuple(pieces)} overlap in the full tensor")


def replicated(shape) -> ShardLayout:
    """The whole parameter on every rank."""
    return ShardLayout(tuple(shape), None, ())


def split_layout(full_shape, dim: int, rank: int, tp_size: int, blocks: Optional[Sequence[int]] = None) -> ShardLayout:
    """Rank `rank` of `tp_size`'s share of a parameter split evenly along `dim`.

    blocks: the full extent along `dim` as consecutive blocks (default: one block), each split evenly;
    the local tensor is [block 0's share; block 1's share; ...] (LayerNormMLP's gated fc1: two blocks
    of ffn rows; a fused, non-interleaved QKV: the q, k and v rows).
    """
    full_shape = tuple(full_shape)
    extent = full_shape[dim]
    blocks = [extent] if blocks is None else [int(b) for b in blocks]
    if sum(blocks) != extent:
        raise ValueError(f"split_layout: blocks {blocks} add up to {sum(blocks)}, not the full extent {extent} of dim {dim}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"split_layout: rank {rank} is not in [0, {tp_size})")
    pieces, local, start = [], 0, 0
    for size in blocks:
        if size % tp_size:
            raise ValueError(f"split_layout: block of {size} along dim {dim} is not divisible by tp_size={tp_size}")
        share = size // tp_size
        pieces.append((local, start + rank * share, share))
        local, start = local + share, start + size
    return ShardLayout(full_shape, dim, tuple(pieces))


def shard_layouts(module: nn.Module) -> Dict[str, ShardLayout]:
    """Every parameter of `module`'s tree (fully qualified names, as named_parameters gives them) ->
    its ShardLayout: what each submodule's `tp_shard_layouts()` says for its own parameters,
    replicated for the rest. Each layout's local shape is checked against the parameter."""
    declared: Dict[str, ShardLayout] = {}
    for prefix, sub in module.named_modules():
        fn = getattr(sub, "tp_shard_layouts", None)
        if fn is None:
            continue
        for name, layout in fn().items():
            if sub._parameters.get(name) is None:
                raise ValueError(f"shard_layouts: {type(sub).__name__}.tp_shard_layouts() names {name!r}, "
                                 f"which is not one of its own parameters")
            declared[f"{prefix}.{name}" if prefix else name] = layout
    out = {}
    for name, p in module.named_parameters():
        layout = declared.get(name) or replicated(p.shape)
        if tuple(layout.local_shape) != tuple(p.shape):
            raise ValueError(f"shard_layouts: {name} has shape {tuple(p.shape)} but its layout describes a local "
                             f"shape {layout.local_shape} (full {layout.full_shape})")
        out[name] = layout
    return out


_EXPERT_PARAM = re.compile(r"^(weight|bias)(\d+)$")  # a per-expert parameter: GroupedLinear's weight{g}, bias{g}


@dataclass(frozen=True)
class ExpertShard:
    """A module's local experts among the `num_experts` experts of its layer: local expert g is expert
    `offset + g`, for g < `num_local` (module docstring). Names: a parameter of local expert g,
    `<stem>{g}` (stem weight or bias), is `<stem>{offset + g}` in the whole model."""

    num_experts: int
    offset: int
    num_local: int

    def __post_init__(self) -> None:
        if not (0 < self.num_local and 0 <= self.offset and self.offset + self.num_local <= self.num_experts):
            raise ValueError(f"ExpertShard: local experts [{self.offset}, {self.offset + self.num_local}) must lie "
                             f"inside the layer's {self.num_experts} experts")

    def global_name(self, name: str) -> str:
        """The whole model's name of the local parameter `name` (`name` itself if it is not an expert's)."""
        found = _EXPERT_PARAM.match(name)
        if found is None or int(found.group(2)) >= self.num_local:
            return name
        return f"{found.group(1)}{self.offset + int(found.group(2))}"

    def local_name(self, name: str) -> Optional[str]:
        """The local name of the whole model's expert parameter `name` when this rank holds that expert, else
        None (another rank's expert, or not an expert's parameter)."""
        found = _EXPERT_PARAM.match(name)
        if found is None or not self.offset <= int(found.group(2)) < self.offset + self.num_local:
            return None
        return f"{found.group(1)}{int(found.group(2)) - self.offset}"

    def is_expert_name(self, name: str) -> bool:
        """Whether `name` names a parameter of one of the layer's experts, held here or not."""
        found = _EXPERT_PARAM.match(name)
        return found is not None and int(found.group(2)) < self.num_experts
