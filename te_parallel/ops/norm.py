"""LayerNorm and RMSNorm (functional), with TE's zero-centred gamma, and fp64 references.

zero_centered_gamma: the stored weight is γ − 1 (initialised to 0), so weight decay pulls γ
towards 1 rather than 0; the math uses (1 + weight).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight + 1 if zero_centered_gamma else weight


def layer_norm(x, weight, bias, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    h = x.shape[-1]
    w = _gamma(weight, zero_centered_gamma).to(x.dtype)
    return F.layer_norm(x, (h,), w, None if bias is None else bias.to(x.dtype), eps)


def rms_norm(x, weight, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    h = x.shape[-1]
    return F.rms_norm(x, (h,), _gamma(weight, zero_centered_gamma).to(x.dtype), eps)


def apply_norm(normalization: str, x, weight, bias: Optional[torch.Tensor], eps: float, zero_centered_gamma: bool):
    if normalization == "LayerNorm":
        return layer_norm(x, weight, bias, eps, zero_centered_gamma)
    return rms_norm(x, weight, eps, zero_centered_gamma)


def layer_norm_reference(x, weight, bias, eps, zero_centered_gamma=False):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    g = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    y = (x - mu) / torch.sqrt(var + eps) * g
    return y if bias is None else y + bias.double()


def rms_norm_reference(x, weight, eps, zero_centered_gamma=False):
    x = x.double()
    g = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g
