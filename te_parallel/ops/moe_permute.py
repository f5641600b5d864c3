"""Token permutation for Mixture-of-Experts layers, with TE's names, signatures and semantics.

`moe_permute` gathers the tokens [N, H] into one buffer [num_out, H] grouped by expert: expert 0's tokens
first, in token order, then expert 1's, and so on; `moe_unpermute` sums each token's rows back into
[N, H], weighted by `merging_probs` when given. `moe_sort_chunks_by_index` reorders contiguous chunks of
rows (expert parallelism: [rank][expert] chunks after the all-to-all become [expert][rank]).

Routing maps (TE's two kinds):
* "mask": routing_map [N, E], bool or integer, nonzero where token t goes to expert e.
* "index": routing_map [N, K], integer: token t's K expert indices. Rows are ordered by expert (a stable
  sort of the N·K indices), so one expert's rows keep the (token, k) order.

row_id_map (this library's format; it round-trips through these functions only): an int64 tensor [N, C],
C = E for "mask" and K for "index". row_id_map[t, c] is the row of the permuted buffer that holds token
t's slot c (expert c, or token t's c-th choice), -1 where the slot is not routed or was dropped. The
inverse (which slot fills each permuted row) is rebuilt from it where needed: one scatter over N·C
integers, far less than the rows it moves.

Dropping: num_out_tokens rows are kept in the expert-major order and the rest dropped (TE's index map
drops the same way; Megatron's capacity factor relies on it). Rows of the buffer that no slot fills
(num_out_tokens larger than the routed count, or padding) are zeros. With probs
(`moe_permute_with_probs`) a row whose probability is exactly 0 is written as zeros too: that is how
capacity padding marks its slots (TE's semantics), and such a row passes no gradient back to the tokens.

Host syncs: none when num_out_tokens is given (>= 0 for "mask", any value for "index"). num_out_tokens < 0
with a mask map counts the routed slots on the host (one sync), as does `moe_permute_and_pad_with_probs`
(the padded buffer's size is a host number).

How the rows move (te_parallel.ops.moe_rows): permute is one gather of the token rows; its backward and
unpermute are segment sums over the permuted rows sorted by token (one sort of the rows' slots, which are
token-major), summed in fp32 (fp64 for fp64 tensors) in slot order and rounded once; unpermute's backward is
one gather that also forms the merging probs' gradients. Each reads and writes the moved rows once on the GPU
(Triton kernels), and works for any number of rows per token: exactly k, dropped slots, padding rows.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch

from te_parallel.ops.moe_rows import gather_rows, segment_sum_rows

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "host_to_device"]

MAP_TYPES = ("mask", "index")


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on device. A small host tensor goes to a GPU through pinned memory without blocking: a plain copy
    from pageable memory would wait for the stream's queued work."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are taken in: fp32, or fp64 for fp64 tensors."""
    return torch.promote_types(dtype, torch.float32)


def _gather_values(v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """v[index] of a 1-D v (zeros where index < 0, or when v is empty)."""
    if v.shape[0] == 0:
        return v.new_zeros(index.shape)
    return v.index_select(0, index.clamp(min=0)).masked_fill_(index < 0, 0)


def _sources(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """src [num_rows] int64: the flat slot t·C + c that fills each permuted row, -1 for rows no slot fills.

    The inverse of row_id_map by one scatter: routed slots have distinct rows; unrouted slots (and rows past
    num_rows) all go to a spare entry that is cut off, so which of them lands there does not matter."""
    flat = row_id_map.reshape(-1)
    dest = torch.where((flat >= 0) & (flat < num_rows), flat, num_rows)
    src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=flat.device)
    src.scatter_(0, dest, torch.arange(flat.numel(), device=flat.device))
    return src[:num_rows]


def _token_of(src: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[rows] the token each permuted row came from, -1 for rows no slot fills."""
    return torch.where(src >= 0, src // max(num_slots, 1), -1)


def _by_token(token: torch.Tensor, src: torch.Tensor, num_tokens: int,
              num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(perm [rows], offsets [N + 1]): the rows with token >= 0 listed token by token, each token's in slot order
    (perm[offsets[t]:offsets[t+1]] are token t's rows), the others after offsets[N]. One sort of the rows'
    slots (distinct), which are token-major: t·C + c."""
    spare = num_tokens * num_slots
    key = torch.where(token >= 0, src, spare)
    if spare < 2 ** 31:  # (a radix sort of 32-bit keys makes half the passes of 64-bit ones)
        key = key.to(torch.int32)
    key_sorted, perm = torch.sort(key)
    token_sorted = torch.where(key_sorted < spare, key_sorted // max(num_slots, 1), num_tokens)
    bounds = torch.arange(num_tokens + 1, device=token.device, dtype=token_sorted.dtype)
    return perm, torch.searchsorted(token_sorted, bounds)


def _scatter_slots(values: torch.Tensor, src: torch.Tensor, shape: Tuple[int, int]) -> torch.Tensor:
    """[N, C] with values[j] at the flat slot src[j] (rows with src -1 dropped), zeros elsewhere."""
    numel = shape[0] * shape[1]
    out = values.new_zeros(numel + 1)
    out.index_add_(0, torch.where(src >= 0, src, numel), values)
    return out[:numel].view(shape)


class _Permute(torch.autograd.Function):
    """out[j] = inp[token of row j] (zeros for rows no slot fills, and for rows whose prob is 0): one gather;
    permuted_probs[j] = probs[slot of row j]. Backward: the adjoint, each token's row gradients summed (a segment
    sum over the rows sorted by token) and the row-prob gradients scattered to their slots."""

    @staticmethod
    def forward(ctx, inp, probs, row_id_map, num_out: int):
        num_tokens, num_slots = row_id_map.shape
        src = _sources(row_id_map, num_out)  # [num_out]
        token = _token_of(src, num_slots)  # [num_out], -1: a zero row
        permuted_probs = None
        if probs is not None:
            permuted_probs = _gather_values(probs.reshape(-1), src)
            token = torch.where(permuted_probs != 0, token, -1)
        out, _ = gather_rows(inp, token)  # [num_out, H]
        ctx.save_for_backward(token, src)
        ctx.num_tokens, ctx.num_slots = num_tokens, num_slots
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad_out, grad_permuted_probs):
        token, src = ctx.saved_tensors
        grad_inp = grad_probs = None
        if ctx.needs_input_grad[0]:
            perm, offsets = _by_token(token, src, ctx.num_tokens, ctx.num_slots)
            grad_inp = segment_sum_rows(grad_out, perm, offsets)  # [N, H]
        if ctx.needs_input_grad[1] and grad_permuted_probs is not None:
            grad_probs = _scatter_slots(grad_permuted_probs, src, (ctx.num_tokens, ctx.num_slots))
        return grad_inp, grad_probs, None, None


class _Unpermute(torch.autograd.Function):
    """out[t] = sum over token t's routed slots c of w[t, c] · inp[row_id_map[t, c]] (w = merging_probs, or
    1): a segment sum over the rows sorted by token. Backward, in one pass over the rows: grad_inp[j] = w(j) ·
    grad_out[token of j] (a gather) and grad_w[t, c] = <grad_out[t], inp[row_id_map[t, c]]>."""

    @staticmethod
    def forward(ctx, inp, merging_probs, row_id_map, num_tokens: int):
        num_slots = row_id_map.shape[1]
        src = _sources(row_id_map, inp.shape[0])  # [rows]
        token = _token_of(src, num_slots)
        weight = None  # [rows] in fp32 / fp64, 0 for rows no slot fills
        if merging_probs is not None:
            weight = _gather_values(merging_probs.reshape(-1).to(_acc_dtype(inp.dtype)), src)
        perm, offsets = _by_token(token, src, num_tokens, num_slots)
        out = segment_sum_rows(inp, perm, offsets, None if weight is None else weight.index_select(0, perm))
        needs_inp = merging_probs is not None and merging_probs.requires_grad
        ctx.save_for_backward(inp if needs_inp else None, weight, token, src)
        ctx.num_slots, ctx.probs_dtype = num_slots, None if merging_probs is None else merging_probs.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight, token, src = ctx.saved_tensors
        needs_probs = ctx.needs_input_grad[1]
        grad_inp, dots = gather_rows(grad_out, token, weight, inp if needs_probs else None)  # [rows, H], [rows]
        grad_probs = None
        if needs_probs:
            grad_probs = _scatter_slots(dots, src, (grad_out.shape[0], ctx.num_slots)).to(ctx.probs_dtype)
        return grad_inp if ctx.needs_input_grad[0] else None, grad_probs, None, None


class _SortChunks(torch.autograd.Function):
    """out = inp[src] with src the inverse of dst; backward: grad[dst]. Both directions are gathers (autograd's
    own backward of a gather would be an index_add_), by index_select: a permutation of whole rows, which it
    moves at least as fast as moe_rows' gather (H200, docs/moe.md)."""

    @staticmethod
    def forward(ctx, inp, probs, dst):
        src = torch.zeros_like(dst).scatter_(0, dst, torch.arange(dst.numel(), device=dst.device))
        ctx.save_for_backward(dst)
        return inp.index_select(0, src), None if probs is None else probs.index_select(0, src)

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        (dst,) = ctx.saved_tensors
        grad_inp = grad_out.index_select(0, dst) if ctx.needs_input_grad[0] else None
        grad_p = grad_probs.index_select(0, dst) if ctx.needs_input_grad[1] and grad_probs is not None else None
        return grad_inp, grad_p, None


# ----------------------------------------------------------------------------------------------------
# Building the row_id_map (integer ops, no gradient).
# ----------------------------------------------------------------------------------------------------

def _mask_row_id_map(routing_map: torch.Tensor, num_out: int,
                     pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, E]: the expert-major rank of each routed (t, e) (plus expert e's pad offset), -1 where not
    routed or past num_out."""
    num_tokens, num_experts = routing_map.shape
    routed = routing_map.bool().t()  # [E, N]
    rows = torch.cumsum(routed.reshape(-1), 0).view(num_experts, num_tokens) - 1  # expert-major rank
    if pad_offsets is not None:
        rows = rows + pad_offsets.to(device=rows.device, dtype=rows.dtype).unsqueeze(1)
    rows = torch.where(routed & (rows < num_out), rows, -1)
    return rows.t().contiguous()


def _index_row_id_map(indices: torch.Tensor, num_out: int) -> torch.Tensor:
    """[N, K]: the rank of each (t, k) in the stable sort of the flat indices, -1 past num_out."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # sorted position -> flat slot t·K + k
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return torch.where(rank < num_out, rank, -1).view(indices.shape)


# ----------------------------------------------------------------------------------------------------
# Input checks: one line each, before any work.
# ----------------------------------------------------------------------------------------------------

def _check_tokens(owner: str, inp: torch.Tensor) -> None:
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2:
        got = tuple(inp.shape) if isinstance(inp, torch.Tensor) else type(inp).__name__
        raise ValueError(f"{owner}: inp is {got}; need a 2-D [num_tokens, hidden_size] tensor")


def _check_routing_map(owner: str, inp: torch.Tensor, routing_map: torch.Tensor, map_type: str) -> None:
    if map_type not in MAP_TYPES:
        raise ValueError(f"{owner}: map_type must be one of {MAP_TYPES}, got {map_type!r}")
    what = "[num_tokens, num_experts]" if map_type == "mask" else "[num_tokens, topK]"
    if (not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2
            or routing_map.shape[0] != inp.shape[0]):
        got = tuple(routing_map.shape) if isinstance(routing_map, torch.Tensor) else type(routing_map).__name__
        raise ValueError(f"{owner}: routing_map is {got} for inp {tuple(inp.shape)}; need a 2-D {what} "
                         f"tensor with num_tokens = {inp.shape[0]}")
    if routing_map.is_floating_point() or routing_map.is_complex() or (
            map_type == "index" and routing_map.dtype == torch.bool):
        kinds = "bool or integer" if map_type == "mask" else "integer (expert indices)"
        raise ValueError(f"{owner}: routing_map has dtype {routing_map.dtype}; a {map_type!r} map must be {kinds}")


def _as_int(owner: str, name: str, value) -> int:
    """An int, or a 0-dim integer tensor read on the host (Megatron passes a CPU one; a device one costs a sync)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (value.is_floating_point() or value.is_complex()
                                                                     or value.dtype == torch.bool):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{owner}: {name} must be an int (or a 0-dim integer tensor), got {value!r}")
    return int(value)


def _check_probs(owner: str, name: str, probs: torch.Tensor, shape: Sequence[int], what: str) -> None:
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != tuple(shape) or not probs.is_floating_point():
        got = (f"{tuple(probs.shape)} {probs.dtype}" if isinstance(probs, torch.Tensor)
               else type(probs).__name__)
        raise ValueError(f"{owner}: {name} is {got}; need a floating-point {what} tensor of shape {tuple(shape)}")


# ----------------------------------------------------------------------------------------------------
# TE's functions.
# ----------------------------------------------------------------------------------------------------

def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Union[int, torch.Tensor] = -1,
                max_token_num: int = -1,
                map_type: str = "mask") -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the tokens inp [N, H] by expert: returns (permuted [num_out, H], row_id_map).

    map_type "mask": routing_map [N, E] (bool / integer); num_out_tokens >= 0 is the buffer's row count,
    < 0 (the default) counts the routed slots (one host sync). "index": routing_map [N, K] expert indices;
    num_out_tokens > 0 is the row count, <= 0 means N·K. Rows past num_out_tokens in the expert-major
    order are dropped. num_out_tokens may be a 0-dim integer tensor (read on the host). max_token_num (TE's
    workspace hint) is accepted and not needed."""
    _check_tokens("moe_permute", inp)
    _check_routing_map("moe_permute", inp, routing_map, map_type)
    num_out_tokens = _as_int("moe_permute", "num_out_tokens", num_out_tokens)
    _as_int("moe_permute", "max_token_num", max_token_num)
    if map_type == "index":
        full = routing_map.numel()
        num_out = num_out_tokens if num_out_tokens > 0 else full
        row_id_map = _index_row_id_map(routing_map, num_out)
        out, _ = _Permute.apply(inp, None, row_id_map, num_out)
        return out, row_id_map
    num_out = int(routing_map.bool().sum()) if num_out_tokens < 0 else num_out_tokens  # (host sync if < 0)
    row_id_map = _mask_row_id_map(routing_map, num_out)
    out, _ = _Permute.apply(inp, None, row_id_map, num_out)
    return out, row_id_map


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: Union[int, torch.Tensor] = -1
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_permute of a mask map that also carries each slot's probability: returns (permuted [num_out, H],
    permuted_probs [num_out], row_id_map). probs [N, E]; rows whose probability is exactly 0 (capacity
    padding) come out as zeros. Gradients flow to inp and probs."""
    _check_tokens("moe_permute_with_probs", inp)
    _check_routing_map("moe_permute_with_probs", inp, routing_map, "mask")
    _check_probs("moe_permute_with_probs", "probs", probs, routing_map.shape, "[num_tokens, num_experts]")
    num_out_tokens = _as_int("moe_permute_with_probs", "num_out_tokens", num_out_tokens)
    num_out = int(routing_map.bool().sum()) if num_out_tokens < 0 else num_out_tokens  # (host sync if < 0)
    row_id_map = _mask_row_id_map(routing_map, num_out)
    out, permuted_probs = _Permute.apply(inp, probs, row_id_map, num_out)
    return out, permuted_probs, row_id_map


def moe_permute_and_pad_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                                   tokens_per_expert: torch.Tensor, align_size: int):
    """moe_permute_with_probs with each expert's rows padded (zeros) to a multiple of align_size, as grouped
    FP8 GEMMs need. Returns (permuted, permuted_probs, row_id_map, pad_offsets, padded_tokens_per_expert):
    pad_offsets [E] is how far expert e's rows moved (None when no expert needed padding). The buffer's
    size is a host number: one host sync. The row_id_map already points at the padded rows, so
    moe_unpermute needs no pad_offsets."""
    owner = "moe_permute_and_pad_with_probs"
    _check_tokens(owner, inp)
    _check_routing_map(owner, inp, routing_map, "mask")
    _check_probs(owner, "probs", probs, routing_map.shape, "[num_tokens, num_experts]")
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (routing_map.shape[1],):
        got = tuple(tokens_per_expert.shape) if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
        raise ValueError(f"{owner}: tokens_per_expert is {got}; need a [num_experts] = [{routing_map.shape[1]}] tensor")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"{owner}: align_size must be a positive int, got {align_size!r}")
    counts = host_to_device(tokens_per_expert.to(torch.int64), inp.device)
    padded = (counts + align_size - 1) // align_size * align_size
    pad = padded - counts
    total, any_pad = torch.stack([padded.sum(), (pad != 0).any().long()]).tolist()  # (host sync)
    pad_offsets = (torch.cumsum(pad, 0) - pad) if any_pad else None
    row_id_map = _mask_row_id_map(routing_map, total, pad_offsets)
    out, permuted_probs = _Permute.apply(inp, probs, row_id_map, total)
    return out, permuted_probs, row_id_map, pad_offsets, padded


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[Union[torch.Size, Sequence[int]]] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None, pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of moe_permute: out [N, H], out[t] = sum over token t's kept rows of merging_probs[t, c] ·
    inp[row] (merging_probs [N, E] for a mask map, [N, K] for an index map), or the plain sum without
    merging_probs. restore_shape (N, H), when given, must match row_id_map and inp. `probs` is TE's
    deprecated name of merging_probs; pad_offsets is accepted for TE's signature (the row_id_map of
    moe_permute_and_pad_with_probs already holds the padded rows)."""
    owner = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{owner}: both merging_probs and probs (its deprecated name) were given; "
                             f"pass merging_probs")
        warnings.warn("moe_unpermute: probs is deprecated; pass merging_probs", DeprecationWarning, stacklevel=2)
        merging_probs = probs
    if map_type not in MAP_TYPES:
        raise ValueError(f"{owner}: map_type must be one of {MAP_TYPES}, got {map_type!r}")
    _check_tokens(owner, inp)
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dim() != 2 or row_id_map.dtype != torch.int64:
        got = (f"{tuple(row_id_map.shape)} {row_id_map.dtype}" if isinstance(row_id_map, torch.Tensor)
               else type(row_id_map).__name__)
        raise ValueError(f"{owner}: row_id_map is {got}; need the int64 [num_tokens, slots] row_id_map that "
                         f"moe_permute returned")
    num_tokens = row_id_map.shape[0]
    if restore_shape is not None and tuple(restore_shape) != (num_tokens, inp.shape[1]):
        raise ValueError(f"{owner}: restore_shape is {tuple(restore_shape)}; the row_id_map and inp give "
                         f"{(num_tokens, inp.shape[1])}")
    if merging_probs is not None:
        _check_probs(owner, "merging_probs", merging_probs, row_id_map.shape,
                     "[num_tokens, num_experts]" if map_type == "mask" else "[num_tokens, topK]")
    return _Unpermute.apply(inp, merging_probs, row_id_map, num_tokens)


def _chunk_destinations(owner: str, inp: torch.Tensor, split_sizes, sorted_index) -> torch.Tensor:
    """dst [rows]: where each input row lands when the chunks (split_sizes) are laid out in sorted_index's
    order. Device tensors are not checked against inp (that would be a host sync); CPU ones are."""
    split_sizes = torch.as_tensor(split_sizes)
    sorted_index = torch.as_tensor(sorted_index)
    if (split_sizes.dim() != 1 or sorted_index.shape != split_sizes.shape or split_sizes.is_floating_point()
            or sorted_index.is_floating_point()):
        raise ValueError(f"{owner}: split_sizes {tuple(split_sizes.shape)} and sorted_index "
                         f"{tuple(sorted_index.shape)} must be integer 1-D tensors of one length")
    num_rows = inp.shape[0]
    if split_sizes.device.type == "cpu" and int(split_sizes.sum()) != num_rows:
        raise ValueError(f"{owner}: split_sizes sum to {int(split_sizes.sum())}; inp has {num_rows} rows")
    if split_sizes.numel() == 0 and num_rows > 0:
        raise ValueError(f"{owner}: split_sizes is empty; inp has {num_rows} rows")
    sizes = host_to_device(split_sizes.to(torch.int64), inp.device)
    order = host_to_device(sorted_index.to(torch.int64), inp.device)
    ends = torch.cumsum(sizes, 0)
    out_sizes = sizes.index_select(0, order)  # chunk sizes in output order
    out_start = torch.empty_like(sizes).scatter_(0, order, torch.cumsum(out_sizes, 0) - out_sizes)
    row = torch.arange(num_rows, device=inp.device)
    chunk = torch.searchsorted(ends, row, right=True).clamp_(max=max(sizes.numel() - 1, 0))
    dst = row - (ends - sizes)[chunk] + out_start[chunk]
    return dst.clamp_(0, max(num_rows - 1, 0))  # (split sizes that miss the row count: wrong rows, no fault)


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor) -> torch.Tensor:
    """Split inp [rows, H] into chunks of split_sizes rows and concatenate them in sorted_index's order:
    out = cat([chunk[i] for i in sorted_index])."""
    _check_tokens("moe_sort_chunks_by_index", inp)
    dst = _chunk_destinations("moe_sort_chunks_by_index", inp, split_sizes, sorted_index)
    out, _ = _SortChunks.apply(inp, None, dst)
    return out


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_sort_chunks_by_index of inp [rows, H] and of its per-row probs [rows], in one pass."""
    owner = "moe_sort_chunks_by_index_with_probs"
    _check_tokens(owner, inp)
    _check_probs(owner, "probs", probs, (inp.shape[0],), "[num_tokens]")
    dst = _chunk_destinations(owner, inp, split_sizes, sorted_index)
    return _SortChunks.apply(inp, probs, dst)
