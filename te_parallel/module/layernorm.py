"""te.LayerNorm and te.RMSNorm."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from te_parallel.module.base import (activation_dtype, check_features, check_input, check_materialized,
                                     norm_outside_autocast, resolve_device, resolve_dtype)
from te_parallel.module.parallel_mixin import TensorParallelMixin
from te_parallel.ops.norm import layer_norm, rms_norm
from te_parallel.parallel.collectives import all_reduce_grad


def _hidden_size(owner: str, hidden_size, normalized_shape) -> int:
    """TE 2.x names the size `normalized_shape` (an int or a one-element sequence, as torch.nn.LayerNorm)
    and keeps `hidden_size` as the older name; either may be given, or both when they agree."""
    if normalized_shape is None:
        if hidden_size is None:
            raise TypeError(f"{owner}: give the normalized size, as normalized_shape (or hidden_size)")
        return hidden_size
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1 or not isinstance(shape[0], int):
        raise ValueError(f"{owner}: normalizes over the last dim only, so normalized_shape must be an int or a "
                         f"1-element sequence, got {normalized_shape!r}")
    if hidden_size is not None and hidden_size != shape[0]:
        raise ValueError(f"{owner}: hidden_size={hidden_size} and normalized_shape={normalized_shape!r} disagree; give one")
    return shape[0]


class _Norm(nn.Module, TensorParallelMixin):
    """Under sequence_parallel each rank normalizes its own tokens, so γ/β gradients are partial.
    With a tp_group (te_parallel's addition to TE's arguments, or set_tensor_parallel_group) they are
    all-reduced here; without one the parameters carry Megatron's `sequence_parallel` marker and
    the caller reduces them, as with TE."""

    def __init__(self, hidden_size: Optional[int], eps: float, sequence_parallel: bool, params_dtype,
                 zero_centered_gamma: bool, device, with_bias: bool, tp_group, normalized_shape=None) -> None:
        super().__init__()
        name = type(self).__name__
        hidden_size = _hidden_size(name, hidden_size, normalized_shape)
        check_features(name, hidden_size=hidden_size)
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self._init_tp(name, tp_group, 1, sequence_parallel)
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        self.normalized_shape = (hidden_size,)  # torch.nn.LayerNorm's attribute (TE 2.x has it too)
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype)) if with_bias else None
        self.reset_parameters()

    def set_tensor_parallel_group(self, tp_group) -> None:
        """The group over which γ/β gradients are summed under sequence parallelism (a ProcessGroup or a
        1-D DeviceMesh); the parameters are whole on every rank, so any group size is accepted."""
        self._init_tp(type(self).__name__, tp_group, 1, self.sequence_parallel)

    def _params(self):
        if self.sequence_parallel and self.tp_group is not None:
            return all_reduce_grad(self.weight, self.tp_group), all_reduce_grad(self.bias, self.tp_group)
        return self.weight, self.bias

    def _input(self, inp: torch.Tensor) -> torch.Tensor:
        """inp in the activation dtype (the parameters', or torch.autocast's), as every module's output is."""
        check_input(type(self).__name__, inp, self.hidden_size)
        weight = self.weight
        if weight.is_meta:
            check_materialized(self)
        dtype = activation_dtype(weight.dtype, inp.device)
        return inp if inp.dtype == dtype else inp.to(dtype)

    def _norm(self, fn, inp: torch.Tensor, *args) -> torch.Tensor:
        x = self._input(inp)
        return norm_outside_autocast(fn, x, x, *args)

    def reset_parameters(self) -> None:
        """weight 1 (0 with zero_centered_gamma), bias 0, as at construction; after `to_empty` this
        materialises a norm built on the meta device. Marks the parameters for sequence parallelism."""
        for p in self.parameters():  # (to_empty makes new Parameters, without the marker)
            p.sequence_parallel = self.sequence_parallel
        if self.weight.is_meta:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """y = (x − mean) / sqrt(var + eps) · γ + β over the last dim (γ = 1 + weight if zero_centered_gamma)."""

    def __init__(self, hidden_size: Optional[int] = None, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None,
                 tp_group=None, normalized_shape=None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, True, tp_group,
                         normalized_shape)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params()
        return self._norm(layer_norm, inp, weight, bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x²) + eps) · γ over the last dim (γ = 1 + weight if zero_centered_gamma)."""

    def __init__(self, hidden_size: Optional[int] = None, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None,
                 tp_group=None, normalized_shape=None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, False, tp_group,
                         normalized_shape)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        weight, _ = self._params()
        return self._norm(rms_norm, inp, weight, self.eps, self.zero_centered_gamma)
