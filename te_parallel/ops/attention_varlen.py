"""Ragged attention pieces: cu_seqlens checks, packing and unpacking of tokens, and flash-attention's
varlen kernels ("flash_varlen") as an autograd Function.

Conventions (TE's): cu_seqlens is int32 [batch + 1], 0 first, non-decreasing, last = the token count;
sequence i holds tokens [cu[i], cu[i+1]). Zero-length sequences are allowed. A padded bshd/sbhd batch
has its valid tokens first in each row (right padding), as TE assumes when it turns a padding mask into
cu_seqlens.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from te_parallel.ops.attention import Band


@dataclass(frozen=True)
class Packed:
    """Sequence boundaries of a packed batch: cu_q/cu_kv int32 [b + 1] on the tensors' device and upper
    bounds of the per-sequence lengths (the kernels size their grids with them)."""
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int
    same_lengths: bool  # cu_q and cu_kv hold the same values (self-attention)

    @property
    def batch(self) -> int:
        return self.cu_q.numel() - 1


def check_cu_seqlens(owner: str, name: str, cu, device) -> None:
    """Dtype, shape and device; the values are checked by `seqlen_stats`."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{owner}: {name} must be an int32 tensor [batch + 1] (0, then the running token count), "
                         f"got {got}; build it with dtype=torch.int32")
    if cu.device != device:
        raise ValueError(f"{owner}: {name} must be on {device} like the inputs, got {cu.device}")


def check_pair(owner: str, cu_q: torch.Tensor, cu_kv: torch.Tensor, suffix: str = "") -> None:
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(f"{owner}: cu_seqlens_q{suffix} and cu_seqlens_kv{suffix} must both be [batch + 1]; "
                         f"got {cu_q.numel()} and {cu_kv.numel()} entries")


def seqlen_stats(owner: str, name: str, cu: torch.Tensor, tokens: int) -> int:
    """Check the values of cu (one host read) and return the longest sequence."""
    steps = cu[1:] - cu[:-1]
    first, last, low, high = torch.stack([cu[0], cu[-1], steps.min(), steps.max()]).tolist()
    if first != 0 or low < 0 or last != tokens:
        raise ValueError(f"{owner}: {name} must start at 0, never decrease and end at the token count {tokens}; "
                         f"got first {first}, last {last}, smallest step {low}")
    return high


def resolve_max(owner: str, name: str, cu: torch.Tensor, tokens: int, given: Optional[int]) -> int:
    """max_seqlen: the caller's (values then unchecked on CUDA: no host sync), else read from cu. On the
    CPU the values are always checked (no sync to avoid)."""
    if given is not None:
        if isinstance(given, torch.Tensor) and given.numel() == 1 and not given.is_floating_point():
            given = int(given)  # (Megatron may hand a tensor; reading it is a host sync)
        if not isinstance(given, numbers.Integral) or given < 0:
            raise ValueError(f"{owner}: max_seqlen for {name} must be an int >= 0, got {given!r}")
        given = int(given)
        if cu.device.type == "cpu":
            high = seqlen_stats(owner, name, cu, tokens)
            if high > given:
                raise ValueError(f"{owner}: {name} has a sequence of {high} tokens, more than its max_seqlen {given}")
        return given
    return seqlen_stats(owner, name, cu, tokens)


def lengths_of(cu: torch.Tensor) -> torch.Tensor:
    return cu[1:] - cu[:-1]


def cu_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def token_positions(cu: torch.Tensor, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, position within the sequence) of each of the `tokens` packed tokens (no host sync)."""
    t = torch.arange(tokens, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:].long(), t, right=True)
    return seq, t - cu.long()[seq]


# -- bshd / sbhd rows <-> packed tokens ------------------------------------------------------------

def token_rows(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """[s, b, h, d] ("sbhd") or [b, s, h, d] ("bshd") -> [s·b or b·s, h, d] (a view when contiguous)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def valid_rows(valid: torch.Tensor, fmt: str) -> torch.Tensor:
    """valid bool [b, s] -> indices into `token_rows` of the valid tokens, sequence by sequence."""
    b, s = valid.shape
    idx = valid.reshape(-1).nonzero().squeeze(1)  # b-major: row = b_i · s + s_i
    return idx if fmt == "bshd" else (idx % s) * b + idx // s


def unpad(t: torch.Tensor, fmt: str, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """bshd/sbhd -> packed [tokens, h, d]; rows None = every token (bshd: a view)."""
    if rows is None:
        return token_rows(t if fmt == "bshd" else t.transpose(0, 1), "bshd")
    return token_rows(t, fmt).index_select(0, rows)


def pad(out: torch.Tensor, fmt: str, rows: Optional[torch.Tensor], b: int, s: int) -> torch.Tensor:
    """packed [tokens, h, d] -> [b, s, h, d] or [s, b, h, d]; padded rows are zero (TE's output)."""
    if rows is None:
        full = out.view(b, s, *out.shape[1:])
        return full if fmt == "bshd" else full.transpose(0, 1)
    full = out.new_zeros(b * s, *out.shape[1:]).index_copy(0, rows, out)
    return full.view(b, s, *out.shape[1:]) if fmt == "bshd" else full.view(s, b, *out.shape[1:])


def compact_rows(cu: torch.Tensor, cu_padded: torch.Tensor) -> torch.Tensor:
    """Rows of the valid tokens of a thd batch with gaps between sequences (TE's cu_seqlens_padded):
    sequence i holds rows [cu_padded[i], cu_padded[i] + len_i). One host read (the token count)."""
    tokens = int(cu[-1])
    seq, pos = token_positions(cu, tokens)
    return cu_padded.long()[seq] + pos


# -- packed tokens <-> a padded dense batch (for the dense kernels) --------------------------------

def to_dense(t: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """packed [tokens, h, d] -> [b, h, s, d] with zeros after each sequence."""
    dense = t.new_zeros(b, s, *t.shape[1:])
    dense = dense.index_put((seq, pos), t)
    return dense.transpose(1, 2)


def from_dense(out: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> packed [tokens, h, d]."""
    return out.transpose(1, 2)[seq, pos]


def valid_from_lengths(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """bool [b, s]: position < length."""
    return torch.arange(s, device=lengths.device).view(1, s) < lengths.view(-1, 1)


# -- flash-attention varlen ------------------------------------------------------------------------

def flash_window(band: Band, same_lengths: bool) -> Tuple[int, int]:
    """flash-attention's (window_size_left, window_size_right): bottom-right aligned, -1 unbounded; a
    top-left band is the same thing when every sequence has s_q == s_kv."""
    if not (band.bottom_right or same_lengths or band.full):
        raise ValueError("flash_varlen aligns causal masks and windows bottom-right; this input needs top-left "
                         "with s_q != s_kv")
    return band.left, band.right


class FlashVarlenFunction(torch.autograd.Function):
    """out = softmax(q·kᵀ·scale + band) · v per sequence; q [t_q, h, d], k/v [t_kv, g, d] (GQA native).

    Forward: aten._flash_attention_forward on cu_seqlens; it returns the log-sum-exp [h, t_q] and the
    Philox state of its dropout, both kept for the backward (aten._flash_attention_backward), which
    replays the same dropout mask."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, scale: float, left: int, right: int,
                dropout_p: float):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p, left < 0 and right == 0, False,
            scale=scale, window_size_left=left, window_size_right=right)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rng_state, unused)
        ctx.args = (max_q, max_kv, dropout_p, scale, left, right)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_kv, rng_state, unused = ctx.saved_tensors
        max_q, max_kv, dropout_p, scale, left, right = ctx.args
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, dropout_p,
            left < 0 and right == 0, rng_state, unused, scale=scale, window_size_left=left, window_size_right=right)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_varlen(q, k, v, packed: Packed, band: Band, scale: float, dropout_p: float) -> torch.Tensor:
    left, right = flash_window(band, packed.same_lengths)
    return FlashVarlenFunction.apply(q, k, v, packed.cu_q.contiguous(), packed.cu_kv.contiguous(), max(packed.max_q, 1),
                                     max(packed.max_kv, 1), scale, left, right, dropout_p)
