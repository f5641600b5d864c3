"""te.DotProductAttention: softmax(q·kᵀ·scale + mask)·v over this rank's heads."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from te_parallel.module.parallel_mixin import TensorParallelMixin
from te_parallel.ops.attention import BACKENDS, attention, build_mask, check_mask_type, check_window, choose_backend
from te_parallel.parallel.groups import check_divisible

QKV_FORMATS = ("sbhd", "bshd")


class DotProductAttention(nn.Module, TensorParallelMixin):
    """Attention core with TE's arguments. Inputs q [s, b, h/tp, d], k/v [s, b, g/tp, d] ("sbhd", or
    "bshd"); output [s, b, h/tp · d]. Heads (and GQA groups) are split across the TP group.

    backend: "auto" (the rule in te_parallel.ops.attention), or "flash", "cudnn", "efficient",
    "math", "unfused"; `last_backend` says which one ran. Masks: True = masked out.
    Attention dropout on sharded heads draws from the tracker's model-parallel RNG state when
    get_rng_state_tracker is given (TE / Megatron).
    """

    def __init__(self, num_attention_heads: int, kv_channels: int, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker=None,
                 tp_group=None, layer_number: Optional[int] = None, attention_type: str = "self",
                 softmax_scale: Optional[float] = None, backend: str = "auto",
                 rng_tracker_name: Optional[str] = None) -> None:
        super().__init__()
        owner = "DotProductAttention"
        self._init_tp(owner, tp_group, tp_size, sequence_parallel)
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if groups < 1 or num_attention_heads % groups:
            raise ValueError(f"{owner}: num_attention_heads={num_attention_heads} is not divisible by num_gqa_groups={groups}")
        self.num_heads = check_divisible(owner, "num_attention_heads", num_attention_heads, self.tp_size)
        self.num_gqa_groups = check_divisible(owner, "num_gqa_groups", groups, self.tp_size)
        check_mask_type(owner, attn_mask_type)
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"{owner}: qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{owner}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{owner}: backend must be one of {BACKENDS}, got {backend!r}")
        self.kv_channels, self.qkv_format, self.attn_mask_type = kv_channels, qkv_format, attn_mask_type
        self.window_size, self.attention_type = check_window(owner, window_size), attention_type
        self.attention_dropout, self.softmax_scale, self.backend = attention_dropout, softmax_scale, backend
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.layer_number, self.last_backend = layer_number, None

    def reset_parameters(self) -> None:
        """Nothing to initialise: the attention core has no parameters or buffers (here for the
        deferred-init protocol every module follows)."""

    def _to_bhsd(self, t: torch.Tensor, fmt: str) -> torch.Tensor:
        return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2)

    def _check_qkv(self, q, k, v, fmt: str) -> None:
        heads_q, heads_kv = q.shape[2], k.shape[2]
        if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"DotProductAttention: q/k/v must be 4-D [{fmt}] with v like k, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if heads_q != self.num_heads or heads_kv != self.num_gqa_groups or q.shape[-1] != self.kv_channels:
            raise ValueError(
                f"DotProductAttention: expected q with {self.num_heads} heads and k/v with {self.num_gqa_groups} "
                f"of size {self.kv_channels} on this rank, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None, attn_mask_type: Optional[str] = None,
                window_size=None, core_attention_bias_type: str = "no_bias", core_attention_bias=None):
        fmt = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        check_mask_type("DotProductAttention", mask_type)
        window = check_window("DotProductAttention", window_size) if window_size is not None else self.window_size
        self._check_qkv(query_layer, key_layer, value_layer, fmt)
        q, k, v = (self._to_bhsd(t, fmt) for t in (query_layer, key_layer, value_layer))
        b, h, sq, _ = q.shape
        skv = k.shape[2]
        causal_flag = mask_type == "causal" and window is None and attention_mask is None
        mask = None if causal_flag else build_mask(mask_type, attention_mask, b, h, sq, skv, window, q.device)
        backend = choose_backend(self.backend, q, has_mask=mask is not None, gqa=k.shape[1] != h)
        fallback = "flash" if self.backend == "auto" and backend == "cudnn" else None
        p = self.attention_dropout if self.training else 0.0
        with self._dropout_rng(p):
            out, self.last_backend = attention(q, k, v, mask, backend, self.softmax_scale, p, is_causal=causal_flag,
                                               fallback=fallback)
        out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)  # [s, b, h, d] / [b, s, h, d]
        return out.reshape(*out.shape[:2], h * out.shape[-1])

    def _dropout_rng(self, p: float):
        if p > 0 and self.get_rng_state_tracker is not None:
            tracker = self.get_rng_state_tracker()
            return tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()
        return contextlib.nullcontext()
