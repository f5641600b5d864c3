"""te.TransformerLayer: attention (+ cross attention) and MLP blocks with residuals, GPT/BERT/T5 styles."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from te_parallel.module.attention import check_thd_hidden
from te_parallel.module.base import activation_dtype, check_hidden_states, check_input
from te_parallel.module.init import reset_children
from te_parallel.module.layernorm import LayerNorm, RMSNorm
from te_parallel.module.layernorm_mlp import LayerNormMLP
from te_parallel.module.multi_head_attention import MultiheadAttention, head_dim
from te_parallel.moe.layer import LayerNormMoE, MoEConfig
from te_parallel.module.parallel_mixin import resolve_tp_size, set_tree_tp_group
from te_parallel.parallel.groups import as_group
from te_parallel.ops.attention import check_mask_type
from te_parallel.ops.dropout import dropout_add


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability p (batch dim given)."""

    def __init__(self, p: float, batch_dim: int) -> None:
        super().__init__()
        self.p, self.batch_dim = p, batch_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        shape = [1] * x.dim()
        shape[self.batch_dim] = x.shape[self.batch_dim]
        keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class TransformerLayer(nn.Module):
    """One transformer block with TE's arguments.

    Pre-LN by default (GPT). BERT: apply_residual_connection_post_layernorm=True, output_layernorm=True
    (the attention then has no input norm, the MLP's norm output is its residual, a final norm
    follows). T5 decoder: layer_type="decoder" adds cross attention over encoder_output.
    With set_parallel_mode and a TP group: QKV/FC1 column-parallel, PROJ/FC2 row-parallel; with
    sequence_parallel, hidden_states is [s/tp, b, h] and so is the output. With attn_input_format="thd"
    (packed sequences) hidden_states is [total_tokens, h] and forward takes TE's cu_seqlens_q/kv and
    max_seqlen_q/kv. Context parallelism (cp_group, cp_global_ranks, cp_stream, cp_comm_type, or
    set_context_parallel_group): hidden_states holds this rank's tokens in the load-balanced layout
    (te_parallel.parallel.context_parallel), and so does the output.
    Mixture of Experts (te_parallel's addition): moe=MoEConfig(num_experts, topk, ...) makes the MLP block a
    norm + te_parallel.MoELayer of SwiGLU experts of ffn_hidden_size (activation must be "swiglu"; the experts
    have no biases), expert-parallel over ep_group; `aux_loss` is its last load-balancing loss.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, layer_number: Optional[int] = None,
                 kv_channels: Optional[int] = None, self_attn_mask_type: str = "causal", window_size=None,
                 enc_dec_attn_mask_type: str = "no_mask", tp_group=None, tp_size: int = 1, params_dtype=None,
                 get_rng_state_tracker=None, fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0, set_parallel_mode: bool = False,
                 fuse_qkv_params: bool = False, zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 ub_tp_comm_overlap: bool = False, ub_overlap_ag: bool = True, ub_overlap_rs: bool = True,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = True, ub_bulk_wgrad: bool = True,
                 ub_comm=None, bias: bool = True, activation: str = "gelu",
                 normalization: str = "LayerNorm", device=None, attn_input_format: str = "sbhd",
                 attention_backend: str = "auto", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", moe: Optional[MoEConfig] = None, ep_group=None) -> None:
        super().__init__()
        owner = "TransformerLayer"
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"{owner}: layer_type must be 'encoder' or 'decoder', got {layer_type!r}")
        check_mask_type(owner, self_attn_mask_type)
        check_mask_type(owner, enc_dec_attn_mask_type)
        # Comm-GEMM overlap: ub_tp_comm_overlap switches on the ub_* flags below (TE's defaults) for
        # QKV/PROJ/FC1/FC2; ub_comm is the object initialize_ub returned for tp_group.
        on = bool(ub_tp_comm_overlap)
        ub = dict(ub_overlap_ag=on and ub_overlap_ag, ub_overlap_rs=on and ub_overlap_rs,
                  ub_overlap_rs_dgrad=on and ub_overlap_rs_dgrad, ub_bulk_dgrad=on and ub_bulk_dgrad,
                  ub_bulk_wgrad=on and ub_bulk_wgrad, ub_comm=ub_comm if on else None)
        self.tp_size = resolve_tp_size(owner, tp_group, tp_size)
        self.tp_group, self.tp_mesh = as_group(owner, "tp_group", tp_group)
        head_dim(owner, hidden_size, num_attention_heads, kv_channels)
        self.layer_type, self.self_attn_mask_type = layer_type, self_attn_mask_type
        self.enc_dec_attn_mask_type, self.window_size = enc_dec_attn_mask_type, window_size
        self.residual_post_ln, self.output_layernorm = apply_residual_connection_post_layernorm, output_layernorm
        self.hidden_dropout, self.sequence_parallel = hidden_dropout, sequence_parallel
        self.get_rng_state_tracker, self.attn_input_format = get_rng_state_tracker, attn_input_format
        common = dict(tp_group=tp_group, tp_size=self.tp_size, params_dtype=params_dtype, device=device,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation, set_parallel_mode=set_parallel_mode,
                      zero_centered_gamma=zero_centered_gamma, bias=bias, init_method=init_method,
                      output_layer_init_method=output_layer_init_method)
        attn = dict(kv_channels=kv_channels, attention_dropout=attention_dropout, layernorm_epsilon=layernorm_epsilon,
                    layer_number=layer_number, num_gqa_groups=num_gqa_groups, fuse_qkv_params=fuse_qkv_params,
                    qkv_weight_interleaved=qkv_weight_interleaved, normalization=normalization,
                    qkv_format=attn_input_format, return_bias=False, attention_backend=attention_backend,
                    cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_stream=cp_stream, cp_comm_type=cp_comm_type,
                    **common)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type, window_size=window_size,
            input_layernorm=not output_layernorm, attention_type="self",
            return_layernorm_output=apply_residual_connection_post_layernorm, **attn, **ub)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, attn_mask_type=enc_dec_attn_mask_type, input_layernorm=True,
                attention_type="cross", return_layernorm_output=apply_residual_connection_post_layernorm, **attn)
        common.pop("output_layer_init_method")
        if moe is not None:  # (MoE) norm + MoELayer in place of LayerNormMLP
            if activation != "swiglu":
                raise ValueError(f"{owner}: moe experts are SwiGLU MLPs; got activation={activation!r}, pass "
                                 f"activation='swiglu'")
            self.layernorm_mlp = LayerNormMoE(
                hidden_size, ffn_hidden_size, moe, eps=layernorm_epsilon, normalization=normalization,
                zero_centered_gamma=zero_centered_gamma,
                return_layernorm_output=apply_residual_connection_post_layernorm,
                sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=self.tp_size, ep_group=ep_group,
                params_dtype=params_dtype, device=device, init_method=init_method,
                output_layer_init_method=output_layer_init_method)
        else:
            self.layernorm_mlp = LayerNormMLP(
                hidden_size, ffn_hidden_size, eps=layernorm_epsilon, activation=activation, normalization=normalization,
                return_bias=False, return_layernorm_output=apply_residual_connection_post_layernorm,
                output_layer_init_method=output_layer_init_method, **common, **ub)
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device,
                                  tp_group=tp_group if self.tp_size > 1 else None)
        self.drop_path = DropPath(drop_path_rate, batch_dim=1 if attn_input_format == "sbhd" else 0)

    @property
    def aux_loss(self) -> Optional[torch.Tensor]:
        """The MoE MLP's load-balancing loss of the last forward (None without moe, or with aux_loss_coeff 0)."""
        return self.layernorm_mlp.aux_loss if isinstance(self.layernorm_mlp, LayerNormMoE) else None

    def reset_parameters(self) -> None:
        """Initialise every submodule as the constructor does, in the same order (so the same seed gives
        the same weights); after `to_empty` this materialises a layer built on the meta device."""
        reset_children(self)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Hand every sub-module the TP group (a ProcessGroup or a 1-D DeviceMesh) after construction (TE's API)."""
        set_tree_tp_group(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p") -> None:
        """Hand the attention blocks their context-parallel group (TE's API; see DotProductAttention)."""
        for attn in (self.self_attention, getattr(self, "inter_attention", None)):
            if attn is not None:
                attn.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _dropout_add(self, out, residual):
        """residual + drop_path(dropout(out)); the projections add their bias in the GEMM epilogue.
        Under SP the activations are sequence shards, so the dropout draws from the tracker's
        model-parallel stream (a different mask per rank). Without drop path, dropout and add are one
        native pass that stores no mask (te_parallel.ops.dropout) where the kernel runs."""
        ctx = contextlib.nullcontext()
        if self.sequence_parallel and self.training and self.hidden_dropout > 0 and self.get_rng_state_tracker:
            ctx = self.get_rng_state_tracker().fork()
        with ctx:
            if not (self.training and self.drop_path.p > 0):
                return dropout_add(out, residual, self.hidden_dropout, self.training)
            out = F.dropout(out, p=self.hidden_dropout, training=self.training)
        return residual + self.drop_path(out)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """hidden_states checked and in the activation dtype (the parameters', or torch.autocast's): the
        residual stream, and so the output, is in that dtype whatever the input's."""
        if self.attn_input_format == "thd":  # packed sequences: [total_tokens, hidden]
            check_thd_hidden("TransformerLayer", x)
        else:
            check_hidden_states("TransformerLayer", x, self.attn_input_format)
        check_input("TransformerLayer", x, self.layernorm_mlp.hidden_size)
        dtype = activation_dtype(self.layernorm_mlp.param_dtype, x.device)
        return x if x.dtype == dtype else x.to(dtype)

    def _block(self, module, x, **kw):
        post_ln = self.residual_post_ln and not (module is self.self_attention and self.output_layernorm)
        if not post_ln and not (self.training and (self.hidden_dropout > 0 or self.drop_path.p > 0)):
            # x + out with nothing between: the module adds x itself, in its output GEMM's epilogue where that
            # GEMM runs in FP8 on one rank (te.Linear's `residual`: one rounding, no pass of its own)
            return module(x, residual=x, **kw)
        outputs = module(x, **kw)
        if post_ln:
            out, residual = outputs
        else:
            out, residual = outputs, x
        return self._dropout_add(out, residual)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, self_attn_mask_type: Optional[str] = None,
                window_size=None, encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None):
        mask_type = self_attn_mask_type or self.self_attn_mask_type
        hidden_states = self._input(hidden_states)
        # packed sequences (attn_input_format="thd"): cu_seqlens_q/kv int32 [batch + 1], as TE
        seqs = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                    cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                    core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                    alibi_slopes=alibi_slopes)
        x = self._block(self.self_attention, hidden_states, attention_mask=attention_mask, attn_mask_type=mask_type,
                        window_size=window_size, is_first_microbatch=is_first_microbatch, rotary_pos_emb=rotary_pos_emb,
                        **seqs)
        if self.layer_type == "decoder":
            x = self._block(self.inter_attention, x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                            attn_mask_type=enc_dec_attn_mask_type or self.enc_dec_attn_mask_type,
                            is_first_microbatch=is_first_microbatch, **seqs)
        x = self._block(self.layernorm_mlp, x, is_first_microbatch=is_first_microbatch)
        return self.layernorm(x) if self.output_layernorm else x
