"""Attention of one block of queries against one block of keys that also returns the softmax statistics
(the log-sum-exp of each query's scores), the merge of such partial results, and the matching backward.

Context parallelism splits one attention into blocks of keys. Over the blocks b of one query row,

    lse = log Σ_b exp(lse_b)                  out = Σ_b exp(lse_b − lse) · out_b

is exactly softmax over all the keys times V (each out_b being softmax over block b's keys times its V).
The backward of block b needs only the merged statistics: with P_b = exp(S_b − lse) (S the scaled
scores) and D = rowsum(dO ∘ O) of the merged output O,

    dV_b = P_bᵀ dO     dS_b = P_b ∘ (dO V_bᵀ − D)     dQ += dS_b K_b · scale     dK_b = dS_bᵀ Q · scale

which is flash-attention's backward called with the merged `out` and `lse` in place of the block's own.

Layouts (GQA: g may be smaller than h):
  dense   q [b, s_q, h, d], k/v [b, s_kv, g, d]; out [b, s_q, h, d], lse [b, s_q, h];
  packed  q [t_q, h, d], k/v [t_kv, g, d] with cu_seqlens (BlockMask.cu_q/cu_kv); out [t_q, h, d], lse [t_q, h].
lse (and the math kernel's out) is in fp32, or fp64 for fp64 inputs; a query that sees no key has lse = −inf
and output 0.

The kernel rule (`lse_kernel`, the one place that picks): CUDA fp16/bf16, head_dim a multiple of 8 up to
256, sm_80+: flash-attention through aten (`_flash_attention_forward/backward`, varlen form: its LSE is
[h, t]); anything else: "math" (the formulas above in fp32 or wider).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from te_parallel.ops.attention import Band, band_mask
from te_parallel.ops.attention_varlen import from_dense, lengths_of, to_dense, token_positions

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BlockMask:
    """Which keys each query of a block sees: per sequence, keys j in [p − left, p + right] (−1 =
    unbounded) with p = i + len_kv − len_q (bottom-right aligned: a causal diagonal is (−1, 0), and for
    equal lengths it is the usual top-left one). cu_q/cu_kv (int32 [n + 1]) mark the sequences of packed
    tokens, max_q/max_kv bound their lengths; None: dense tensors [b, s, ...]."""
    left: int = -1
    right: int = -1
    cu_q: Optional[torch.Tensor] = None
    cu_kv: Optional[torch.Tensor] = None
    max_q: int = 0
    max_kv: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_q is not None


def lse_kernel(q: torch.Tensor) -> str:
    """"flash" or "math" (see the module docstring)."""
    if (q.is_cuda and q.dtype in _HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        return "flash"
    return "math"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the dtype of the statistics and of the merge."""
    return torch.promote_types(dtype, torch.float32)


def block_forward(q, k, v, mask: BlockMask, scale: float):
    """-> (out, lse, aux): out like q (fp32 or wider from "math", q's dtype from "flash"), lse [.., h] in
    fp32 or wider, aux what block_backward needs of this call."""
    if q.numel() == 0 or k.numel() == 0:
        acc = acc_dtype(q.dtype)
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], float("-inf"), dtype=acc), ()
    if lse_kernel(q) == "flash":
        return _flash_forward(q, k, v, mask, scale)
    out, lse = _math(q, k, v, mask, scale)
    return out, lse, ()


def block_backward(dout, q, k, v, out, lse, aux, mask: BlockMask, scale: float):
    """Gradients of one block given the merged out and lse of its query rows -> (dq, dk, dv)."""
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if lse_kernel(q) == "flash":
        return _flash_backward(dout, q, k, v, out, lse, aux, mask, scale)
    return _math(q, k, v, mask, scale, grad=(dout, out, lse))


# -- merging ---------------------------------------------------------------------------------------

def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold one block's (out_b, lse_b) into the running (out, lse), in place; out/lse in fp32 or wider.
    Rows that have seen no key yet (lse = −inf) stay 0 until a block brings one."""
    new = torch.logaddexp(lse, lse_b)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # −inf − −inf would be NaN
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(out_b.to(out.dtype) * torch.exp(lse_b - base).unsqueeze(-1))
    lse.copy_(new)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The merged (out, lse) of partial results over disjoint sets of keys (fp32 or wider)."""
    acc = acc_dtype(outs[0].dtype)
    out = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
    lse = torch.full(lses[0].shape, float("-inf"), dtype=acc, device=lses[0].device)
    for o, s in zip(outs, lses):
        merge_(out, lse, o, s.to(acc))
    return out, lse


# -- math ------------------------------------------------------------------------------------------

def _math(q, k, v, mask: BlockMask, scale: float, grad=None):
    """Forward (grad None) -> (out, lse); backward (grad = (dout, out, lse)) -> (dq, dk, dv)."""
    acc = acc_dtype(q.dtype)
    if mask.packed:
        seq_q, pos_q = token_positions(mask.cu_q, q.shape[0])
        seq_kv, pos_kv = token_positions(mask.cu_kv, k.shape[0])
        b, sq, skv = mask.cu_q.numel() - 1, max(mask.max_q, 1), max(mask.max_kv, 1)
        len_q, len_kv = lengths_of(mask.cu_q), lengths_of(mask.cu_kv)
        qd = to_dense(q.to(acc), seq_q, pos_q, b, sq)                  # [b, h, sq, d]
        kd, vd = (to_dense(t.to(acc), seq_kv, pos_kv, b, skv) for t in (k, v))
        hidden = torch.arange(skv, device=q.device).view(1, 1, 1, skv) >= len_kv.view(-1, 1, 1, 1)
        band = _band(mask, len_q, len_kv, sq, skv, q.device)
        masked = hidden if band is None else hidden | band
        to_rows = lambda t: from_dense(t, seq_q, pos_q)                 # [b, h, sq, ..] -> [t_q, h, ..]
        to_rows_kv = lambda t: from_dense(t, seq_kv, pos_kv)
    else:
        qd, kd, vd = (t.to(acc).transpose(1, 2) for t in (q, k, v))    # [b, h|g, s, d]
        sq, skv = qd.shape[2], kd.shape[2]
        masked = _band(mask, None, None, sq, skv, q.device)
        to_rows = to_rows_kv = lambda t: t.transpose(1, 2)
    rep = qd.shape[1] // kd.shape[1]
    kr, vr = (t.repeat_interleave(rep, 1) if rep > 1 else t for t in (kd, vd))
    scores = torch.matmul(qd, kr.transpose(-2, -1)) * scale           # [b, h, sq, skv]
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    if grad is None:
        lse = torch.logsumexp(scores, -1)                             # [b, h, sq]; −inf: no key
        probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
        out = torch.matmul(probs, vr)
        return to_rows(out), to_rows(lse.unsqueeze(-1)).squeeze(-1)
    dout, out, lse = grad
    if mask.packed:
        do, o = (to_dense(t.to(acc), seq_q, pos_q, b, sq) for t in (dout, out))
        lse_d = to_dense(lse.to(acc).unsqueeze(-1), seq_q, pos_q, b, sq).squeeze(-1)
    else:
        do, o = (t.to(acc).transpose(1, 2) for t in (dout, out))
        lse_d = lse.to(acc).transpose(1, 2)
    probs = torch.exp(scores - _finite(lse_d).unsqueeze(-1))          # P with the merged statistics (0 where masked)
    delta = (do * o).sum(-1, keepdim=True)                            # D = rowsum(dO ∘ O)
    dv = torch.matmul(probs.transpose(-2, -1), do)
    ds = probs * (torch.matmul(do, vr.transpose(-2, -1)) - delta)
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qd) * scale
    if rep > 1:  # GQA: sum the gradients of the query heads that share a key head
        dk, dv = (t.view(t.shape[0], -1, rep, *t.shape[2:]).sum(2) for t in (dk, dv))
    return to_rows(dq), to_rows_kv(dk), to_rows_kv(dv)


def _band(mask: BlockMask, len_q, len_kv, sq: int, skv: int, device) -> Optional[torch.Tensor]:
    return band_mask(Band(True, mask.left, mask.right), len_q, len_kv, sq, skv, device)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with −inf (rows without keys) as 0, so exp(−inf − lse) is 0 rather than NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


# -- flash-attention (CUDA) ------------------------------------------------------------------------

def _packed_args(q, k, v, mask: BlockMask):
    """The varlen kernel's inputs: tokens [t, h, d] and cu_seqlens (dense blocks: b sequences of s)."""
    if mask.packed:
        return q, k, v, mask.cu_q, mask.cu_kv, max(mask.max_q, 1), max(mask.max_kv, 1)
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    steps = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    q, k, v = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))
    return q, k, v, steps * sq, steps * skv, sq, skv


def _flash_forward(q, k, v, mask: BlockMask, scale: float):
    shape = q.shape
    qp, kp, vp, cu_q, cu_kv, max_q, max_kv = _packed_args(q, k, v, mask)
    qp, kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (qp, kp, vp))
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        qp, kp, vp, cu_q, cu_kv, max_q, max_kv, 0.0, mask.left < 0 and mask.right == 0, False, scale=scale,
        window_size_left=mask.left, window_size_right=mask.right)
    rows = _lse_rows(lse, cu_q, qp.shape[0])
    rows = rows.masked_fill(torch.isposinf(rows), float("-inf"))  # flash marks a row without keys +inf
    return out.view(shape), rows.reshape(*shape[:-1]), (rng_state, unused, lse.dim())


def _flash_backward(dout, q, k, v, out, lse, aux, mask: BlockMask, scale: float):
    rng_state, unused, lse_dims = aux
    qp, kp, vp, cu_q, cu_kv, max_q, max_kv = _packed_args(q, k, v, mask)
    qp, kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (qp, kp, vp))
    rows = lambda t: t.reshape(-1, *t.shape[-2:]).to(q.dtype).contiguous()
    lse_k = lse.reshape(-1, lse.shape[-1]).float()
    lse_k = _lse_kernel_layout(lse_k.masked_fill(torch.isneginf(lse_k), float("inf")), cu_q, max_q, lse_dims)  # +inf: P = 0
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        rows(dout), qp, kp, vp, rows(out), lse_k, cu_q, cu_kv, max_q, max_kv, 0.0, mask.left < 0 and mask.right == 0,
        rng_state, unused, scale=scale, window_size_left=mask.left, window_size_right=mask.right)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _lse_rows(lse: torch.Tensor, cu_q: torch.Tensor, tokens: int) -> torch.Tensor:
    """The varlen kernel's LSE, [h, t] (or [b, h, max_q] padded per sequence) -> [t, h]."""
    if lse.dim() == 2:
        return lse.t()
    seq, pos = token_positions(cu_q, tokens)
    return lse[seq, :, pos]


def _lse_kernel_layout(rows: torch.Tensor, cu_q: torch.Tensor, max_q: int, dims: int) -> torch.Tensor:
    """[t, h] -> the layout the kernel returned ([h, t], or [b, h, max_q])."""
    if dims == 2:
        return rows.t().contiguous()
    seq, pos = token_positions(cu_q, rows.shape[0])
    out = rows.new_full((cu_q.numel() - 1, rows.shape[1], max_q), float("inf"))
    out[seq, :, pos] = rows
    return out
