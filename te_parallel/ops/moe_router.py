"""The MoE router's top-k and load-balancing loss, with TE's names, signatures and semantics.

fused_topk_with_score_function (per token, logits [.., E]):
* softmax, use_pre_softmax=False: pick the top-k logits, probs = softmax over those k logits.
* softmax, use_pre_softmax=True: scores = softmax over all E logits, probs = the top-k scores.
* sigmoid / sqrtsoftplus: scores = sigmoid(logits) or sqrt(softplus(logits)); the top-k are picked on
  scores + expert_bias (the bias steers the choice only, DeepSeek-V3's auxiliary-loss-free balancing, and
  gets no gradient); probs = the picked scores, divided by their sum (+1e-20) when topk > 1.
* group-limited top-k (DeepSeek-V3, num_groups and group_topk): the E experts form num_groups equal
  groups; a group's score is the sum of its top (topk // group_topk) selection scores; the choice is made
  among the experts of the group_topk best groups.
* probs are multiplied by scaling_factor (None: 1) and returned dense [.., E] with zeros off the routing
  map, in the logits' dtype. Math is in fp32 (fp64 for fp64 logits, which TE refuses).

Gradients come from torch's autograd of this composition; the choice of experts (a top-k) has none, so
they match TE's hand-written backward: the softmax / sigmoid / normalization chain on the chosen slots.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from te_parallel.ops.moe_permute import host_to_device

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
           "SCORE_FUNCTIONS"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_EPS = 1e-20  # TE's and Megatron's guard of the sum that normalizes sigmoid scores


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    return F.softplus(logits).sqrt()


def _group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """Indices [T, topk] of the top-k among the experts of each token's group_topk best groups."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    in_best = in_best.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores.masked_fill(~in_best, float("-inf")).topk(topk, dim=-1).indices


def _topk_indices(select: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]):
    if group_topk:
        return _group_limited_topk(select, topk, num_groups, group_topk)
    return select.topk(topk, dim=-1).indices


def _check_logits(owner: str, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{owner}: logits is {got}; need a floating-point [..., num_experts] tensor")


def _check_topk(owner: str, topk, num_experts: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"{owner}: topk is {topk!r}; need an int in [1, num_experts = {num_experts}]")


def _check_score_function(owner: str, score_function) -> None:
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"{owner}: score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")


def _check_groups(num_experts: int, topk: int, num_groups, group_topk) -> None:
    owner = "fused_topk_with_score_function"
    if not group_topk:
        return
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{owner}: group_topk={group_topk!r} needs num_groups, an int dividing num_experts = "
                         f"{num_experts}; got num_groups={num_groups!r}")
    group_size = num_experts // num_groups
    if (isinstance(group_topk, bool) or not isinstance(group_topk, int) or not 1 <= group_topk <= num_groups
            or not 1 <= topk // group_topk <= group_size or topk > group_topk * group_size):
        raise ValueError(f"{owner}: group_topk is {group_topk!r} for topk={topk}, {num_groups} groups of {group_size} "
                         f"experts; need 1 <= group_topk <= num_groups, 1 <= topk // group_topk <= {group_size} "
                         f"and topk <= group_topk * {group_size}")


def fused_topk_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool, num_groups: Optional[int],
                                   group_topk: Optional[int], scaling_factor: Optional[float], score_function: str,
                                   expert_bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route each token to topk experts (module doc). logits [..., E] -> (probs [..., E] in logits' dtype,
    zeros off the map; routing_map [..., E] bool). Gradients flow to logits, not to expert_bias."""
    owner = "fused_topk_with_score_function"
    _check_logits(owner, logits)
    num_experts = logits.shape[-1]
    _check_topk(owner, topk, num_experts)
    _check_score_function(owner, score_function)
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError(f"{owner}: expert_bias is used with score_function 'sigmoid' or 'sqrtsoftplus'; "
                             f"got 'softmax' (pass expert_bias=None)")
        if not isinstance(expert_bias, torch.Tensor) or tuple(expert_bias.shape) != (num_experts,):
            got = tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else type(expert_bias).__name__
            raise ValueError(f"{owner}: expert_bias is {got}; need a [num_experts] = [{num_experts}] tensor")
    _check_groups(num_experts, topk, num_groups, group_topk)

    x = logits.reshape(-1, num_experts).to(_acc_dtype(logits.dtype))  # [T, E]
    if score_function == "softmax" and not use_pre_softmax:
        index = _topk_indices(x.detach(), topk, num_groups, group_topk)
        probs_k = torch.softmax(x.gather(1, index), dim=-1)
    else:
        scores = _scores(x, score_function)
        select = scores.detach()
        if expert_bias is not None:
            select = select + expert_bias.detach().to(select)
        index = _topk_indices(select, topk, num_groups, group_topk)
        probs_k = scores.gather(1, index)  # [T, topk]
        if score_function != "softmax" and topk > 1:
            probs_k = probs_k / (probs_k.sum(dim=-1, keepdim=True) + _EPS)
    if scaling_factor is not None:
        probs_k = probs_k * scaling_factor
    probs = torch.zeros_like(x).scatter(1, index, probs_k).to(logits.dtype)
    routing_map = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(1, index, True)
    return probs.view(logits.shape), routing_map.view(logits.shape)


def fused_compute_score_for_moe_aux_loss(logits: torch.Tensor, topk: int,
                                         score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scores the load-balancing loss uses: (routing_map [..., E] bool, scores [..., E] fp32).

    scores = softmax(logits), or sigmoid / sqrt(softplus) of the logits divided by their sum over all E
    experts (+1e-20); routing_map marks each token's topk scores. Gradients flow from scores to logits."""
    owner = "fused_compute_score_for_moe_aux_loss"
    _check_logits(owner, logits)
    num_experts = logits.shape[-1]
    _check_topk(owner, topk, num_experts)
    _check_score_function(owner, score_function)
    x = logits.reshape(-1, num_experts).to(_acc_dtype(logits.dtype))
    scores = _scores(x, score_function)
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + _EPS)
    index = scores.detach().topk(topk, dim=-1).indices
    routing_map = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter_(1, index, True)
    return routing_map.view(logits.shape), scores.view(logits.shape)


def fused_moe_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                       total_num_tokens: Union[float, torch.Tensor], num_experts: int, topk: int,
                       coeff: float) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss, a 0-dim tensor in probs' dtype:

        loss = num_experts · coeff / (topk · total_num_tokens²) · sum_e tokens_per_expert[e] · sum_t probs[t, e]

    probs [T, E] (this rank's tokens), tokens_per_expert [E] (counted over the tokens the loss covers),
    total_num_tokens a number or a 0-dim tensor (Megatron's count of unpadded tokens; never read on the
    host). Summed in fp64, as TE does; the gradient flows to probs (d loss / d probs[t, e] = coefficient ·
    tokens_per_expert[e])."""
    owner = "fused_moe_aux_loss"
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        got = f"{tuple(probs.shape)} {probs.dtype}" if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"{owner}: probs is {got}; need a floating-point [num_tokens, num_experts] tensor")
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (probs.shape[1],):
        got = tuple(tokens_per_expert.shape) if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
        raise ValueError(f"{owner}: tokens_per_expert is {got}; need a [{probs.shape[1]}] tensor (one count per column "
                         f"of probs)")
    for name, value in (("num_experts", num_experts), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}")
    if isinstance(total_num_tokens, torch.Tensor):
        if total_num_tokens.dim() != 0:
            raise ValueError(f"{owner}: total_num_tokens is a tensor of shape {tuple(total_num_tokens.shape)}; "
                             f"need an int or a 0-dim tensor")
        tokens = host_to_device(total_num_tokens, probs.device).to(torch.float64)
    elif isinstance(total_num_tokens, bool) or not isinstance(total_num_tokens, numbers.Real) or total_num_tokens <= 0:
        raise ValueError(f"{owner}: total_num_tokens must be a number > 0 or a 0-dim tensor, got {total_num_tokens!r}")
    else:
        tokens = float(total_num_tokens)
    per_expert = probs.sum(dim=0, dtype=torch.float64)  # [E]
    weighted = (per_expert * host_to_device(tokens_per_expert, probs.device).to(torch.float64)).sum()
    return (weighted * (num_experts * coeff / topk) / (tokens * tokens)).to(probs.dtype)
