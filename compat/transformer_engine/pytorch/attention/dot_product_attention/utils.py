"""TE's `transformer_engine.pytorch.attention.dot_product_attention.utils`, the part its tests import.

`check_set_window_size` works (TE's rule for a sliding window per mask type). TE's backend selection
(`AttentionParams`, `get_attention_backend`: flash-attn / cuDNN fused / unfused, by TE's rules) is
import-only: te_parallel's DotProductAttention chooses among its own backends (te_parallel.ops.attention,
docs/attention.md), which are not TE's three.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional, Tuple

from transformer_engine.pytorch._missing import missing_class, missing_function

__all__ = ["AttentionLogging", "AttentionParams", "get_attention_backend", "check_set_window_size"]

_SELECTION = "TE's attention backend selection (te_parallel's DotProductAttention picks its own backend)"
AttentionParams = missing_class("attention.dot_product_attention.utils.AttentionParams", _SELECTION)
get_attention_backend = missing_function("attention.dot_product_attention.utils.get_attention_backend", _SELECTION)

_CAUSAL_ONLY_LEFT = ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
_TWO_SIDED = ("no_mask", "padding", "arbitrary")


class AttentionLogging:
    """TE's attention logger switch. te_parallel logs through the standard `logging` module (this logger
    among them); setting it up only records that it was."""

    fa_logger = logging.getLogger("transformer_engine.pytorch.attention")
    _is_logging_setup = False

    @staticmethod
    def setup_logging() -> None:
        AttentionLogging._is_logging_setup = True


def check_set_window_size(attn_mask_type: str, window_size: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """The sliding window (left, right) for `attn_mask_type`, -1 = unbounded, as TE fills and corrects it:
    causal masks take (-1 or >= 0, 0) (a right side is dropped with a warning); the others take (-1, -1)
    or (>= 0, >= 0) ((-1, 0) becomes (-1, -1) with a warning). None gives the unbounded window."""
    if attn_mask_type in _CAUSAL_ONLY_LEFT:
        if window_size is None:
            return (-1, 0)
        left, right = window_size
        if (left, right) == (-1, -1) or (left >= 0 and right != 0):
            warnings.warn(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}; "
                          f"using ({left}, 0)")
            return (left, 0)
        if left < -1 or (left == -1 and right != 0):
            raise ValueError(f"check_set_window_size: window_size={tuple(window_size)} is not valid for "
                             f"attn_mask_type={attn_mask_type}; use (-1, 0) or (>=0, 0)")
        return tuple(window_size)
    if attn_mask_type in _TWO_SIDED:
        if window_size is None:
            return (-1, -1)
        left, right = window_size
        if (left, right) == (-1, 0):
            warnings.warn(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}; "
                          f"using (-1, -1)")
            return (-1, -1)
        if (left, right) != (-1, -1) and (left < 0 or right < 0):
            raise ValueError(f"check_set_window_size: window_size={tuple(window_size)} is not valid for "
                             f"attn_mask_type={attn_mask_type}; use (-1, -1) or (>=0, >=0)")
        return tuple(window_size)
    raise ValueError(f"check_set_window_size: attn_mask_type={attn_mask_type!r} is not one of "
                     f"{_CAUSAL_ONLY_LEFT + _TWO_SIDED}")
