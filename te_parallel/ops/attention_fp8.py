"""FP8 attention (TE's recipe fields fp8_dpa / fp8_mha): q, k, v quantized to FP8 with one scale each, the
two attention GEMMs in FP8 inside cuDNN's fused FP8 flash-attention kernels (cuDNN frontend graphs sdpa_fp8 /
sdpa_fp8_backward, Hopper), and the output and the input gradients handed back in the inputs' dtype.

Tensors and formats (fmt = the recipe's Format; HYBRID = E4M3 forward, E5M2 backward):
  forward   Q, K, V, O in fmt.fwd_dtype; P = the softmax probabilities in fmt.fwd_dtype
  backward  dO, dP (the gradient of the scores), dQ, dK, dV in fmt.bwd_dtype
Every FP8 tensor t is stored as t_fp8 = cast(t · scale_t) and read as t_fp8 · descale_t (descale = 1 / scale).

Where the scales come from (per DotProductAttention, in its `fp8_attention_state`, an FP8ScalingState whose
forward slots are Q, K, V, O and backward slots dO, dP, dQ, dK, dV; it is updated by fp8_autocast's
delayed-scaling machinery exactly as a GEMM module's state: forward amaxes when the outermost region exits,
backward amaxes when the backward pass ends, all-reduced over the fp8 group):
  DelayedScaling        every scale from its amax history (the recipe's length, margin, algorithm); the
                        amaxes come from the casts (Q, K, V, dO) and from the kernels (O, dP, dQ, dK, dV).
  Float8CurrentScaling  Q, K, V and dO from their own amax just before the cast; O, dP, dQ, dK, dV are written
                        inside the kernels, so their scales must exist before the tensors do: they are delayed,
                        from the previous pass's amax (history of one pass, margin 0).
  P                     scale_s = fp8_max(fmt.fwd_dtype), a constant: the kernels quantize
                        exp(S - running row max), which lies in [0, 1], so the bound is exact (cuDNN's advice:
                        its amax_s output is not requested).

Emulation (`emulate_forward` / `emulate_backward`): the same arithmetic in torch at a chosen precision (fp32 on
CPU and as the GPU tests' second opinion; fp64 as the tests' reference of the same quantization). It takes P
relative to the row's final max (the kernels' running max is per tile of keys; the two agree for rows whose
max is in the first tile and differ by FP8 rounding otherwise) and the row sum from unquantized P, as the
kernels do. The backward recomputes P = exp(S - LSE), quantizes it with scale_s for dV = Pᵀ·dO, forms
dS = P ∘ (dP - rowsum(dO ∘ O)) from the dequantized FP8 dO and O, and quantizes dS with scale_dP for
dQ = dS·K and dK = dSᵀ·Q (attn_scale applied after the GEMMs).

What runs: dense sbhd/bshd input with no mask, "causal" or "causal_bottom_right", no window, no attention
dropout, equal head dims of q and v (a multiple of 16, at most 256), outside torch.compile and without context
parallelism. On a CUDA device of compute capability 9.x with the cuDNN frontend that is the kernel (when cuDNN
builds both graphs); on CPU the emulation. Anything else runs the high-precision attention of the layer with
one warning naming why (`unsupported_reason`).

Outputs: where cuDNN writes O and dQ, dK, dV in the inputs' bf16/fp16 (its FP8 graphs with high-precision
outputs: cuDNN >= 9.13 on Blackwell; the frontend refuses them on Hopper), those graphs run and nothing follows
them; elsewhere the FP8-output graphs run and one dequantizing launch per tensor follows (`_graphs` asks in that
order, once per shape). Either way the kernels report max |O| and max |dQ|, |dK|, |dV| before any scale, which
delayed scaling keeps in the histories as before.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from te_parallel.fp8 import autocast as _autocast
from te_parallel.fp8.state import FP8ScalingState
from te_parallel.ops import attention_cudnn_fe as fe
from te_parallel.ops.attention import Band, band_mask, warn_once
from te_parallel.ops.cast import quantize, quantize_current
from te_parallel.ops.fp8_dequantize import dequantize
from te_parallel.recipe import DelayedScaling, Format, Recipe, fp8_max

# slots of the FP8ScalingState (forward: 2·NUM_GEMMS slots, of which Q, K, V, O are used; backward: NUM_GEMMS)
Q, K, V, O = 0, 1, 2, 3
DO, DP, DQ, DK, DV = 0, 1, 2, 3, 4
NUM_GEMMS = 5
MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")


def requested(recipe: Recipe) -> bool:
    """The recipe asks for FP8 attention (fp8_dpa, or fp8_mha which implies it)."""
    return bool(getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False))


def new_state(device) -> FP8ScalingState:
    return FP8ScalingState(NUM_GEMMS, device=device)


_UPDATE_RECIPES: Dict[Format, DelayedScaling] = {}


def _current_update_recipe(fmt: Format) -> DelayedScaling:
    """Current scaling: the rule of the kernel-written tensors' delayed scales (the previous pass's amax)."""
    if fmt not in _UPDATE_RECIPES:
        _UPDATE_RECIPES[fmt] = DelayedScaling(fp8_format=fmt, amax_history_len=1, amax_compute_algo="max")
    return _UPDATE_RECIPES[fmt]


@dataclass(frozen=True)
class Plan:
    """One call's FP8 attention: the recipe's dtypes, where the scales live, how they are updated."""
    state: FP8ScalingState
    update: DelayedScaling      # the rule fp8_autocast applies to `state` (the recipe itself when delayed)
    group: object               # amaxes are all-reduced over it (None: this rank only)
    current: bool               # Q, K, V, dO scaled from their own amax
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    kernel: bool                # cuDNN's kernels (else the emulation)

    @property
    def scale_s(self) -> float:
        return fp8_max(self.fwd_dtype)


def make_plan(recipe: Recipe, state: FP8ScalingState, group, kernel: bool) -> Plan:
    """The plan of one forward under `recipe`; registers `state` for the forward update at autocast exit (a
    pass that records no amax leaves every scale as it is)."""
    if recipe.scaling not in ("delayed", "current"):
        raise ValueError(f"FP8 attention needs DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
    current = recipe.scaling == "current"
    update = _current_update_recipe(recipe.fp8_format) if current else recipe
    state.ensure_history_len(update.amax_history_len)
    _autocast.record_forward(state, update, group)
    fmt = recipe.fp8_format
    return Plan(state, update, group, current, fmt.fwd_dtype, fmt.bwd_dtype, kernel)


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


# -- quantization ----------------------------------------------------------------------------------

def to_fp8(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """cast(x · scale) with saturation to ±fp8_max (the kernels' satfinite conversion)."""
    limit = fp8_max(dtype)
    return (x * scale).clamp(-limit, limit).to(dtype)


def _cast(plan: Plan, x: torch.Tensor, slot: int, backward: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(FP8 bytes of x, contiguous in x's shape; descale: fp32 0-d). Delayed: the slot's scale, amax recorded
    in its history; current: the scale from amax(x)."""
    dtype = plan.bwd_dtype if backward else plan.fwd_dtype
    x2 = x.reshape(-1, x.shape[-1])
    if plan.current:
        t = quantize_current(x2, dtype)
    else:
        scale, cell = plan.state.slot_views(backward, slot)
        t = quantize(x2, scale, dtype, amax_out=cell)
    return t.data.view(x.shape), t.scale_inv.reshape(())


def _record(plan: Plan, slot: int, backward: bool, amax: torch.Tensor) -> None:
    cell = plan.state.slot_views(backward, slot)[1]
    torch.maximum(cell, amax.reshape(1).to(cell.dtype), out=cell)


def _record_backward(plan: Plan, amaxes: torch.Tensor) -> None:
    """amaxes [4] of dP, dQ, dK, dV (slots 1..4, adjacent in the history's row 0) into the history, one launch."""
    cells = plan.state.history_row0(True)[DP:DV + 1]
    torch.maximum(cells, amaxes.to(cells.dtype), out=cells)


# -- emulation -------------------------------------------------------------------------------------

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
    stats [b, h, s_q, 1] fp32 log-sum-exp, amax_o fp32 0-d), in `compute` precision (see the module docstring)."""
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


# -- cuDNN graphs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphKey:
    device: int
    b: int
    h: int
    g: int
    d: int
    sq: int
    skv: int
    sbhd: bool            # the FP8 tensors are contiguous [s, b, n, d] (else [b, s, n, d])
    causal: bool
    bottom_right: bool
    attn_scale: float
    fwd: torch.dtype
    bwd: torch.dtype
    deterministic: bool
    amax_s_output: bool = False  # an older cuDNN may want Amax_S bound (see _build_forward)
    hp_out: Optional[torch.dtype] = None  # O (forward, and read by the backward) and dQ, dK, dV in this
    #                                       bf16/fp16 instead of FP8 (None: FP8; see _graphs)


_FE_DTYPES = {torch.float8_e4m3fn: "FP8_E4M3", torch.float8_e5m2: "FP8_E5M2", torch.bfloat16: "BFLOAT16",
              torch.float16: "HALF"}


def _dtype(torch_dtype: torch.dtype):
    return getattr(fe.frontend().data_type, _FE_DTYPES[torch_dtype])


def _bhsd(key: GraphKey, heads: int, s: int):
    return [key.b, heads, s, key.d], list(fe._contiguous_bhsd((s, key.b, heads, key.d) if key.sbhd else (key.b, s, heads, key.d), key.sbhd))


def _mask(key: GraphKey) -> dict:
    if not key.causal:
        return {}
    return {"use_causal_mask_bottom_right": True} if key.bottom_right else {"use_causal_mask": True}


def _scalars(g, names):
    cd = fe.frontend()
    return {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cd.data_type.FLOAT) for n in names}


def _io(g, name: str, key: GraphKey, heads: int, s: int, dtype: torch.dtype):
    dim, stride = _bhsd(key, heads, s)
    return g.tensor(name=name, dim=dim, stride=stride, data_type=_dtype(dtype))


def _out(t, key: GraphKey, heads: int, s: int, dtype) -> None:
    dim, stride = _bhsd(key, heads, s)
    t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype)


def _amax(t) -> None:
    t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fe.frontend().data_type.FLOAT)


class _Graph:
    """A built pygraph and its named tensors."""

    def __init__(self, graph, tensors: dict, workspace: int):
        self.graph, self.tensors, self.workspace = graph, tensors, workspace


FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
               "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def _pygraph(key: GraphKey, handle):
    cd = fe.frontend()
    return cd.pygraph(io_data_type=_dtype(key.fwd), intermediate_data_type=cd.data_type.FLOAT,
                      compute_data_type=cd.data_type.FLOAT, handle=handle)


def _refusals(build):
    """A graph builder whose every failure (the frontend raises its own types while the graph is described,
    not only when it is planned) is a CudnnFeUnsupported naming the first line of the reason."""
    def wrapped(key: GraphKey, handle) -> _Graph:
        try:
            return build(key, handle)
        except fe.CudnnFeUnsupported:
            raise
        except Exception as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise fe.CudnnFeUnsupported(f"cuDNN cannot describe this FP8 attention graph ({first})") from err
    return wrapped


@_refusals
def _build_forward(key: GraphKey, handle) -> _Graph:
    g = _pygraph(key, handle)
    t = dict(q=_io(g, "q", key, key.h, key.sq, key.fwd), k=_io(g, "k", key, key.g, key.skv, key.fwd),
             v=_io(g, "v", key, key.g, key.skv, key.fwd))
    t.update(_scalars(g, FWD_SCALARS))
    o, stats, amax_s, amax_o = g.sdpa_fp8(name="sdpa_fp8", **t, generate_stats=True, attn_scale=key.attn_scale,
                                          **_mask(key))
    _out(o, key, key.h, key.sq, key.hp_out or key.fwd)
    stats.set_output(True).set_data_type(fe.frontend().data_type.FLOAT)
    stats.set_dim([key.b, key.h, key.sq, 1]).set_stride([key.h * key.sq, key.sq, 1, 1])
    _amax(amax_o)
    t.update(o=o, stats=stats, amax_o=amax_o)
    if key.amax_s_output:
        _amax(amax_s)
        t["amax_s"] = amax_s
    return _Graph(g, t, fe.build_plans(g))


@_refusals
def _build_backward(key: GraphKey, handle) -> _Graph:
    g = _pygraph(key, handle)
    t = dict(q=_io(g, "q", key, key.h, key.sq, key.fwd), k=_io(g, "k", key, key.g, key.skv, key.fwd),
             v=_io(g, "v", key, key.g, key.skv, key.fwd), o=_io(g, "o", key, key.h, key.sq, key.hp_out or key.fwd),
             dO=_io(g, "dO", key, key.h, key.sq, key.bwd))
    t["stats"] = g.tensor(name="stats", dim=[key.b, key.h, key.sq, 1], stride=[key.h * key.sq, key.sq, 1, 1],
                          data_type=fe.frontend().data_type.FLOAT)
    t.update(_scalars(g, BWD_SCALARS))
    extra = {"use_deterministic_algorithm": True} if key.deterministic else {}
    outs = g.sdpa_fp8_backward(name="sdpa_fp8_backward", **t, attn_scale=key.attn_scale, **_mask(key), **extra)
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = outs[:7]
    grad_dtype = key.hp_out or key.bwd
    _out(dq, key, key.h, key.sq, grad_dtype)
    _out(dk, key, key.g, key.skv, grad_dtype)
    _out(dv, key, key.g, key.skv, grad_dtype)
    for a in (amax_dq, amax_dk, amax_dv, amax_dp):
        _amax(a)
    t.update(dQ=dq, dK=dk, dV=dv, amax_dQ=amax_dq, amax_dK=amax_dk, amax_dV=amax_dv, amax_dP=amax_dp)
    return _Graph(g, t, fe.build_plans(g))


GraphPair = Tuple[GraphKey, _Graph, Optional[_Graph]]


def _graphs(key: GraphKey, backward: bool, hp_dtype: Optional[torch.dtype]) -> GraphPair:
    """(the key that built, forward graph, backward graph or None); raises CudnnFeUnsupported with cuDNN's
    reason. First the graphs that write O and dQ, dK, dV in `hp_dtype` (the inputs' bf16/fp16; None: skip),
    where no dequantization follows the kernels (cuDNN >= 9.13 on Blackwell; the frontend refuses them on
    Hopper); where cuDNN refuses either of the pair, the FP8-output graphs, dequantized after the kernels. The
    refusals are cached with the graphs, and the key that built here: later calls look the pair up directly."""
    chosen = _CHOSEN.get((key, backward, hp_dtype))
    if chosen is not None:
        return _graph_pair(chosen, backward)
    result = None
    if hp_dtype is not None:
        try:
            result = _graph_pair(dataclasses.replace(key, hp_out=hp_dtype), backward)
        except fe.CudnnFeUnsupported:
            pass
    if result is None:
        result = _graph_pair(key, backward)
    if len(_CHOSEN) >= 1024:
        _CHOSEN.clear()
    _CHOSEN[(key, backward, hp_dtype)] = result[0]
    return result


_CHOSEN: Dict[tuple, GraphKey] = {}  # (key asked, backward, hp dtype) -> the key whose graphs built


def outputs_of(q: torch.Tensor, k: torch.Tensor, sbhd: bool) -> Optional[str]:
    """What the FP8 graphs last chosen for q, k of this shape write: "bf16"/"fp16" (the high-precision-output
    graphs), "fp8" (FP8 outputs, dequantized after the kernels), or None (no kernel call at this shape yet)."""
    s_dim, b_dim = (0, 1) if sbhd else (1, 0)
    shape = (q.shape[b_dim], q.shape[2], k.shape[2], q.shape[3], q.shape[s_dim], k.shape[s_dim], sbhd)
    for used in reversed(list(_CHOSEN.values())):
        if (used.b, used.h, used.g, used.d, used.sq, used.skv, used.sbhd) == shape:
            return {None: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16"}[used.hp_out]
    return None


def _graph_pair(key: GraphKey, backward: bool) -> GraphPair:
    """_graphs for one output dtype. A forward cuDNN refuses with Amax_S left virtual is tried once more with
    it bound."""
    try:
        fwd = fe.cached_graph(key, "fp8_fwd", _build_forward)
    except fe.CudnnFeUnsupported as first:
        key = dataclasses.replace(key, amax_s_output=True)
        try:
            fwd = fe.cached_graph(key, "fp8_fwd", _build_forward)
        except fe.CudnnFeUnsupported:
            raise first from None
    bwd = fe.cached_graph(key, "fp8_bwd", _build_backward) if backward else None
    return key, fwd, bwd


def _execute(graph: _Graph, buffers: dict, device: torch.device) -> None:
    pack = {graph.tensors[name]: t for name, t in buffers.items()}
    workspace = torch.empty(max(graph.workspace, 1), dtype=torch.uint8, device=device)
    try:
        graph.graph.execute(pack, workspace, handle=fe._handle(fe._index(device)))
    except Exception as err:
        raise fe.CudnnFeUnsupported(f"cuDNN FP8 attention graph failed to execute ({str(err).strip()[:200]})") from err


_CONSTANTS: Dict[tuple, torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A [1, 1, 1, 1] fp32 constant on device, made once per process (never written)."""
    key = (value, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


def _s4(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, 1, 1)


def graph_key(q, k, sbhd: bool, band: Band, attn_scale: float, plan: Plan) -> GraphKey:
    s_dim, b_dim = (0, 1) if sbhd else (1, 0)
    return GraphKey(fe._index(q.device), q.shape[b_dim], q.shape[2], k.shape[2], q.shape[3], q.shape[s_dim],
                    k.shape[s_dim], sbhd, not band.full, band.bottom_right and q.shape[s_dim] != k.shape[s_dim],
                    float(attn_scale), plan.fwd_dtype,
                    plan.bwd_dtype, torch.are_deterministic_algorithms_enabled())


def kernel_forward(key: GraphKey, fwd: _Graph, q8, k8, v8, dsc_q, dsc_k, dsc_v, scale_s: float, scale_o):
    """-> (o in the layout's [s, b, h, d] or [b, s, h, d]: FP8, or key.hp_out where the graph writes it so (then
    scale_o is 1), stats [b, h, s_q, 1], amax_o [1]: max |O| before any scale)."""
    shape = (key.sq, key.b, key.h, key.d) if key.sbhd else (key.b, key.sq, key.h, key.d)
    dev = q8.device
    o = torch.empty(shape, dtype=key.hp_out or key.fwd, device=dev)
    stats = torch.empty(key.b, key.h, key.sq, 1, dtype=torch.float32, device=dev)
    amax = torch.zeros(2, dtype=torch.float32, device=dev)
    scale_o = _constant(1.0, dev) if key.hp_out is not None else _s4(scale_o)
    buffers = dict(q=q8, k=k8, v=v8, o=o, stats=stats, amax_o=_s4(amax[0:1]), descale_q=_s4(dsc_q),
                   descale_k=_s4(dsc_k), descale_v=_s4(dsc_v), descale_s=_constant(1.0 / scale_s, dev),
                   scale_s=_constant(scale_s, dev), scale_o=scale_o)
    if key.amax_s_output:
        buffers["amax_s"] = _s4(amax[1:2])
    _execute(fwd, buffers, dev)
    return o, stats, amax[0:1]


def kernel_backward(key: GraphKey, bwd: _Graph, q8, k8, v8, o, do8, stats, descales, scales, scale_s: float):
    """o: FP8, or key.hp_out (then descales[3] is 1); descales (q, k, v, o, dO, dP) and scales (dP, dQ, dK, dV):
    fp32 0-d. -> ((dq, dk, dv) in the layout: FP8 or key.hp_out, amaxes [4]: dP, dQ, dK, dV)."""
    dev = q8.device
    grad_dtype = key.hp_out or key.bwd
    dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=dev) for t in (q8, k8, v8))
    amax = torch.zeros(4, dtype=torch.float32, device=dev)
    dsc_q, dsc_k, dsc_v, dsc_o, dsc_do, dsc_dp = descales
    sc_dp, sc_dq, sc_dk, sc_dv = scales
    if key.hp_out is not None:
        sc_dq = sc_dk = sc_dv = _constant(1.0, dev)
    buffers = dict(q=q8, k=k8, v=v8, o=o, dO=do8, stats=stats, dQ=dq, dK=dk, dV=dv,
                   amax_dP=_s4(amax[0:1]), amax_dQ=_s4(amax[1:2]), amax_dK=_s4(amax[2:3]), amax_dV=_s4(amax[3:4]),
                   descale_q=_s4(dsc_q), descale_k=_s4(dsc_k), descale_v=_s4(dsc_v), descale_o=_s4(dsc_o),
                   descale_dO=_s4(dsc_do), descale_s=_constant(1.0 / scale_s, dev), descale_dP=_s4(dsc_dp),
                   scale_s=_constant(scale_s, dev), scale_dQ=_s4(sc_dq), scale_dK=_s4(sc_dk), scale_dV=_s4(sc_dv),
                   scale_dP=_s4(sc_dp))
    _execute(bwd, buffers, dev)
    return (dq, dk, dv), amax


# -- the autograd Function -------------------------------------------------------------------------

def _to_bhsd(t: torch.Tensor, sbhd: bool) -> torch.Tensor:
    return t.permute(1, 2, 0, 3) if sbhd else t.transpose(1, 2)


def _from_bhsd(t: torch.Tensor, sbhd: bool) -> torch.Tensor:
    return (t.permute(2, 0, 1, 3) if sbhd else t.transpose(1, 2)).contiguous()


class FP8AttentionFunction(torch.autograd.Function):
    """q [s, b, h, d] (sbhd) or [b, s, h, d], k/v with g heads, in bf16/fp16/fp32 -> [s, b, h·d] or [b, s, h·d]
    in q's dtype, through FP8 (see the module docstring). Gradients come back in the inputs' dtypes.

    The kernels read the scales from the state's buffers themselves (the update that rewrites them in place is
    queued after them on the stream); what outlives the pass is copied: O's descale, by the reciprocal that
    makes it. FP8 outputs come back through one dequantizing launch each (te_parallel.ops.fp8_dequantize)."""

    @staticmethod
    def forward(ctx, q, k, v, sbhd: bool, band: Band, attn_scale: float, plan: Plan, graphs):
        q8, dsc_q = _cast(plan, q, Q, False)
        k8, dsc_k = _cast(plan, k, K, False)
        v8, dsc_v = _cast(plan, v, V, False)
        scale_o = plan.state.slot_views(False, O)[0]
        hp = False
        if graphs is not None:
            key, fwd_graph, bwd_graph = graphs
            o, stats, amax_o = kernel_forward(key, fwd_graph, q8, k8, v8, dsc_q, dsc_k, dsc_v, plan.scale_s, scale_o)
            graphs, hp = (key, bwd_graph), key.hp_out is not None
        else:
            o, stats, amax_o = emulate_forward(*(_to_bhsd(t, sbhd) for t in (q8, k8, v8)), dsc_q, dsc_k, dsc_v,
                                               scale_o, attn_scale, band)
            o = _from_bhsd(o, sbhd)
        _record(plan, O, False, amax_o)
        # O in high precision: the output itself, read by the backward with descale 1
        dsc_o = _constant(1.0, q.device).reshape(()) if hp else torch.reciprocal(scale_o)
        out = o if hp else dequantize(o, dsc_o, q.dtype)
        ctx.save_for_backward(q8, k8, v8, o, stats, dsc_q, dsc_k, dsc_v, dsc_o)
        ctx.plan, ctx.sbhd, ctx.band, ctx.attn_scale, ctx.graphs = plan, sbhd, band, attn_scale, graphs
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.reshape(*out.shape[:2], -1)

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, o, stats, dsc_q, dsc_k, dsc_v, dsc_o = ctx.saved_tensors
        plan, sbhd = ctx.plan, ctx.sbhd
        do8, dsc_do = _cast(plan, grad_out.reshape(o.shape), DO, True)
        bwd_scale = plan.state.tensors(True)[1]  # [5]: dO, dP, dQ, dK, dV
        bwd_descale = torch.reciprocal(bwd_scale)  # all five descales, one launch
        scales = tuple(bwd_scale[slot] for slot in (DP, DQ, DK, DV))
        descales = (dsc_q, dsc_k, dsc_v, dsc_o, dsc_do)
        hp = False
        if ctx.graphs is not None:
            key, bwd_graph = ctx.graphs
            grads, amaxes = kernel_backward(key, bwd_graph, q8, k8, v8, o, do8, stats, descales + (bwd_descale[DP],),
                                            scales, plan.scale_s)
            hp = key.hp_out is not None
        else:
            grads, amaxes = emulate_backward(*(_to_bhsd(t, sbhd) for t in (q8, k8, v8, o, do8)), stats, descales,
                                             scales, ctx.attn_scale, ctx.band)
            grads, amaxes = tuple(_from_bhsd(t, sbhd) for t in grads), torch.stack(amaxes)
        _record_backward(plan, amaxes)
        _autocast.record_backward(plan.state, plan.update, plan.group)
        if not hp:
            grads = tuple(dequantize(t8, bwd_descale[slot], dtype)
                          for t8, slot, dtype in zip(grads, (DQ, DK, DV), ctx.dtypes))
        return grads + (None, None, None, None, None)


def fp8_attention(q, k, v, sbhd: bool, band: Band, attn_scale: float, plan: Plan) -> torch.Tensor:
    """q [s, b, h, d] (sbhd) or [b, s, h, d], k/v [.., g, d] -> [s, b, h·d] or [b, s, h·d] in q's dtype. Raises
    fe.CudnnFeUnsupported when cuDNN refuses the graphs (built first: before any amax is recorded). Where
    cuDNN refuses E5M2 gradients (HYBRID) but takes E4M3 ones, the backward runs in E4M3, with one warning."""
    graphs = None
    if plan.kernel:
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        same = q.dtype == k.dtype == v.dtype
        hp_dtype = (q.dtype if same and q.dtype in (torch.bfloat16, torch.float16) and _high_precision_outputs(q.device)
                    else None)
        try:
            graphs = _graphs(graph_key(q, k, sbhd, band, attn_scale, plan), backward, hp_dtype)
        except fe.CudnnFeUnsupported as err:
            if not backward or plan.bwd_dtype != torch.float8_e5m2:
                raise
            e4m3 = _e4m3_backward(plan)
            try:
                graphs = _graphs(graph_key(q, k, sbhd, band, attn_scale, e4m3), backward, hp_dtype)
            except fe.CudnnFeUnsupported:
                raise err from None
            warn_once(("fp8_dpa", "e4m3 backward"), f"FP8 attention: cuDNN refuses E5M2 gradients ({err}); the "
                                                    f"attention backward runs in E4M3")
            plan = e4m3
    return FP8AttentionFunction.apply(q, k, v, sbhd, band, attn_scale, plan, graphs)


def _high_precision_outputs(device: torch.device) -> bool:
    """Whether to ask cuDNN for bf16/fp16 O and dQ, dK, dV: cuDNN >= 9.13 builds them on Blackwell (sm_100 and
    later) only, and the frontend refuses them on Hopper, so they are not asked for there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


_E4M3_UPDATES: Dict[DelayedScaling, DelayedScaling] = {}


def _e4m3_backward(plan: Plan) -> Plan:
    """The plan with E4M3 backward tensors, updated by the same rule with E4M3's fp8_max (the forward dtype
    of HYBRID is E4M3 already, so the forward update is unchanged)."""
    update = _E4M3_UPDATES.get(plan.update)
    if update is None:
        update = _E4M3_UPDATES[plan.update] = dataclasses.replace(plan.update, fp8_format=Format.E4M3)
    return dataclasses.replace(plan, update=update, bwd_dtype=torch.float8_e4m3fn)


def uses_kernel(q: torch.Tensor) -> bool:
    """The kernel on CUDA (unsupported_reason has checked it can), the emulation elsewhere."""
    return q.is_cuda


def probe(device: torch.device, d: int = 128, s: int = 256) -> None:
    """Build one forward and one backward FP8 graph (HYBRID, causal, GQA) and run them once: raises with
    cuDNN's reason where they cannot (the GPU script's first diagnostic)."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    plan = Plan(new_state(device), recipe, None, False, recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype, True)
    q = torch.randn(s, 1, 8, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, 1, 2, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, 1, 2, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = fp8_attention(q, k, v, True, Band(False, -1, 0), 1.0 / math.sqrt(d), plan)
    out.float().square().mean().backward()
    torch.cuda.synchronize(device)
