"""Rotary position embedding on q / k: one fused kernel on CUDA (te_parallel.native.rope), torch ops
elsewhere.

out = t·cos(f) + rotate_half(t)·sin(f) on the first rot channels of each head (rotate_half(t) = [-t2, t1],
t1 / t2 the halves of those channels), the other channels unchanged. The kernel computes in fp32 and
rounds once (as TE's fused RoPE); the torch path rounds each product and the sum to t's dtype. The
kernel's backward is the transpose of the same map, with no gradient for the angles.
"""
from __future__ import annotations

import torch

from te_parallel.native import rope as native_rope


def rope_torch(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """t [..., D] rotated by the angles f [..., rot] (broadcast against t's leading dims), in torch ops."""
    rot = f.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = f.cos().to(t.dtype), f.sin().to(t.dtype)
    t1, t2 = t_rot.chunk(2, dim=-1)
    out = t_rot * cos + torch.cat([-t2, t1], dim=-1) * sin
    return torch.cat([out, t_pass], dim=-1) if t_pass.shape[-1] else out


class _RopeFunction(torch.autograd.Function):
    """t viewed as [S, B, H, D] (sbhd: t itself; bshd: t.transpose(0, 1)) rotated by angles [S, rot];
    the result has t's layout."""

    @staticmethod
    def forward(ctx, t, angles, bshd: bool):
        ctx.angles, ctx.bshd = angles, bshd
        return _run(t, angles, bshd, backward=False)

    @staticmethod
    def backward(ctx, grad):
        if grad.stride(-1) != 1:  # (the kernel reads rows of D contiguous elements)
            grad = grad.contiguous()
        return _run(grad, ctx.angles, ctx.bshd, backward=True), None, None


def _run(t: torch.Tensor, angles: torch.Tensor, bshd: bool, backward: bool) -> torch.Tensor:
    if not bshd:
        return native_rope.rope(t, angles, backward)  # [s, b, h, d], contiguous
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # [b, s, h, d], contiguous
    native_rope.rope(t.transpose(0, 1), angles, backward, out=out.transpose(0, 1))
    return out


def _kernel_angles(freqs: torch.Tensor, s: int):
    """The angles [s, rot] of positions 0..s-1 that the kernel reads, from freqs [s' >= s, 1, 1, rot] without
    a gradient (the kernel gives none); None for any other freqs."""
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) or freqs.shape[0] < s or freqs.requires_grad:
        return None
    return freqs[:s].reshape(s, freqs.shape[-1])


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, bshd: bool) -> torch.Tensor:
    """t [s, b, h, d] (or [b, s, h, d] when bshd) rotated by freqs [s, 1, 1, rot] (positions beyond s
    already cut off): the fused kernel where it takes the input (and the angles need no gradient),
    else rope_torch."""
    s = t.shape[1] if bshd else t.shape[0]
    angles = _kernel_angles(freqs, s)
    seq_first = t.transpose(0, 1) if bshd else t
    if angles is not None and native_rope.usable(seq_first, angles):
        return _RopeFunction.apply(t, angles, bshd)
    return rope_torch(t, freqs.transpose(0, 1) if bshd else freqs)


class _QKVRopeFunction(torch.autograd.Function):
    """Self-attention's q, k, v out of the fused projection's output in the interleaved layout, q and k
    rotated: mixed [s, b, g·(n + 2)·d] (per KV group: n query heads, the key, the value) -> q [s, b, g·n, d]
    and k [s, b, g, d] (new, contiguous), v [s, b, g, d] (a view of mixed).

    The kernel reads q and k where they lie in mixed (for the query heads of a group, a strided [s, b·g, n,
    d] view) and, in backward, writes their gradients straight into those slots of mixed's gradient. The
    split's own path copies q into the [s, b, h, d] layout first and joins the three gradients in one
    concatenation afterwards."""

    @staticmethod
    def forward(ctx, mixed, q_angles, k_angles, groups: int, per_group: int, head_dim: int):
        s, b = mixed.shape[0], mixed.shape[1]
        g, n, d = groups, per_group, head_dim
        slots = mixed.view(s, b * g, n + 2, d)
        q = native_rope.rope(slots[:, :, :n], q_angles, False).view(s, b, g * n, d)
        k = native_rope.rope(slots[:, :, n:n + 1], k_angles, False).view(s, b, g, d)
        ctx.angles, ctx.dims, ctx.like = (q_angles, k_angles), (s, b, g, n, d), (mixed.dtype, mixed.device)
        return q, k, slots[:, :, n + 1].view(s, b, g, d)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        s, b, g, n, d = ctx.dims
        (q_angles, k_angles), rows = ctx.angles, b * g
        dtype, device = ctx.like
        dmixed = torch.empty((s, b, g * (n + 2) * d), dtype=dtype, device=device)
        slots = dmixed.view(s, rows, n + 2, d)
        native_rope.rope(_rows_of_groups(dq, s, rows, n, d), q_angles, True, out=slots[:, :, :n])
        native_rope.rope(_rows_of_groups(dk, s, rows, 1, d), k_angles, True, out=slots[:, :, n:n + 1])
        slots[:, :, n + 1].copy_(dv.reshape(s, rows, d))
        return dmixed, None, None, None, None, None


def _rows_of_groups(t: torch.Tensor, s: int, rows: int, heads: int, d: int) -> torch.Tensor:
    """t [s, b, g·heads, d] as [s, b·g, heads, d] (a view where its strides allow, else a contiguous copy)."""
    if t.stride(-1) == 1:
        try:
            return t.view(s, rows, heads, d)
        except RuntimeError:
            pass
    return t.contiguous().view(s, rows, heads, d)


def qkv_rope_split(mixed: torch.Tensor, groups: int, per_group: int, head_dim: int, q_freqs: torch.Tensor,
                   k_freqs: torch.Tensor):
    """(q, k, v) of _QKVRopeFunction where it applies: eager mode (a compiled graph fuses the split's copies
    itself), a contiguous CUDA mixed [s, b, g·(n + 2)·d] in sbhd order, and angles [s', 1, 1, rot] (s' ≥ s,
    no gradient) that the kernel takes; None otherwise (the caller splits, then rotates)."""
    if torch.compiler.is_compiling() or mixed.dim() != 3 or not mixed.is_contiguous():
        return None
    s = mixed.shape[0]
    angles = [_kernel_angles(f, s) for f in (q_freqs, k_freqs)]
    if any(a is None for a in angles) or mixed.shape[2] != groups * (per_group + 2) * head_dim or not mixed.is_cuda:
        return None
    slots = mixed.view(s, -1, per_group + 2, head_dim)
    if not all(native_rope.usable(slots, a) for a in angles):
        return None
    return _QKVRopeFunction.apply(mixed, angles[0], angles[1], groups, per_group, head_dim)


@torch.library.register_kernel("te_parallel::rope", "cpu")
def _rope_cpu(x, freqs, backward):
    """CPU kernel of the native op (compiled graphs call it): rope_torch, and for `backward` the transpose of
    its map (per channel pair i, j = i + rot/2: dx_i = cos f_i·g_i + sin f_j·g_j, dx_j = cos f_j·g_j − sin f_i·g_i),
    in fp32 (or x's wider dtype) and rounded once."""
    angles = freqs[:, None, None, :]
    if not backward:
        return rope_torch(x, angles).contiguous()
    rot, math = freqs.shape[-1], torch.promote_types(x.dtype, torch.float32)
    g = x[..., :rot].to(math)
    cos, sin = angles.cos().to(math), angles.sin().to(math)
    g1, g2 = g.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    dx = torch.cat([c1 * g1 + s2 * g2, c2 * g2 - s1 * g1], dim=-1).to(x.dtype)
    return torch.cat([dx, x[..., rot:]], dim=-1).contiguous()
