"""Context parallelism's ring ("p2p"): K/V blocks travel round the CP group while each rank attends its
queries to the block it holds, and the partial results are merged by their log-sum-exp.

The tensors are in the causal load-balanced layout (te_parallel.parallel.context_parallel): with P ranks
the sequence is cut into 2P chunks and rank r holds chunks r and 2P−1−r, its "first" and "second" half.
At step i rank r holds the K/V of rank src = (r − i) mod P, and under a causal mask (TE's schedule):

    i = 0       all queries  × all keys of r       causal (the two halves in order: the local diagonal)
    src < r     all queries  × first half of src   no mask (chunk src is before both of r's chunks)
    src > r     second half  × all keys of src     no mask (r's first chunk is before both of src's;
                                                   its second chunk is after them)

Without a mask every step is all × all. Forward: the next block's isend/irecv is posted before this
step's attention runs, so the transfer overlaps it. Backward: K/V go round again in the same order, and
with each block travels the fp32 sum of its dK/dV over the ranks that have used it so far; after P steps
every rank holds the sum for its own block.

One rank's compute apart from the transfers is a RankSchedule (its blocks, merges and accumulations step
by step); rank_forward / rank_backward run it on one device with every rank's K/V already there, which is
how one GPU measures a rank's share of a CP step against the unsplit attention (benchmarks/bench_cp.py).

Tokens: dense [b, s, h, d] (the halves are slices of dim 1) or packed [t, h, d] in the per-rank padded
layout of TE's thd (each sequence's slot holds its two chunks; only the rows of real tokens attend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.ops.attention_lse import BlockMask, acc_dtype, block_backward, block_forward, merge_


@dataclass(frozen=True)
class Ring:
    """The ring of a CP (or p2p sub-) group: this rank's place and its neighbours' global ranks."""
    group: dist.ProcessGroup
    size: int
    rank: int
    next_peer: int   # global rank that K/V are sent to
    prev_peer: int   # global rank they come from


@dataclass(frozen=True)
class TokenView:
    """Some of a rank's local tokens: a slice [start, stop) of dim 1 (dense) or rows of dim 0 (packed,
    with their sequences' boundaries cu and an upper bound max_len of the lengths)."""
    start: int = 0
    stop: Optional[int] = None
    rows: Optional[torch.Tensor] = None
    cu: Optional[torch.Tensor] = None
    max_len: int = 0

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.start:self.stop] if self.rows is None else x.index_select(0, self.rows)

    def add_(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        if self.rows is None:
            acc[:, self.start:self.stop].add_(x)
        else:
            acc.index_add_(0, self.rows, x.to(acc.dtype))

    def merge_(self, out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        if self.rows is None:
            merge_(out[:, self.start:self.stop], lse[:, self.start:self.stop], out_b, lse_b)
            return
        o, s = out.index_select(0, self.rows), lse.index_select(0, self.rows)
        merge_(o, s, out_b, lse_b)
        out.index_copy_(0, self.rows, o)
        lse.index_copy_(0, self.rows, s)


def block_mask(q_view: TokenView, kv_view: TokenView, causal: bool) -> BlockMask:
    return BlockMask(-1, 0 if causal else -1, q_view.cu, kv_view.cu, q_view.max_len, kv_view.max_len)


class DenseChunks:
    """The halves of dense local tokens [b, s, ...]: the same slices on every rank."""

    def __init__(self, s_local: int) -> None:
        self.half = s_local // 2

    def view(self, rank: int, part: str) -> TokenView:
        return {"all": TokenView(), "first": TokenView(0, self.half), "second": TokenView(self.half, None)}[part]


class PackedChunks:
    """The halves of packed local tokens [t, ...] in TE's thd layout over `size` ranks: sequence n has a
    slot of (cu_padded[n+1] − cu_padded[n]) / size rows on each rank, holding its chunks r and 2·size−1−r
    of L_n = padded length / (2·size) rows, real tokens first (cu_seqlens gives the real lengths).
    Views are built for any rank (the K/V of other ranks arrive in the same layout)."""

    def __init__(self, cu: torch.Tensor, cu_padded: torch.Tensor, size: int, tokens: int, max_chunk: int) -> None:
        self.size, self.tokens, self.max_chunk = size, tokens, max_chunk
        self.lengths = (cu[1:] - cu[:-1]).long()
        self.chunk = ((cu_padded[1:] - cu_padded[:-1]) // (2 * size)).long()     # L_n
        starts = (cu_padded // size).long()                                    # slot starts on a rank
        t = torch.arange(tokens, device=cu.device)
        self.seq = torch.searchsorted(starts[1:], t, right=True)
        offset = t - starts[self.seq]
        chunk_len = self.chunk[self.seq]
        self.second = offset >= chunk_len                                      # in the rank's second chunk
        self.within = offset - self.second.long() * chunk_len                  # offset inside its chunk
        self._views = {}

    def positions(self, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(position of each local token within its sequence, whether it is a real token) on `rank`."""
        chunk_id = torch.where(self.second, 2 * self.size - 1 - rank, rank)
        pos = chunk_id * self.chunk[self.seq] + self.within
        return pos, pos < self.lengths[self.seq]

    def view(self, rank: int, part: str) -> TokenView:
        key = (rank, part)
        if key not in self._views:
            _, real = self.positions(rank)
            keep = real if part == "all" else real & (self.second if part == "second" else ~self.second)
            rows = keep.nonzero().squeeze(1)
            counts = torch.zeros_like(self.lengths).index_add_(0, self.seq[rows], torch.ones_like(rows))
            cu = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
            self._views[key] = TokenView(rows=rows, cu=cu, max_len=self.max_chunk * (2 if part == "all" else 1))
        return self._views[key]


def steps(rank: int, size: int, i: int, causal: bool) -> List[Tuple[str, str]]:
    """The (query part of `rank`, key part of the source rank) blocks of step i; causal diagonal at i = 0."""
    src = (rank - i) % size
    if not causal or i == 0:
        return [("all", "all")]
    return [("all", "first")] if src < rank else [("second", "all")]


@dataclass(frozen=True)
class RankSchedule:
    """What one rank of the ring computes, step by step, apart from the communication: at step i it holds
    kv = stack([k, v]) of rank `source(i)` and runs the blocks of `steps`. RingAttention runs it with K/V
    arriving from its neighbour; `rank_forward` / `rank_backward` run it with every rank's K/V at hand (one
    device standing in for the ring: the same blocks, merges and accumulations, no transfers)."""
    rank: int
    size: int
    q_chunks: object   # DenseChunks or PackedChunks of the queries
    kv_chunks: object  # ... of the keys
    causal: bool
    scale: float

    def source(self, i: int) -> int:
        return (self.rank - i) % self.size

    def blocks(self, i: int) -> List[Tuple[TokenView, TokenView, BlockMask]]:
        """Step i's blocks: (this rank's query view, the source's key view, the block's mask)."""
        src = self.source(i)
        out = []
        for q_part, kv_part in steps(self.rank, self.size, i, self.causal):
            qv, kvv = self.q_chunks.view(self.rank, q_part), self.kv_chunks.view(src, kv_part)
            out.append((qv, kvv, block_mask(qv, kvv, i == 0 and self.causal)))
        return out

    def start(self, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The running (out, lse) before step 0: zeros and −inf in fp32 (fp64 for fp64 q)."""
        acc = acc_dtype(q.dtype)
        return (torch.zeros(q.shape, dtype=acc, device=q.device),
                torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device))

    def forward(self, i: int, q, kv, out, lse) -> list:
        """Step i: merge each block's (out, lse) into the running out/lse in place -> the blocks' aux."""
        aux = []
        for qv, kvv, mask in self.blocks(i):
            o_b, l_b, a = block_forward(qv.take(q), kvv.take(kv[0]), kvv.take(kv[1]), mask, self.scale)
            qv.merge_(out, lse, o_b, l_b)
            aux.append(a)
        return aux

    def backward(self, i: int, dout, q, out, lse, kv, aux: list, dq, dkv) -> None:
        """Step i's gradients with the merged out/lse: added into dq (fp32, like q) and into dkv (fp32 [2, ..]
        like kv, the running dK/dV sum of the source's block), in place."""
        for (qv, kvv, mask), a in zip(self.blocks(i), aux):
            dq_b, dk_b, dv_b = block_backward(qv.take(dout), qv.take(q), kvv.take(kv[0]), kvv.take(kv[1]),
                                              qv.take(out), qv.take(lse), a, mask, self.scale)
            qv.add_(dq, dq_b)
            kvv.add_(dkv[0], dk_b)
            kvv.add_(dkv[1], dv_b)


def rank_forward(sched: RankSchedule, q, kv_of: Callable[[int], torch.Tensor]):
    """The ring's forward for sched.rank with every rank's K/V at hand (kv_of(src) -> stack([k, v]) of rank
    src) -> (out like q, lse in fp32, aux per step for rank_backward)."""
    out, lse = sched.start(q)
    aux = [sched.forward(i, q, kv_of(sched.source(i)), out, lse) for i in range(sched.size)]
    return out.to(q.dtype), lse, aux


def rank_backward(sched: RankSchedule, dout, q, out, lse, kv_of: Callable[[int], torch.Tensor], aux,
                  dkv_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The ring's backward for sched.rank without transfers -> dq like q. This rank's dK/dV of rank src's
    block is added into dkv_of(src) (fp32 [2, ..]), as the ring adds it into the sum travelling with the block."""
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    for i in range(sched.size):
        src = sched.source(i)
        sched.backward(i, dout, q, out, lse, kv_of(src), aux[i], dq, dkv_of(src))
    return dq.to(q.dtype)


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring: Ring, tag: int) -> List[dist.Work]:
    """isend `send` to the next rank and irecv `recv` from the previous one (async; wait on the works)."""
    ops = [dist.P2POp(dist.isend, send, ring.next_peer, ring.group, tag),
           dist.P2POp(dist.irecv, recv, ring.prev_peer, ring.group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(works: Optional[List[dist.Work]]) -> None:
    for w in works or ():
        w.wait()


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over the whole sequence's keys, K/V moving round the ring.

    forward:  q [b, s, h, d] / [t, h, d], k, v [b, s_kv, g, d] / [t_kv, g, d] (this rank's chunks)
              -> out like q (q's dtype); P − 1 K/V transfers, each overlapping one step's attention.
    backward: dout like out -> dq, dk, dv on this rank; P − 1 K/V transfers and P transfers of the
              blocks' fp32 dK/dV sums (the last delivers each rank its own block's)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, q_chunks, kv_chunks, causal: bool, scale: float):
        sched = RankSchedule(ring.rank, ring.size, q_chunks, kv_chunks, causal, scale)
        out, lse = sched.start(q)
        kv = torch.stack([k, v])  # one message per step
        aux = []
        for i in range(ring.size):
            works, nxt = None, None
            if i + 1 < ring.size:
                nxt = torch.empty_like(kv)
                works = _exchange(kv, nxt, ring, tag=0)
            aux.append(sched.forward(i, q, kv, out, lse))
            _wait(works)
            kv = nxt if nxt is not None else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, sched, aux)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, sched, aux = ctx.args
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        kv = torch.stack([k, v])
        dkv = None  # the running dK/dV sum of the block held at this step
        for i in range(ring.size):
            works_kv, nxt = None, None
            if i + 1 < ring.size:
                nxt = torch.empty_like(kv)
                works_kv = _exchange(kv, nxt, ring, tag=0)
            if dkv is None:
                dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
            sched.backward(i, dout, q, out, lse, kv, aux[i], dq, dkv)
            dkv_next = torch.empty_like(dkv)
            works_dkv = _exchange(dkv, dkv_next, ring, tag=1)
            _wait(works_kv)
            _wait(works_dkv)
            kv, dkv = (nxt if nxt is not None else kv), dkv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, ring: Ring, q_chunks, kv_chunks, causal: bool, scale: float) -> torch.Tensor:
    """RingAttention.apply (see there): out [.., h, d] like q."""
    return RingAttention.apply(q, k, v, ring, q_chunks, kv_chunks, causal, scale)
