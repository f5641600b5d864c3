"""The CPU emulation of cuDNN's FP8 attention kernels (te_parallel.ops.attention_fp8): the kernels' arithmetic in
torch at a chosen precision (fp32 on CPU and as the GPU tests' second opinion; fp64 as the tests' reference of
the same quantization). It knows FP8 bytes, descales and scales; where the scales come from is
te_parallel.ops.attention_fp8_state's.

Forward: S = Q·Kᵀ·attn_scale from the dequantized FP8 inputs; P = exp(S - row max) quantized with the fixed
scale_s = fp8_max(forward dtype) (P lies in [0, 1], so the bound is exact) and multiplied by V; divided by the
row sum of the unquantized P; O quantized with its scale. P is taken relative to the row's final max (the
kernels' running max is per tile of keys; the two agree for rows whose max is in the first tile and differ
by FP8 rounding otherwise). Backward: P = exp(S - LSE) recomputed and quantized with scale_s for
dV = Pᵀ·dO; dS = P ∘ (dP - rowsum(dO ∘ O)) from the dequantized FP8 dO and O, quantized with scale_dP for
dQ = dS·K and dK = dSᵀ·Q (attn_scale applied after the GEMMs); dQ, dK, dV quantized.

Layout: [b, n, s, d] tensors (any strides), GQA through k/v with g heads serving h/g query heads each.
"""
from __future__ import annotations

import torch

from te_parallel.ops.attention import Band, band_mask
from te_parallel.recipe import fp8_max

__all__ = ["to_fp8", "emulate_forward", "emulate_backward"]


def to_fp8(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """cast(x · scale) with saturation to ±fp8_max (the kernels' satfinite conversion)."""
    limit = fp8_max(dtype)
    return (x * scale).clamp(-limit, limit).to(dtype)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, h, s, d] (each KV group serves h/g query heads)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _reduce_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, g, s, d]: the gradient of _expand."""
    b, h, s, d = t.shape
    return t if h == groups else t.view(b, groups, h // groups, s, d).sum(2)


def _scores(qd, kd, attn_scale: float, band: Band):
    s = torch.matmul(qd, kd.transpose(-1, -2)) * attn_scale
    mask = band_mask(band, None, None, s.shape[-2], s.shape[-1], s.device)
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def emulate_forward(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, attn_scale: float, band: Band,
                    compute: torch.dtype = torch.float32):
    """q8 [b, h, s_q, d], k8/v8 [b, g, s_kv, d] FP8 (any strides) -> (o8 [b, h, s_q, d] FP8 of q8's dtype,
    stats [b, h, s_q, 1] fp32 log-sum-exp, amax_o fp32 0-d), in `compute` precision (module doc)."""
    h, fwd = q8.shape[1], q8.dtype
    scale_s = fp8_max(fwd)
    qd = q8.to(compute) * descale_q.to(compute)
    kd = _expand(k8.to(compute) * descale_k.to(compute), h)
    vd = _expand(v8.to(compute) * descale_v.to(compute), h)
    s = _scores(qd, kd, attn_scale, band)
    m = s.amax(-1, keepdim=True)
    empty = torch.isneginf(m)  # a row with no key (bottom-right with s_q > s_kv)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    l = p.sum(-1, keepdim=True)
    pq = to_fp8(p, scale_s, fwd).to(compute) / scale_s
    o = torch.matmul(pq, vd) / torch.where(empty, torch.ones_like(l), l)
    amax_o = o.abs().amax().to(torch.float32)
    o8 = to_fp8(o, scale_o.to(compute), fwd)
    stats = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log(l)).to(torch.float32)
    return o8, stats, amax_o


def emulate_backward(q8, k8, v8, o8, do8, stats, descales, scales, attn_scale: float, band: Band,
                     compute: torch.dtype = torch.float32):
    """The backward of emulate_forward: do8 [b, h, s_q, d] FP8 (the backward dtype); descales (q, k, v, o, dO)
    and scales (dP, dQ, dK, dV): fp32 0-d tensors. -> ((dq8, dk8, dv8) FP8 of do8's dtype, (amax_dP, amax_dQ,
    amax_dK, amax_dV) fp32 0-d)."""
    h, g, fwd, bwd = q8.shape[1], k8.shape[1], q8.dtype, do8.dtype
    dsc_q, dsc_k, dsc_v, dsc_o, dsc_do = (t.to(compute) for t in descales)
    sc_dp, sc_dq, sc_dk, sc_dv = (t.to(compute) for t in scales)
    scale_s = fp8_max(fwd)
    qd = q8.to(compute) * dsc_q
    kd = _expand(k8.to(compute) * dsc_k, h)
    vd = _expand(v8.to(compute) * dsc_v, h)
    do = do8.to(compute) * dsc_do
    o = o8.to(compute) * dsc_o
    p = torch.exp(_scores(qd, kd, attn_scale, band) - stats.to(compute))  # normalised P from the forward's LSE
    pq = to_fp8(p, scale_s, fwd).to(compute) / scale_s
    dv = _reduce_groups(torch.matmul(pq.transpose(-1, -2), do), g)
    dp = torch.matmul(do, vd.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    amax_dp = ds.abs().amax()
    dsq = to_fp8(ds, sc_dp, bwd).to(compute) / sc_dp
    dq = torch.matmul(dsq, kd) * attn_scale
    dk = _reduce_groups(torch.matmul(dsq.transpose(-1, -2), qd), g) * attn_scale
    amaxes = tuple(t.abs().amax().to(torch.float32) for t in (dq, dk, dv))
    grads = tuple(to_fp8(t, sc, bwd) for t, sc in ((dq, sc_dq), (dk, sc_dk), (dv, sc_dv)))
    return grads, (amax_dp.to(torch.float32),) + amaxes
