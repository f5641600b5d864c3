"""From DotProductAttention's arguments to a kernel and back: the input kinds, the backend rule with its
fallbacks, and the layout conversions between the dense and varlen kernel families.

Input kinds:
  dense   bshd/sbhd, no padding (masks: none, causal, window, arbitrary);
  padded  bshd/sbhd with a padding mask ([b, 1, 1, s] True = padding, a (q, kv) pair, or cu_seqlens);
  packed  thd with cu_seqlens (and cu_seqlens_padded when there are gaps between sequences).
A dense kernel takes padded and packed inputs as a padded [b, h, s, d] batch and a mask; a varlen
kernel takes dense and padded inputs as packed tokens (bshd unpadded; dense bshd is a view).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from te_parallel.ops import attention_cudnn_fe as cudnn_fe
from te_parallel.ops import attention_varlen as vl
from te_parallel.ops.attention import (
    DENSE_BACKENDS, Band, band_mask, choose_backend, dense_attention, fallback_of, make_case, mask_union,
    unsupported_reason, warn_once,
)


@dataclass(frozen=True)
class Call:
    """What the layer asks for: layout, mask, band, scale, dropout, the requested backend."""
    owner: str
    fmt: str
    mask_type: str
    band: Band
    scale: float
    dropout_p: float
    backend: str


@dataclass
class Batch:
    """One call's q/k/v in their layout and what is known of the sequences (see the module docstring)."""
    kind: str                                   # "dense" | "padded" | "packed"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    arbitrary: Optional[torch.Tensor] = None    # dense: bool mask, True = masked out
    valid_q: Optional[torch.Tensor] = None      # padded: bool [b, s_q], True = a real token
    valid_kv: Optional[torch.Tensor] = None
    packed: Optional[vl.Packed] = None          # packed: sequence boundaries
    rows_q: Optional[torch.Tensor] = None       # packed with gaps: rows of the real tokens
    rows_kv: Optional[torch.Tensor] = None
    same_lengths: bool = True


def run(call: Call, batch: Batch) -> Tuple[torch.Tensor, str]:
    """-> (output in the input's layout with heads merged: [s, b, h·d], [b, s, h·d] or [t, h·d], backend)."""
    case = make_case(batch.q, ragged=batch.kind != "dense", arbitrary=batch.arbitrary is not None, band=call.band,
                     same_lengths=batch.same_lengths, dropout=call.dropout_p > 0,
                     cudnn_fe=batch.q.is_cuda and cudnn_fe.available())
    if call.backend != "auto":
        reason = unsupported_reason(call.backend, case)
        if reason is not None:
            raise ValueError(f"{call.owner}: backend={call.backend!r} cannot run this input ({_describe(call, batch)}): "
                             f"it needs {reason}; use backend='auto' or another backend")
        return _execute(call, batch, call.backend), call.backend
    backend = choose_backend(case)
    while True:
        try:
            return _execute(call, batch, backend), backend
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as err:
            if backend == "unfused":
                raise
            nxt = fallback_of(backend, case)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            warn_once((backend, nxt, call.fmt, call.mask_type, batch.q.dtype),
                      f"te_parallel attention: backend '{backend}' cannot run this input ({first}); using '{nxt}'")
            backend = nxt


def _describe(call: Call, batch: Batch) -> str:
    q = batch.q
    return (f"{call.fmt} {q.dtype} on {q.device}, head_dim {q.shape[-1]}, attn_mask_type {call.mask_type!r}, "
            f"band {call.band}, dropout {call.dropout_p}")


def _execute(call: Call, batch: Batch, backend: str) -> torch.Tensor:
    if backend in DENSE_BACKENDS:
        return _run_dense(call, batch, backend)
    if backend == "cudnn_fe" and batch.kind == "dense" and batch.arbitrary is None:
        s_dim = 0 if call.fmt == "sbhd" else 1
        same = batch.q.shape[s_dim] == batch.k.shape[s_dim]
        if batch.q.shape[s_dim] and batch.k.shape[s_dim]:
            return cudnn_fe.cudnn_fe_dense_attention(batch.q, batch.k, batch.v, call.fmt == "sbhd", _aligned(call.band, same),
                                                     call.scale, call.dropout_p)
    q, k, v, packed, restore = _to_packed(call, batch)
    if q.shape[0] == 0 or k.shape[0] == 0:
        out = q * 0  # no tokens, or no keys for any query: zeros, still attached to q for autograd
    elif backend == "cudnn_fe":
        out = cudnn_fe.cudnn_fe_attention(q, k, v, packed.cu_q, packed.cu_kv, packed.max_q, packed.max_kv,
                                          _aligned(call.band, packed.same_lengths), call.scale, packed.same_lengths,
                                          call.dropout_p)
    else:
        out = vl.flash_varlen(q, k, v, packed, call.band, call.scale, call.dropout_p)
    return restore(out)


def _aligned(band: Band, same_lengths: bool) -> Band:
    """Where every sequence has s_q == s_kv the two alignments are one band: top-left, which cuDNN also
    takes with dropout."""
    return Band(False, band.left, band.right) if same_lengths and band.bottom_right and not band.full else band


# -- dense kernels ---------------------------------------------------------------------------------

def _bhsd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2)


def _merge_heads(out: torch.Tensor, fmt: str) -> torch.Tensor:
    """[b, h, s, d] -> [s, b, h·d] or [b, s, h·d]."""
    out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
    return out.reshape(*out.shape[:2], -1)


def _run_dense(call: Call, batch: Batch, backend: str) -> torch.Tensor:
    if batch.kind == "packed":
        return _run_dense_packed(call, batch, backend)
    q, k, v = (_bhsd(t, call.fmt) for t in (batch.q, batch.k, batch.v))
    sq, skv = q.shape[2], k.shape[2]
    mask, is_causal = batch.arbitrary, False
    if batch.kind == "padded":
        len_q, len_kv = batch.valid_q.sum(1), batch.valid_kv.sum(1)
        mask = _padding_mask(batch.valid_q, batch.valid_kv, call.band, len_q, len_kv)
    elif call.band.causal_only and sq == skv and mask is None:
        is_causal = True  # SDPA's flag (top-left; the same as bottom-right here)
    else:
        mask = mask_union(mask, band_mask(call.band, None, None, sq, skv, q.device))
    out = dense_attention(q, k, v, mask, is_causal, backend, call.scale, call.dropout_p)
    return _merge_heads(out, call.fmt)


def _padding_mask(valid_q, valid_kv, band: Band, len_q, len_kv) -> torch.Tensor:
    """bool [b, 1, sq, skv]: padded keys, padded queries (whole rows: their output is 0) and the band."""
    b, sq = valid_q.shape
    skv = valid_kv.shape[1]
    mask = ~valid_kv.view(b, 1, 1, skv) | ~valid_q.view(b, 1, sq, 1)
    return mask_union(mask, band_mask(band, len_q, len_kv, sq, skv, valid_q.device))


def _run_dense_packed(call: Call, batch: Batch, backend: str) -> torch.Tensor:
    """thd through a dense kernel: pad each sequence to the longest, attend, take the real rows back."""
    p = batch.packed
    q, k, v = _compact(batch)
    seq_q, pos_q = vl.token_positions(p.cu_q, q.shape[0])
    seq_kv, pos_kv = vl.token_positions(p.cu_kv, k.shape[0])
    b, sq, skv = p.batch, max(p.max_q, 1), max(p.max_kv, 1)
    qd = vl.to_dense(q, seq_q, pos_q, b, sq)
    kd, vd = (vl.to_dense(t, seq_kv, pos_kv, b, skv) for t in (k, v))
    len_q, len_kv = vl.lengths_of(p.cu_q), vl.lengths_of(p.cu_kv)
    mask = _padding_mask(vl.valid_from_lengths(len_q, sq), vl.valid_from_lengths(len_kv, skv), call.band, len_q, len_kv)
    out = vl.from_dense(dense_attention(qd, kd, vd, mask, False, backend, call.scale, call.dropout_p), seq_q, pos_q)
    return _uncompact(out, batch).flatten(1)


def _compact(batch: Batch):
    """thd with gaps between sequences -> the real tokens only."""
    q, k, v = batch.q, batch.k, batch.v
    if batch.rows_q is not None:
        q = q.index_select(0, batch.rows_q)
    if batch.rows_kv is not None:
        k, v = k.index_select(0, batch.rows_kv), v.index_select(0, batch.rows_kv)
    return q, k, v


def _uncompact(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    if batch.rows_q is None:
        return out
    return out.new_zeros(batch.q.shape[0], *out.shape[1:]).index_copy(0, batch.rows_q, out)


# -- varlen kernels --------------------------------------------------------------------------------

def _to_packed(call: Call, batch: Batch):
    """-> (q [t_q, h, d], k, v [t_kv, g, d], Packed, restore: packed output -> the caller's layout)."""
    if batch.kind == "packed":
        q, k, v = _compact(batch)
        return q, k, v, batch.packed, lambda out: _uncompact(out, batch).flatten(1)
    fmt = call.fmt
    s_dim = 0 if fmt == "sbhd" else 1
    b, sq, skv = batch.q.shape[1 - s_dim], batch.q.shape[s_dim], batch.k.shape[s_dim]
    if batch.kind == "dense":
        rows_q = rows_kv = None
        len_q = torch.full((b,), sq, dtype=torch.int32, device=batch.q.device)
        len_kv = torch.full((b,), skv, dtype=torch.int32, device=batch.q.device)
    else:
        rows_q = vl.valid_rows(batch.valid_q, fmt)
        rows_kv = rows_q if batch.valid_kv is batch.valid_q else vl.valid_rows(batch.valid_kv, fmt)
        len_q = batch.valid_q.sum(1, dtype=torch.int32)
        len_kv = len_q if batch.valid_kv is batch.valid_q else batch.valid_kv.sum(1, dtype=torch.int32)
    cu_q = vl.cu_from_lengths(len_q)
    cu_kv = cu_q if len_kv is len_q or (batch.kind == "dense" and sq == skv) else vl.cu_from_lengths(len_kv)
    packed = vl.Packed(cu_q, cu_kv, sq, skv, batch.same_lengths)
    q = vl.unpad(batch.q, fmt, rows_q)
    k, v = (vl.unpad(t, fmt, rows_kv) for t in (batch.k, batch.v))

    def restore(out: torch.Tensor) -> torch.Tensor:
        full = vl.pad(out, fmt, rows_q, b, sq)
        return full.reshape(*full.shape[:2], -1)
    return q, k, v, packed, restore


# -- building a Batch from the layer's arguments ---------------------------------------------------

PADDING_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")


def make_batch(owner: str, fmt: str, q, k, v, mask_type: str, band: Band, attention_mask, cu_q, cu_kv,
               cu_q_padded, cu_kv_padded, max_q, max_kv) -> Batch:
    if fmt == "thd":
        return _packed_batch(owner, q, k, v, band, cu_q, cu_kv, cu_q_padded, cu_kv_padded, max_q, max_kv)
    if mask_type in PADDING_TYPES:
        return _padded_batch(owner, fmt, q, k, v, band, attention_mask, cu_q, cu_kv)
    s_dim = 0 if fmt == "sbhd" else 1
    same = q.shape[s_dim] == k.shape[s_dim]
    if mask_type != "arbitrary":
        return Batch("dense", q, k, v, same_lengths=same)  # TE ignores attention_mask here (Megatron passes one)
    if attention_mask is None:
        raise ValueError(f"{owner}: attn_mask_type='arbitrary' needs attention_mask [batch|1, heads|1, s_q, s_kv] (True = masked out)")
    b, h = q.shape[1 - s_dim], q.shape[2]
    _check_mask_shape(attention_mask, (b, h, q.shape[s_dim], k.shape[s_dim]), "arbitrary attention_mask")
    return Batch("dense", q, k, v, arbitrary=attention_mask, same_lengths=same)


def _check_mask_shape(mask, want, what: str) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or any(
            m not in (1, w) for m, w in zip(mask.shape, want)):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{what} must be a bool tensor broadcastable to [batch, heads, s_q, s_kv] = {list(want)} "
                         f"(True = masked out), got {got}")


def _needs_alignment(band: Band) -> bool:
    return not band.bottom_right and not band.full


def _padded_batch(owner: str, fmt: str, q, k, v, band: Band, attention_mask, cu_q, cu_kv) -> Batch:
    s_dim = 0 if fmt == "sbhd" else 1
    b, sq, skv = q.shape[1 - s_dim], q.shape[s_dim], k.shape[s_dim]
    if cu_q is not None:  # TE: sequence lengths as cu_seqlens instead of a mask, valid tokens first
        cu_kv = cu_q if cu_kv is None else cu_kv
        for name, cu, s in (("cu_seqlens_q", cu_q, sq), ("cu_seqlens_kv", cu_kv, skv)):
            vl.check_cu_seqlens(owner, name, cu, q.device)
            if cu.numel() != b + 1:
                raise ValueError(f"{owner}: {name} must have batch + 1 = {b + 1} entries, got {cu.numel()}")
            if cu.device.type == "cpu":
                vl.seqlen_stats(owner, name, cu, int(cu[-1]))
                if int(vl.lengths_of(cu).max()) > s:
                    raise ValueError(f"{owner}: {name} has a sequence longer than the padded length {s}")
        valid_q = vl.valid_from_lengths(vl.lengths_of(cu_q), sq)
        valid_kv = valid_q if cu_kv is cu_q and sq == skv else vl.valid_from_lengths(vl.lengths_of(cu_kv), skv)
    elif attention_mask is None:
        raise ValueError(f"{owner}: padding masks need attention_mask [batch, 1, 1, s] (True = padding), a "
                         f"(q_mask, kv_mask) pair for cross attention, or cu_seqlens_q/cu_seqlens_kv")
    elif isinstance(attention_mask, (tuple, list)):
        q_mask, kv_mask = attention_mask
        _check_mask_shape(q_mask, (b, 1, 1, sq), "padding attention_mask[0] (queries)")
        _check_mask_shape(kv_mask, (b, 1, 1, skv), "padding attention_mask[1] (keys)")
        valid_q, valid_kv = ~q_mask.expand(b, 1, 1, sq).reshape(b, sq), ~kv_mask.expand(b, 1, 1, skv).reshape(b, skv)
    else:
        _check_mask_shape(attention_mask, (b, 1, 1, skv), "padding attention_mask")
        if sq != skv:
            raise ValueError(f"{owner}: one padding mask serves self-attention (s_q == s_kv); for s_q={sq}, s_kv={skv} "
                             f"pass a (q_mask [b, 1, 1, s_q], kv_mask [b, 1, 1, s_kv]) pair")
        valid_q = valid_kv = ~attention_mask.expand(b, 1, 1, sq).reshape(b, sq)
    same = valid_kv is valid_q
    if not same and _needs_alignment(band):
        same = bool(torch.equal(valid_q.sum(1), valid_kv.sum(1)))
    return Batch("padded", q, k, v, valid_q=valid_q, valid_kv=valid_kv, same_lengths=same)


def _packed_batch(owner: str, q, k, v, band: Band, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv) -> Batch:
    if cu_q is None:
        raise ValueError(f"{owner}: qkv_format='thd' needs cu_seqlens_q (int32 [batch + 1], the running token count)"
                         f" and, for cross attention, cu_seqlens_kv")
    cu_kv = cu_q if cu_kv is None else cu_kv
    if cu_kv is cu_q and cu_kv_pad is None:
        cu_kv_pad = cu_q_pad
    vl.check_cu_seqlens(owner, "cu_seqlens_q", cu_q, q.device)
    vl.check_cu_seqlens(owner, "cu_seqlens_kv", cu_kv, q.device)
    vl.check_pair(owner, cu_q, cu_kv)
    rows_q = _gap_rows(owner, "q", cu_q, cu_q_pad, q.shape[0])
    rows_kv = rows_q if cu_kv is cu_q and cu_kv_pad is cu_q_pad else _gap_rows(owner, "kv", cu_kv, cu_kv_pad, k.shape[0])
    t_q = q.shape[0] if rows_q is None else rows_q.numel()
    t_kv = k.shape[0] if rows_kv is None else rows_kv.numel()
    if cu_kv is cu_q and t_kv != t_q:
        raise ValueError(f"{owner}: key/value have {t_kv} tokens and the query {t_q}; give cu_seqlens_kv for cross attention")
    max_q = vl.resolve_max(owner, "cu_seqlens_q", cu_q, t_q, max_q)
    max_kv = max_q if cu_kv is cu_q and max_kv is None else vl.resolve_max(owner, "cu_seqlens_kv", cu_kv, t_kv, max_kv)
    same = cu_kv is cu_q
    if not same and _needs_alignment(band):
        same = bool(torch.equal(cu_q, cu_kv))
    packed = vl.Packed(cu_q, cu_kv, max_q, max_kv, same)
    return Batch("packed", q, k, v, packed=packed, rows_q=rows_q, rows_kv=rows_kv, same_lengths=same)


def _gap_rows(owner: str, side: str, cu, cu_pad, rows: int) -> Optional[torch.Tensor]:
    """Rows of the real tokens when sequences start at cu_seqlens_{side}_padded (None: no gaps)."""
    if cu_pad is None or cu_pad is cu:
        return None
    name = f"cu_seqlens_{side}_padded"
    vl.check_cu_seqlens(owner, name, cu_pad, cu.device)
    if cu_pad.numel() != cu.numel():
        raise ValueError(f"{owner}: {name} must have as many entries as cu_seqlens_{side} ({cu.numel()}), got {cu_pad.numel()}")
    vl.seqlen_stats(owner, name, cu_pad, rows)
    if torch.equal(cu, cu_pad):
        return None
    if bool(((cu[1:] - cu[:-1]) > (cu_pad[1:] - cu_pad[:-1])).any()):
        raise ValueError(f"{owner}: each sequence of cu_seqlens_{side} must fit in its slot of {name}")
    return vl.compact_rows(cu, cu_pad)


# -- q, k, v as views of a fused projection's output -----------------------------------------------

class _SplitViews(torch.autograd.Function):
    """mixed -> the views q, k, v that `views(mixed)` gives (together they tile it). Backward: when the three
    gradients are the same views of one tensor shaped like mixed (the cuDNN frontend's dense attention
    writes them so), that tensor is mixed's gradient, with no copy; else `join` concatenates them."""

    @staticmethod
    def forward(ctx, mixed, views, join):
        parts = views(mixed)
        ctx.shape, ctx.join, ctx.like = mixed.shape, join, dict(dtype=mixed.dtype, device=mixed.device)
        ctx.geometry = tuple((t.shape, t.stride(), t.storage_offset() - mixed.storage_offset()) for t in parts)
        return parts

    @staticmethod
    def backward(ctx, *grads):
        base = grads[0]._base if grads[0] is not None else None  # (mixed's own base may be 2-D: the GEMM's output)
        if (base is not None and base.numel() == ctx.shape.numel() and base.is_contiguous()
                and all(g is not None and g._base is base and (g.shape, g.stride(), g.storage_offset() - base.storage_offset()) == geo
                        for g, geo in zip(grads, ctx.geometry))):
            return base.view(ctx.shape), None, None
        grads = [torch.zeros(shape, **ctx.like) if g is None else g for g, (shape, _, _) in zip(grads, ctx.geometry)]
        return ctx.join(*grads), None, None


def split_views(mixed: torch.Tensor, views, join):
    """q, k, v = views(mixed) whose gradients come back joined without a copy when the attention kernel
    writes them into one tensor (see _SplitViews); `join(dq, dk, dv)` builds mixed's gradient otherwise."""
    return _SplitViews.apply(mixed, views, join)
