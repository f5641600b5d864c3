"""Where each format runs (TE's availability helpers; FP8 per-tensor scaling: te_parallel.is_fp8_available).

Without CUDA every format te_parallel implements runs (its torch paths compute what the kernels do).
On CUDA: FP8 needs compute capability >= 8.9; block scaling runs its GEMMs with cuBLASLt's 1x128 / 128x128
scale modes, which need a Hopper GPU (sm_90) and CUDA >= 12.9 (TE accepts newer GPUs too, where it turns
block-scaled operands into MXFP8; te_parallel does not). MXFP8 and NVFP4 (Blackwell) are not implemented.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

from te_parallel.recipe import DelayedScaling, Recipe

__all__ = ["get_device_compute_capability", "is_bf16_available", "is_fp8_block_scaling_available",
           "is_mxfp8_available", "is_nvfp4_available", "get_default_fp8_recipe"]

Availability = Union[bool, Tuple[bool, str]]


def _answer(ok: bool, reason: str, return_reason: bool) -> Availability:
    return (ok, "" if ok else reason) if return_reason else ok


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) without CUDA."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def is_bf16_available(return_reason: bool = False) -> Availability:
    """bf16 computation: on the CPU, and on CUDA GPUs of compute capability >= 8.0."""
    if not torch.cuda.is_available():
        return _answer(True, "", return_reason)
    cc = get_device_compute_capability()
    return _answer(cc >= (8, 0), f"bf16 needs a GPU of compute capability >= 8.0; this one is {cc[0]}.{cc[1]}",
                   return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Availability:
    """FP8 block scaling (Float8BlockScaling): on the CPU; on CUDA, sm_90 with CUDA >= 12.9 (module doc). The
    check fp8_autocast makes (te_parallel.fp8.autocast), answered once per device."""
    from te_parallel.fp8.autocast import is_fp8_block_scaling_available as check

    ok, reason = check(return_reason=True)
    return _answer(ok, reason, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Availability:
    return _answer(False, "MXFP8 is a Blackwell format that te_parallel does not implement", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Availability:
    return _answer(False, "NVFP4 is a Blackwell format that te_parallel does not implement", return_reason)


def get_default_fp8_recipe() -> Recipe:
    """The recipe of fp8_autocast(fp8_recipe=None): DelayedScaling() (TE's default before Blackwell)."""
    return DelayedScaling()
