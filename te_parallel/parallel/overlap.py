"""Comm-GEMM overlap for sequence-parallel tensor parallelism: `initialize_ub` and the object it returns.

    ub = te.initialize_ub([seq * batch, hidden], tp_group, use_fp8=True, dtype=torch.bfloat16)
    layer = te.TransformerLayer(..., tp_group=tp_group, sequence_parallel=True,
                                ub_tp_comm_overlap=True, ub_comm=ub)

Unlike TE, the returned `CommOverlap` is handed to the modules (`ub_comm=`); nothing is registered in
a global under a string name. `ub_name` and `ub_cfgs` still pick per-GEMM settings (OverlapConfig).

What it overlaps (tp = group size, M = tokens of the whole sequence, every tensor [rows, features]):
    column fprop  y = AG(x)·Wᵀ        ring: GEMM the chunk held while the next chunk is pulled
    row fprop     y = RS(x·Wᵀ)        GEMM by destination chunk; each partial is pulled by its owner
                                      while the next is computed; the owner adds tp partials in fp32
    row dgrad     dx = AG(dy)·W       ring, as column fprop (the gathered dy is kept for wgrad)
    column bwd    AG(x) runs under dgrad; RS(dx) runs under wgrad (bulk, on side streams)
The bytes move with the copy engines over CUDA IPC mappings (csrc/comm_gemm_overlap), so the GEMMs
keep every SM; where IPC is impossible the same schedule runs over torch.distributed P2P.
"""
from __future__ import annotations

import datetime
import pickle
import socket
import time
import copy
import dataclasses
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from te_parallel.native import comm_overlap as native_comm
from te_parallel.parallel.groups import as_group, group_rank, group_size
from te_parallel.parallel.ub_transport import IpcTransport, P2PTransport, warn_fallback

from te_parallel.parallel.overlap_config import DEFAULT_OVERLAP, OverlapConfig

__all__ = ["initialize_ub", "CommOverlap", "OverlapConfig", "UB_NAMES"]

# TE's ub_name values, each with its fprop / dgrad / wgrad GEMMs.
UB_NAMES = ("qkv", "proj", "fc1", "fc2")
# TE ub_cfgs keys that tune SM-driven communication kernels; te_parallel's copies use copy engines.
_IGNORED_KEYS = {"num_sm", "cga_size", "set_sm_margin", "num_splits", "atomic_gemm", "fp8_buf",
                 "use_ce", "aggregate", "comm_priority", "gemm_priority", "pipeline_rs_overlap_first_gemm",
                 "is_reduce_scatter", "num_max_streams"}
_BOOTSTRAPS = ("store", "gloo", "nccl", "mpi")


def _parse_cfgs(ub_cfgs: Optional[Dict[str, dict]], default: OverlapConfig) -> Dict[str, OverlapConfig]:
    """{"<ub_name>_<fprop|dgrad|wgrad>": OverlapConfig}: `default` with each entry's fields replaced."""
    out: Dict[str, OverlapConfig] = {}
    valid = {f"{n}_{p}" for n in UB_NAMES for p in ("fprop", "dgrad", "wgrad")}
    fields = {f.name for f in dataclasses.fields(OverlapConfig)}
    for key, cfg in (ub_cfgs or {}).items():
        if key not in valid:
            raise ValueError(f"initialize_ub: ub_cfgs key {key!r} is not one of {sorted(valid)}")
        if not isinstance(cfg, dict):
            raise ValueError(f"initialize_ub: ub_cfgs[{key!r}] must be a dict, got {type(cfg).__name__}")
        unknown = set(cfg) - _IGNORED_KEYS - fields
        if unknown:
            raise ValueError(f"initialize_ub: ub_cfgs[{key!r}] has unknown keys {sorted(unknown)}; "
                             f"known: OverlapConfig's {sorted(fields)} and TE's {sorted(_IGNORED_KEYS)}")
        try:
            out[key] = dataclasses.replace(default, **{k: v for k, v in cfg.items() if k in fields})
        except (TypeError, ValueError) as err:
            raise ValueError(f"initialize_ub: ub_cfgs[{key!r}]: {err}") from None
    return out


class CommOverlap:
    """The communicator of one TP group for comm-GEMM overlap; made by `initialize_ub`.

    transport: "ipc" (CUDA IPC + copy engines) or "p2p" (torch.distributed point-to-point).

    Its ops can be captured in CUDA graphs (te_parallel.make_graphed_callables, torch.cuda.graph) and
    replayed any number of times, between eager ops too: the transports keep no per-op state (the
    IPC flags are cleared by their readers, see ub_transport). Every rank of the group must issue or
    replay the same ops in the same order, since the ranks pair their ops by order alone.
    """

    def __init__(self, shape: Sequence[int], tp_group, use_fp8: bool, dtype: torch.dtype,
                 cfgs: Dict[str, OverlapConfig], transport, exchange: "_Exchange",
                 default: OverlapConfig = DEFAULT_OVERLAP, ub_cfgs: Optional[Dict[str, dict]] = None) -> None:
        self.shape, self.tp_group, self.use_fp8, self.dtype = tuple(shape), tp_group, use_fp8, dtype
        self.exchange = exchange
        self.tp_size, self.rank = group_size(tp_group), group_rank(tp_group)
        self.cfgs, self.default, self.ub_cfgs, self.transport = cfgs, default, dict(ub_cfgs or {}), transport
        # ops issued from the host (tests and benchmarks check the path); replays of a captured graph
        # run its ops again without issuing them, so they do not count here
        self.counts = {"all_gather": 0, "reduce_scatter": 0}

    @property
    def transport_name(self) -> str:
        return self.transport.name

    def config(self, ub_name: Optional[str], gemm: str) -> OverlapConfig:
        """The OverlapConfig of GEMM `gemm` ("fprop", "dgrad", "wgrad") of the layer named ub_name."""
        return self.cfgs.get(f"{ub_name}_{gemm}", self.default) if ub_name else self.default

    def with_config(self, config: OverlapConfig) -> "CommOverlap":
        """This communicator (the same buffers, transport and op counters) with `config` as the default
        OverlapConfig of its GEMMs; initialize_ub's ub_cfgs entries still change fields of it per GEMM.
        Modules built with the returned object schedule their overlapped GEMMs by it."""
        if not isinstance(config, OverlapConfig):
            raise TypeError(f"CommOverlap.with_config: need a te_parallel.OverlapConfig, got {type(config).__name__}")
        other = copy.copy(self)
        other.default, other.cfgs = config, _parse_cfgs(self.ub_cfgs, config)
        return other

    def check_group(self, owner: str, tp_group) -> None:
        if tp_group is not self.tp_group:
            raise ValueError(f"{owner}: ub_comm was initialised for another tp_group; pass the same group to "
                             f"initialize_ub and to the module")

    def mark_inputs_ready(self):
        """A marker (CUDA event, or None off-GPU) after the work that produced an exchange's input, so
        work issued between it and `all_gather(after=...)` does not delay the exchange."""
        return self.transport.mark()

    def all_gather(self, x_local: torch.Tensor, out: Optional[torch.Tensor] = None, after=None):
        """Start gathering dim 0; the handle's chunk(src) / wait() give the pieces / the whole.
        after: a `mark_inputs_ready()` marker (default: everything issued so far)."""
        self.counts["all_gather"] += 1
        return self.transport.all_gather(x_local, out, after)

    def reduce_scatter(self, rows: int, cols: int, dtype: torch.dtype, device, pieces: int = 1):
        """Start a reduce-scatter of [rows, cols] partials; fill slot(d), call ready(d), then finish().
        pieces: row pieces a partial may be signalled and pulled in (the IPC transport; see its
        `pieces`, which may hold fewer when the chunk is short)."""
        self.counts["reduce_scatter"] += 1
        return self.transport.reduce_scatter(rows, cols, dtype, device, pieces)

    def gemm_rs(self, a: torch.Tensor, a_scale_inv, b: torch.Tensor, b_scale_inv, out_dtype: torch.dtype,
                pieces: int, fast_accum: bool = False, own_group: int = 1) -> torch.Tensor:
        """Row-parallel GEMM + reduce-scatter in one native call (IPC transport; see IpcTransport.gemm_rs)."""
        self.counts["reduce_scatter"] += 1
        return self.transport.gemm_rs(a, a_scale_inv, b, b_scale_inv, out_dtype, pieces, fast_accum, own_group)

    def ag_gemm(self, a: torch.Tensor, a_scale_inv, b: torch.Tensor, b_scale_inv, bias, out_dtype: torch.dtype,
                keep_gathered: bool, fast_accum: bool = False):
        """All-gather + GEMM in one native call (IPC transport; see IpcTransport.ag_gemm)."""
        self.counts["all_gather"] += 1
        return self.transport.ag_gemm(a, a_scale_inv, b, b_scale_inv, bias, out_dtype, keep_gathered, fast_accum)

    def destroy(self) -> None:
        """Free the shared buffers. Collective: every rank first finishes its GPU work and waits for the
        others, since a peer may still be signalling into this rank's flags after this rank is done."""
        if self.transport.name == "ipc":
            torch.cuda.synchronize()
            self.exchange.allgather_obj(None, step="destroy barrier")
        self.transport.close()

    def __repr__(self) -> str:
        return (f"CommOverlap(shape={self.shape}, tp_size={self.tp_size}, transport={self.transport_name!r}, "
                f"use_fp8={self.use_fp8}, dtype={self.dtype})")


def initialize_ub(shape: Sequence[int], tp_group, use_fp8: bool = False, dtype: torch.dtype = torch.bfloat16,
                  ub_cfgs: Optional[Dict[str, dict]] = None, bootstrap_backend: Optional[str] = None,
                  timeout: float = 120.0, config: OverlapConfig = DEFAULT_OVERLAP) -> CommOverlap:
    """Collective over `tp_group`: make the buffers for overlapping its all-gathers / reduce-scatters.

    shape: [tokens of the whole sequence (s·b), hidden], the largest activation an overlapped GEMM
    moves. tp_group: the ProcessGroup of the layers or their 1-D DeviceMesh (an int equal to the world
    size is accepted for TE code that passes tp_size, and means the world group). bootstrap_backend: how IPC handles are
    exchanged: "store" (the default: torch.distributed's key-value store), "gloo"/"nccl" (an all-gather
    on tp_group) or "mpi" (mpi4py, under mpirun). Every wait of the exchange is bounded by `timeout`
    seconds and fails with the rank and the step that did not complete. config: the OverlapConfig of
    every overlapped GEMM; ub_cfgs ({"<ub_name>_<fprop|dgrad|wgrad>": {field: value}}, TE's form)
    changes fields of it for single GEMMs.
    """
    tp_group = _resolve_group(tp_group)
    tp = group_size(tp_group)
    if tp < 2:
        raise ValueError(f"initialize_ub: tp_group has {tp} rank(s); comm-GEMM overlap needs tensor parallelism (>= 2)")
    if len(shape) != 2 or any(not isinstance(d, int) or d < 1 for d in shape) or shape[0] % tp:
        raise ValueError(f"initialize_ub: shape={list(shape)}; need [tokens, hidden] positive ints with tokens "
                         f"divisible by tp_size={tp}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"initialize_ub: dtype={dtype}; need torch.bfloat16, torch.float16 or torch.float32")
    backend = bootstrap_backend or "store"
    if backend not in _BOOTSTRAPS:
        raise ValueError(f"initialize_ub: bootstrap_backend={bootstrap_backend!r}; need one of {_BOOTSTRAPS}")
    if not isinstance(config, OverlapConfig):
        raise TypeError(f"initialize_ub: config must be a te_parallel.OverlapConfig, got {type(config).__name__}")
    cfgs = _parse_cfgs(ub_cfgs, config)
    rank = group_rank(tp_group)
    exchange = _Exchange(tp_group, backend, timeout)
    chunk_bytes = shape[0] // tp * shape[1] * torch.empty((), dtype=dtype).element_size()
    transport = _make_transport(tp_group, rank, tp, chunk_bytes, exchange)
    return CommOverlap(shape, tp_group, use_fp8, dtype, cfgs, transport, exchange, config, ub_cfgs)


def _resolve_group(tp_group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_ub: torch.distributed is not initialised; init_process_group first")
    if isinstance(tp_group, int):
        if tp_group != dist.get_world_size():
            raise ValueError(f"initialize_ub: got tp_size={tp_group} (an int) but the world has "
                             f"{dist.get_world_size()} ranks; pass the tensor-parallel ProcessGroup instead")
        return dist.group.WORLD
    group = as_group("initialize_ub", "tp_group", tp_group)[0]  # a ProcessGroup or a 1-D DeviceMesh
    if group is None:
        raise TypeError("initialize_ub: tp_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got None")
    return group


def _device_of(tp_group) -> torch.device:
    backend = dist.get_backend(tp_group)
    if backend == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _make_transport(tp_group, rank: int, tp: int, chunk_bytes: int, exchange: "_Exchange"):
    """IPC when every rank can use it (decided together, so no two ranks pick differently)."""
    device = _device_of(tp_group)
    reason = None
    if device.type != "cuda":
        reason = "the tp_group runs on CPU (gloo)"
    elif not native_comm.usable():
        reason = "te_parallel._C is absent (built without nvcc)"
    hosts = exchange.allgather_obj((socket.gethostname(), reason), step="host check")
    reasons = [r for _, r in hosts if r]
    if len({h for h, _ in hosts}) > 1:
        reasons.append("the TP group spans several hosts (CUDA IPC works within one node)")
    if not reasons:
        try:
            transport = IpcTransport(rank, tp, chunk_bytes, exchange.allgather_bytes, device)
            failure = None
        except RuntimeError as err:  # e.g. no peer access between these GPUs
            transport, failure = None, str(err).splitlines()[0]
        failures = [f for f in exchange.allgather_obj(failure, step="IPC mapping check") if f]
        if not failures:
            return transport
        if transport is not None:
            transport.close()
        reasons.append(f"CUDA IPC failed ({failures[0]})")
    warn_fallback(reasons[0])
    return P2PTransport(tp_group, rank, tp, chunk_bytes)


class _Exchange:
    """Bounded all-gathers of small host payloads over the TP group, for bootstrapping."""

    def __init__(self, tp_group, backend: str, timeout: float) -> None:
        self.group, self.backend, self.timeout = tp_group, backend, timeout
        self.rank, self.tp = group_rank(tp_group), group_size(tp_group)
        self.ranks = [dist.get_global_rank(tp_group, r) for r in range(self.tp)]
        self.round = 0
        _Exchange.calls = getattr(_Exchange, "calls", 0) + 1
        self.tag = f"te_parallel/ub/{'-'.join(map(str, self.ranks))}/{_Exchange.calls}"

    OBJ_BYTES = 2048  # fixed, so that every rank (and, under MPI, every TP group) sends the same size

    def allgather_obj(self, obj, step: str) -> list:
        """A small picklable object (strings are cut to 400 characters) from every rank."""
        if isinstance(obj, tuple):
            obj = tuple(o[:400] if isinstance(o, str) else o for o in obj)
        elif isinstance(obj, str):
            obj = obj[:400]
        payload = pickle.dumps(obj)
        n = self.OBJ_BYTES
        data = self.allgather_bytes(len(payload).to_bytes(4, "little") + payload.ljust(n - 4, b"\0"), step=step)
        chunks = [data[i * n : (i + 1) * n] for i in range(self.tp)]
        return [pickle.loads(c[4 : 4 + int.from_bytes(c[:4], "little")]) for c in chunks]

    def allgather_bytes(self, payload: bytes, step: str = "IPC handle exchange") -> bytes:
        """Every rank's `payload` (same length on all) concatenated in TP rank order."""
        self.round += 1
        what = f"initialize_ub (rank {self.rank} of the TP group, {step})"
        if self.backend == "store":
            return self._via_store(payload, what)
        if self.backend == "mpi":
            return self._via_mpi(payload, what)
        return self._via_collective(payload, what)

    def _via_store(self, payload: bytes, what: str) -> bytes:
        store = dist.distributed_c10d._get_default_store()
        key = f"{self.tag}/{self.round}"
        store.set(f"{key}/{self.rank}", payload)
        keys = [f"{key}/{r}" for r in range(self.tp)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as err:  # DistStoreError (a RuntimeError) on timeout
            missing = [r for r in range(self.tp) if not store.check([f"{key}/{r}"])]
            raise TimeoutError(f"{what}: ranks {missing} of the TP group did not join within {self.timeout:.0f} s "
                               f"({type(err).__name__})") from None
        return b"".join(store.get(k) for k in keys)

    def _via_collective(self, payload: bytes, what: str) -> bytes:
        device = _device_of(self.group)
        send = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        recv = torch.empty(self.tp * len(payload), dtype=torch.uint8, device=device)
        work = dist.all_gather_into_tensor(recv, send, group=self.group, async_op=True)
        _poll(work.is_completed, self.timeout, what)
        work.wait()
        return bytes(recv.cpu().numpy())

    def _via_mpi(self, payload: bytes, what: str) -> bytes:
        try:
            from mpi4py import MPI
        except ImportError:
            raise RuntimeError(f"{what}: bootstrap_backend='mpi' needs mpi4py (pip install mpi4py)") from None
        world = MPI.COMM_WORLD
        # One non-blocking all-gather over the MPI world (a deadline needs a non-blocking call); this TP
        # group's entries are picked out by global rank (mpirun ranks = torch.distributed ranks).
        send = bytearray(payload)
        recv = bytearray(len(payload) * world.Get_size())
        req = world.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        _poll(req.Test, self.timeout, what)
        n = len(payload)
        return b"".join(bytes(recv[g * n : (g + 1) * n]) for g in self.ranks)


def _poll(done, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the TP group did not complete the exchange within {timeout:.0f} s "
                               f"(a rank never called initialize_ub?)")
        time.sleep(0.001)
