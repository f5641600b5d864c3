"""Token dispatch and combine of an MoE layer, with expert parallelism over an "ep" group.

Shapes per rank; T tokens on this rank, k = topk, E experts in all, ep ranks in the group, G = E / ep local
experts (rank j holds experts [j·G, (j+1)·G)):

  dispatch
    moe_permute           x [T, h] -> [T·k, h], rows sorted by global expert (E chunks)
    (ep > 1)
    exchange_counts       [E] rows per expert -> [ep, G]: rows each rank sends to each of my local experts
                          (one small all-to-all), then the one host read of the layer: the split sizes
    AllToAll              [T·k, h] -> [R, h], R = rows received; chunks ordered [source rank][local expert]
    moe_sort_chunks       -> [local expert][source rank]: each local expert's rows contiguous
  combine (the reverse, in reverse order)
    moe_sort_chunks       [local expert][source rank] -> [source rank][local expert]
    AllToAll              [R, h] -> [T·k, h]
    moe_unpermute         [T·k, h] -> [T, h], each token's k rows summed, weighted by its routing probs

Without expert parallelism nothing is read on the host: T·k is the permuted row count (every token goes to
exactly k experts; no token is dropped) and the per-expert counts stay on the device. With it, the
all-to-all's split sizes must be host numbers (torch.distributed takes lists): one read per forward, of
2·ep + G integers, right after the counts' all-to-all. The backward reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.moe.experts import ExpertRows
from te_parallel.ops.moe_permute import moe_permute, moe_sort_chunks_by_index, moe_unpermute
from te_parallel.parallel.groups import group_size


def all_to_all_rows(x: torch.Tensor, group, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
    """[sum(send_splits), ...] -> [sum(recv_splits), ...]: rows send_splits[j] go to rank j of `group`, rows
    recv_splits[i] come from rank i, in rank order (torch.distributed.all_to_all_single)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Expert-parallel all-to-all of token rows, per rank:

        forward   x [sum(send_splits), h] -> [sum(recv_splits), h]   (send_splits[j] rows to rank j)
        backward  grad [sum(recv_splits), h] -> [sum(send_splits), h]: the same exchange reversed, each
                  row's gradient back to the rank its row came from

    send_splits / recv_splits are host lists of one entry per rank of `group` (each rank's recv_splits[i]
    is rank i's send_splits[me])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        return all_to_all_rows(x, group, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_rows(grad, ctx.group, ctx.recv_splits, ctx.send_splits), None, None, None


def exchange_counts(tokens_per_expert: torch.Tensor, group) -> torch.Tensor:
    """[E] rows this rank sends to each expert -> [ep, G] int64: [i, g] rows rank i sends to my local expert g.
    One all-to-all of E integers (equal splits of G: rank j's slice is the count for its experts)."""
    ep = group_size(group)
    counts = tokens_per_expert.to(torch.int64).contiguous()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1)


@dataclass(frozen=True)
class EPSplits:
    """The expert-parallel exchange of one forward: host split sizes (one per rank of the group), the
    received counts [ep, G] on the device, and the chunk orders of the local re-sort."""

    group: object
    send: List[int]
    recv: List[int]
    recv_counts: torch.Tensor
    per_expert: Tuple[int, ...]

    def by_expert(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(split sizes in arrival order [source rank][local expert], the order that groups them by expert)."""
        ep, num = self.recv_counts.shape
        chunks = torch.arange(ep * num, device=self.recv_counts.device).view(ep, num)
        return self.recv_counts.reshape(-1), chunks.t().reshape(-1)

    def by_rank(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(split sizes in expert order [local expert][source rank], the order that restores arrival order)."""
        ep, num = self.recv_counts.shape
        chunks = torch.arange(ep * num, device=self.recv_counts.device).view(num, ep)
        return self.recv_counts.t().reshape(-1), chunks.t().reshape(-1)


@dataclass(frozen=True)
class Dispatched:
    """What combine needs to bring the experts' rows back to their tokens."""

    row_id_map: torch.Tensor       # moe_permute's map [T, E]
    probs: torch.Tensor            # [T, E] routing probabilities (zeros off the routing map)
    num_tokens: int                # T
    ep: Optional[EPSplits]         # None without expert parallelism


def _exchange(counts: torch.Tensor, group, num_local: int) -> EPSplits:
    """The counts' all-to-all and the one host read of split sizes (module docstring)."""
    ep = group_size(group)
    recv_counts = exchange_counts(counts, group)                    # [ep, G]
    send = counts.view(ep, num_local).sum(1)                          # [ep] rows to each rank
    host = torch.cat([send, recv_counts.sum(1), recv_counts.sum(0)]).tolist()  # (host sync: split sizes)
    return EPSplits(group, host[:ep], host[ep:2 * ep], recv_counts, tuple(host[2 * ep:]))


def dispatch(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, topk: int, ep_group,
             num_local_experts: int) -> Tuple[torch.Tensor, ExpertRows, Dispatched]:
    """x [T, h], probs / routing_map [T, E] (exactly topk experts per token) -> (rows of the local experts
    [R, h] sorted by local expert, their ExpertRows, what combine needs)."""
    num_tokens = x.shape[0]
    permuted, row_id_map = moe_permute(x, routing_map, num_out_tokens=num_tokens * topk)  # [T·k, h]
    counts = routing_map.sum(0)                                                            # [E] int64
    if group_size(ep_group) == 1:
        return permuted, ExpertRows(counts, None, permuted.shape[0]), Dispatched(row_id_map, probs, num_tokens, None)
    ep = _exchange(counts, ep_group, num_local_experts)
    received = AllToAll.apply(permuted, ep_group, ep.send, ep.recv)   # [R, h]: [source rank][local expert]
    sizes, order = ep.by_expert()
    rows = moe_sort_chunks_by_index(received, sizes, order)            # [R, h]: [local expert][source rank]
    per_expert = ep.recv_counts.sum(0)                                  # [G]
    return rows, ExpertRows(per_expert, ep.per_expert, rows.shape[0]), Dispatched(row_id_map, probs, num_tokens, ep)


def combine(y: torch.Tensor, d: Dispatched) -> torch.Tensor:
    """The experts' rows y [R, h] (dispatch's order) -> [T, h]: each token's rows summed, weighted by its probs."""
    if d.ep is not None:
        sizes, order = d.ep.by_rank()
        y = moe_sort_chunks_by_index(y, sizes, order)                   # [source rank][local expert]
        y = AllToAll.apply(y, d.ep.group, d.ep.recv, d.ep.send)          # [T·k, h]
    return moe_unpermute(y, d.row_id_map, merging_probs=d.probs, restore_shape=(d.num_tokens, y.shape[1]))
