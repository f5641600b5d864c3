"""A GPT built from te.TransformerLayer with a vocabulary-parallel embedding and loss."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import te_parallel as te
from te_parallel.parallel.groups import as_group, group_size
from te_parallel.parallel.sharding import shard_layouts
from te_parallel.parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    ffn: int = 512
    seq_len: int = 128
    dropout: float = 0.0
    arch: str = "gpt"  # "gpt": LayerNorm, GELU, biases, multi-head; "llama": RMSNorm, SwiGLU, no biases, GQA
    kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0: as many as heads
    experts: int = 0  # Mixture of Experts: SwiGLU experts per layer (0: a dense MLP)
    topk: int = 2  # experts per token
    aux_loss_coeff: float = 0.0  # load-balancing loss coefficient


# (MoE) an expert's weight: <MoELayer>.experts.linear_fc<1|2>.weight<local expert>
_EXPERT_WEIGHT = re.compile(r"^(.*)\.experts\.linear_fc([12])\.weight(\d+)$")


class GPT(nn.Module):
    """ids [s, b] -> mean next-token loss. Under TP the heads, FFN and vocabulary are split; under SP
    the activations between the layers are [s/tp, b, h]; under CP each rank holds s/cp of every sequence's
    tokens (load-balanced chunks) and only the attention exchanges keys and values. RoPE positions, pre-norm
    layers: GPT's (LayerNorm, GELU, biases) or Llama's (RMSNorm, SwiGLU, no biases, grouped-query attention),
    by cfg.arch."""

    def __init__(self, cfg: GPTConfig, tp_group=None, sequence_parallel: bool = False, tracker=None, device=None,
                 ub_comm=None, ep_group=None, cp_group=None, cp_comm_type: str = "p2p") -> None:
        """tp_group: the TP ranks as a 1-D DeviceMesh (e.g. mesh["tp"]) or a ProcessGroup; None for TP=1.
        ep_group: with cfg.experts, the expert-parallel ranks (None: every rank holds every expert).
        cp_group: the context-parallel ranks (1-D mesh or ProcessGroup; None for CP=1), which split every
        sequence; cp_comm_type: how the attention exchanges keys and values ("p2p", "all_gather", "a2a")."""
        super().__init__()
        self.cfg, self.tp_group = cfg, as_group("GPT", "tp_group", tp_group)[0]
        self.cp_group = as_group("GPT", "cp_group", cp_group)[0]
        self.cp_size = group_size(self.cp_group)
        cp_ranks = dist.get_process_group_ranks(self.cp_group) if self.cp_size > 1 else None
        tp = group_size(self.tp_group)
        sp = sequence_parallel and tp > 1
        init = lambda w: nn.init.normal_(w, 0.0, 0.02)  # noqa: E731
        out_init = lambda w: nn.init.normal_(w, 0.0, 0.02 / math.sqrt(2 * cfg.layers))  # noqa: E731
        get_tracker = (lambda: tracker) if tracker is not None else None
        self.embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_group, sp, device=device)
        arch = {} if cfg.arch == "gpt" else dict(normalization="RMSNorm", activation="swiglu", bias=False,
                                                 num_gqa_groups=cfg.kv_heads or cfg.heads)
        if cfg.experts:  # (MoE) the MLP: a router and cfg.experts SwiGLU experts, cfg.topk per token
            arch.update(activation="swiglu", ep_group=ep_group,
                        moe=te.MoEConfig(cfg.experts, cfg.topk, aux_loss_coeff=cfg.aux_loss_coeff))
        self.layers = nn.ModuleList(
            te.TransformerLayer(cfg.hidden, cfg.ffn, cfg.heads, hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
                                **arch,
                                init_method=init, output_layer_init_method=out_init, layer_number=i + 1,
                                tp_group=tp_group, set_parallel_mode=True, sequence_parallel=sp,
                                get_rng_state_tracker=get_tracker, device=device, cp_group=self.cp_group,
                                cp_global_ranks=cp_ranks, cp_comm_type=cp_comm_type,
                                ub_tp_comm_overlap=ub_comm is not None, ub_comm=ub_comm,
                                # dx's reduce-scatter pipelined with dgrad: the faster schedule (docs/overlap.md)
                                ub_overlap_rs_dgrad=ub_comm is not None)
            for i in range(cfg.layers))
        norm = te.LayerNorm if cfg.arch == "gpt" else te.RMSNorm
        self.norm = norm(cfg.hidden, sequence_parallel=sp, tp_group=tp_group if sp else None, device=device)
        self.head = te.Linear(cfg.hidden, cfg.vocab, bias=False, init_method=init, tp_group=tp_group,
                              parallel_mode="column", sequence_parallel=sp, device=device)
        self.rope = te.RotaryPositionEmbedding(cfg.hidden // cfg.heads).to(device)

    @torch.no_grad()
    def init_like_single_rank(self, seed: int) -> None:
        """Initialise every parameter as the TP=1 model with this seed would, then keep this rank's
        shard: runs with different TP sizes then start from the same model (a parity gate)."""
        layouts = shard_layouts(self)  # where each rank's piece sits in the full tensor (fused QKV, SwiGLU's halves)
        for i, name, p in self._init_order():
            layout = layouts[name]
            shape = list(layout.full_shape)
            gen = torch.Generator().manual_seed(seed * 7919 + i)
            if "layer_norm" in name or name.startswith("norm") or name.endswith("bias"):
                full = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
            else:
                out = name.endswith(("proj.weight", "fc2_weight")) or ".linear_fc2.weight" in name
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if out else 0.02
                full = torch.randn(shape, generator=gen) * std
            for local, index in layout.global_slices():
                if layout.dim is None:
                    p.copy_(full)
                else:
                    p.narrow(layout.dim, local.start, local.stop - local.start).copy_(full[index])

    def _init_order(self):
        """(i, name, parameter): i the parameter's place in the one-rank model's parameter order. (MoE) An
        expert-parallel rank holds experts [offset, offset + G) of each MoE layer as weight0..weight{G-1}: they
        take the places of their global experts, so the same seed gives the same full model at any ep size."""
        moe = {name: m for name, m in self.named_modules() if isinstance(m, te.MoELayer)}
        i, block_start = 0, {}
        for name, p in self.named_parameters():
            found = _EXPERT_WEIGHT.match(name)
            if found is None:
                yield i, name, p
                i += 1
                continue
            layer, fc, g = moe[found.group(1)], found.group(2), int(found.group(3))
            start = block_start.setdefault((found.group(1), fc), i)  # the fc's E places begin here
            yield start + layer.expert_offset + g, name, p
            i = start + layer.num_experts

    def matmul_params(self) -> int:
        """Parameters of the full (TP=1) model that multiply activations: all but the embedding table
        (a lookup). The same at any TP size, and under FSDP2 (a DTensor's numel is its dp-global one).
        (MoE) Of the experts, those a token passes through: topk of them per layer."""
        layouts = shard_layouts(self)
        moe = {name: m for name, m in self.named_modules() if isinstance(m, te.MoELayer)}
        total = 0.0
        for name, _ in self.named_parameters():
            if name.startswith("embed."):
                continue
            found = _EXPERT_WEIGHT.match(name)
            share = 1.0 if found is None else moe[found.group(1)].topk / moe[found.group(1)].num_local_experts
            total += math.prod(layouts[name].full_shape) * share
        return round(total)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """ids, targets [s/cp, b]: under context parallelism this rank's two chunks of every sequence (the
        layout of te_parallel.parallel.context_parallel.shard_sequence) -> the mean loss of those tokens."""
        x = self.embed(ids)                              # [s/cp(/tp), b, h]
        freqs = self.rope(ids.shape[0] * self.cp_size)   # the whole sequence's angles; attention takes its rows'
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        logits = self.head(self.norm(x))                 # [s/cp, b, vocab/tp]
        # Every cp rank holds s/cp tokens of each sequence: the mean over the dp x cp ranks of their means (the
        # data-parallel engine's average of the gradients, World.dp_mean of the loss) is the sum over all the
        # tokens divided by their count, the loss of the whole sequences.
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group).mean()

