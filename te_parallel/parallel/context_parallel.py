"""Context parallelism (CP) for attention: the sequence is split over the ranks of a CP group, with TE's
arguments (cp_group, cp_global_ranks, cp_stream, cp_comm_type) on DotProductAttention,
MultiheadAttention and TransformerLayer.

Layout (causal load balancing, TE's and Megatron's): the sequence is cut into 2·cp chunks and rank i
holds chunks i and 2·cp−1−i, in that order, so that under a causal mask every rank has the same work.
Everything outside attention is per token and runs on the local tokens as it is. `shard_sequence` /
`gather_sequence` (bshd/sbhd) and `shard_thd` / `unshard_thd` (thd) move a full batch to and from this
layout; `sequence_positions` / `thd_positions` give the local tokens' positions (for RoPE).
Packed sequences (thd): each sequence is padded to a multiple of 2·cp (cu_seqlens_padded, see
`pad_cu_seqlens`) and load-balanced on its own; cu_seqlens / cu_seqlens_padded / max_seqlen are those of
the whole batch, the tensors hold this rank's tokens.

Communication (`cp_comm_type`):
  "p2p"         ring (cp_ring.py): K/V blocks go round the group by isend/irecv, each transfer overlapping
                one block's attention; partial outputs are merged by their log-sum-exp in fp32; the
                backward sends dK/dV round the ring.
  "all_gather"  K/V all-gathered (cp_comm.AllGatherKV); each local query chunk attends to the keys it
                needs (a prefix of the sequence under a causal mask); backward reduce-scatters dK/dV.
  "a2a"         Ulysses: an all-to-all trades heads for sequence (cp_comm.SeqToHeads), attention runs on
                the whole sequence with heads/cp heads, and one more brings the output back (HeadsToSeq).
  "a2a+p2p"     cp_group = [a2a group, p2p group]: a2a inside the first, the ring over the second. The
                layout's rank is p2p_rank · a2a_size + a2a_rank (`cp_rank_and_size`).
`context_parallel_attention` is the one entry; it checks the combination and says in one line what is
not supported. cp_stream is kept for TE's signature; the kernels run on the current stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from te_parallel.ops import attention_varlen as vl
from te_parallel.ops.attention import Band
from te_parallel.ops.attention_dispatch import Batch, Call, make_batch, run
from te_parallel.ops.attention_lse import lse_kernel
from te_parallel.parallel.collectives import all_gather_dim0
from te_parallel.parallel.cp_comm import AllGatherKV, ChunkOrder, HeadsToSeq, SeqToHeads, packed_order
from te_parallel.parallel.cp_ring import DenseChunks, PackedChunks, Ring, ring_attention
from te_parallel.parallel.groups import as_group, group_rank, group_size

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


# -- the layout ------------------------------------------------------------------------------------

def chunk_ids(cp_rank: int, cp_size: int) -> Tuple[int, int]:
    """The two of the 2·cp sequence chunks that rank cp_rank holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_length(owner: str, seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(f"{owner}: sequence length {seq_len} is not divisible by 2·cp = {2 * cp_size}; "
                         f"pad the sequence to a multiple of {2 * cp_size}")


def sequence_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions in the full sequence (of seq_len) of rank cp_rank's seq_len/cp tokens: int64 [seq_len/cp]."""
    _check_length("sequence_positions", seq_len, cp_size)
    n = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunk_ids(cp_rank, cp_size)])


def shard_sequence(x_full: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """x [.., s, ..] (s at seq_dim) -> this rank's [.., s/cp, ..]: chunks i and 2·cp−1−i (a copy)."""
    _check_length("shard_sequence", x_full.shape[seq_dim], cp_size)
    chunks = x_full.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp_rank, cp_size)], dim=seq_dim)


def unshard_sequence(shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Every rank's shard, in rank order -> the full tensor (the inverse of shard_sequence)."""
    cp = len(shards)
    chunks = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=seq_dim)
        c0, c1 = chunk_ids(rank, cp)
        chunks[c0], chunks[c1] = first, second
    return torch.cat(chunks, dim=seq_dim)


def gather_sequence(x_local: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """All-gather over the CP group (a collective, no autograd): this rank's shard -> the full tensor."""
    size = group_size(cp_group)
    gathered = all_gather_dim0(x_local.movedim(seq_dim, 0).unsqueeze(0), cp_group)[0]  # [cp, s/cp, ..]
    return unshard_sequence([g.movedim(0, seq_dim) for g in gathered.unbind(0)], seq_dim) if size > 1 else x_local


def cp_rank_and_size(cp_group) -> Tuple[int, int]:
    """(this rank's place in the layout, CP ranks in all) for a group, or TE's [a2a group, p2p group] pair
    (place = p2p_rank · a2a_size + a2a_rank)."""
    if isinstance(cp_group, (list, tuple)):
        a2a, p2p = cp_group
        return group_rank(p2p) * group_size(a2a) + group_rank(a2a), group_size(a2a) * group_size(p2p)
    return group_rank(cp_group), group_size(cp_group)


def pad_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """cu_seqlens_padded for packed sequences under CP: each sequence's slot rounded up to a multiple of 2·cp."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    slots = (lengths + 2 * cp_size - 1) // (2 * cp_size) * (2 * cp_size)
    return torch.nn.functional.pad(torch.cumsum(slots, 0), (1, 0)).to(cu_seqlens.dtype)


def _thd_chunks(cu_padded: torch.Tensor, cp_size: int, cu_seqlens: Optional[torch.Tensor] = None) -> PackedChunks:
    tokens = int(cu_padded[-1]) // cp_size
    return PackedChunks(cu_padded if cu_seqlens is None else cu_seqlens, cu_padded, cp_size, tokens, 0)


def thd_positions(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Position within its sequence of each of rank cp_rank's packed tokens (padding included): int64 [t/cp]."""
    return _thd_chunks(cu_seqlens_padded, cp_size).positions(cp_rank)[0]


def thd_cu_seqlens_on_rank(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_rank: int,
                           cp_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens of the real tokens each sequence has on rank cp_rank, the rank's slots cu_seqlens_padded / cp):
    what the rank's [t/cp, ...] tokens would be described by on their own."""
    chunk = ((cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]) // (2 * cp_size)).long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    real = sum((lengths - c * chunk).clamp(min=0).minimum(chunk) for c in chunk_ids(cp_rank, cp_size))
    cu = torch.nn.functional.pad(torch.cumsum(real, 0), (1, 0)).to(cu_seqlens.dtype)
    return cu, cu_seqlens_padded // cp_size


def thd_rows(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rows of the full packed tensor [t, ...] (sequences at cu_seqlens_padded) that rank cp_rank holds, in
    its local order: per sequence, its chunk i, then its chunk 2·cp−1−i."""
    chunks = _thd_chunks(cu_seqlens_padded, cp_size)
    return cu_seqlens_padded.long()[chunks.seq] + chunks.positions(cp_rank)[0]


def shard_thd(x_full: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Packed x [t, ...] in the padded layout -> this rank's [t/cp, ...]."""
    return x_full.index_select(0, thd_rows(cu_seqlens_padded, cp_rank, cp_size))


def unshard_thd(shards: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Every rank's packed shard, in rank order -> the full [t, ...] (the inverse of shard_thd)."""
    cp = len(shards)
    full = shards[0].new_empty(int(cu_seqlens_padded[-1]), *shards[0].shape[1:])
    for rank, shard in enumerate(shards):
        full.index_copy_(0, thd_rows(cu_seqlens_padded, rank, cp), shard)
    return full


# -- the groups ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextParallel:
    """A module's CP settings, checked once (make_context_parallel). rank/size: this rank's place in the
    layout and the CP ranks in all; group: the ring's or all-gather's group; a2a_group / a2a_size: the group
    heads are traded over ("a2a", "a2a+p2p"); ring: the ring's neighbours ("p2p", "a2a+p2p")."""
    comm_type: str
    rank: int
    size: int
    group: Optional[dist.ProcessGroup] = None
    a2a_group: Optional[dist.ProcessGroup] = None
    a2a_size: int = 1
    ring: Optional[Ring] = None
    stream: object = None


def make_context_parallel(owner: str, cp_group, cp_global_ranks=None, cp_stream=None,
                          cp_comm_type: str = "p2p") -> Optional[ContextParallel]:
    """TE's arguments -> ContextParallel, or None when there is no group or it has one rank (nothing changes).
    A group pair of which one has a single rank is the other's comm type (TE's rule)."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"{owner}: cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")
    if cp_group is None:
        return None
    if isinstance(cp_group, (list, tuple)):
        if cp_comm_type != "a2a+p2p" or len(cp_group) != 2:
            raise ValueError(f"{owner}: a list cp_group is [a2a group, p2p group] for cp_comm_type='a2a+p2p'; got "
                             f"{len(cp_group)} groups with cp_comm_type={cp_comm_type!r}")
        a2a, p2p = (as_group(owner, "cp_group", g)[0] for g in cp_group)
    elif cp_comm_type == "a2a+p2p":
        raise ValueError(f"{owner}: cp_comm_type='a2a+p2p' needs cp_group=[a2a group, p2p group], got one "
                         f"{type(cp_group).__name__}")
    else:
        group = as_group(owner, "cp_group", cp_group)[0]
        a2a, p2p = (group, None) if cp_comm_type == "a2a" else (None, group)
    size_a, size_p = group_size(a2a), group_size(p2p)
    if size_a * size_p == 1:
        return None
    kind = cp_comm_type if size_a > 1 and size_p > 1 else ("a2a" if size_a > 1 else cp_comm_type.replace("a2a+", ""))
    rank_a, rank_p = group_rank(a2a), group_rank(p2p)
    _check_global_ranks(owner, cp_global_ranks, a2a, p2p, rank_a, rank_p)
    ring = None
    if kind in ("p2p", "a2a+p2p"):
        ring = Ring(p2p, size_p, rank_p, dist.get_global_rank(p2p, (rank_p + 1) % size_p),
                    dist.get_global_rank(p2p, (rank_p - 1) % size_p))
    return ContextParallel(kind, rank_p * size_a + rank_a, size_a * size_p, p2p if size_p > 1 else None,
                           a2a if size_a > 1 else None, size_a, ring, cp_stream)


def _check_global_ranks(owner: str, given, a2a, p2p, rank_a: int, rank_p: int) -> None:
    """cp_global_ranks (TE: global ranks in layout order, p2p_rank · a2a_size + a2a_rank) against the groups."""
    size_a, size_p = group_size(a2a), group_size(p2p)
    if given is None:
        return
    given = [int(r) for r in given]
    if len(given) != size_a * size_p:
        raise ValueError(f"{owner}: cp_global_ranks has {len(given)} ranks but cp_group has {size_a * size_p}; "
                         f"pass the global ranks of cp_group in its rank order")
    want = {}
    if p2p is not None:
        want.update({p * size_a + rank_a: dist.get_global_rank(p2p, p) for p in range(size_p)})
    if a2a is not None:
        want.update({rank_p * size_a + a: dist.get_global_rank(a2a, a) for a in range(size_a)})
    bad = {i: r for i, r in want.items() if given[i] != r}
    if bad:
        raise ValueError(f"{owner}: cp_global_ranks={given} does not match cp_group (entries {sorted(bad)} should be "
                         f"{[bad[i] for i in sorted(bad)]}); pass the global ranks of cp_group in its rank order")


# -- the entry -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seqs:
    """Packed sequences of the whole batch (thd): real and padded boundaries, and what one host read told."""
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    cu_q_padded: torch.Tensor
    cu_kv_padded: torch.Tensor
    max_q: int               # longest sequence (real)
    max_kv: int
    max_padded_q: int        # longest padded slot
    max_padded_kv: int


def context_parallel_attention(cp: ContextParallel, call: Call, q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None,
                               cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                               max_seqlen_kv=None) -> Tuple[torch.Tensor, str]:
    """DotProductAttention under CP: q [s/cp, b, h, d] ("sbhd"), [b, s/cp, h, d] ("bshd") or [t/cp, h, d]
    ("thd"), k/v likewise with g heads, all in the load-balanced layout -> (output with heads merged in the
    same layout, the kernel that ran). Refuses unsupported combinations in one line before any collective."""
    thd = call.fmt == "thd"
    seqs = _thd_seqs(cp, call, q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                     max_seqlen_q, max_seqlen_kv) if thd else None
    _check_supported(cp, call, q, k, seqs)
    if call.fmt == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, ..] views
    if cp.comm_type == "all_gather":
        out, backend = (_all_gather_thd if thd else _all_gather_dense)(cp, call, q, k, v, seqs)
    elif cp.comm_type == "a2a":
        out, backend = _a2a(cp, call, q, k, v, seqs)
    else:
        out, backend = _ring(cp, call, q, k, v, seqs)
    return (out.transpose(0, 1).contiguous() if call.fmt == "sbhd" else out), backend


def _thd_seqs(cp, call, q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv) -> Seqs:
    owner = call.owner
    if cu_q is None:
        raise ValueError(f"{owner}: qkv_format='thd' needs cu_seqlens_q (the whole batch's, int32 [batch + 1]) under "
                         f"context parallelism")
    same = cu_kv is None or cu_kv is cu_q
    cu_kv = cu_q if same else cu_kv
    cu_q_pad = cu_q if cu_q_pad is None else cu_q_pad
    cu_kv_pad = (cu_q_pad if same else cu_kv) if cu_kv_pad is None else cu_kv_pad
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv), ("cu_seqlens_q_padded", cu_q_pad),
                     ("cu_seqlens_kv_padded", cu_kv_pad)):
        vl.check_cu_seqlens(owner, name, cu, q.device)
    vl.check_pair(owner, cu_q, cu_kv)
    (longest_q, slot_q), (longest_kv, slot_kv) = _read_bounds(owner, cp.size, ((cu_q, cu_q_pad, q.shape[0], "q"),
                                                                              (cu_kv, cu_kv_pad, k.shape[0], "kv")))
    max_q = longest_q if max_q is None else int(max_q)
    max_kv = (max_q if same else longest_kv) if max_kv is None else int(max_kv)
    return Seqs(cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv, slot_q, slot_kv)


def _read_bounds(owner: str, cp_size: int, sides):
    """Check each side's (cu_seqlens, cu_seqlens_padded, local tokens) in one host read -> per side
    (longest sequence, longest padded slot)."""
    two_cp, stats = 2 * cp_size, []
    for cu, pad, _, _ in sides:
        lengths, slots = cu[1:] - cu[:-1], pad[1:] - pad[:-1]
        stats += [pad[-1], (slots % two_cp).abs().max(), (lengths - slots).max(), lengths.min(), slots.min(),
                  lengths.max(), slots.max()]
    stats = torch.stack([v.long() for v in stats]).tolist()
    bounds = []
    for i, (_, _, tokens, side) in enumerate(sides):
        total, rem, over, low, low_slot, longest, slot = stats[7 * i:7 * i + 7]
        if rem or low_slot < 0:
            raise ValueError(f"{owner}: under context parallelism each packed sequence's slot must be a multiple of "
                             f"2·cp = {two_cp}; cu_seqlens_{side}_padded is not (pad_cu_seqlens makes it)")
        if over > 0 or low < 0:
            raise ValueError(f"{owner}: cu_seqlens_{side} must be non-decreasing with each sequence fitting its slot "
                             f"of cu_seqlens_{side}_padded")
        if total != tokens * cp_size:
            raise ValueError(f"{owner}: {side} has {tokens} tokens on this rank, so {tokens * cp_size} over cp = {cp_size}, "
                             f"but cu_seqlens_{side}_padded ends at {total}")
        bounds.append((longest, slot))
    return bounds


_DENSE_MASKS = ("no_mask", "causal")
_THD_MASKS = ("padding", "padding_causal")


def _check_supported(cp: ContextParallel, call: Call, q, k, seqs: Optional[Seqs]) -> None:
    owner, fmt, mask = call.owner, call.fmt, call.mask_type
    where = f"under context parallelism (cp_comm_type={cp.comm_type!r}, qkv_format={fmt!r})"
    allowed = _THD_MASKS if fmt == "thd" else _DENSE_MASKS
    if mask not in allowed:
        hint = "" if fmt == "thd" else "; for padded sequences use qkv_format='thd'"
        raise ValueError(f"{owner}: attn_mask_type={mask!r} is not supported {where}; use one of {allowed}{hint}")
    causal = "causal" in mask
    if fmt == "thd":
        cross = seqs.cu_kv is not seqs.cu_q and not torch.equal(seqs.cu_kv, seqs.cu_q)
    else:
        s_dim = 0 if fmt == "sbhd" else 1
        cross = q.shape[s_dim] != k.shape[s_dim]
        for name, t in (("q", q), ("k/v", k)):
            if t.shape[s_dim] % 2:
                raise ValueError(f"{owner}: {name} has {t.shape[s_dim]} tokens on this rank ({t.shape[s_dim] * cp.size} "
                                 f"in all): the sequence length must be divisible by 2·cp = {2 * cp.size} {where}")
    window = not (call.band.full or call.band.causal_only)
    if cross and (causal or window):
        raise ValueError(f"{owner}: a causal mask or sliding window with different query and key sequences is not "
                         f"supported {where}; use attn_mask_type='no_mask' there")
    if window and cp.comm_type not in ("a2a", "all_gather"):
        raise ValueError(f"{owner}: sliding windows (window_size=({call.band.left}, {call.band.right})) are not supported "
                         f"{where}; use cp_comm_type 'a2a' or 'all_gather'")
    if window and fmt == "thd" and cp.comm_type == "all_gather" and not causal:
        raise ValueError(f"{owner}: a sliding window without a causal mask is not supported {where}; use "
                         f"cp_comm_type 'a2a' or a causal mask")
    if call.dropout_p > 0 and cp.ring is not None:
        raise ValueError(f"{owner}: attention dropout ({call.dropout_p}) is not supported {where}; set "
                         f"attention_dropout=0 or use cp_comm_type 'a2a' or 'all_gather'")
    if cp.a2a_group is not None and q.shape[-2] % cp.a2a_size:
        raise ValueError(f"{owner}: {q.shape[-2]} attention heads on this rank are not divisible by the "
                         f"{cp.a2a_size} ranks heads are spread over {where}; use cp_comm_type 'p2p' or 'all_gather'")


# -- all_gather ------------------------------------------------------------------------------------

def _kv_range(chunk: int, n: int, s_kv: int, band: Band):
    """Keys [start, end) that query chunk `chunk` (n rows) can see, and the band re-aligned bottom-right on
    them (band: the whole sequence's, s_q == s_kv). A query at p = chunk_end − n + i sees keys
    [p − left, p + right]; on the trimmed keys the bottom-right diagonal is at i + end − start − n."""
    chunk_end = (chunk + 1) * n
    end, right = (s_kv, -1) if band.right < 0 else (min(s_kv, chunk_end + band.right), None)
    if right is None:
        right = chunk_end + band.right - end
    start, left = (0, -1) if band.left < 0 else (max(0, chunk_end - n - band.left), band.left + end - chunk_end)
    return start, end, Band(True, left, right)


def _all_gather_dense(cp: ContextParallel, call: Call, q, k, v, seqs):
    """q [b, s, h, d], k/v [b, s_kv, g, d] (this rank's chunks) -> ([b, s, h·d], kernel)."""
    kv = AllGatherKV.apply(torch.stack([k, v], dim=-3), ChunkOrder(cp.group, cp.size))  # [b, S_kv, 2, g, d]
    k_all, v_all = kv.unbind(-3)
    call = replace(call, fmt="bshd")
    if call.band.full:
        return run(call, Batch("dense", q, k_all, v_all, same_lengths=q.shape[1] == k_all.shape[1]))
    n, outs = q.shape[1] // 2, []
    for part, chunk in enumerate(chunk_ids(cp.rank, cp.size)):
        start, end, band = _kv_range(chunk, n, k_all.shape[1], call.band)
        batch = Batch("dense", q[:, part * n:(part + 1) * n], k_all[:, start:end], v_all[:, start:end],
                      same_lengths=end - start == n)
        out, backend = run(replace(call, band=band), batch)
        outs.append(out)
    return torch.cat(outs, dim=1), backend


def _all_gather_thd(cp: ContextParallel, call: Call, q, k, v, seqs: Seqs):
    """q [t, h, d], k/v [t_kv, g, d] (this rank's tokens, padded layout) -> ([t, h·d], kernel)."""
    order = packed_order(cp.group, cp.size, seqs.cu_kv_padded, cp.size, k.shape[0])
    kv = AllGatherKV.apply(torch.stack([k, v], dim=-3), order)  # [T_kv, 2, g, d], whole padded sequences
    k_all, v_all = kv.unbind(-3)
    q_chunks = PackedChunks(seqs.cu_q, seqs.cu_q_padded, cp.size, q.shape[0], seqs.max_padded_q // (2 * cp.size))
    causal = "causal" in call.mask_type
    out, backend = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2]), None
    for part, chunk in zip(("first", "second"), chunk_ids(cp.rank, cp.size)):
        qv = q_chunks.view(cp.rank, part)
        rows, cu_kv, max_kv = _visible_keys(seqs, q_chunks, chunk, causal, k_all.shape[0])
        packed = vl.Packed(qv.cu, cu_kv, max(qv.max_len, 1), max(max_kv, 1), False)
        batch = Batch("packed", qv.take(q), k_all.index_select(0, rows), v_all.index_select(0, rows), packed=packed,
                      same_lengths=False)
        band = Band(True, call.band.left, 0) if causal else Band(True, -1, -1)
        o, backend = run(replace(call, band=band), batch)
        out = out.index_copy(0, qv.rows, o)
    return out, backend


def _visible_keys(seqs: Seqs, q_chunks: PackedChunks, chunk: int, causal: bool, tokens: int):
    """Rows of the gathered keys that chunk `chunk` of every sequence can see (causal: the real keys up to
    the chunk's end; else all real keys), with their cu_seqlens and a bound on the lengths."""
    cu_pad = seqs.cu_kv_padded.long()
    lengths = (seqs.cu_kv[1:] - seqs.cu_kv[:-1]).long()
    ends = torch.minimum(lengths, (chunk + 1) * q_chunks.chunk) if causal else lengths
    t = torch.arange(tokens, device=cu_pad.device)
    seq = torch.searchsorted(cu_pad[1:], t, right=True)
    rows = ((t - cu_pad[seq]) < ends[seq]).nonzero().squeeze(1)
    cu = torch.nn.functional.pad(torch.cumsum(ends, 0), (1, 0)).to(torch.int32)
    bound = min(seqs.max_kv, (chunk + 1) * q_chunks.max_chunk) if causal else seqs.max_kv
    return rows, cu, bound


# -- a2a and the ring ------------------------------------------------------------------------------

def _repeat_kv(k, v, ranks: int):
    """GQA with fewer key heads than a2a ranks (or not a multiple): repeat each key head so that every rank
    gets whole ones (lcm(g, ranks) heads; the gradients of the copies are summed by autograd)."""
    g = k.shape[-2]
    rep = ranks // math.gcd(g, ranks)
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2))


def _to_heads(cp: ContextParallel, q, k, v, seqs: Optional[Seqs]):
    """SeqToHeads over the a2a group for q and the stacked k/v -> (q, k, v, order of q's tokens)."""
    group, size = cp.a2a_group, cp.a2a_size
    k, v = _repeat_kv(k, v, size)
    if seqs is None:
        order_q = order_kv = ChunkOrder(group, size)
    else:  # the full padded sequences are spread over all cp.size ranks; this group holds cp.size/size of them
        order_q = packed_order(group, size, seqs.cu_q_padded, cp.size, q.shape[0])
        order_kv = order_q if seqs.cu_kv_padded is seqs.cu_q_padded else packed_order(
            group, size, seqs.cu_kv_padded, cp.size, k.shape[0])
    q = SeqToHeads.apply(q, order_q)
    k, v = SeqToHeads.apply(torch.stack([k, v], dim=-3), order_kv).unbind(-3)
    return q, k, v, order_q


def _a2a(cp: ContextParallel, call: Call, q, k, v, seqs: Optional[Seqs]):
    """Attention of the whole sequence on h/cp heads between two all-to-alls -> ([b, s, h·d] / [t, h·d], kernel)."""
    d = q.shape[-1]
    q, k, v, order = _to_heads(cp, q, k, v, seqs)
    if seqs is None:
        call = replace(call, fmt="bshd")
        batch = Batch("dense", q, k, v, same_lengths=q.shape[1] == k.shape[1])
    else:
        batch = make_batch(call.owner, "thd", q, k, v, call.mask_type, call.band, None, seqs.cu_q, seqs.cu_kv,
                           seqs.cu_q_padded, seqs.cu_kv_padded, seqs.max_q, seqs.max_kv)
    out, backend = run(call, batch)
    out = HeadsToSeq.apply(out.view(*out.shape[:-1], -1, d), order)
    return out.reshape(*out.shape[:-2], -1), backend


def _ring(cp: ContextParallel, call: Call, q, k, v, seqs: Optional[Seqs]):
    """The ring over cp.ring (after SeqToHeads over the a2a group for "a2a+p2p") -> ([b, s, h·d] / [t, h·d], kernel)."""
    order = None
    if cp.a2a_group is not None:
        q, k, v, order = _to_heads(cp, q, k, v, seqs)
    ring = cp.ring
    if seqs is None:
        q_chunks, kv_chunks = DenseChunks(q.shape[1]), DenseChunks(k.shape[1])
    else:
        q_chunks = PackedChunks(seqs.cu_q, seqs.cu_q_padded, ring.size, q.shape[0], seqs.max_padded_q // (2 * ring.size))
        kv_chunks = q_chunks if seqs.cu_kv is seqs.cu_q and seqs.cu_kv_padded is seqs.cu_q_padded else PackedChunks(
            seqs.cu_kv, seqs.cu_kv_padded, ring.size, k.shape[0], seqs.max_padded_kv // (2 * ring.size))
    out = ring_attention(q, k, v, ring, q_chunks, kv_chunks, "causal" in call.mask_type, call.scale)
    if order is not None:
        out = HeadsToSeq.apply(out, order)
    return out.reshape(*out.shape[:-2], -1), lse_kernel(q)


# -- RoPE ------------------------------------------------------------------------------------------

def rotary_on_rank(cp: ContextParallel, freqs: torch.Tensor, fmt: str, tokens: int,
                   cu_seqlens_padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The angles of this rank's tokens from the whole sequence's freqs [s, 1, 1, rot]: [tokens, 1, 1, rot]
    (bshd/sbhd: the rows of the two chunks; thd: each token's position in its own sequence, slots of
    cu_seqlens_padded)."""
    if fmt == "thd":
        if cu_seqlens_padded is None:
            raise ValueError("rotary_pos_emb on qkv_format='thd' under context parallelism needs cu_seqlens_q "
                             "(or cu_seqlens_q_padded)")
        pos = thd_positions(cu_seqlens_padded, cp.rank, cp.size)
        covers = freqs.device.type != "cpu" or pos.numel() == 0 or freqs.shape[0] > int(pos.max())  # (no host sync on CUDA)
        need = int(pos.max()) + 1 if not covers else 0
    else:
        pos = sequence_positions(tokens * cp.size, cp.rank, cp.size, freqs.device)
        covers, need = freqs.shape[0] >= tokens * cp.size, tokens * cp.size
    if not covers:
        raise ValueError(f"rotary_pos_emb covers {freqs.shape[0]} positions; under context parallelism it must cover "
                         f"the whole sequence ({need} positions)")
    return freqs.index_select(0, pos.to(freqs.device))
