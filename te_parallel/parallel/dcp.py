"""Distributed checkpoints of tensor-parallel models with torch.distributed.checkpoint (DCP), in
full-tensor coordinates, so that a checkpoint written at one layout loads at another.

    sd = te.dcp_state_dict(model, optimizer)        # model and optimizer state, TP shards in global coordinates
    dcp.save(sd, checkpoint_id=path)

    sd = te.dcp_state_dict(model, optimizer)        # the same call on the new layout: a template of views
    dcp.load(sd, checkpoint_id=path)                # writes into the parameters and optimizer state in place
    te.load_dcp_state_dict(model, sd, optimizer)    # hands them to the modules (FP8 state, caches, param groups)

A TP-sharded parameter's entry is a `GlobalShards`: a tensor of the full (TP=1) shape of which this
rank holds rectangular chunks, each a view of the local tensor at its offset in the full tensor. Its
chunks come from the parameter's `ShardLayout` (te_parallel.parallel.sharding) and, under FSDP2,
from the data-parallel DTensor's own chunk of the TP-local tensor. It implements DCP's checkpoint
protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`, the hooks DTensor
uses), so the default planners save and reshard it; no other tensor operation is defined on it.
Why this and not DTensor placements or ShardedTensor: docs/checkpoints.md.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
try:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed: no DCP to write for, and no DTensor to meet
    DTensor = ()

from te_parallel.parallel.sharding import ExpertShard, ShardLayout, shard_layouts

# path components that torch's state-dict functions leave out of fully qualified names (activation
# checkpointing, torch.compile and FSDP1 wrappers); DDP's root "module." is removed by unwrapping the root
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

Chunk = Tuple[Tuple[int, ...], Tuple[int, ...], torch.Tensor]  # (offsets in the full tensor, sizes, view)


class GlobalShards(torch.Tensor):
    """A state-dict entry for DCP: a tensor of the full (TP=1) shape of `layout` (kept as `shard_layout`)
    of which this rank holds `chunks`, (offsets, sizes, view of the local tensor) each. `source` is the
    state-dict value it was made from (the parameter, its FSDP2 DTensor, or an optimizer state tensor):
    what DCP writes
    into the views on load is already in `source`. Defined on it: DCP's checkpoint protocol,
    `to_local()` and `full_tensor()` (over `group`, the module's TP group); any other tensor operation,
    and pickling, raise (they would see one rank's shard)."""

    # _make_wrapper_subclass and _disabled_torch_function_impl: the standard hooks of a tensor subclass
    # without storage of its own (DTensor is built on them), in every torch version supported.
    @staticmethod
    def __new__(cls, source: torch.Tensor, layout: ShardLayout, chunks: Sequence[Chunk],
                group: Optional[dist.ProcessGroup] = None):
        local = source.to_local() if isinstance(source, DTensor) else source
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(layout.full_shape), dtype=local.dtype,
                                                  device=local.device, requires_grad=False)
        out.source, out.shard_layout, out.chunks, out.group = source, layout, list(chunks), group
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"GlobalShards is a checkpoint entry of a TP-sharded parameter, for torch.distributed."
                        f"checkpoint and load_state_dict only; {func} is not defined on it: use .to_local() for this "
                        f"rank's shard or .full_tensor() for the whole tensor")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a TP-sharded state-dict entry (full shape {tuple(self.shape)}) cannot be pickled: torch.save "
                        f"would keep one rank's shard; save with torch.distributed.checkpoint (dcp.save), or pickle "
                        f".to_local() (this rank's shard) or .full_tensor() (the whole tensor)")

    def to_local(self) -> torch.Tensor:
        """This rank's shard as the module holds it: the TP-local tensor, or its FSDP2 DTensor."""
        return self.source

    def full_tensor(self) -> torch.Tensor:
        """The whole (TP=1) tensor, assembled on every rank from every TP rank's shard (and, under FSDP2,
        its data-parallel shards): collectives over the TP group (and the FSDP2 mesh)."""
        local = (self.source.full_tensor() if isinstance(self.source, DTensor) else self.source).detach()
        layouts, locals_ = [self.shard_layout], [local]
        if self.group is None:
            raise ValueError(f"GlobalShards.full_tensor: this entry (full shape {tuple(self.shape)}) was made "
                             f"without its TP group; take it from the module's state_dict() to gather it")
        if dist.get_world_size(self.group) > 1:
            size = dist.get_world_size(self.group)
            layouts = [None] * size
            dist.all_gather_object(layouts, self.shard_layout, group=self.group)
            locals_ = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(locals_, local.contiguous(), group=self.group)
        full = torch.empty(self.shape, dtype=local.dtype, device=local.device)
        for layout, rank_local in zip(layouts, locals_):
            lead = (slice(None),) * layout.dim
            for local_index, full_index in layout.global_slices():
                full[full_index] = rank_local[lead + (local_index,)]
        return full

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                              properties=TensorProperties.create_from_tensor(view), size=self.shape))
                for off, size, view in self.chunks]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)) for off, size, _ in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, view in self.chunks:
            if torch.Size(off) == index.offset:
                return view
        raise ValueError(f"GlobalShards {index.fqn}: no chunk at offset {tuple(index.offset or ())} on this rank "
                         f"(chunks at {[tuple(o) for o, _, _ in self.chunks]})")


def global_chunks(layout: ShardLayout, offsets: Sequence[int], sizes: Sequence[int]) -> List[Tuple[tuple, tuple, int]]:
    """The box of the TP-local tensor at `offsets` with `sizes` (all of it, or a data-parallel shard of
    it) as boxes of the full tensor: [(full offsets, sizes, start along layout.dim inside the box)].
    Only the split dim moves: the pieces of the layout cut the box there and place each cut at its
    global start; the other dims keep their coordinates. Empty boxes are left out."""
    offsets, sizes = tuple(int(v) for v in offsets), tuple(int(v) for v in sizes)
    if any(n == 0 for n in sizes):
        return []
    if layout.dim is None:
        return [(offsets, sizes, 0)]
    d = layout.dim
    lo, hi = offsets[d], offsets[d] + sizes[d]
    out = []
    for local_start, global_start, length in layout.pieces:
        a, b = max(lo, local_start), min(hi, local_start + length)
        if a < b:
            out.append((offsets[:d] + (global_start + a - local_start,) + offsets[d + 1:],
                        sizes[:d] + (b - a,) + sizes[d + 1:], a - lo))
    return out


def global_shards(name: str, value: torch.Tensor, layout: ShardLayout,
                  group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """`value` (a TP-local tensor, or its FSDP2 DTensor) as a GlobalShards in full-tensor coordinates;
    `value` itself where the layout is replicated (DCP then keeps one copy of what every rank holds)."""
    if layout.dim is None:
        return value
    if tuple(value.shape) != tuple(layout.local_shape):
        raise ValueError(f"dcp_state_dict: {name} has shape {tuple(value.shape)} but its ShardLayout describes a "
                         f"local shape {tuple(layout.local_shape)} (full {tuple(layout.full_shape)})")
    if isinstance(value, DTensor):
        (box,) = value.__create_chunk_list__()  # this rank's box of the TP-local tensor (FSDP2 may pad: not in it)
        local, offsets, sizes = value.to_local(), box.offsets, box.sizes
    else:
        local, offsets, sizes = value, (0,) * value.dim(), tuple(value.shape)
    chunks = [(off, size, local.narrow(layout.dim, start, size[layout.dim]))
              for off, size, start in global_chunks(layout, offsets, sizes)]
    return GlobalShards(value, layout, chunks, group)


# -- state_dict() of a TP-sharded module: whole tensors for PyTorch's own tools -----------------------

def register_whole_tensor_hooks(module: nn.Module) -> None:
    """Make `module.state_dict()` hold each of its TP-sharded parameters as a GlobalShards in full-tensor
    coordinates, and `module.load_state_dict()` take such entries back (a state dict of the same TP
    layout, as DCP's load leaves it). The module answers `tp_shard_layouts()` and has `tp_group`; its
    `whole_tensor_state_dict` (True by default) switches this off, for clients that expect each rank's
    plain shard (compat: TE's layout, which Megatron's sharded_state_dict reads)."""
    module.whole_tensor_state_dict = True
    module._register_state_dict_hook(_global_entries)
    module._register_load_state_dict_pre_hook(_local_entries, with_module=True)


def _sharded_layouts(module: nn.Module) -> Dict[str, ShardLayout]:
    """The module's parameters that are split across TP ranks (none at TP=1). A module built for TP>1
    that has no group yet raises: where its shards sit is unknown."""
    if not module.whole_tensor_state_dict:
        return {}
    return {n: lay for n, lay in module.tp_shard_layouts().items() if lay.local_shape != lay.full_shape}


def _global_entries(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """state_dict hook: this module's TP-sharded parameters as GlobalShards, and FP8 weights
    (quantized_model_init) as their high-precision values, which any model loads and DCP stores like any
    weight. Parameters themselves (keep_vars=True: a caller that wants the objects) are left as they are."""
    if not module.whole_tensor_state_dict:
        return
    layouts = _sharded_layouts(module)
    for name in module._parameters:
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, (nn.Parameter, GlobalShards)):
            continue
        value = _high_precision(value)
        layout = layouts.get(name)
        state_dict[key] = value if layout is None else global_shards(key, value, layout, module.tp_group)
    shard = _expert_shard(module)
    if shard is not None:  # each expert under its name in the whole layer (local names never clash with them)
        for name in module._parameters:
            if prefix + name in state_dict and shard.global_name(name) != name:
                state_dict[prefix + shard.global_name(name)] = state_dict.pop(prefix + name)


def _local_entries(module: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: a GlobalShards entry of this module's layout loads as its local shard
    (what DCP wrote into it in place, or another model's shard of the same layout); one of another
    TP layout is refused, since its local data is not this rank's part of the tensor."""
    _expert_local_entries(module, state_dict, prefix)
    entries = {name: state_dict.get(prefix + name) for name in module._parameters}
    entries = {name: value for name, value in entries.items() if isinstance(value, GlobalShards)}
    layouts = _sharded_layouts(module) if entries else {}  # (once per module, and only when needed)
    for name, value in entries.items():
        layout = layouts.get(name)
        if layout is None or value.shard_layout != layout:
            have = "unsharded" if layout is None else f"{layout.full_shape} split on dim {layout.dim} {layout.pieces}"
            raise ValueError(f"load_state_dict: {prefix + name} is a TP shard ({value.shard_layout.full_shape} split on dim "
                             f"{value.shard_layout.dim} {value.shard_layout.pieces}) of another layout than this rank's ({have}); "
                             f"load across TP layouts with torch.distributed.checkpoint (dcp.load into this model's "
                             f"state_dict(), then load_state_dict)")
        state_dict[prefix + name] = value.source


def _expert_shard(module: nn.Module) -> Optional[ExpertShard]:
    """The module's place among its layer's experts where they are split over an ep group (sharding's
    `ep_shard()`), else None; None too where whole_tensor_state_dict is off (each rank's local names)."""
    fn = getattr(module, "ep_shard", None)  # the modules that answer it: ExpertShard's rule
    return None if fn is None or not module.whole_tensor_state_dict else fn()


def _expert_local_entries(module: nn.Module, state_dict, prefix: str) -> None:
    """Expert entries under their names in the whole layer (weight{e}) become this rank's local entries
    (weight{e - offset}); other ranks' experts' entries are left out, so a state dict of the whole layer
    (one process, or another ep size gathered by dcp.load) loads into each rank's experts."""
    shard = _expert_shard(module)
    if shard is None:
        return
    taken = {}
    for key in [k for k in state_dict if k.startswith(prefix) and shard.is_expert_name(k[len(prefix):])]:
        value = state_dict.pop(key)
        local = shard.local_name(key[len(prefix):])
        if local is not None:
            taken[prefix + local] = value
    state_dict.update(taken)


def dcp_state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                   process_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """{"model": ..., "optim": ...} for dcp.save, and the template dcp.load fills in place.

    torch's get_model_state_dict / get_optimizer_state_dict (FSDP2, DDP and compiled models as torch
    handles them), with every TP-sharded parameter and its optimizer state as a GlobalShards. Buffers
    (the FP8 scaling state among them) are StoredOnce entries: bytes, one copy, of the first rank of
    `process_group` (the ranks that make this call together, as for dcp.save; default: the default
    group when torch.distributed is initialized), so the checkpoint holds one consistent state even
    where data-parallel replicas' FP8 states differ.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(model, nn.Module):
        raise TypeError(f"dcp_state_dict: model must be an nn.Module, got {type(model).__name__}")
    names = expert_names(model)
    layouts = {names.get(n, n): layout for n, layout in model_layouts(model).items()}
    model_sd = _sources(dict(get_model_state_dict(model)))  # the TP-local entries, wrapped below with the rest
    missing = sorted(set(layouts) - set(model_sd))
    if missing:
        raise ValueError(f"dcp_state_dict: parameters {missing[:3]} are not in the model's state dict; "
                         f"te_parallel needs every TP-sharded parameter under its own name")
    for name, value in model_sd.items():
        model_sd[name] = _high_precision(value)
    for name, layout in layouts.items():
        model_sd[name] = global_shards(name, model_sd[name], layout)
    param_names = {names.get(n, n) for n in (_fqn(n) for n, _ in _root(model).named_parameters(remove_duplicate=False))}
    _replicate_buffers(model_sd, param_names, process_group)
    out = {"model": model_sd}
    if optimizer is not None:
        optim_sd = _renamed_state(get_optimizer_state_dict(model, optimizer), names)
        out["optim"] = _optimizer_entries(optim_sd, layouts)
    return out


def load_dcp_state_dict(model: nn.Module, state_dict: Mapping[str, Any],
                        optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """After dcp.load(state_dict) into a dcp_state_dict template: load it into the model (FP8 scaling
    state, quantized-weight caches) and the optimizer (param groups), through torch's
    set_model_state_dict / set_optimizer_state_dict. The tensors DCP wrote are already in place."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not isinstance(state_dict, Mapping) or "model" not in state_dict:
        got = sorted(state_dict)[:4] if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"load_dcp_state_dict: state_dict must be what dcp_state_dict returned ({{'model': ..., "
                         f"'optim': ...}}), got {got}")
    if optimizer is not None and "optim" not in state_dict:
        raise ValueError("load_dcp_state_dict: an optimizer was given but state_dict has no 'optim' entry; "
                         "make the template with dcp_state_dict(model, optimizer)")
    # (the root module: under DDP torch would look the entries up by their local names, and an expert's is
    # its whole-layer name, which the modules' load hooks take back)
    set_model_state_dict(_root(model), _sources(state_dict["model"]))
    if optimizer is not None:
        local_names = {g: n for n, g in expert_names(model).items()}
        set_optimizer_state_dict(model, optimizer, _renamed_state(_sources(state_dict["optim"]), local_names))
    for module in model.modules():  # weights changed under them (writes through views keep versions right too)
        drop = getattr(module, "drop_fp8_weight_cache", None)
        if drop is not None:
            drop()


def _high_precision(value: Any) -> Any:
    """A quantized parameter (an FP8 weight: a tensor subclass with `dequantize()`, or its FSDP2 DTensor)
    as a plain high-precision copy of its value: DCP then stores and reshards it like any weight, and a
    model with or without FP8 weights can load it (load_dcp_state_dict quantizes it back on the way in).
    Anything else is returned as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    if type(local) is torch.Tensor or not callable(getattr(local, "dequantize", None)):
        return value
    plain = local.dequantize()
    if isinstance(value, DTensor):
        return DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return plain


def model_layouts(model: nn.Module) -> Dict[str, ShardLayout]:
    """The TP-sharded parameters' layouts under the names torch's state-dict functions give them (every
    name of a shared parameter: the state dict holds it under each)."""
    root = _root(model)
    layouts = shard_layouts(root)
    first = {id(p): name for name, p in root.named_parameters()}
    out = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        layout = layouts[first[id(p)]]
        if layout.dim is not None:
            out[_fqn(name)] = layout
    return out


def expert_names(model: nn.Module) -> Dict[str, str]:
    """{local name: name in the whole model} of the parameters of experts split over an ep group (the
    names torch's state-dict functions give them), where the two differ: the modules' `ep_shard()`
    (te_parallel.parallel.sharding)."""
    out = {}
    for prefix, module in _root(model).named_modules(remove_duplicate=False):
        shard = _expert_shard(module)
        if shard is None:
            continue
        for name in module._parameters:
            if shard.global_name(name) != name:
                out[_fqn(f"{prefix}.{name}" if prefix else name)] = _fqn(
                    f"{prefix}.{shard.global_name(name)}" if prefix else shard.global_name(name))
    return out


def _renamed_state(optim_sd: Dict[str, Any], names: Mapping[str, str]) -> Dict[str, Any]:
    """The optimizer state dict with its per-parameter state under `names` (the param groups' lists of
    names are left as they are: the local names, the same on every ep rank, so that whichever rank's copy
    DCP keeps maps the groups at load)."""
    if not names:
        return optim_sd
    return {**optim_sd, "state": {names.get(k, k): v for k, v in optim_sd.get("state", {}).items()}}


def _root(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _optimizer_entries(optim_sd: Dict[str, Any], layouts: Dict[str, ShardLayout]) -> Dict[str, Any]:
    """Optimizer state of a TP-sharded parameter (the tensors shaped like it: moments, not `step`) as
    GlobalShards of the parameter's layout."""
    state = {}
    for name, entries in optim_sd.get("state", {}).items():
        layout = layouts.get(name)
        if layout is None or not isinstance(entries, Mapping):
            state[name] = entries
            continue
        state[name] = {k: global_shards(f"{name}.{k}", v, layout)
                       if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(layout.local_shape) else v
                       for k, v in entries.items()}
    return {**optim_sd, "state": state}


class StoredOnce:
    """A replicated buffer's entry (the FP8 scaling state's among them): DCP stores it as bytes, one copy,
    and loads it whatever its shape, since a fresh model's amax histories need not have the saved
    length (the recipe's amax_history_len). It pickles as the plain tensor, so a load hands back a
    plain tensor, also to code that never imported te_parallel."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        return self.tensor.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"StoredOnce(shape={tuple(self.tensor.shape)}, dtype={self.tensor.dtype})"


def _replicate_buffers(model_sd: Dict[str, Any], params, group: Optional[dist.ProcessGroup]) -> None:
    """Every plain-tensor buffer entry becomes a StoredOnce of the group's first rank's value (one
    broadcast per dtype and device). DCP keeps one copy of an entry that all ranks write, chosen per
    entry: without the broadcast, the saved FP8 scales and amax histories of replicas whose states
    differ could come from different replicas."""
    names = [n for n, v in model_sd.items()
             if n not in params and isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]
    if names and dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        src = dist.get_process_group_ranks(group)[0]
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[str]] = {}
        for n in names:
            by_kind.setdefault((model_sd[n].dtype, model_sd[n].device), []).append(n)
        for kind_names in by_kind.values():
            flat = torch.cat([model_sd[n].detach().reshape(-1) for n in kind_names])
            dist.broadcast(flat, src=src, group=group)
            for n, part in zip(kind_names, flat.split([model_sd[n].numel() for n in kind_names])):
                model_sd[n] = part.view_as(model_sd[n]).clone()  # own storage: pickled alone
    for n in names:
        model_sd[n] = StoredOnce(model_sd[n].detach())


def _sources(tree: Any) -> Any:
    """The state dict with every GlobalShards and StoredOnce replaced by the tensor it was made from (a
    StoredOnce that DCP loaded is already a plain tensor)."""
    if isinstance(tree, GlobalShards):
        return tree.source
    if isinstance(tree, StoredOnce):
        return tree.tensor
    if isinstance(tree, Mapping):
        return {k: _sources(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_sources(v) for v in tree]
    return tree
