"""TE's `transformer_engine.pytorch.utils`: the helpers its clients import."""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["get_device_compute_capability", "make_weak_ref", "is_bf16_compatible", "get_cudnn_version"]


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) without CUDA."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def is_bf16_compatible() -> bool:
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def get_cudnn_version() -> Tuple[int, int, int]:
    version = torch.backends.cudnn.version() or 0
    return version // 10000, version // 100 % 100, version % 100


def make_weak_ref(x):
    """TE's CUDA-graph helper: a tensor sharing x's storage without keeping x's autograd history
    (containers are mapped element-wise)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(make_weak_ref(v) for v in x)
    if isinstance(x, dict):
        return {k: make_weak_ref(v) for k, v in x.items()}
    return x
