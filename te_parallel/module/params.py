"""Parameters of the GEMM modules: a linear layer's weight [out, in] and bias [out], whole or split
(TE's parameters_split) into named views of one buffer, and their concatenation without a copy; the
norm parameters of the LayerNorm* modules; where each sits in the full (TP=1) parameter; and their
(re)initialisation, which `reset_parameters()` and the constructors share."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from te_parallel.fp8.params import Float8Weight
from te_parallel.fp8.state import DEFAULT_HISTORY_LEN
from te_parallel.module.fp8_weights import high_precision_stand_ins, quantize_weights
from te_parallel.module.init import DEFAULT_INIT, ShardedInit
from te_parallel.ops.fp8_weight import cat_fp8_weights
from te_parallel.ops.linear import WgradTarget
from te_parallel.parallel.groups import check_divisible, group_rank
from te_parallel.parallel.sharding import ShardLayout, replicated, split_layout


class LinearParams:
    """Creates a linear layer's weight [out, in] and bias [out] on `module`, whole or split.

    With `parameters_split` (TE's: names or {name: size}) the parameters are `<name>_weight` /
    `<name>_bias`, views of one buffer so the forward concatenates them without a copy.
    The values are written by `reset` (the module's reset_parameters), not here.
    """

    def __init__(self, module: nn.Module, in_features: int, out_features: int, *, bias: bool,
                 parameters_split, init_method: Optional[Callable], device, dtype, prefix: str = "",
                 split_divisor: int = 1, row_blocks: Optional[Sequence[int]] = None) -> None:
        """in/out_features are this rank's (local) sizes; split_divisor: the TP size by which
        `parameters_split` sizes (given for the full layer) are divided. row_blocks: the local rows of
        an unsplit weight as consecutive blocks that are each a column shard of their own block of the
        full weight (a gated fc1's [a_r; b_r]); default one block."""
        owner = type(module).__name__
        splits = split_sizes(out_features * split_divisor, parameters_split, owner)
        splits = [(name, check_divisible(owner, f"split {name!r} size", size, split_divisor)) for name, size in splits]
        self.in_features, self.init_method, self.row_blocks = in_features, init_method, None
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        bias_full = torch.empty(out_features, device=device, dtype=dtype) if bias else None
        self.weight_names: List[str] = []
        self.bias_names: List[str] = []
        self.bounds = []
        start = 0
        for name, size in splits:
            stop = start + size
            w = weight if len(splits) == 1 else weight[start:stop]
            module.register_parameter(f"{prefix}{name}weight", nn.Parameter(w))
            self.weight_names.append(f"{prefix}{name}weight")
            if bias:
                b = bias_full if len(splits) == 1 else bias_full[start:stop]
                module.register_parameter(f"{prefix}{name}bias", nn.Parameter(b))
                self.bias_names.append(f"{prefix}{name}bias")
            self.bounds.append((start, stop))
            start = stop
        if not bias:
            module.register_parameter(f"{prefix}bias", None)
        if row_blocks is not None:
            self.set_row_blocks(row_blocks, owner)

    def set_row_blocks(self, row_blocks: Sequence[int], owner: str = "") -> None:
        """Declare the local rows of the (unsplit) weight as blocks, each a column shard of its own block
        of the full weight; must come before the values are written (see __init__)."""
        rows, blocks = self.bounds[-1][1], tuple(int(b) for b in row_blocks)
        if len(self.bounds) != 1:
            raise ValueError(f"{owner or 'LinearParams'}: row blocks apply to an unsplit weight, not to parameters_split")
        if sum(blocks) != rows or any(b < 1 for b in blocks):
            raise ValueError(f"{owner or 'LinearParams'}: row blocks {blocks} must be positive and add up to the {rows} local rows")
        self.row_blocks = blocks

    def layouts(self, mode: Optional[str], rank: int, tp_size: int) -> Dict[str, ShardLayout]:
        """ShardLayout of each of these parameters on TP rank `rank` of `tp_size` ("column": rows split,
        the bias too; "row": columns split, the bias whole; None: all whole)."""
        out = {}
        for i, ((a, b), w_name) in enumerate(zip(self.bounds, self.weight_names)):
            rows = b - a
            if mode == "column" and tp_size > 1:
                blocks = [n * tp_size for n in (self.row_blocks or (rows,))] if len(self.bounds) == 1 else None
                w = split_layout((rows * tp_size, self.in_features), 0, rank, tp_size, blocks)
                bias = ShardLayout((rows * tp_size,), 0, w.pieces)
            elif mode == "row" and tp_size > 1:
                w = split_layout((rows, self.in_features * tp_size), 1, rank, tp_size)
                bias = replicated((rows,))
            else:
                w, bias = replicated((rows, self.in_features)), replicated((rows,))
            out[w_name] = w
            if self.bias_names:
                out[self.bias_names[i]] = bias
        return out

    def reset(self, module: nn.Module, layouts: Optional[Dict[str, ShardLayout]]) -> None:
        """Write the initial values: weights by init_method (the default and te_parallel.init's
        initialisers generate from full-tensor indices through `layouts`; a plain callable is called
        on this rank's local weight, TE's contract), biases zero. layouts None: TP rank unknown, each
        local weight is initialised as if whole."""
        params = module._parameters
        weights = [params[n] for n in self.weight_names]
        if any(w.is_meta for w in weights):
            return
        _retie_views(weights)
        _retie_views([params[n] for n in self.bias_names])
        init = DEFAULT_INIT if self.init_method is None else self.init_method
        with torch.no_grad():
            if isinstance(init, ShardedInit):
                for name, w in zip(self.weight_names, weights):
                    init.fill_(w, None if layouts is None else layouts[name])
            else:
                joined = _joined(weights)
                for w in [joined] if joined is not None else weights:
                    init(w)
            for name in self.bias_names:
                params[name].zero_()

    # (module._parameters, not getattr: nn.Module.__getattr__ costs about a microsecond per name, and
    # these run on every forward; functional_call and friends swap the entries of _parameters too)
    def weights(self, module) -> List[torch.Tensor]:
        params = module._parameters
        return [params[n] for n in self.weight_names]

    def weight(self, module) -> torch.Tensor:
        return cat_params(self.weights(module))

    def bias(self, module) -> Optional[torch.Tensor]:
        if not self.bias_names:
            return None
        params = module._parameters
        return cat_params([params[n] for n in self.bias_names])

    def wgrad_targets(self, module) -> List[WgradTarget]:
        return [WgradTarget(p, a, b) for p, (a, b) in zip(self.weights(module), self.bounds)]


class _NoopCat(torch.autograd.Function):
    """Concatenate split parameters along dim 0; no copy while they are adjacent views of one buffer.

    backward splits the gradient back into the parts.
    """

    @staticmethod
    def forward(ctx, *parts: torch.Tensor):
        ctx.sizes = [p.shape[0] for p in parts]
        first = parts[0].detach()
        if _are_adjacent(parts):
            return first.as_strided((sum(ctx.sizes), *first.shape[1:]), first.stride(), first.storage_offset())
        return torch.cat([p.detach() for p in parts])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.split(grad, ctx.sizes))


def _are_adjacent(parts: Sequence[torch.Tensor]) -> bool:
    base = parts[0]
    offset = base.storage_offset()
    for p in parts:
        same = p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        if not (same and p.is_contiguous() and p.storage_offset() == offset):
            return False
        offset += p.numel()
    return True


def cat_params(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Float8Weight):  # FP8 weights: one FP8 tensor (te_parallel/ops/fp8_weight.py)
        return cat_fp8_weights(parts)
    if torch.compiler.is_compiling():  # storage identity cannot be traced; the compiled graph concatenates
        return torch.cat(parts)
    return _NoopCat.apply(*parts)


def split_sizes(total: int, parameters_split, owner: str) -> List[Tuple[str, int]]:
    """TE's parameters_split: None, names (equal split) or {name: size}, as [(prefix, size)]."""
    if parameters_split is None:
        return [("", total)]
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif isinstance(parameters_split, (list, tuple)) and parameters_split:
        if total % len(parameters_split):
            raise ValueError(
                f"{owner}: out_features={total} is not divisible into {len(parameters_split)} equal splits {tuple(parameters_split)}"
            )
        items = [(name, total // len(parameters_split)) for name in parameters_split]
    else:
        raise ValueError(f"{owner}: parameters_split must be None, a tuple of names or a dict name->size, got {parameters_split!r}")
    if sum(size for _, size in items) != total:
        raise ValueError(f"{owner}: parameters_split sizes {dict(items)} add up to {sum(s for _, s in items)}, not out_features={total}")
    return [(str(name).rstrip("_") + "_", int(size)) for name, size in items]


def _retie_views(weights: Sequence[torch.Tensor]) -> None:
    """Make split weights adjacent views of one buffer again (to_empty gives each its own storage), so
    the forward's concatenation stays free. Plain tensors only: a DTensor's storage is its owner's."""
    if len(weights) < 2 or any(type(w.data) is not torch.Tensor for w in weights) or _are_adjacent(weights):
        return
    first = weights[0]
    buf = torch.empty(sum(w.shape[0] for w in weights), *first.shape[1:], dtype=first.dtype, device=first.device)
    start = 0
    for w in weights:
        w.data = buf[start:start + w.shape[0]]
        start += w.shape[0]


def _joined(weights: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The whole local weight as one tensor when the splits are adjacent views (a plain init_method is
    called on it, as at construction); None otherwise."""
    if len(weights) == 1:
        return weights[0]
    if any(type(w.data) is not torch.Tensor for w in weights) or not _are_adjacent(weights):
        return None
    first = weights[0]
    return first.as_strided((sum(w.shape[0] for w in weights), *first.shape[1:]), first.stride(), first.storage_offset())


def tp_rank(module: nn.Module) -> Optional[int]:
    """The module's rank in its TP group: 0 at tp_size 1, None while a tp_size > 1 module has no group."""
    if module.tp_size == 1:
        return 0
    return None if module.tp_group is None else group_rank(module.tp_group)


def gemm_layouts(module: nn.Module, parts: Sequence[Tuple[LinearParams, Optional[str]]]) -> Dict[str, ShardLayout]:
    """tp_shard_layouts() of a GEMM module: each LinearParams with its parallel mode."""
    rank = tp_rank(module)
    if rank is None:
        raise RuntimeError(f"{type(module).__name__}: built with tp_size={module.tp_size} but has no tp_group, so its "
                           f"shard's place in the full parameters is unknown; call set_tensor_parallel_group(group) first")
    out: Dict[str, ShardLayout] = {}
    for params, mode in parts:
        out.update(params.layouts(mode, rank, module.tp_size))
    return out


def reset_norm_params(module: nn.Module) -> None:
    """layer_norm_weight 1 (0 with zero_centered_gamma), layer_norm_bias 0."""
    weight, bias = module.layer_norm_weight, module.layer_norm_bias
    if weight.is_meta:
        return
    with torch.no_grad():
        weight.fill_(0.0 if module.zero_centered_gamma else 1.0)
        if bias is not None:
            bias.zero_()


def reset_gemm_module(module: nn.Module, parts: Sequence[Tuple[LinearParams, Optional[str]]]) -> None:
    """reset_parameters() of a GEMM module: norm parameters (if any), then each LinearParams in order
    (the order the constructor drew its keys in), fresh FP8 scaling state, no cached FP8 weight."""
    if "layer_norm_weight" in module._parameters:
        reset_norm_params(module)
    layouts = gemm_layouts(module, parts) if tp_rank(module) is not None else None
    saved = [high_precision_stand_ins(module, params) for params, _ in parts]  # FP8 weights: written via stand-ins
    for params, _ in parts:
        params.reset(module, layouts)
    state = module._modules.get("fp8_state")
    if state is not None and not state.fwd_scale.is_meta:
        state.reset(DEFAULT_HISTORY_LEN)
    quantize_weights(module, parts, saved)  # FP8 weights (quantized_model_init), after the state's reset
    module.drop_fp8_weight_cache()
