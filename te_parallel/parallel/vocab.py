"""Vocabulary-parallel embedding and cross-entropy (Megatron): the vocabulary is split across TP ranks.

Rank r owns token ids [r·V/tp, (r+1)·V/tp).
  VocabParallelEmbedding: each rank looks up the ids it owns (zeros elsewhere); the partial
  embeddings are summed over the group: all-reduce, or reduce-scatter along the sequence (dim 0)
  under sequence parallelism, which yields the [s/tp, b, h] shard the next layer expects.
  vocab_parallel_cross_entropy: logits [.., V/tp] per rank; the softmax denominator and the
  target logit are assembled with three small all-reduces (max, sum of exp, target logit), so
  the [.., V] logits never exist on one rank. Backward: softmax − one-hot, locally.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from te_parallel.parallel.collectives import reduce_from_tp, reduce_scatter_to_sp
from te_parallel.parallel.dcp import register_whole_tensor_hooks
from te_parallel.parallel.groups import as_group, check_divisible, group_rank, group_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, sequence_parallel: bool = False,
                 init_method=None, params_dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        tp_group, self.tp_mesh = as_group("VocabParallelEmbedding", "tp_group", tp_group)  # ProcessGroup or 1-D mesh
        tp = group_size(tp_group)
        self.vocab_local = check_divisible("VocabParallelEmbedding", "num_embeddings", num_embeddings, tp)
        self.vocab_start = group_rank(tp_group) * self.vocab_local
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.vocab_local, embedding_dim, device=device,
                                               dtype=params_dtype or torch.get_default_dtype()))
        (init_method or (lambda w: nn.init.normal_(w, 0.0, 0.02)))(self.weight)
        register_whole_tensor_hooks(self)  # state_dict() holds the table's shard as the whole table

    def tp_shard_layouts(self):
        """This rank's rows of the full [num_embeddings, dim] table (te_parallel.parallel.sharding)."""
        from te_parallel.parallel.sharding import split_layout

        tp = group_size(self.tp_group)
        full = (self.vocab_local * tp, self.weight.shape[1])
        return {"weight": split_layout(full, 0, self.vocab_start // self.vocab_local, tp)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [s, b] -> [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        emb = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        if group_size(self.tp_group) == 1:
            return emb
        return reduce_scatter_to_sp(emb, self.tp_group) if self.sequence_parallel else reduce_from_tp(emb, self.tp_group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        vmax = logits.max(dim=-1, keepdim=True)[0]
        if group_size(group) > 1:
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - vmax
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        idx = local.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, outside)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx, -(~outside).unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token loss −log softmax(logits)[target]; logits [.., V/tp] (this rank's vocabulary slice)."""
    tp_group = as_group("vocab_parallel_cross_entropy", "tp_group", tp_group)[0]
    vocab_start = group_rank(tp_group) * logits.shape[-1]
    return _VocabParallelCE.apply(logits, target, tp_group, vocab_start)
