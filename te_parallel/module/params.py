"""Parameters of the GEMM modules: a linear layer's weight [out, in] and bias [out], whole or split
(TE's parameters_split) into named views of one buffer, and their concatenation without a copy."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from te_parallel.ops.linear import WgradTarget
from te_parallel.parallel.groups import check_divisible

DEFAULT_INIT_STD = 0.023  # TE's default init: N(0, 0.023²)


def default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


class LinearParams:
    """Creates a linear layer's weight [out, in] and bias [out] on `module`, whole or split.

    With `parameters_split` (TE's: names or {name: size}) the parameters are `<name>_weight` /
    `<name>_bias`, views of one buffer so the forward concatenates them without a copy.
    """

    def __init__(self, module: nn.Module, in_features: int, out_features: int, *, bias: bool,
                 parameters_split, init_method: Optional[Callable], device, dtype, prefix: str = "",
                 split_divisor: int = 1) -> None:
        """in/out_features are this rank's (local) sizes; split_divisor: the TP size by which
        `parameters_split` sizes (given for the full layer) are divided."""
        owner = type(module).__name__
        splits = split_sizes(out_features * split_divisor, parameters_split, owner)
        splits = [(name, check_divisible(owner, f"split {name!r} size", size, split_divisor)) for name, size in splits]
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        (init_method or default_init)(weight)
        bias_full = torch.zeros(out_features, device=device, dtype=dtype) if bias else None
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
    return parts[0] if len(parts) == 1 else _NoopCat.apply(*parts)


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
