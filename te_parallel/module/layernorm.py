"""te.LayerNorm and te.RMSNorm."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from te_parallel.module.base import check_features, check_input, resolve_device, resolve_dtype
from te_parallel.ops.norm import layer_norm, rms_norm


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, params_dtype, zero_centered_gamma: bool,
                 device, with_bias: bool) -> None:
        super().__init__()
        name = type(self).__name__
        check_features(name, hidden_size=hidden_size)
        if sequence_parallel:
            raise NotImplementedError(f"{name}: sequence_parallel=True is not implemented in this version")
        device, dtype = resolve_device(device), resolve_dtype(params_dtype)
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if with_bias else None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """y = (x − mean) / sqrt(var + eps) · γ + β over the last dim (γ = 1 + weight if zero_centered_gamma)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, True)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        check_input("LayerNorm", inp, self.hidden_size)
        return layer_norm(inp, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x²) + eps) · γ over the last dim (γ = 1 + weight if zero_centered_gamma)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False, device=None) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device, False)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        check_input("RMSNorm", inp, self.hidden_size)
        return rms_norm(inp, self.weight, self.eps, self.zero_centered_gamma)
