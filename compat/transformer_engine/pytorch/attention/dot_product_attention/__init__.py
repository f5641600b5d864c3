"""TE's te.DotProductAttention: te_parallel.DotProductAttention with TE 2.9's keywords and behaviour.

As in TE, `attention_mask` is ignored for the mask types that need none ("no_mask", "causal",
"causal_bottom_right"): Megatron passes its causal mask with attn_mask_type="causal".
Context parallelism (`cp_group`, `cp_comm_type`, ...) and FP8 attention (recipes' `fp8_dpa` / `fp8_mha`: cuDNN's
FP8 fused attention) are te_parallel's. Non-vanilla softmax, `return_max_logit`, ALiBi and KV caches raise
NotImplementedError; packed sequences
(`cu_seqlens_*`, `max_seqlen_*`, qkv_format="thd") go to te_parallel's attention where it takes them.

`_attention_backends` is TE's cache of its backend choice, kept for the code that reads or resets it;
te_parallel's attention does not consult it (its backend rule is te_parallel.ops.attention's).
`utils` holds TE's attention helpers that its tests import.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

import te_parallel

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, split_te_kwargs

__all__ = ["DotProductAttention", "_attention_backends"]

# TE's keys; written by TE's backend selection (not present here: utils.get_attention_backend raises)
_attention_backends = {"attention_params": None, "use_flash_attention": None, "flash_attention_backend": None,
                       "use_fused_attention": None, "fused_attention_backend": None, "use_unfused_attention": None,
                       "backend_selection_requires_update": False}

_NO_MASK_NEEDED = ("no_mask", "causal", "causal_bottom_right")
_PACKED = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
           "max_seqlen_kv", "pad_between_seqs")


def _head_dim(kv_channels) -> int:
    if isinstance(kv_channels, (tuple, list)):
        k, v = kv_channels
        if k != v:
            raise NotImplementedError(f"DotProductAttention: kv_channels={tuple(kv_channels)} (different key and value "
                                      f"head sizes) is not implemented in te_parallel")
        return k
    return kv_channels


class DotProductAttention(TransformerEngineBaseModule, te_parallel.DotProductAttention):
    """softmax(q·kᵀ·scale + mask)·v (te_parallel.DotProductAttention)."""

    def __init__(self, num_attention_heads: int, kv_channels, *args, cp_group=None, cp_global_ranks=None,
                 cp_stream=None, cp_comm_type: str = "p2p", softmax_type: str = "vanilla",
                 return_max_logit: bool = False, **kwargs) -> None:
        te_kwargs = split_te_kwargs("DotProductAttention", kwargs)
        kwargs.pop("allreduce_sp_grads")  # (no parameters)
        if softmax_type != "vanilla":
            raise NotImplementedError(f"DotProductAttention: softmax_type={softmax_type!r} is not implemented in "
                                      f"te_parallel; use 'vanilla'")
        if return_max_logit:
            raise NotImplementedError("DotProductAttention: return_max_logit=True (Megatron's qk_clip) is not "
                                      "implemented in te_parallel")
        super().__init__(num_attention_heads, _head_dim(kv_channels), *args, **kwargs)
        self._init_te(te_kwargs)
        self.fp8_attention_state.in_extra_state = True  # TE's layout: no FP8 attention state beside _extra_state
        self.softmax_type = softmax_type
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None, attn_mask_type: Optional[str] = None,
                window_size=None, checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                fp8_output: bool = False, num_splits=None, **packed):
        self._note_region()
        for name, value in (("alibi_slopes", alibi_slopes), ("inference_params", inference_params)):
            if value is not None:
                raise NotImplementedError(f"DotProductAttention: {name} is not implemented in te_parallel")
        if (attn_mask_type or self.attn_mask_type) in _NO_MASK_NEEDED:
            attention_mask = None  # TE ignores the mask of these types
        kwargs = dict(qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
                      core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias)
        kwargs.update(self._packed_kwargs(packed))
        run = super().forward
        if checkpoint_core_attention and torch.is_grad_enabled():
            return te_parallel.checkpoint(lambda q, k, v: run(q, k, v, attention_mask, **kwargs),
                                          query_layer, key_layer, value_layer,
                                          get_rng_state_tracker=self.get_rng_state_tracker)
        return run(query_layer, key_layer, value_layer, attention_mask, **kwargs)

    def _packed_kwargs(self, packed: dict) -> dict:
        unknown = sorted(k for k in packed if k not in _PACKED)
        if unknown:
            raise TypeError(f"DotProductAttention.forward() got unexpected keyword(s) {unknown}")
        given = {k: v for k, v in packed.items() if v is not None}
        if not given:
            return {}
        accepted = inspect.signature(te_parallel.DotProductAttention.forward).parameters
        missing = sorted(k for k in given if k not in accepted)
        if missing:
            raise NotImplementedError(f"DotProductAttention: packed sequences ({', '.join(missing)}) are not "
                                      f"implemented in this te_parallel")
        return given
