"""cuDNN's FP8 attention kernels for te_parallel.ops.attention_fp8: the cuDNN frontend graphs sdpa_fp8 /
sdpa_fp8_backward (Hopper and newer), described from a GraphKey, built once per shape and cached with the
bf16 graphs (te_parallel.ops.attention_cudnn_fe), and run on given FP8 bytes, scales and descales.

Outputs: where cuDNN writes O and dQ, dK, dV in the inputs' bf16/fp16 (its FP8 graphs with high-precision
outputs: cuDNN >= 9.13 on Blackwell; the frontend refuses them on Hopper), those graphs run and nothing follows
them; elsewhere the FP8-output graphs run and one dequantizing launch per tensor follows (`choose_graphs` asks
in that order, once per shape). Either way the kernels report max |O| and max |dQ|, |dK|, |dV| before any
scale, which delayed scaling keeps in the histories. P's scale is the constant fp8_max(forward dtype): the
kernels quantize exp(S - running row max), which lies in [0, 1] (cuDNN's advice: its amax_s output is not
requested).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from te_parallel.ops import attention_cudnn_fe as fe
from te_parallel.ops.attention import Band
from te_parallel.ops.attention_fp8_state import Plan

__all__ = ["GraphKey", "graph_key", "choose_graphs", "outputs_of", "high_precision_outputs", "kernel_forward",
           "kernel_backward", "constant"]


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
    #                                       bf16/fp16 instead of FP8 (None: FP8; see choose_graphs)


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


def choose_graphs(key: GraphKey, backward: bool, hp_dtype: Optional[torch.dtype]) -> GraphPair:
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
    """choose_graphs for one output dtype. A forward cuDNN refuses with Amax_S left virtual is tried once more with
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


def constant(value: float, device: torch.device) -> torch.Tensor:
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
    scale_o = constant(1.0, dev) if key.hp_out is not None else _s4(scale_o)
    buffers = dict(q=q8, k=k8, v=v8, o=o, stats=stats, amax_o=_s4(amax[0:1]), descale_q=_s4(dsc_q),
                   descale_k=_s4(dsc_k), descale_v=_s4(dsc_v), descale_s=constant(1.0 / scale_s, dev),
                   scale_s=constant(scale_s, dev), scale_o=scale_o)
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
        sc_dq = sc_dk = sc_dv = constant(1.0, dev)
    buffers = dict(q=q8, k=k8, v=v8, o=o, dO=do8, stats=stats, dQ=dq, dK=dk, dV=dv,
                   amax_dP=_s4(amax[0:1]), amax_dQ=_s4(amax[1:2]), amax_dK=_s4(amax[2:3]), amax_dV=_s4(amax[3:4]),
                   descale_q=_s4(dsc_q), descale_k=_s4(dsc_k), descale_v=_s4(dsc_v), descale_o=_s4(dsc_o),
                   descale_dO=_s4(dsc_do), descale_s=constant(1.0 / scale_s, dev), descale_dP=_s4(dsc_dp),
                   scale_s=constant(scale_s, dev), scale_dQ=_s4(sc_dq), scale_dK=_s4(sc_dk), scale_dV=_s4(sc_dv),
                   scale_dP=_s4(sc_dp))
    _execute(bwd, buffers, dev)
    return (dq, dk, dv), amax


def high_precision_outputs(device: torch.device) -> bool:
    """Whether to ask cuDNN for bf16/fp16 O and dQ, dK, dV: cuDNN >= 9.13 builds them on Blackwell (sm_100 and
    later) only, and the frontend refuses them on Hopper, so they are not asked for there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
