"""te.MultiheadAttention: (norm →) QKV projection → RoPE → DotProductAttention → output projection."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from te_parallel.module.attention import DotProductAttention, apply_rope_thd, check_thd_hidden
from te_parallel.module.base import check_hidden_states, pack_outputs, resolve_device
from te_parallel.module.init import reset_children
from te_parallel.module.layernorm_linear import LayerNormLinear
from te_parallel.module.linear import Linear
from te_parallel.module.rope import apply_rotary_pos_emb
from te_parallel.ops.attention_dispatch import split_views
from te_parallel.ops.rope import qkv_rope_split
from te_parallel.module.parallel_mixin import resolve_tp_size, set_tree_tp_group
from te_parallel.parallel.context_parallel import rotary_on_rank
from te_parallel.parallel.groups import as_group


def head_dim(owner: str, hidden_size: int, num_heads: int, kv_channels: Optional[int]) -> int:
    if kv_channels is not None:
        return kv_channels
    if hidden_size % num_heads:
        raise ValueError(f"{owner}: hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads}; pass kv_channels")
    return hidden_size // num_heads


class MultiheadAttention(nn.Module):
    """Self or cross attention with TE's arguments; column-parallel QKV, row-parallel projection.

    Fused QKV (fuse_qkv_params=True) is one weight; with qkv_weight_interleaved (TE's default) its
    rows are grouped per KV group as [q heads of the group, k, v] so a column shard holds whole
    groups; otherwise [q | k | v]. fuse_qkv_params=False gives separate query_/key_/value_ weights.
    forward(hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
    window_size=None, is_first_microbatch=None, rotary_pos_emb=None, ..., cu_seqlens_q=None,
    cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, ...) -> out[, bias][, ln_out].
    With qkv_format="thd", hidden_states is [total_tokens, hidden] and the cu_seqlens say where each
    packed sequence starts (RoPE then counts positions from each sequence's start).
    forward(..., residual=t) (te_parallel's addition) returns out + t, t of out's shape and dtype: the
    projection adds it (te.Linear's `residual`: in its FP8 epilogue on one rank).
    Context parallelism (cp_group, cp_global_ranks, cp_stream, cp_comm_type, or set_context_parallel_group):
    hidden_states holds this rank's tokens in the load-balanced layout; rotary_pos_emb is the whole
    sequence's and each local token takes its own position's angles.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels: Optional[int] = None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, layer_number: Optional[int] = None,
                 attn_mask_type: str = "causal", window_size=None, tp_group=None, tp_size: int = 1,
                 num_gqa_groups: Optional[int] = None, fuse_wgrad_accumulation: bool = False, get_rng_state_tracker=None,
                 sequence_parallel: bool = False, params_dtype=None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False, attention_type: str = "self",
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_comm=None, bias: bool = True, normalization: str = "LayerNorm", device=None, qkv_format: str = "sbhd",
                 attention_backend: str = "auto", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p") -> None:
        super().__init__()
        owner = "MultiheadAttention"
        self.tp_size = resolve_tp_size(owner, tp_group, tp_size)
        (self.tp_group, self.tp_mesh), self.sequence_parallel = as_group(owner, "tp_group", tp_group), sequence_parallel
        self.head_dim = head_dim(owner, hidden_size, num_attention_heads, kv_channels)
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if sequence_parallel and qkv_format != "sbhd":
            raise ValueError(f"{owner}: sequence_parallel shards dim 0 and needs qkv_format='sbhd', got {qkv_format!r}")
        self.attention_type, self.input_layernorm, self.qkv_format = attention_type, input_layernorm, qkv_format
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.fuse_qkv_params, self.interleaved = fuse_qkv_params, qkv_weight_interleaved and fuse_qkv_params
        self.hidden_q, self.hidden_kv = num_attention_heads * self.head_dim, self.num_gqa_groups * self.head_dim
        self.core_attention = DotProductAttention(
            num_attention_heads, self.head_dim, num_gqa_groups=self.num_gqa_groups, attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size, tp_size=self.tp_size,
            get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group, layer_number=layer_number,
            attention_type=attention_type, backend=attention_backend, cp_group=cp_group, cp_global_ranks=cp_global_ranks,
            cp_stream=cp_stream, cp_comm_type=cp_comm_type)
        self.core_attention.fp8_attention_state.to(resolve_device(device))  # (the attention core takes no device)
        col = "column" if set_parallel_mode else None
        common = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=self.tp_size,
                      sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device, bias=bias,
                      get_rng_state_tracker=get_rng_state_tracker)
        ln = dict(eps=layernorm_epsilon, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                  return_layernorm_output=return_layernorm_output)
        # Comm-GEMM overlap (self-attention's input projection and proj; ub_comm from initialize_ub).
        qkv_ub = dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                      ub_bulk_wgrad=ub_bulk_wgrad, ub_name="qkv", ub_comm=ub_comm)
        self._build_projections(hidden_size, attention_type, input_layernorm, col, init_method, common, ln, qkv_ub)
        # TE's rule: proj takes output_layer_init_method, the default init when that is None
        self.proj = Linear(self.hidden_q, hidden_size, init_method=output_layer_init_method,
                           parallel_mode="row" if set_parallel_mode else None, return_bias=return_bias,
                           ub_overlap_rs=ub_overlap_rs, ub_overlap_ag=ub_overlap_ag, ub_name="proj", ub_comm=ub_comm,
                           **common)

    def _build_projections(self, hidden, attention_type, input_layernorm, col, init, common, ln, qkv_ub) -> None:
        def make(out, split, prefix_norm: bool, name: str, ub=None):
            # A fused, non-interleaved weight's column shard is [q_r; k_r; v_r] ([k_r; v_r]): blocks of the
            # full weight, declared before its values are generated from full-tensor indices; so it is built
            # on the meta device and materialised here (keys are drawn in the same order either way).
            blocks = None
            if self.fuse_qkv_params and not self.interleaved and split is not None and col and self.tp_size > 1:
                blocks = [size // self.tp_size for size in split.values()]
            split = None if self.fuse_qkv_params else split
            kw = dict(init_method=init, parallel_mode=col, parameters_split=split, **common, **(ub or {}))
            if blocks is not None:
                kw["device"] = "meta"
            module = LayerNormLinear(hidden, out, **ln, **kw) if prefix_norm else Linear(hidden, out, **kw)
            if blocks is not None:
                module._params.set_row_blocks(blocks, "MultiheadAttention")
                device = resolve_device(common["device"])
                if device.type != "meta":
                    module.to_empty(device=device)
                    module.reset_parameters()
            setattr(self, name, module)

        q, kv = self.hidden_q, self.hidden_kv
        if attention_type == "self":
            name = "layernorm_qkv" if input_layernorm else "qkv"
            make(q + 2 * kv, {"query": q, "key": kv, "value": kv}, input_layernorm, name, qkv_ub)
            self._qkv_name = name
        elif attention_type == "cross":
            name = "layernorm_query" if input_layernorm else "query_layer"
            make(q, None, input_layernorm, name)
            make(2 * kv, {"key": kv, "value": kv}, False, "key_value")
            self._qkv_name = name
        else:
            raise ValueError(f"MultiheadAttention: attention_type must be 'self' or 'cross', got {attention_type!r}")

    def reset_parameters(self) -> None:
        """Initialise every projection as the constructor does, in the same order (so the same seed gives
        the same weights); after `to_empty` this materialises a module built on the meta device."""
        reset_children(self)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Hand every projection and the attention core the TP group (a ProcessGroup or a 1-D DeviceMesh)."""
        set_tree_tp_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p") -> None:
        """Hand the attention core its context-parallel group (TE's API; see DotProductAttention)."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _rope_on_rank(self, cp, rope, out, encoder_output, cu_q, cu_kv, cu_q_padded, cu_kv_padded):
        """(q angles, k angles) of the whole sequence -> those of this rank's query and key tokens."""
        s_dim = 1 if self.qkv_format == "bshd" else 0
        starts_q = cu_q if cu_q_padded is None else cu_q_padded
        starts_kv = cu_kv if cu_kv_padded is None else cu_kv_padded
        starts_kv = starts_q if starts_kv is None else starts_kv
        keys = out if encoder_output is None else encoder_output
        return (rotary_on_rank(cp, rope[0], self.qkv_format, out.shape[s_dim], starts_q),
                rotary_on_rank(cp, rope[1], self.qkv_format, keys.shape[s_dim], starts_kv))

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], n, self.head_dim)

    def _split_qkv(self, mixed: torch.Tensor):
        """[.., (h + 2g)/tp · d] -> q [.., h/tp, d], k, v [.., g/tp, d]: views of `mixed` where the layout
        allows (all but interleaved GQA), whose gradients the cuDNN frontend's attention writes into one
        tensor that becomes mixed's gradient as it is (ops/attention_dispatch.split_views)."""
        h, g, d = self.core_attention.num_heads, self.core_attention.num_gqa_groups, self.head_dim
        lead = mixed.shape[:-1]
        if self.interleaved:
            per = h // g
            if per == 1 and mixed.dim() == 3 and not torch.compiler.is_compiling():
                return split_views(mixed, lambda m: m.view(*lead, g, 3, d).unbind(-2),
                                   lambda dq, dk, dv: torch.cat([t.unsqueeze(-2) for t in (dq, dk, dv)], dim=-2).view(*lead, -1))
            # one split, not three slices: its backward is one concatenation, where a slice's backward
            # zero-fills a gradient the size of `mixed` and the three are summed (3 fills + 2 adds)
            grouped = mixed.reshape(*lead, g, per + 2, d)  # [.., g, h/g + 2, d]
            q, k, v = grouped.split([per, 1, 1], dim=-2)
            return q.reshape(*lead, h, d), k.squeeze(-2), v.squeeze(-2)
        sizes = [h * d, g * d, g * d]
        if mixed.dim() == 3 and not torch.compiler.is_compiling():
            return split_views(mixed, lambda m: tuple(t.view(*lead, -1, d) for t in m.split(sizes, dim=-1)),
                               lambda dq, dk, dv: torch.cat([t.reshape(*lead, -1) for t in (dq, dk, dv)], dim=-1))
        q, k, v = mixed.split(sizes, dim=-1)
        return self._heads(q, h), self._heads(k, g), self._heads(v, g)

    def _split_kv(self, mixed: torch.Tensor):
        g = self.core_attention.num_gqa_groups
        if self.interleaved:
            grouped = mixed.reshape(*mixed.shape[:-1], g, 2, self.head_dim)  # [.., g, 2, d]
            k, v = grouped.split([1, 1], dim=-2)  # (one concatenation in backward, as _split_qkv)
            return k.squeeze(-2), v.squeeze(-2)
        k, v = mixed.chunk(2, dim=-1)
        return self._heads(k, g), self._heads(v, g)

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        if self.qkv_format == "thd":
            check_thd_hidden("MultiheadAttention", x, what)
        else:
            check_hidden_states("MultiheadAttention", x, self.qkv_format, what)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None, window_size=None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None, *, residual: Optional[torch.Tensor] = None):
        self._check_input(hidden_states, "hidden_states")
        if encoder_output is not None:
            self._check_input(encoder_output, "encoder_output")
        first = getattr(self, self._qkv_name)
        out = first(hidden_states, is_first_microbatch=is_first_microbatch)
        ln_out = None
        if self.input_layernorm and self.return_layernorm_output:
            out, ln_out = out
        rope = None  # (q angles, k angles)
        if rotary_pos_emb is not None:
            rope = tuple(rotary_pos_emb) if isinstance(rotary_pos_emb, (tuple, list)) else (rotary_pos_emb,) * 2
        cp = self.core_attention.cp_config
        if rope is not None and cp is not None:  # the whole sequence's angles -> this rank's tokens' (in their order)
            rope = self._rope_on_rank(cp, rope, out, encoder_output, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                      cu_seqlens_kv_padded)
        qkv = None
        if self.attention_type == "self" and rope is not None and self.interleaved and self.qkv_format == "sbhd":
            # q and k rotated where they lie in `out`, their gradients written back there (no regrouping copy,
            # no concatenation of the three gradients)
            h, g = self.core_attention.num_heads, self.core_attention.num_gqa_groups
            qkv = qkv_rope_split(out, g, h // g, self.head_dim, *rope)
        if qkv is not None:
            (q, k, v), rope = qkv, None
        elif self.attention_type == "self":
            q, k, v = self._split_qkv(out)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention: attention_type='cross' needs encoder_output")
            q = self._heads(out, self.core_attention.num_heads)
            k, v = self._split_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch))
        if rope is not None:
            q_emb, k_emb = rope
            if self.qkv_format == "thd" and cp is not None:  # angles per local token already
                q, k = (apply_rotary_pos_emb(t.unsqueeze(1), f, "sbhd").squeeze(1) for t, f in ((q, q_emb), (k, k_emb)))
            elif self.qkv_format == "thd":  # positions within each packed sequence
                starts_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
                starts_kv = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
                starts_kv = starts_q if starts_kv is None else starts_kv
                q, k = apply_rope_thd(q, q_emb, starts_q), apply_rope_thd(k, k_emb, starts_kv)
            else:
                q = apply_rotary_pos_emb(q, q_emb, self.qkv_format)
                k = apply_rotary_pos_emb(k, k_emb, self.qkv_format)
        context = self.core_attention(
            q, k, v, attention_mask, attn_mask_type=attn_mask_type, window_size=window_size, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes)
        if residual is None:  # bias in the GEMM unless returned
            out = self.proj(context, is_first_microbatch=is_first_microbatch)
        else:
            out = self.proj(context, is_first_microbatch=is_first_microbatch, residual=residual)
        out, bias = out if self.return_bias else (out, None)
        return pack_outputs(out, bias, ln_out, self.return_bias, self.input_layernorm and self.return_layernorm_output)
