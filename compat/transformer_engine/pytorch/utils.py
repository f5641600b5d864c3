"""TE's `transformer_engine.pytorch.utils`: the helpers its clients (and its tests) import."""
from __future__ import annotations

import math
from typing import Callable, Tuple

import torch

from te_parallel.fp8.quantizers import get_device_compute_capability, is_bf16_available

__all__ = ["get_device_compute_capability", "make_weak_ref", "is_bf16_compatible", "is_bf16_available",
           "get_cudnn_version", "is_non_tn_fp8_gemm_supported", "init_method_normal", "scaled_init_method_normal",
           "attention_mask_func", "round_up_to_nearest_multiple"]


def is_bf16_compatible() -> bool:
    return bool(is_bf16_available())


def is_non_tn_fp8_gemm_supported() -> bool:
    """False: te_parallel's FP8 GEMMs take the TN layout on every GPU, so its FP8 tensors keep a separate
    transposed copy for the other direction (TE's layout before Blackwell)."""
    return False


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init function drawing from N(0, sigma^2)."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init function drawing from N(0, (sigma / sqrt(2 num_layers))^2) (output layers of a deep stack)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Masked positions (True) of the scores set to -10000, in place."""
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
