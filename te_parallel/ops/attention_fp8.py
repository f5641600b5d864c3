"""FP8 attention (TE's recipe fields fp8_dpa / fp8_mha): q, k, v quantized to FP8 with one scale each, the
two attention GEMMs in FP8 inside cuDNN's fused FP8 flash-attention kernels (cuDNN frontend graphs sdpa_fp8 /
sdpa_fp8_backward, Hopper), and the output and the input gradients handed back in the inputs' dtype. This
module decides what runs and owns autograd; the pieces it composes:

  te_parallel.ops.attention_fp8_state      the scaling state (a layer's `fp8_attention_state`), how the
                                           recipe's quantizers scale each tensor, the casts and amax records
  te_parallel.ops.attention_fp8_graphs     cuDNN's kernels: graph description, caching, execution
  te_parallel.ops.attention_fp8_emulation  the kernels' arithmetic in torch (CPU, and the tests' reference)

Tensors and formats (the dtypes of the recipe's input and grad quantizers; HYBRID = E4M3 forward, E5M2 backward):
  forward   Q, K, V, O in the forward dtype; P = the softmax probabilities in the forward dtype
  backward  dO, dP (the gradient of the scores), dQ, dK, dV in the backward dtype
Every FP8 tensor t is stored as t_fp8 = cast(t · scale_t) and read as t_fp8 · descale_t (descale = 1 / scale).
The scales live in the layer's state and are updated by fp8_autocast's delayed-scaling machinery exactly as a
GEMM module's: forward amaxes when the outermost region exits, backward amaxes when the backward pass ends,
all-reduced over the fp8 group. The amaxes come from the casts (Q, K, V, dO) and from the kernels (O, dP, dQ,
dK, dV); P's scale is the constant fp8_max(forward dtype).

What runs: dense sbhd/bshd input with no mask, "causal" or "causal_bottom_right", no window, no attention
dropout, equal head dims of q and v (a multiple of 16, at most 256), outside torch.compile and without context
parallelism. On a CUDA device of compute capability 9.x with the cuDNN frontend that is the kernel (when cuDNN
builds both graphs); on CPU the emulation. Anything else runs the high-precision attention of the layer with
one warning naming why (`unsupported_reason`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from te_parallel.fp8 import autocast as _autocast
from te_parallel.ops import attention_cudnn_fe as fe
from te_parallel.ops import attention_fp8_emulation as em
from te_parallel.ops import attention_fp8_graphs as gr
from te_parallel.ops import attention_fp8_state as st
from te_parallel.ops.attention import Band, warn_once
from te_parallel.ops.fp8_dequantize import dequantize
from te_parallel.recipe import DelayedScaling, Format, Recipe

__all__ = ["requested", "unsupported_reason", "uses_kernel", "fp8_attention", "FP8AttentionFunction", "probe"]

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")


def requested(recipe: Recipe) -> bool:
    """The recipe asks for FP8 attention (fp8_dpa, or fp8_mha which implies it)."""
    return bool(getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False))


def unsupported_reason(q, k, v, fmt: str, mask_type: str, band: Band, dropout: float, context_parallel: bool) -> Optional[str]:
    """Why FP8 attention cannot take this call (None: it can). Device-independent conditions first, so CPU
    and GPU route alike; then the kernel's (CUDA only)."""
    if torch.compiler.is_compiling():
        return "inside a torch.compile trace"
    if _autocast.checkpoint_stash() is not None:  # (the original pass and its replay alike: both run high precision)
        return "activation recompute (te.checkpoint), whose replay FP8 attention's scales do not follow"
    if context_parallel:
        return "context parallelism (FP8 attention runs on one rank's whole sequence)"
    if fmt not in ("sbhd", "bshd"):
        return f"qkv_format {fmt!r} (FP8 attention takes sbhd and bshd)"
    if mask_type not in MASK_TYPES or not (band.full or band.causal_only):
        return f"attn_mask_type {mask_type!r} with band {band} (FP8 attention takes no_mask, causal, causal_bottom_right)"
    if dropout > 0:
        return f"attention dropout {dropout}"
    d = q.shape[-1]
    if v.shape[-1] != d or d % 16 or d > 256:
        return f"head dims q {d}, v {v.shape[-1]} (FP8 attention needs them equal, a multiple of 16, at most 256)"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype}"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 9:
            return f"compute capability {major}.{minor} (cuDNN's FP8 attention kernels need Hopper or newer, 9.0+)"
        if not fe.available():
            return "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)"
    return None


def _to_bhsd(t: torch.Tensor, sbhd: bool) -> torch.Tensor:
    return t.permute(1, 2, 0, 3) if sbhd else t.transpose(1, 2)


def _from_bhsd(t: torch.Tensor, sbhd: bool) -> torch.Tensor:
    return (t.permute(2, 0, 1, 3) if sbhd else t.transpose(1, 2)).contiguous()


class FP8AttentionFunction(torch.autograd.Function):
    """q [s, b, h, d] (sbhd) or [b, s, h, d], k/v with g heads, in bf16/fp16/fp32 -> [s, b, h·d] or [b, s, h·d]
    in q's dtype, through FP8 (module doc). Gradients come back in the inputs' dtypes.

    The kernels read the scales from the state's buffers themselves (the update that rewrites them in place is
    queued after them on the stream); what outlives the pass is copied: O's descale, by the reciprocal that
    makes it. FP8 outputs come back through one dequantizing launch each (te_parallel.ops.fp8_dequantize)."""

    @staticmethod
    def forward(ctx, q, k, v, sbhd: bool, band: Band, attn_scale: float, plan: st.Plan, graphs):
        q8, dsc_q = st.cast(plan, q, st.Q, False)
        k8, dsc_k = st.cast(plan, k, st.K, False)
        v8, dsc_v = st.cast(plan, v, st.V, False)
        scale_o = plan.state.slot_views(False, st.O)[0]
        hp = False
        if graphs is not None:
            key, fwd_graph, bwd_graph = graphs
            o, stats, amax_o = gr.kernel_forward(key, fwd_graph, q8, k8, v8, dsc_q, dsc_k, dsc_v, plan.scale_s,
                                                 scale_o)
            graphs, hp = (key, bwd_graph), key.hp_out is not None
        else:
            o, stats, amax_o = em.emulate_forward(*(_to_bhsd(t, sbhd) for t in (q8, k8, v8)), dsc_q, dsc_k, dsc_v,
                                                  scale_o, attn_scale, band)
            o = _from_bhsd(o, sbhd)
        st.record(plan, st.O, False, amax_o)
        # O in high precision: the output itself, read by the backward with descale 1
        dsc_o = gr.constant(1.0, q.device).reshape(()) if hp else torch.reciprocal(scale_o)
        out = o if hp else dequantize(o, dsc_o, q.dtype)
        ctx.save_for_backward(q8, k8, v8, o, stats, dsc_q, dsc_k, dsc_v, dsc_o)
        ctx.plan, ctx.sbhd, ctx.band, ctx.attn_scale, ctx.graphs = plan, sbhd, band, attn_scale, graphs
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.reshape(*out.shape[:2], -1)

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, o, stats, dsc_q, dsc_k, dsc_v, dsc_o = ctx.saved_tensors
        plan, sbhd = ctx.plan, ctx.sbhd
        do8, dsc_do = st.cast(plan, grad_out.reshape(o.shape), st.DO, True)
        bwd_scale = plan.state.tensors(True)[1]  # [5]: dO, dP, dQ, dK, dV
        bwd_descale = torch.reciprocal(bwd_scale)  # all five descales, one launch
        scales = tuple(bwd_scale[slot] for slot in (st.DP, st.DQ, st.DK, st.DV))
        descales = (dsc_q, dsc_k, dsc_v, dsc_o, dsc_do)
        hp = False
        if ctx.graphs is not None:
            key, bwd_graph = ctx.graphs
            grads, amaxes = gr.kernel_backward(key, bwd_graph, q8, k8, v8, o, do8, stats,
                                               descales + (bwd_descale[st.DP],), scales, plan.scale_s)
            hp = key.hp_out is not None
        else:
            grads, amaxes = em.emulate_backward(*(_to_bhsd(t, sbhd) for t in (q8, k8, v8, o, do8)), stats, descales,
                                                scales, ctx.attn_scale, ctx.band)
            grads, amaxes = tuple(_from_bhsd(t, sbhd) for t in grads), torch.stack(amaxes)
        st.record_backward(plan, amaxes)
        _autocast.record_backward(plan.state, plan.update, plan.group)
        if not hp:
            grads = tuple(dequantize(t8, bwd_descale[slot], dtype)
                          for t8, slot, dtype in zip(grads, (st.DQ, st.DK, st.DV), ctx.dtypes))
        return grads + (None, None, None, None, None)


def fp8_attention(q, k, v, sbhd: bool, band: Band, attn_scale: float, plan: st.Plan) -> torch.Tensor:
    """q [s, b, h, d] (sbhd) or [b, s, h, d], k/v [.., g, d] -> [s, b, h·d] or [b, s, h·d] in q's dtype. Raises
    fe.CudnnFeUnsupported when cuDNN refuses the graphs (built first: before any amax is recorded). Where
    cuDNN refuses E5M2 gradients (HYBRID) but takes E4M3 ones, the backward runs in E4M3, with one warning."""
    graphs = None
    if plan.kernel:
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        same = q.dtype == k.dtype == v.dtype
        hp_dtype = (q.dtype if same and q.dtype in (torch.bfloat16, torch.float16)
                    and gr.high_precision_outputs(q.device) else None)
        try:
            graphs = gr.choose_graphs(gr.graph_key(q, k, sbhd, band, attn_scale, plan), backward, hp_dtype)
        except fe.CudnnFeUnsupported as err:
            if not backward or plan.bwd_dtype != torch.float8_e5m2:
                raise
            e4m3 = st.e4m3_backward(plan)
            try:
                graphs = gr.choose_graphs(gr.graph_key(q, k, sbhd, band, attn_scale, e4m3), backward, hp_dtype)
            except fe.CudnnFeUnsupported:
                raise err from None
            warn_once(("fp8_dpa", "e4m3 backward"), f"FP8 attention: cuDNN refuses E5M2 gradients ({err}); the "
                                                    f"attention backward runs in E4M3")
            plan = e4m3
    return FP8AttentionFunction.apply(q, k, v, sbhd, band, attn_scale, plan, graphs)


def uses_kernel(q: torch.Tensor) -> bool:
    """The kernel on CUDA (unsupported_reason has checked it can), the emulation elsewhere."""
    return q.is_cuda


def probe(device: torch.device, d: int = 128, s: int = 256) -> None:
    """Build one forward and one backward FP8 graph (HYBRID, causal, GQA) and run them once: raises with
    cuDNN's reason where they cannot (the GPU script's first diagnostic)."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    fmt = recipe.fp8_format
    plan = st.Plan(st.new_state(device), recipe, None, False, fmt.fwd_dtype, fmt.bwd_dtype, True)
    q = torch.randn(s, 1, 8, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, 1, 2, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, 1, 2, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = fp8_attention(q, k, v, True, Band(False, -1, 0), 1.0 / math.sqrt(d), plan)
    out.float().square().mean().backward()
    torch.cuda.synchronize(device)
