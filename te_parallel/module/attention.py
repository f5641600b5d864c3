"""te.DotProductAttention: softmax(q·kᵀ·scale + mask)·v over this rank's heads."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from te_parallel.fp8.autocast import current_frame
from te_parallel.module.parallel_mixin import TensorParallelMixin
from te_parallel.ops import attention_fp8
from te_parallel.ops import attention_fp8_state as fp8_state
from te_parallel.ops.attention_cudnn_fe import CudnnFeUnsupported
from te_parallel.module.rope import apply_rotary_pos_emb
from te_parallel.ops.attention import BACKENDS, check_mask_type, check_window, default_scale, make_band, warn_once
from te_parallel.ops.attention_dispatch import Call, make_batch, run
from te_parallel.ops.attention_varlen import token_positions
from te_parallel.parallel.context_parallel import context_parallel_attention, make_context_parallel
from te_parallel.parallel.groups import check_divisible

QKV_FORMATS = ("sbhd", "bshd", "thd")
# thd is ragged by construction: TE reads "no_mask"/"causal" there as their padding variants
_THD_MASK = {"no_mask": "padding", "causal": "padding_causal", "causal_bottom_right": "padding_causal_bottom_right"}


class DotProductAttention(nn.Module, TensorParallelMixin):
    """Attention core with TE's arguments. Inputs q [s, b, h/tp, d], k/v [s, b, g/tp, d] ("sbhd"),
    [b, s, ...] ("bshd") or packed sequences q [t, h/tp, d], k/v [t, g/tp, d] ("thd", with
    cu_seqlens_q/cu_seqlens_kv int32 [batch + 1]); output [s, b, h/tp · d], [b, s, ...] or [t, ...].
    Heads (and GQA groups) are split across the TP group.

    backend: "auto" (the rule in te_parallel.ops.attention), or "cudnn", "cudnn_fe", "flash",
    "flash_varlen", "efficient", "math", "unfused"; `last_backend` says which one ran. Masks: True =
    masked out. Padding masks give zeros at padded query positions (as TE). Attention dropout on
    sharded heads draws from the tracker's model-parallel RNG state when get_rng_state_tracker is given.

    Context parallelism (TE's cp_group, cp_global_ranks, cp_stream, cp_comm_type; or
    set_context_parallel_group): the inputs are this rank's tokens in the load-balanced layout and so is the
    output (te_parallel.parallel.context_parallel; a group of one rank, or None, changes nothing).

    FP8 attention: under fp8_autocast with a recipe whose fp8_dpa (or fp8_mha) is True and whose quantizers keep
    one scale per tensor (DelayedScaling, Float8CurrentScaling, or a recipe registered with such quantizers),
    q/k/v are quantized to FP8 and attention runs in cuDNN's FP8 kernels (CPU: their emulation), returning the
    inputs' dtype. Its scales and amax histories live in `fp8_attention_state` (te_parallel.ops.attention_fp8_state),
    made here with the layer, so state_dict / load_state_dict and torch.distributed.checkpoint carry them into a
    freshly built layer. Inputs FP8 attention does not take run as above, with one warning
    (te_parallel.ops.attention_fp8); `last_backend` is then "cudnn_fe_fp8", "fp8_emulation" or the bf16 one.
    """

    def __init__(self, num_attention_heads: int, kv_channels: int, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker=None,
                 tp_group=None, layer_number: Optional[int] = None, attention_type: str = "self",
                 softmax_scale: Optional[float] = None, backend: str = "auto",
                 rng_tracker_name: Optional[str] = None, cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p") -> None:
        super().__init__()
        owner = "DotProductAttention"
        self._init_tp(owner, tp_group, tp_size, sequence_parallel)
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if groups < 1 or num_attention_heads % groups:
            raise ValueError(f"{owner}: num_attention_heads={num_attention_heads} is not divisible by num_gqa_groups={groups}")
        self.num_heads = check_divisible(owner, "num_attention_heads", num_attention_heads, self.tp_size)
        self.num_gqa_groups = check_divisible(owner, "num_gqa_groups", groups, self.tp_size)
        check_mask_type(owner, attn_mask_type)
        _check_format(owner, qkv_format)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{owner}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        if backend not in BACKENDS:
            raise ValueError(f"{owner}: backend must be one of {BACKENDS}, got {backend!r}")
        self.kv_channels, self.qkv_format, self.attn_mask_type = kv_channels, qkv_format, attn_mask_type
        self.window_size, self.attention_type = check_window(owner, window_size), attention_type
        self.attention_dropout, self.softmax_scale, self.backend = attention_dropout, softmax_scale, backend
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.layer_number, self.last_backend = layer_number, None
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        # FP8 attention's scales (fp8_dpa), on the default device until the first FP8 call moves them to q's
        self.fp8_attention_state = fp8_state.new_state()

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p") -> None:
        """TE's API: cp_group a ProcessGroup (or [a2a group, p2p group] for cp_comm_type "a2a+p2p"),
        cp_global_ranks its global ranks in order, cp_stream kept for TE's signature; checked here."""
        self.cp_config = make_context_parallel("DotProductAttention", cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def reset_parameters(self) -> None:
        """No parameters to initialise; FP8 attention's scaling state is made fresh (the deferred-init protocol
        every module follows: after `to_empty` this gives the state its values)."""
        self.fp8_attention_state.reset_fresh()

    def _check_qkv(self, q, k, v, fmt: str) -> None:
        dims = 3 if fmt == "thd" else 4
        if q.dim() != dims or k.dim() != dims or v.shape != k.shape:
            raise ValueError(f"DotProductAttention: q/k/v must be {dims}-D [{fmt}] with v like k, got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        heads_q, heads_kv = q.shape[-2], k.shape[-2]
        if heads_q != self.num_heads or heads_kv != self.num_gqa_groups or q.shape[-1] != self.kv_channels:
            raise ValueError(
                f"DotProductAttention: expected q with {self.num_heads} heads and k/v with {self.num_gqa_groups} "
                f"of size {self.kv_channels} on this rank, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None, cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, attn_mask_type: Optional[str] = None, window_size=None,
                checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                pad_between_seqs: Optional[bool] = None, fp8_output: bool = False):
        """TE 2.x's arguments. attention_mask is read for the padding and arbitrary types only (TE
        ignores it otherwise). checkpoint_core_attention, fast_zero_fill and pad_between_seqs are
        accepted and need nothing here (gaps between packed sequences come from cu_seqlens_*_padded)."""
        owner = "DotProductAttention"
        fmt = qkv_format or self.qkv_format
        _check_format(owner, fmt)
        mask_type = attn_mask_type or self.attn_mask_type
        check_mask_type(owner, mask_type)
        _check_unsupported(owner, core_attention_bias_type, core_attention_bias, alibi_slopes, inference_params, fp8_output)
        if fmt == "thd":
            if mask_type == "arbitrary":
                raise ValueError(f"{owner}: qkv_format='thd' takes no arbitrary mask; sequences come from cu_seqlens")
            mask_type = _THD_MASK.get(mask_type, mask_type)
        window = check_window(owner, window_size) if window_size is not None else self.window_size
        self._check_qkv(query_layer, key_layer, value_layer, fmt)
        band = make_band(mask_type, window)
        p = self.attention_dropout if self.training else 0.0
        call = Call(owner, fmt, mask_type, band, default_scale(self.kv_channels, self.softmax_scale), p, self.backend)
        frame = current_frame()
        if frame is not None and frame.enabled and attention_fp8.requested(frame.recipe):
            out = self._fp8_forward(frame, call, query_layer, key_layer, value_layer)
            if out is not None:
                return out
        if self.cp_config is not None:
            with self._dropout_rng(p):
                out, self.last_backend = context_parallel_attention(
                    self.cp_config, call, query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                    cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
            return out
        batch = make_batch(owner, fmt, query_layer, key_layer, value_layer, mask_type, band, attention_mask,
                           cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q,
                           max_seqlen_kv)
        with self._dropout_rng(p):
            out, self.last_backend = run(call, batch)
        return out

    def _fp8_forward(self, frame, call: Call, q, k, v):
        """FP8 attention, or None (after one warning naming why) where it cannot take this call."""
        if self.backend not in ("auto", "cudnn_fe"):
            raise ValueError(f"DotProductAttention: backend={self.backend!r} runs attention in {q.dtype}, and the recipe "
                             f"asks for FP8 attention (fp8_dpa/fp8_mha); use backend='auto' or 'cudnn_fe'")
        reason = attention_fp8.unsupported_reason(q, k, v, call.fmt, call.mask_type, call.band, call.dropout_p,
                                                  self.cp_config is not None)
        if reason is None:
            scaling = fp8_state.scaling_of(frame.recipe, frame.quantizers)  # (one-line error: no per-tensor scales)
            state = self._fp8_attention_state(q.device)
            group = frame.group if frame.group is not None else self.tp_group
            plan = fp8_state.make_plan(scaling, state, group, attention_fp8.uses_kernel(q))
            try:
                out = attention_fp8.fp8_attention(q, k, v, call.fmt == "sbhd", call.band, call.scale, plan)
            except CudnnFeUnsupported as err:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            else:
                self.last_backend = "cudnn_fe_fp8" if plan.kernel else "fp8_emulation"
                return out
        warn_once(("fp8_dpa", reason), f"DotProductAttention: FP8 attention (recipe fp8_dpa) cannot run this input "
                                       f"({reason}); running it in {q.dtype}")
        return None

    def _fp8_attention_state(self, device: torch.device):
        state = self._modules["fp8_attention_state"]  # (not nn.Module.__getattr__: this runs on every FP8 forward)
        if state.fwd_scale.device != device:
            state.to(device)
        return state

    def _dropout_rng(self, p: float):
        if p > 0 and self.get_rng_state_tracker is not None:
            tracker = self.get_rng_state_tracker()
            return tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()
        return contextlib.nullcontext()


def _check_format(owner: str, fmt: str) -> None:
    if fmt not in QKV_FORMATS:
        raise ValueError(f"{owner}: qkv_format must be one of {QKV_FORMATS}, got {fmt!r}")


def _check_unsupported(owner: str, bias_type: str, bias, alibi_slopes, inference_params, fp8_output) -> None:
    given = [name for name, bad in (("core_attention_bias_type", bias_type != "no_bias"),
                                    ("core_attention_bias", bias is not None), ("alibi_slopes", alibi_slopes is not None),
                                    ("inference_params", inference_params is not None), ("fp8_output", bool(fp8_output)))
             if bad]
    if given:
        raise ValueError(f"{owner}: {', '.join(given)} not supported (attention biases, ALiBi, KV caches and FP8 "
                         f"output tensors are not implemented; FP8 attention through a recipe's fp8_dpa returns the "
                         f"inputs' dtype); leave them at their defaults")


# -- helpers for MultiheadAttention / TransformerLayer in thd --------------------------------------

def check_thd_hidden(owner: str, x: torch.Tensor, what: str = "hidden_states") -> None:
    """thd layers take hidden_states [total_tokens, hidden]."""
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"{owner}: {what} must be 2-D [total_tokens, hidden] for qkv_format 'thd', "
                         f"got shape {tuple(x.shape)}")


def apply_rope_thd(t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """RoPE on packed tokens t [t, h, d]: each token rotated by its position within its own sequence
    (sequence i starting at row cu_seqlens[i]); freqs [s_max, 1, 1, rot] as RotaryPositionEmbedding gives."""
    if cu_seqlens is None:
        raise ValueError("rotary_pos_emb on qkv_format='thd' needs cu_seqlens_q (where each packed sequence starts)")
    _, pos = token_positions(cu_seqlens, t.shape[0])
    if t.device.type == "cpu" and t.shape[0] and freqs.shape[0] <= int(pos.max()):  # (on CUDA: no host sync)
        raise ValueError(f"rotary_pos_emb covers {freqs.shape[0]} positions, a packed sequence has {int(pos.max()) + 1}")
    per_token = freqs.reshape(freqs.shape[0], -1)[pos].view(t.shape[0], 1, 1, -1)  # [t, 1, 1, rot]
    return apply_rotary_pos_emb(t.unsqueeze(1), per_token, "sbhd").squeeze(1)
