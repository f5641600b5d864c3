"""A GPT built from te.TransformerLayer with a vocabulary-parallel embedding and loss."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
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


class GPT(nn.Module):
    """ids [s, b] -> mean next-token loss. Under TP the heads, FFN and vocabulary are split; under SP
    the activations between the layers are [s/tp, b, h]. RoPE positions, pre-norm layers: GPT's (LayerNorm,
    GELU, biases) or Llama's (RMSNorm, SwiGLU, no biases, grouped-query attention), by cfg.arch."""

    def __init__(self, cfg: GPTConfig, tp_group=None, sequence_parallel: bool = False, tracker=None, device=None,
                 ub_comm=None) -> None:
        """tp_group: the TP ranks as a 1-D DeviceMesh (e.g. mesh["tp"]) or a ProcessGroup; None for TP=1."""
        super().__init__()
        self.cfg, self.tp_group = cfg, as_group("GPT", "tp_group", tp_group)[0]
        tp = group_size(self.tp_group)
        sp = sequence_parallel and tp > 1
        init = lambda w: nn.init.normal_(w, 0.0, 0.02)  # noqa: E731
        out_init = lambda w: nn.init.normal_(w, 0.0, 0.02 / math.sqrt(2 * cfg.layers))  # noqa: E731
        get_tracker = (lambda: tracker) if tracker is not None else None
        self.embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp_group, sp, device=device)
        arch = {} if cfg.arch == "gpt" else dict(normalization="RMSNorm", activation="swiglu", bias=False,
                                                 num_gqa_groups=cfg.kv_heads or cfg.heads)
        self.layers = nn.ModuleList(
            te.TransformerLayer(cfg.hidden, cfg.ffn, cfg.heads, hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
                                **arch,
                                init_method=init, output_layer_init_method=out_init, layer_number=i + 1,
                                tp_group=tp_group, set_parallel_mode=True, sequence_parallel=sp,
                                get_rng_state_tracker=get_tracker, device=device,
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
        for i, (name, p) in enumerate(self.named_parameters()):
            layout = layouts[name]
            shape = list(layout.full_shape)
            gen = torch.Generator().manual_seed(seed * 7919 + i)
            if "layer_norm" in name or name.startswith("norm") or name.endswith("bias"):
                full = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("proj.weight", "fc2_weight")) else 0.02
                full = torch.randn(shape, generator=gen) * std
            for local, index in layout.global_slices():
                if layout.dim is None:
                    p.copy_(full)
                else:
                    p.narrow(layout.dim, local.start, local.stop - local.start).copy_(full[index])

    def matmul_params(self) -> int:
        """Parameters of the full (TP=1) model that multiply activations: all but the embedding table
        (a lookup). The same at any TP size, and under FSDP2 (a DTensor's numel is its dp-global one)."""
        layouts = shard_layouts(self)
        return sum(math.prod(layouts[name].full_shape) for name, _ in self.named_parameters()
                   if not name.startswith("embed."))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                              # [s(/tp), b, h]
        freqs = self.rope(ids.shape[0])
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        logits = self.head(self.norm(x))                 # [s, b, vocab/tp]
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group).mean()

