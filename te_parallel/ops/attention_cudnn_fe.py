"""Packed ("thd") attention on cuDNN's fused flash-attention kernels through the cuDNN frontend
(PyPI nvidia-cudnn-frontend, import name `cudnn`; optional: `pip install te_parallel[cudnn]`).

q [t_q, h, d], k/v [t_kv, g, d] (GQA native) are described to cuDNN as [b, h, s, d] tensors whose
sequence i starts at a ragged offset (cu_seqlens[i] · token stride elements); per-sequence lengths give
the padding mask; a causal mask or window is cuDNN's diagonal band (left bound = window left + 1, right
bound = window right, top-left or bottom-right aligned). Softmax statistics [b, h, s, 1] (fp32, natural
log) go from the forward to the backward graph.

Building a graph is slow (the frontend plans and compiles it), so graphs are cached per shape: the
batch, the longest sequences and the token counts are rounded up to quarter-octave buckets (at most
25 % above the true size; extra sequences have length 0; sequence and token buckets are multiples of
64, which also keeps cuDNN's backward away from its unsupported s_q = s_kv = 1), so a training run with
varying packs builds a few graphs, not one per step. Inputs may be strided views (q/k/v split from one
fused QKV output) as long as the head dim is contiguous; the strides are part of the key.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from te_parallel.ops.attention import Band

_CACHE_SIZE = 256
_lock = threading.Lock()
_graphs: "OrderedDict[tuple, object]" = OrderedDict()
_handles: Dict[int, object] = {}
_frontend: Dict[str, object] = {}  # imported once (a plain dict, which torch.compile reads as a constant)


def frontend():
    """The `cudnn` module, or None when it does not import (not installed, or no loadable cuDNN)."""
    if "module" not in _frontend:
        try:
            import cudnn  # noqa: PLC0415
        except Exception:  # ImportError, OSError from a missing libcudnn, ...
            cudnn = None
        _frontend["module"] = cudnn
    return _frontend["module"]


def available() -> bool:
    return frontend() is not None


class CudnnFeUnsupported(RuntimeError):
    """cuDNN could not build a graph for this input (the caller falls back to another kernel)."""


def bucket(n: int, multiple: int = 1) -> int:
    """n rounded up to a quarter-octave step, then to a multiple of `multiple`."""
    n = max(n, 1)
    step = 1 << max(0, n.bit_length() - 3)
    n = -(-n // step) * step
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class GraphKey:
    device: int
    dtype: torch.dtype
    b: int
    h: int
    g: int
    d: int
    sq: int
    skv: int
    tq: int
    tkv: int
    strides: Tuple[Tuple[int, int], ...]  # (token, head) strides of q, k, v
    band: Band
    scale: float
    deterministic: bool


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with _lock:
            if index not in _handles:
                with torch.cuda.device(index):
                    _handles[index] = frontend().create_handle()
            handle = _handles[index]
        frontend().set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    except Exception as err:  # e.g. a frontend built for another cuDNN: the caller falls back
        raise CudnnFeUnsupported(f"cannot get a cuDNN handle ({str(err).strip()[:200]})") from err
    return handle


def _io_type(dtype: torch.dtype):
    cd = frontend()
    return cd.data_type.BFLOAT16 if dtype == torch.bfloat16 else cd.data_type.HALF


def _offset_dtypes():
    """Ragged offsets are int64 from cuDNN 9.6 on, int32 before: (cudnn type, torch dtype)."""
    cd = frontend()
    return (cd.data_type.INT64, torch.int64) if cd.backend_version() >= 90600 else (cd.data_type.INT32, torch.int32)


class _Builder:
    """One pygraph with the tensors both graphs share: q, k, v, the lengths and ragged offsets."""

    def __init__(self, key: GraphKey, handle):
        cd = frontend()
        self.key, self.cd = key, cd
        self.graph = cd.pygraph(io_data_type=_io_type(key.dtype), intermediate_data_type=cd.data_type.FLOAT,
                                compute_data_type=cd.data_type.FLOAT, handle=handle)
        self.offsets: Dict[Tuple[str, int], object] = {}
        k = key
        self.q = self.ragged("q", "q", [k.b, k.h, k.sq, k.d], *k.strides[0])
        self.k = self.ragged("k", "kv", [k.b, k.g, k.skv, k.d], *k.strides[1])
        self.v = self.ragged("v", "kv", [k.b, k.g, k.skv, k.d], *k.strides[2])
        lengths = dict(dim=[k.b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cd.data_type.INT32)
        self.seq_q = self.graph.tensor(name="seq_q", **lengths)
        self.seq_kv = self.graph.tensor(name="seq_kv", **lengths)

    def offset(self, side: str, token_stride: int):
        if (side, token_stride) not in self.offsets:
            self.offsets[(side, token_stride)] = self.graph.tensor(
                name=f"offset_{side}_{token_stride}", dim=[self.key.b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                data_type=_offset_dtypes()[0])
        return self.offsets[(side, token_stride)]

    def ragged(self, name: str, side: str, dim, token_stride: int, head_stride: int, output=None):
        """[b, heads, s, d] over packed rows: element (i, n, t, e) at offset_i + t·token_stride + n·head_stride + e."""
        stride = [dim[2] * token_stride, head_stride, token_stride, 1]
        t = output if output is not None else self.graph.tensor(name=name, dim=dim, stride=stride)
        if output is not None:
            t.set_output(True).set_dim(dim).set_stride(stride)
        t.set_ragged_offset(self.offset(side, token_stride))
        return t

    def mask_args(self) -> dict:
        cd, k = self.cd, self.key
        args = dict(attn_scale=k.scale, use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv)
        if k.band.left >= 0 or k.band.right >= 0:
            align = cd.diagonal_alignment.BOTTOM_RIGHT if k.band.bottom_right else cd.diagonal_alignment.TOP_LEFT
            args["diagonal_alignment"] = align
            if k.band.left >= 0:
                args["diagonal_band_left_bound"] = k.band.left + 1  # cuDNN keeps j > p - left_bound
            if k.band.right >= 0:
                args["diagonal_band_right_bound"] = k.band.right
        if k.d % 16 == 0:  # bounds the backward's workspace by the token count (cuDNN >= 9.6)
            args.update(max_total_seq_len_q=k.tq, max_total_seq_len_kv=k.tkv)
        return args

    def finish(self):
        g, cd = self.graph, self.cd
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as err:  # cudnnGraphNotSupportedError and the frontend's ValueErrors alike
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise CudnnFeUnsupported(f"cuDNN cannot build this attention graph ({first})") from err
        self.workspace = g.get_workspace_size()
        return self


def _build_forward(key: GraphKey, handle) -> _Builder:
    bld = _Builder(key, handle)
    o, stats = bld.graph.sdpa(name="sdpa", q=bld.q, k=bld.k, v=bld.v, generate_stats=True, **bld.mask_args())
    k = key
    bld.o = bld.ragged("o", "q", [k.b, k.h, k.sq, k.d], k.h * k.d, k.d, output=o)
    stats.set_output(True).set_data_type(bld.cd.data_type.FLOAT)
    stats.set_dim([k.b, k.h, k.sq, 1]).set_stride([k.h * k.sq, k.sq, 1, 1])
    bld.stats = stats
    return bld.finish()


def _build_backward(key: GraphKey, handle) -> _Builder:
    bld = _Builder(key, handle)
    k, g = key, bld.graph
    dense_o = dict(dim=[k.b, k.h, k.sq, k.d], stride=[k.sq * k.h * k.d, k.d, k.h * k.d, 1])
    bld.o = bld.ragged("o", "q", dense_o["dim"], k.h * k.d, k.d)
    bld.do = bld.ragged("do", "q", dense_o["dim"], k.h * k.d, k.d)
    bld.stats = g.tensor(name="stats", dim=[k.b, k.h, k.sq, 1], stride=[k.h * k.sq, k.sq, 1, 1],
                         data_type=bld.cd.data_type.FLOAT)
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=bld.q, k=bld.k, v=bld.v, o=bld.o, dO=bld.do, stats=bld.stats,
                                 use_deterministic_algorithm=k.deterministic, **bld.mask_args())
    bld.dq = bld.ragged("dq", "q", [k.b, k.h, k.sq, k.d], k.h * k.d, k.d, output=dq)
    bld.dk = bld.ragged("dk", "kv", [k.b, k.g, k.skv, k.d], k.g * k.d, k.d, output=dk)
    bld.dv = bld.ragged("dv", "kv", [k.b, k.g, k.skv, k.d], k.g * k.d, k.d, output=dv)
    return bld.finish()


def _graph(key: GraphKey, which: str, device: torch.device) -> _Builder:
    """The cached graph (or the cached reason it cannot be built)."""
    handle = _handle(device)
    with _lock:
        entry = _graphs.get((key, which))
        if entry is not None:
            _graphs.move_to_end((key, which))
    if entry is None:
        try:
            entry = (_build_forward if which == "fwd" else _build_backward)(key, handle)
        except CudnnFeUnsupported as err:
            entry = err
        with _lock:
            _graphs[(key, which)] = entry
            while len(_graphs) > _CACHE_SIZE:
                _graphs.popitem(last=False)
    if isinstance(entry, CudnnFeUnsupported):
        raise CudnnFeUnsupported(str(entry))
    return entry


def _execute(bld: _Builder, buffers: dict, cu_q, cu_kv, device) -> None:
    """Bind pointers (graph tensors -> device addresses) and run on the current stream."""
    pack = {t: x.data_ptr() for t, x in buffers.items()}
    b = bld.key.b
    cus = {"q": _pad_cu(cu_q, b), "kv": _pad_cu(cu_kv, b)}
    keep = []  # the small index tensors stay alive until the launch; after it the stream orders their reuse
    for (side, token_stride), t in bld.offsets.items():
        off = (cus[side].long() * token_stride).to(_offset_dtypes()[1])
        keep.append(off)
        pack[t] = off.data_ptr()
    seq_q, seq_kv = (c[1:] - c[:-1] for c in (cus["q"], cus["kv"]))
    keep += [seq_q, seq_kv]
    pack[bld.seq_q], pack[bld.seq_kv] = seq_q.data_ptr(), seq_kv.data_ptr()
    workspace = torch.empty(max(bld.workspace, 1), dtype=torch.uint8, device=device)
    try:
        bld.graph.execute(pack, workspace, handle=_handle(device))
    except Exception as err:  # the frontend's own exception types: one RuntimeError for the caller
        raise CudnnFeUnsupported(f"cuDNN attention graph failed to execute ({str(err).strip()[:200]})") from err


def _pad_cu(cu: torch.Tensor, b: int) -> torch.Tensor:
    """cu [n + 1] -> [b + 1] by repeating the last entry: the extra sequences are empty."""
    extra = b + 1 - cu.numel()
    return cu.contiguous() if extra == 0 else torch.cat([cu, cu[-1:].expand(extra)]).contiguous()


def graph_key(q, k, v, batch: int, max_q: int, max_kv: int, band: Band, scale: float) -> GraphKey:
    strides = tuple((t.stride(0), t.stride(1)) for t in (q, k, v))
    return GraphKey(q.device.index if q.device.index is not None else torch.cuda.current_device(), q.dtype,
                    bucket(batch), q.shape[1], k.shape[1], q.shape[2], bucket(max_q, 64), bucket(max_kv, 64),
                    bucket(q.shape[0], 64), bucket(k.shape[0], 64), strides, band, float(scale),
                    torch.are_deterministic_algorithms_enabled())


class CudnnFeFunction(torch.autograd.Function):
    """Attention on packed q [t_q, h, d], k/v [t_kv, g, d] with cuDNN's fused kernels (see the module
    docstring). Both graphs are built in the forward, so a graph cuDNN refuses is found while the
    caller can still choose another kernel."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, band: Band, scale: float, zero_fill: bool):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        key = graph_key(q, k, v, cu_q.numel() - 1, max_q, max_kv, band, scale)
        fwd = _graph(key, "fwd", q.device)
        if any(ctx.needs_input_grad[:3]):
            _graph(key, "bwd", q.device)
        # a query of a sequence with no keys is never written by the kernel: zero it when that can happen
        out = (torch.zeros if zero_fill else torch.empty)(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        stats = torch.empty(key.b, key.h, key.sq, 1, dtype=torch.float32, device=q.device)
        _execute(fwd, {fwd.q: q, fwd.k: k, fwd.v: v, fwd.o: out, fwd.stats: stats}, cu_q, cu_kv, q.device)
        ctx.save_for_backward(q, k, v, out, stats, cu_q, cu_kv)
        ctx.key, ctx.zero_fill = key, zero_fill
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, stats, cu_q, cu_kv = ctx.saved_tensors
        bwd = _graph(ctx.key, "bwd", q.device)
        new = torch.zeros if ctx.zero_fill else torch.empty
        dq = new(q.shape, dtype=q.dtype, device=q.device)
        dk = new(k.shape, dtype=k.dtype, device=k.device)
        dv = new(v.shape, dtype=v.dtype, device=v.device)
        buffers = {bwd.q: q, bwd.k: k, bwd.v: v, bwd.o: out, bwd.do: grad_out.contiguous(), bwd.stats: stats,
                   bwd.dq: dq, bwd.dk: dk, bwd.dv: dv}
        _execute(bwd, buffers, cu_q, cu_kv, q.device)
        return dq, dk, dv, None, None, None, None, None, None, None


def cudnn_fe_attention(q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, band: Band, scale: float,
                       same_lengths: bool) -> torch.Tensor:
    """q [t_q, h, d], k/v [t_kv, g, d] -> [t_q, h, d]. Raises CudnnFeUnsupported if cuDNN refuses."""
    return CudnnFeFunction.apply(q, k, v, cu_q, cu_kv, max_q, max_kv, band, scale, not same_lengths)

