"""The router of an MoE layer: logits = x·Wᵀ, each token's top-k experts and their weights, and the
load-balancing loss (te_parallel.ops.moe_router holds the math, with TE's names).

The logits are computed in `router_dtype` (fp32 by default, whatever torch.autocast says: a bf16 router
makes near-ties between experts a matter of rounding). W [num_experts, hidden] is replicated on every rank.

Load-balancing loss (Switch Transformer, as TE's fused_moe_aux_loss):

    aux = coeff · E / (k · T²) · Σ_e count_e · Σ_t score[t, e]

with score the softmax (or normalised sigmoid) of all E logits, count_e the tokens whose top-k scores hold e,
over the T tokens of the layer's input. Under sequence parallelism each TP rank routes its own sequence
shard: counts are summed over the TP group, T is the group's token count, and each rank's value is its
tokens' share; the value returned is the group's sum (the same on every TP rank, like the vocabulary-parallel
loss), its gradient that of the rank's own share, so the router weight's gradient, summed over the group,
is the whole loss's.

Expert bias (DeepSeek-V3's auxiliary-loss-free balancing, sigmoid scores): a buffer added to the scores when
choosing the experts only. `update_expert_bias` moves it by ±rate towards balance from the tokens counted
since the previous update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from te_parallel.module.base import resolve_device, resolve_dtype
from te_parallel.module.init import DEFAULT_INIT
from te_parallel.ops.moe_router import (SCORE_FUNCTIONS, fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                                        fused_topk_with_score_function)
from te_parallel.parallel.collectives import all_reduce, all_reduce_grad
from te_parallel.parallel.groups import group_size


@dataclass(frozen=True)
class Routing:
    """One forward's routing of T tokens over E experts."""

    probs: torch.Tensor                # [T, E] the weights of each token's experts (zeros elsewhere)
    routing_map: torch.Tensor          # [T, E] bool, exactly topk True per row
    aux_loss: Optional[torch.Tensor]   # 0-dim load-balancing loss, None when its coefficient is 0


class TopKRouter(nn.Module):
    """Routes each token to `topk` of `num_experts` experts (module docstring; arguments as Megatron's router).

    score_function "softmax" (use_pre_softmax: softmax over all experts before the top-k, else over the
    chosen k), "sigmoid" or "sqrtsoftplus" (the chosen scores normalised to sum 1); num_groups / group_topk:
    DeepSeek-V3's group-limited choice; scaling_factor multiplies the weights; expert_bias=True keeps a
    [num_experts] fp32 buffer `expert_bias` (sigmoid / sqrtsoftplus only). Parameter: weight [E, hidden].
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, score_function: str = "softmax",
                 use_pre_softmax: bool = False, num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None, expert_bias: bool = False, aux_loss_coeff: float = 0.0,
                 router_dtype: Optional[torch.dtype] = torch.float32, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method: Optional[Callable] = None) -> None:
        super().__init__()
        device = resolve_device(device)
        dtype = resolve_dtype(params_dtype) if router_dtype is None else router_dtype
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.score_function, self.use_pre_softmax, self.scaling_factor = score_function, use_pre_softmax, scaling_factor
        self.num_groups, self.group_topk, self.aux_loss_coeff = num_groups, group_topk, float(aux_loss_coeff)
        self.init_method = init_method
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = self.tokens_per_expert = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight by init_method (TE's default N(0, 0.023²) when None), expert bias and counts 0."""
        if self.weight.is_meta:
            return
        with torch.no_grad():
            (DEFAULT_INIT if self.init_method is None else self.init_method)(self.weight)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
                self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor, tp_group=None) -> Routing:
        """x [T, hidden] -> Routing. tp_group: the TP group when x is this rank's sequence shard (the weight's
        gradient and the loss's counts are then summed over it); None when x is the same on every TP rank."""
        weight = all_reduce_grad(self.weight, tp_group)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(weight.dtype), weight)  # [T, E]
        probs, routing_map = fused_topk_with_score_function(
            logits, self.topk, self.use_pre_softmax, self.num_groups, self.group_topk, self.scaling_factor,
            self.score_function, self.expert_bias)
        aux = self._aux_loss(logits, tp_group) if self.aux_loss_coeff > 0 else None
        return Routing(probs, routing_map, aux)

    def _aux_loss(self, logits: torch.Tensor, tp_group) -> torch.Tensor:
        routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, self.topk, self.score_function)
        counts = routing_map.sum(0)  # [E] int64
        shards = group_size(tp_group)
        all_reduce(counts, tp_group)
        share = fused_moe_aux_loss(scores, counts, logits.shape[0] * shards, self.num_experts, self.topk,
                                   self.aux_loss_coeff)
        if shards == 1:
            return share
        total = share.detach().clone()
        all_reduce(total, tp_group)
        return share + (total - share.detach())  # the group's value, the gradient of this rank's share

    @torch.no_grad()
    def count_tokens(self, routing_map: torch.Tensor) -> None:
        """Add the tokens routed to each expert (routing_map [T, E]) to the counts of the next bias update."""
        if self.tokens_per_expert is not None and self.training:
            self.tokens_per_expert += routing_map.sum(0).to(torch.float32)

    @torch.no_grad()
    def update_expert_bias(self, rate: float, group=None) -> None:
        """expert_bias += rate · sign(mean count − count_e), the counts summed over `group` (the ranks whose
        tokens share this router: data-parallel / expert-parallel ranks), then zeroed."""
        if self.expert_bias is None:
            raise ValueError("TopKRouter: update_expert_bias needs a router built with expert_bias=True")
        counts = self.tokens_per_expert
        all_reduce(counts, group)
        self.expert_bias += rate * torch.sign(counts.mean() - counts)
        counts.zero_()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, topk={self.topk}, "
                f"score_function={self.score_function}, aux_loss_coeff={self.aux_loss_coeff}")


def check_router_args(owner: str, num_experts: int, topk: int, score_function: str, expert_bias: bool,
                      num_groups: Optional[int], group_topk: Optional[int], aux_loss_coeff: float,
                      router_dtype: Optional[torch.dtype]) -> None:
    """The router's arguments, each a one-line error naming the value and what is needed."""
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= num_experts:
        raise ValueError(f"{owner}: topk={topk!r} must be an int in [1, num_experts={num_experts}]")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"{owner}: score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if expert_bias and score_function == "softmax":
        raise ValueError(f"{owner}: expert_bias=True needs score_function 'sigmoid' or 'sqrtsoftplus' (DeepSeek-V3's "
                         f"balancing), got 'softmax'")
    if (num_groups is None) != (group_topk is None):
        raise ValueError(f"{owner}: group-limited routing takes both num_groups and group_topk, got "
                         f"num_groups={num_groups!r}, group_topk={group_topk!r}")
    if num_groups is not None:
        if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"{owner}: num_groups={num_groups!r} must be an int dividing num_experts={num_experts}")
        per_group = num_experts // num_groups
        if not (isinstance(group_topk, int) and 1 <= group_topk <= num_groups and topk % group_topk == 0
                and topk // group_topk <= per_group):
            raise ValueError(f"{owner}: group_topk={group_topk!r} must be in [1, num_groups={num_groups}] and divide "
                             f"topk={topk}, with topk/group_topk <= {per_group} experts per group")
    if not (isinstance(aux_loss_coeff, (int, float)) and aux_loss_coeff >= 0):
        raise ValueError(f"{owner}: aux_loss_coeff={aux_loss_coeff!r} must be a number >= 0 (0: no load-balancing "
                         f"loss)")
    if router_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{owner}: router_dtype must be torch.float32, torch.bfloat16, torch.float16 or None (the "
                         f"parameters' dtype), got {router_dtype}")
