"""Attention on cuDNN's fused flash-attention kernels through the cuDNN frontend (PyPI
nvidia-cudnn-frontend, import name `cudnn`; optional: `pip install te_parallel[cudnn]`), for packed
("thd") and dense (bshd/sbhd) inputs.

Packed: q [t_q, h, d], k/v [t_kv, g, d] (GQA native) are described to cuDNN as [b, h, s, d] tensors whose
sequence i starts at a ragged offset (cu_seqlens[i] · token stride elements); per-sequence lengths give
the padding mask. Dense: q [s, b, h, d] or [b, s, h, d] with any strides (head dim contiguous), described
as they lie; the output is written in the caller's layout, heads merged, and when q, k and v are views
that tile one tensor (the split of a fused QKV projection's output) their gradients are written into one
new tensor of that shape, so the projection's backward gets its gradient without a concatenation.
A causal mask or window is cuDNN's diagonal band (left bound = window left + 1, right bound = window
right, top-left or bottom-right aligned). Softmax statistics [b, h, s, 1] (fp32, natural log) go from
the forward to the backward graph. Attention dropout is cuDNN's Philox generator, seeded per call by a
draw from torch's CUDA generator (so torch.manual_seed, the TP RNG tracker's fork, activation
recomputation and CUDA graphs see it as any torch random op) and replayed by the backward from the same
seed.

Building a graph is slow (the frontend plans and compiles it), so graphs are cached per shape: the
batch, the longest sequences and the token counts are rounded up to quarter-octave buckets (at most
25 % above the true size; extra sequences have length 0; sequence and token buckets are multiples of
64, which also keeps cuDNN's backward away from its unsupported s_q = s_kv = 1), so a training run with
varying packs builds a few graphs, not one per step. Inputs may be strided views (q/k/v split from one
fused QKV output) as long as the head dim is contiguous; the strides are part of the key.
"""
from __future__ import annotations

import atexit
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
        else:
            atexit.register(_release)
        _frontend["module"] = cudnn
    return _frontend["module"]


def _release() -> None:
    """Drops the cached graphs and handles at interpreter exit, while the frontend's bindings and CUDA are
    still up: frontend objects still alive when the bindings are torn down make nanobind print a report of
    leaked instances, types and functions as the program ends (seen after CUDA-graphed layers)."""
    with _lock:
        _graphs.clear()
        _handles.clear()


# Traced code asks this (ops/attention_dispatch.py): dynamo calls it while tracing and keeps the answer as
# a constant. Traced, the first call's import and atexit registration would break the graph.
@torch.compiler.assume_constant_result
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
    strides: Tuple[Tuple[int, ...], ...]  # packed: (token, head) strides of q, k, v; dense: [b, h, s, d] strides
    band: Band
    scale: float
    deterministic: bool
    dropout: float = 0.0
    ragged: bool = True
    o_strides: Tuple[int, ...] = ()                # dense: [b, h, s, d] strides of o (and of dO)
    grad_strides: Tuple[Tuple[int, ...], ...] = ()  # dense: [b, h, s, d] strides of dq, dk, dv


def _handle(index: int):
    """The device's cuDNN handle, bound to the current stream at every call (the handle is shared by every
    caller on the device, each thread with its own current stream)."""
    try:
        handle = _handles.get(index)
        if handle is None:
            with _lock:
                if index not in _handles:
                    with torch.cuda.device(index):
                        _handles[index] = frontend().create_handle()
                handle = _handles[index]
        frontend().set_stream(handle, torch._C._cuda_getCurrentRawStream(index))
    except Exception as err:  # e.g. a frontend built for another cuDNN: the caller falls back
        raise CudnnFeUnsupported(f"cannot get a cuDNN handle ({str(err).strip()[:200]})") from err
    return handle


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _io_type(dtype: torch.dtype):
    cd = frontend()
    return cd.data_type.BFLOAT16 if dtype == torch.bfloat16 else cd.data_type.HALF


def _offset_dtypes():
    """Ragged offsets are int64 from cuDNN 9.6 on, int32 before: (cudnn type, torch dtype)."""
    cd = frontend()
    return (cd.data_type.INT64, torch.int64) if cd.backend_version() >= 90600 else (cd.data_type.INT32, torch.int32)


class _Builder:
    """One pygraph with the tensors both graphs share: q, k, v, the lengths and ragged offsets (packed),
    the dropout seed and offset."""

    def __init__(self, key: GraphKey, handle):
        cd = frontend()
        self.key, self.cd = key, cd
        self.graph = cd.pygraph(io_data_type=_io_type(key.dtype), intermediate_data_type=cd.data_type.FLOAT,
                                compute_data_type=cd.data_type.FLOAT, handle=handle)
        self.offsets: Dict[Tuple[str, int], object] = {}
        k = key
        self.q = self.io("q", "q", [k.b, k.h, k.sq, k.d], k.strides[0])
        self.k = self.io("k", "kv", [k.b, k.g, k.skv, k.d], k.strides[1])
        self.v = self.io("v", "kv", [k.b, k.g, k.skv, k.d], k.strides[2])
        self.seq_q = self.seq_kv = self.seed = self.philox_offset = None
        if k.ragged:
            lengths = dict(dim=[k.b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cd.data_type.INT32)
            self.seq_q = self.graph.tensor(name="seq_q", **lengths)
            self.seq_kv = self.graph.tensor(name="seq_kv", **lengths)
        if k.dropout > 0:
            scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cd.data_type.INT64)
            self.seed = self.graph.tensor(name="dropout_seed", **scalar)
            self.philox_offset = self.graph.tensor(name="dropout_offset", **scalar)

    def io(self, name: str, side: str, dim, strides, output=None):
        """A [b, heads, s, d] graph tensor: packed rows from ragged offsets ((token, head) strides) or, dense,
        the given [b, h, s, d] strides."""
        if self.key.ragged:
            return self.ragged(name, side, dim, *strides, output=output)
        t = output if output is not None else self.graph.tensor(name=name, dim=dim, stride=list(strides))
        if output is not None:
            t.set_output(True).set_dim(dim).set_stride(list(strides))
        return t

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
        args = dict(attn_scale=k.scale)
        if k.ragged:
            args.update(use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv)
        if k.band.left >= 0 or k.band.right >= 0:
            align = cd.diagonal_alignment.BOTTOM_RIGHT if k.band.bottom_right else cd.diagonal_alignment.TOP_LEFT
            args["diagonal_alignment"] = align
            if k.band.left >= 0:
                args["diagonal_band_left_bound"] = k.band.left + 1  # cuDNN keeps j > p - left_bound
            if k.band.right >= 0:
                args["diagonal_band_right_bound"] = k.band.right
        if k.ragged and k.d % 16 == 0:  # bounds the backward's workspace by the token count (cuDNN >= 9.6)
            args.update(max_total_seq_len_q=k.tq, max_total_seq_len_kv=k.tkv)
        if k.dropout > 0:
            args["dropout"] = (k.dropout, self.seed, self.philox_offset)
        return args

    def finish(self):
        self.workspace = build_plans(self.graph)
        return self


def build_plans(g) -> int:
    """Validate a described pygraph and build its execution plans; -> its workspace size in bytes. Raises
    CudnnFeUnsupported with cuDNN's first line when it refuses the graph."""
    cd = frontend()
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as err:  # cudnnGraphNotSupportedError and the frontend's ValueErrors alike
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CudnnFeUnsupported(f"cuDNN cannot build this attention graph ({first})") from err
    return g.get_workspace_size()


def _o_strides(key: GraphKey):
    return (key.h * key.d, key.d) if key.ragged else key.o_strides


def _build_forward(key: GraphKey, handle, dump: bool = False) -> _Builder:
    bld = _Builder(key, handle)
    k = key
    extra = {}
    if dump:  # tests: the dropout mask as 0/1 floats [b, h, s_q, s_kv]
        bld.dump = bld.graph.tensor(name="rng_dump", dim=[k.b, k.h, k.sq, k.skv],
                                    stride=[k.h * k.sq * k.skv, k.sq * k.skv, k.skv, 1], data_type=bld.cd.data_type.FLOAT)
        extra["rng_dump"] = bld.dump
    o, stats = bld.graph.sdpa(name="sdpa", q=bld.q, k=bld.k, v=bld.v, generate_stats=True, **bld.mask_args(), **extra)
    bld.o = bld.io("o", "q", [k.b, k.h, k.sq, k.d], _o_strides(k), output=o)
    stats.set_output(True).set_data_type(bld.cd.data_type.FLOAT)
    stats.set_dim([k.b, k.h, k.sq, 1]).set_stride([k.h * k.sq, k.sq, 1, 1])
    bld.stats = stats
    return bld.finish()


def _build_backward(key: GraphKey, handle) -> _Builder:
    bld = _Builder(key, handle)
    k, g = key, bld.graph
    dim_o = [k.b, k.h, k.sq, k.d]
    bld.o = bld.io("o", "q", dim_o, _o_strides(k))
    bld.do = bld.io("do", "q", dim_o, _o_strides(k))
    bld.stats = g.tensor(name="stats", dim=[k.b, k.h, k.sq, 1], stride=[k.h * k.sq, k.sq, 1, 1],
                         data_type=bld.cd.data_type.FLOAT)
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=bld.q, k=bld.k, v=bld.v, o=bld.o, dO=bld.do, stats=bld.stats,
                                 use_deterministic_algorithm=k.deterministic, **bld.mask_args())
    grads = ((k.h * k.d, k.d), (k.g * k.d, k.d), (k.g * k.d, k.d)) if k.ragged else k.grad_strides
    bld.dq = bld.io("dq", "q", [k.b, k.h, k.sq, k.d], grads[0], output=dq)
    bld.dk = bld.io("dk", "kv", [k.b, k.g, k.skv, k.d], grads[1], output=dk)
    bld.dv = bld.io("dv", "kv", [k.b, k.g, k.skv, k.d], grads[2], output=dv)
    return bld.finish()


def _graph(key: GraphKey, which: str) -> _Builder:
    """The cached graph (or the cached reason it cannot be built)."""
    build = {"fwd": _build_forward, "bwd": _build_backward,
             "fwd_dump": lambda k, h: _build_forward(k, h, dump=True)}[which]
    return cached_graph(key, which, build)


def cached_graph(key, which: str, build):
    """The graph `build(key, handle)` made for (key, which), from the cache shared by every attention graph
    of the process (bf16 and FP8; key.device names the device), or the cached reason it cannot be built."""
    with _lock:
        entry = _graphs.get((key, which))
        if entry is not None:
            _graphs.move_to_end((key, which))
    if entry is None:
        handle = _handle(key.device)
        try:
            entry = build(key, handle)
        except CudnnFeUnsupported as err:
            entry = CudnnFeUnsupported(str(err))  # the reason alone: a kept traceback would keep the graph's objects
        with _lock:
            _graphs[(key, which)] = entry
            while len(_graphs) > _CACHE_SIZE:
                _graphs.popitem(last=False)
    if isinstance(entry, CudnnFeUnsupported):
        raise CudnnFeUnsupported(str(entry))
    return entry


def _execute(bld: _Builder, buffers: dict, cu_q, cu_kv, device, seed=None) -> None:
    """Bind the buffers to the graph's tensors and run on the current stream. Tensors, not their addresses:
    the frontend reads a tensor natively and describes a bare address in Python, slot by slot (up to a
    fifth of a small attention call's host time)."""
    pack = dict(buffers)
    keep = []  # the small index tensors stay alive until the launch; after it the stream orders their reuse
    if bld.key.ragged:
        b = bld.key.b
        cus = {"q": _pad_cu(cu_q, b), "kv": _pad_cu(cu_kv, b)}
        for (side, token_stride), t in bld.offsets.items():
            off = (cus[side].long() * token_stride).to(_offset_dtypes()[1])
            keep.append(off)
            pack[t] = off
        seq_q, seq_kv = (c[1:] - c[:-1] for c in (cus["q"], cus["kv"]))
        keep += [seq_q, seq_kv]
        pack[bld.seq_q], pack[bld.seq_kv] = seq_q, seq_kv
    if bld.seed is not None:
        pack[bld.seed], pack[bld.philox_offset] = seed, _zero(device)
    workspace = torch.empty(max(bld.workspace, 1), dtype=torch.uint8, device=device)
    try:
        bld.graph.execute(pack, workspace, handle=_handle(bld.key.device))
    except Exception as err:  # the frontend's own exception types: one RuntimeError for the caller
        raise CudnnFeUnsupported(f"cuDNN attention graph failed to execute ({str(err).strip()[:200]})") from err


def _pad_cu(cu: torch.Tensor, b: int) -> torch.Tensor:
    """cu [n + 1] -> [b + 1] by repeating the last entry: the extra sequences are empty."""
    extra = b + 1 - cu.numel()
    return cu.contiguous() if extra == 0 else torch.cat([cu, cu[-1:].expand(extra)]).contiguous()


_zeros: Dict[int, torch.Tensor] = {}


def _zero(device: torch.device) -> torch.Tensor:
    """The Philox offset cuDNN reads (int64 0): each call has a seed of its own instead."""
    index = _index(device)
    if index not in _zeros:
        _zeros[index] = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=torch.device("cuda", index))
    return _zeros[index]


def dropout_seed(device: torch.device) -> torch.Tensor:
    """int64 [1, 1, 1, 1] on the GPU, drawn from torch's CUDA generator (one small kernel)."""
    return torch.randint(0, 2 ** 62, (1, 1, 1, 1), dtype=torch.int64, device=device)


def graph_key(q, k, v, batch: int, max_q: int, max_kv: int, band: Band, scale: float, dropout: float = 0.0) -> GraphKey:
    strides = tuple((t.stride(0), t.stride(1)) for t in (q, k, v))
    return GraphKey(_index(q.device), q.dtype,
                    bucket(batch), q.shape[1], k.shape[1], q.shape[2], bucket(max_q, 64), bucket(max_kv, 64),
                    bucket(q.shape[0], 64), bucket(k.shape[0], 64), strides, band, float(scale),
                    torch.are_deterministic_algorithms_enabled(), float(dropout))


class CudnnFeFunction(torch.autograd.Function):
    """Attention on packed q [t_q, h, d], k/v [t_kv, g, d] with cuDNN's fused kernels (see the module
    docstring). Both graphs are built in the forward, so a graph cuDNN refuses is found while the
    caller can still choose another kernel."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, band: Band, scale: float, zero_fill: bool,
                dropout: float):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        key = graph_key(q, k, v, cu_q.numel() - 1, max_q, max_kv, band, scale, dropout)
        fwd = _graph(key, "fwd")
        if any(ctx.needs_input_grad[:3]):
            _graph(key, "bwd")
        # a query of a sequence with no keys is never written by the kernel: zero it when that can happen
        out = (torch.zeros if zero_fill else torch.empty)(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        stats = torch.empty(key.b, key.h, key.sq, 1, dtype=torch.float32, device=q.device)
        seed = dropout_seed(q.device) if dropout > 0 else None
        _execute(fwd, {fwd.q: q, fwd.k: k, fwd.v: v, fwd.o: out, fwd.stats: stats}, cu_q, cu_kv, q.device, seed)
        ctx.save_for_backward(q, k, v, out, stats, cu_q, cu_kv, seed)
        ctx.key, ctx.zero_fill = key, zero_fill
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, stats, cu_q, cu_kv, seed = ctx.saved_tensors
        bwd = _graph(ctx.key, "bwd")
        new = torch.zeros if ctx.zero_fill else torch.empty
        dq = new(q.shape, dtype=q.dtype, device=q.device)
        dk = new(k.shape, dtype=k.dtype, device=k.device)
        dv = new(v.shape, dtype=v.dtype, device=v.device)
        buffers = {bwd.q: q, bwd.k: k, bwd.v: v, bwd.o: out, bwd.do: grad_out.contiguous(), bwd.stats: stats,
                   bwd.dq: dq, bwd.dk: dk, bwd.dv: dv}
        _execute(bwd, buffers, cu_q, cu_kv, q.device, seed)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def cudnn_fe_attention(q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, band: Band, scale: float,
                       same_lengths: bool, dropout: float = 0.0) -> torch.Tensor:
    """q [t_q, h, d], k/v [t_kv, g, d] -> [t_q, h, d]. Raises CudnnFeUnsupported if cuDNN refuses."""
    return CudnnFeFunction.apply(q, k, v, cu_q, cu_kv, max_q, max_kv, band, scale, not same_lengths, dropout)


# -- dense inputs ----------------------------------------------------------------------------------

_tilings: "OrderedDict[tuple, bool]" = OrderedDict()


def _tiles(parts, base: torch.Tensor) -> bool:
    """Whether the views `parts` of the contiguous `base` ([n0, n1, ...] with the same two outer dims)
    cover each of its elements exactly once: every (i, j) row of `base` is split among them, as the
    q/k/v views of a fused projection's output are. Checked once per geometry."""
    rel = tuple(t.storage_offset() - base.storage_offset() for t in parts)
    geometry = (tuple(base.shape),) + tuple((tuple(t.shape), t.stride(), off) for t, off in zip(parts, rel))
    hit = _tilings.get(geometry)
    if hit is None:
        hit = _tiles_rows(parts, rel, base.numel())
        _tilings[geometry] = hit
        while len(_tilings) > 64:
            _tilings.popitem(last=False)
    return hit


def _tiles_rows(parts, rel, numel: int) -> bool:
    outer = {(t.shape[0], t.shape[1], t.stride(0), t.stride(1)) for t in parts}
    if len(outer) != 1:
        return False
    n0, n1, s0, s1 = outer.pop()
    if s0 != n1 * s1 or numel != n0 * n1 * s1:
        return False
    count = torch.zeros(s1, dtype=torch.int32)
    for t, off in zip(parts, rel):
        last = off + sum((n - 1) * st for n, st in zip(t.shape[2:], t.stride()[2:]))
        if off < 0 or last >= s1 or min(t.stride()[2:]) < 0:
            return False
        index = torch.arange(s1).as_strided(t.shape[2:], t.stride()[2:], off).reshape(-1)
        count.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return bool((count == 1).all())


def shared_base(q, k, v):
    """The tensor q, k and v are views of when together they tile it (a fused QKV output split into q, k,
    v), else None."""
    base = q._base
    if (base is None or k._base is not base or v._base is not base or not base.is_contiguous()
            or base.dtype != q.dtype or q.numel() + k.numel() + v.numel() != base.numel()):
        return None
    return base if _tiles([q, k, v], base) else None


def _bhsd_strides(t: torch.Tensor, sbhd: bool) -> Tuple[int, ...]:
    """Strides of t ([s, b, n, d] or [b, s, n, d]) seen as [b, n, s, d]."""
    st = t.stride()
    return (st[1], st[2], st[0], st[3]) if sbhd else (st[0], st[2], st[1], st[3])


def _contiguous_bhsd(shape, sbhd: bool) -> Tuple[int, ...]:
    """The [b, n, s, d] strides of a contiguous tensor of `shape` ([s, b, n, d] or [b, s, n, d])."""
    n, d = shape[2], shape[3]
    return (n * d, d, shape[1] * n * d, 1) if sbhd else (shape[1] * n * d, d, n * d, 1)


def dense_key(q, k, v, sbhd: bool, band: Band, scale: float, dropout: float, shared: bool) -> GraphKey:
    s_dim, b_dim = (0, 1) if sbhd else (1, 0)
    b, h, d = q.shape[b_dim], q.shape[2], q.shape[3]
    strides = tuple(_bhsd_strides(t, sbhd) for t in (q, k, v))
    grads = strides if shared else tuple(_contiguous_bhsd(t.shape, sbhd) for t in (q, k, v))
    o_strides = _contiguous_bhsd((q.shape[0], q.shape[1], h, v.shape[3]), sbhd)
    return GraphKey(_index(q.device), q.dtype,
                    b, h, k.shape[2], d, q.shape[s_dim], k.shape[s_dim], 0, 0, strides, band, float(scale),
                    torch.are_deterministic_algorithms_enabled(), float(dropout), False, o_strides, grads)


class CudnnFeDenseFunction(torch.autograd.Function):
    """Attention on dense q [s, b, h, d] (sbhd) or [b, s, h, d], k/v with g heads, read where they lie;
    output in the same layout with heads merged. dq, dk, dv go into one new tensor shaped like q's base
    when q, k, v tile it (see `shared_base`), else each into a contiguous tensor of its shape."""

    @staticmethod
    def forward(ctx, q, k, v, sbhd: bool, band: Band, scale: float, dropout: float):
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            q, k, v = (t.contiguous() for t in (q, k, v))
        base = shared_base(q, k, v)
        key = dense_key(q, k, v, sbhd, band, scale, dropout, base is not None)
        fwd = _graph(key, "fwd")
        if any(ctx.needs_input_grad[:3]):
            _graph(key, "bwd")
        out = torch.empty(q.shape[0], q.shape[1], q.shape[2] * v.shape[3], dtype=q.dtype, device=q.device)
        stats = torch.empty(key.b, key.h, key.sq, 1, dtype=torch.float32, device=q.device)
        seed = dropout_seed(q.device) if dropout > 0 else None
        _execute(fwd, {fwd.q: q, fwd.k: k, fwd.v: v, fwd.o: out, fwd.stats: stats}, None, None, q.device, seed)
        ctx.save_for_backward(q, k, v, out, stats, seed)
        ctx.key = key
        ctx.base = None if base is None else (base.shape, [t.storage_offset() - base.storage_offset() for t in (q, k, v)])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, stats, seed = ctx.saved_tensors
        bwd = _graph(ctx.key, "bwd")
        if ctx.base is not None:
            shape, offsets = ctx.base
            grad_base = torch.empty(shape, dtype=q.dtype, device=q.device)
            dq, dk, dv = (grad_base.as_strided(t.shape, t.stride(), off) for t, off in zip((q, k, v), offsets))
        else:
            dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        buffers = {bwd.q: q, bwd.k: k, bwd.v: v, bwd.o: out, bwd.do: grad_out.contiguous(), bwd.stats: stats,
                   bwd.dq: dq, bwd.dk: dk, bwd.dv: dv}
        _execute(bwd, buffers, None, None, q.device, seed)
        return dq, dk, dv, None, None, None, None


def cudnn_fe_dense_attention(q, k, v, sbhd: bool, band: Band, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """q [s, b, h, d] (sbhd) or [b, s, h, d], k/v with g heads -> [s, b, h·d] or [b, s, h·d]. Raises
    CudnnFeUnsupported if cuDNN refuses."""
    return CudnnFeDenseFunction.apply(q, k, v, sbhd, band, scale, dropout)


def dropout_mask(key: GraphKey, q, k, v, seed: torch.Tensor, cu_q=None, cu_kv=None) -> torch.Tensor:
    """Tests: the 0/1 dropout mask [b, h, s_q, s_kv] (fp32) that the forward graph of `key` applies with
    `seed`, from the same graph with cuDNN's RNG dump (0 where the kernel skips masked-out tiles)."""
    bld = _graph(key, "fwd_dump")
    out = torch.empty(max(key.b * key.sq, key.tq) * key.h * key.d, dtype=q.dtype, device=q.device)
    stats = torch.empty(key.b, key.h, key.sq, 1, dtype=torch.float32, device=q.device)
    mask = torch.zeros(key.b, key.h, key.sq, key.skv, dtype=torch.float32, device=q.device)
    _execute(bld, {bld.q: q, bld.k: k, bld.v: v, bld.o: out, bld.stats: stats, bld.dump: mask}, cu_q, cu_kv, q.device, seed)
    return mask
