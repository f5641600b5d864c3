"""Context parallelism's collectives, each a named autograd Function (forward and backward stated together).

Every rank holds two chunks of each sequence (the causal load-balanced layout: with G ranks, rank a holds
chunks a and 2G−1−a). `ChunkOrder` puts the G ranks' tokens, gathered rank after rank, into sequence
order and back:

  AllGatherKV  fwd all-gather   [b, s, ...] -> [b, G·s, ...] in sequence order    ("all_gather")
               bwd reduce-scatter of the gradient, back in rank order: [b, G·s, ...] -> [b, s, ...]
  SeqToHeads   fwd all-to-all   [b, s, h, d] -> [b, G·s, h/G, d]: the whole sequence, h/G heads ("a2a")
               bwd HeadsToSeq's forward
  HeadsToSeq   fwd all-to-all   [b, G·s, h/G, d] -> [b, s, h, d]: this rank's chunks, every head
               bwd SeqToHeads's forward

Packed tokens (TE's thd) take [t, ...] for [b, s, ...]: sequence n has a slot of S_n rows on each rank
(its two chunks, padded), and G·S_n rows in sequence order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from te_parallel.parallel.collectives import all_gather_dim0, reduce_scatter_dim0


@dataclass(frozen=True)
class ChunkOrder:
    """How the tokens of a group's G ranks interleave in sequence order. Dense tensors need only G; packed
    ones the permutation `perm` (row of the rank-major gathered tokens for each row in sequence order)
    and its inverse `inv`, from `packed_order`."""
    group: dist.ProcessGroup
    size: int
    perm: Optional[torch.Tensor] = None
    inv: Optional[torch.Tensor] = None

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[G, b, s, *rest] (rank-major) -> [b, G·s, *rest]; packed: [G, t, *rest] -> [G·t, *rest]."""
        G = self.size
        if self.perm is not None:
            return x.reshape(-1, *x.shape[2:]).index_select(0, self.perm)
        b, s, rest = x.shape[1], x.shape[2], x.shape[3:]
        halves = x.reshape(G, b, 2, s // 2, *rest).transpose(1, 2).reshape(2 * G, b, s // 2, *rest)  # [(rank, half)]
        chunks = halves.index_select(0, _chunk_index(G, x.device))                                 # [chunk]
        return chunks.movedim(0, 1).reshape(b, G * s, *rest)

    def to_ranks(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of to_sequence: [b, G·s, *rest] -> [G, b, s, *rest]; packed [G·t, *rest] -> [G, t, *rest]."""
        G = self.size
        if self.inv is not None:
            return y.index_select(0, self.inv).view(G, -1, *y.shape[1:])
        b, S, rest = y.shape[0], y.shape[1], y.shape[2:]
        chunks = y.reshape(b, 2 * G, S // (2 * G), *rest).movedim(1, 0)                            # [chunk]
        halves = chunks.index_select(0, _half_index(G, y.device))                                  # [(rank, half)]
        return halves.reshape(G, 2, b, S // (2 * G), *rest).transpose(1, 2).reshape(G, b, S // G, *rest)


def _chunk_index(G: int, device) -> torch.Tensor:
    """For chunk c of the sequence: its (rank, half) index 2·rank + half (rank c or 2G−1−c)."""
    return torch.tensor([2 * c if c < G else 2 * (2 * G - 1 - c) + 1 for c in range(2 * G)], device=device)


def _half_index(G: int, device) -> torch.Tensor:
    """For (rank a, half): the chunk it holds (a, or 2G−1−a)."""
    return torch.tensor([a if half == 0 else 2 * G - 1 - a for a in range(G) for half in (0, 1)], device=device)


def packed_order(group, size: int, cu_padded: torch.Tensor, divisor: int, tokens: int) -> ChunkOrder:
    """ChunkOrder of packed tokens: each rank of the group holds `tokens` rows, sequence n a slot of
    (cu_padded[n+1] − cu_padded[n]) / divisor of them (`divisor`: the ranks the full padded sequences
    are spread over, `size` or more when this group is part of a larger CP group)."""
    device = cu_padded.device
    slot = ((cu_padded[1:] - cu_padded[:-1]) // divisor).long()          # S_n rows per rank
    starts = (cu_padded // divisor).long()                              # slot starts on a rank
    t = torch.arange(size * tokens, device=device)                      # a row in sequence order
    seq = torch.searchsorted(size * starts[1:], t, right=True)
    u = t - size * starts[seq]                                          # its place in the sequence's G·S_n rows
    half_len = slot[seq] // 2
    c = u // half_len.clamp(min=1)                                      # its chunk, 0 .. 2G−1
    second = c >= size
    rank = torch.where(second, 2 * size - 1 - c, c)
    perm = rank * tokens + starts[seq] + second.long() * half_len + (u - c * half_len)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=device)
    return ChunkOrder(group, size, perm, inv)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[G, ...] with part i for rank i -> [G, ...] with part i from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, order: ChunkOrder) -> torch.Tensor:
    """[.., h, d] of this rank's tokens -> [.., h/G, d] of the whole sequence (no autograd)."""
    G = order.size
    parts = x.reshape(*x.shape[:-2], G, x.shape[-2] // G, x.shape[-1]).movedim(-3, 0)  # [G(head group), .., h/G, d]
    return order.to_sequence(_all_to_all(parts, order.group))                        # [G(source), ..] -> sequence


def heads_to_seq(y: torch.Tensor, order: ChunkOrder) -> torch.Tensor:
    """The inverse of seq_to_heads (no autograd)."""
    recv = _all_to_all(order.to_ranks(y), order.group)                               # [G(head group), .., h/G, d]
    return recv.movedim(0, -3).reshape(*recv.shape[1:-2], -1, recv.shape[-1])


class SeqToHeads(torch.autograd.Function):
    """fwd: x [b, s, h, d] / [t, h, d] (this rank's chunks, h heads) -> [b, G·s, h/G, d] / [G·t, h/G, d]
    (the sequence in order, this rank's h/G heads); bwd: the gradient through heads_to_seq."""

    @staticmethod
    def forward(ctx, x, order: ChunkOrder):
        ctx.order = order
        return seq_to_heads(x, order)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.order), None


class HeadsToSeq(torch.autograd.Function):
    """fwd: y [b, G·s, h/G, d] / [G·t, h/G, d] -> [b, s, h, d] / [t, h, d] (this rank's chunks, every head);
    bwd: the gradient through seq_to_heads."""

    @staticmethod
    def forward(ctx, y, order: ChunkOrder):
        ctx.order = order
        return heads_to_seq(y, order)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.order), None


class AllGatherKV(torch.autograd.Function):
    """fwd: kv [b, s, 2, g, d] / [t, 2, g, d] (K and V of this rank's chunks) -> [b, G·s, 2, g, d] / [G·t, 2, g, d]
    (the whole sequence in order); bwd: the gradient in rank order, reduce-scattered (each rank gets the sum
    over every rank's queries of its own chunks' dK/dV)."""

    @staticmethod
    def forward(ctx, kv, order: ChunkOrder):
        ctx.order = order
        gathered = all_gather_dim0(kv.unsqueeze(0), order.group)[0]  # [G, b, s, ...]
        return order.to_sequence(gathered)

    @staticmethod
    def backward(ctx, grad):
        summed = reduce_scatter_dim0(ctx.order.to_ranks(grad), ctx.order.group)[0]  # [1, b, s, ...]
        return summed.squeeze(0), None
