"""Activations of LayerNormMLP, by TE's names.

Gated ones (geglu, qgeglu, reglu, sreglu, swiglu) take fc1's output [.., 2F] as (a, b) halves
along the last dim and return act(a) * b, so fc1 has 2·ffn_hidden_size outputs.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F


def gelu(x):  # TE's gelu is the tanh approximation
    return F.gelu(x, approximate="tanh")


def qgelu(x):  # "quick GELU": x·σ(1.702x)
    return x * torch.sigmoid(1.702 * x)


def srelu(x):  # squared ReLU
    return torch.square(F.relu(x))


_BASE: Dict[str, Callable] = {"gelu": gelu, "relu": F.relu, "qgelu": qgelu, "srelu": srelu, "silu": F.silu}
_GATED: Dict[str, Callable] = {"geglu": gelu, "qgeglu": qgelu, "reglu": F.relu, "sreglu": srelu, "swiglu": F.silu}
ACTIVATIONS = tuple(_BASE) + tuple(_GATED)


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def is_gated(name: str) -> bool:
    return name in _GATED


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name in _BASE:
        return _BASE[name](x)
    a, b = x.chunk(2, dim=-1)
    return _GATED[name](a) * b


def activation_reference(name: str, x: torch.Tensor) -> torch.Tensor:
    """fp64 reference written from the formulas (independent of torch.nn.functional)."""
    x = x.double()

    def act(v, n):
        if n in ("gelu", "geglu"):
            return 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3)))
        if n in ("relu", "reglu"):
            return torch.where(v > 0, v, torch.zeros_like(v))
        if n in ("qgelu", "qgeglu"):
            return v / (1 + torch.exp(-1.702 * v))
        if n in ("srelu", "sreglu"):
            return torch.where(v > 0, v * v, torch.zeros_like(v))
        return v / (1 + torch.exp(-v))  # silu, swiglu

    if name in _BASE:
        return act(x, name)
    a, b = x.chunk(2, dim=-1)
    return act(a, name) * b
