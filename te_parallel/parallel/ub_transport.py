"""How comm-GEMM overlap moves bytes between the ranks of one TP group: CUDA IPC + copy engines, or
torch.distributed point-to-point as the fallback. Both offer the same two exchanges:

  all-gather      [m, c] per rank -> chunks of every rank, each awaitable on its own (`AllGather`)
  reduce-scatter  [tp·m, c] partials per rank, filled chunk by chunk by the caller -> [m, c] of the
                  sum on its owner (`ReduceScatter`); the owner adds the tp partials in fp32, in rank
                  order, once

Tensors here are plain ("a tensor": bf16, fp32 or the uint8 view of FP8 bytes); FP8 scales travel
beside them, in the caller's Float8Tensor.

IPC protocol. Per channel (all-gather AG, reduce-scatter RS) every ordered pair producer P ->
consumer C shares one region (AG: C's slot for P, which P pushes into; RS: P's slot for C, which C
pulls from) and two uint32 flags, both 0 at the start:
  ready  in C's flags, set by P, cleared by C: v > 0 = P's data up to piece v is in the region
  busy   in P's flags, set by P, cleared by C: 1 = C may still be reading what P shared last
One op, for every pair:
  P: claim busy (wait busy == 0, set busy = 1), write the region, signal ready = v
  C: wait ready >= v, read the region, release (clear ready, then, fenced, clear busy on P)
v is 1, or j+1 for piece j of a reduce-scatter sent in row pieces (C waits for each piece and
releases once, after the last). The all-gather pushes (P copies into every consumer's region), the
reduce-scatter pulls (the owner of a chunk reads each peer's region), so results live in ordinary
torch memory with ordinary lifetimes; only the small send regions are shared. Waits and signals are
stream memory operations: no host round trip, no SM. Copies go straight between the two GPUs
(NVLink/NVSwitch nodes are fully connected), in ring order me+1, me+2, ... so that at each step every
rank talks to a different peer. The native calls (IpcTransport.gemm_rs / ag_gemm,
te_parallel.native.comm_overlap) run the same protocol on the same flags.

Why a captured op replays safely. Every value above is a constant of its call site; nothing counts
ops, and the transport keeps no per-op host state. A pair's flags go around one cycle per op,
(ready, busy) = (0, 0) -> claim (0, 1) -> signal (v, 1) -> release (0, 0), so every op starts and
ends in the same state and means the same whether it is the first eager op, the thousandth, or the
k-th replay of a graph captured from it (a graph replays the constants it captured). Within a cycle:
  - P writes the region only between its claim and its signal; the claim passes only at busy == 0,
    and since P itself set busy = 1 at its previous claim, only C's release of the previous op can
    have cleared it: P never overwrites what C is still reading.
  - C reads only between its wait and its release; ready > 0 only from P's signal of this op to C's
    own clear, and P cannot set it again before C's release (its next claim waits for the busy
    clear, which C fences after the ready clear): C never reads a stale or a future op's data.
  - Clears cannot overtake sets: P's busy = 1 is fenced before its ready signal, which C sees before
    it clears busy; C's ready clear is fenced before its busy clear, which P sees before it sets
    ready again.
(Flags compared with a per-op generation number fixed at issue time would fail exactly here: after
one replay they hold the capture's largest number, and every wait of the next replay passes at
once.) The ranks pair their ops by order alone, so every rank must issue (or replay) the same ops in
the same order, eagerly or from graphs. tests/test_overlap_capture.py runs this host code against a
model of the GPUs that replays recorded ops and reports any race.

The point-to-point transport keeps no state between ops either: each op posts its own sends and
receives, which NCCL pairs by order, so it is captured and replayed as issued.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.native import comm_overlap as native_comm
from te_parallel.native import launch_on

AG, RS = 0, 1  # channels: all-gather (one chunk region) and reduce-scatter (tp chunk regions)


def _slot_stride(nbytes: int) -> int:
    """Distance between a reduce-scatter's send slots: the same on every rank, and in the native call."""
    return -(-nbytes // 256) * 256


def reduce_sum_reference(parts: List[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """sum(parts) accumulated in fp32 in list order, rounded once (the native kernel's math)."""
    acc = parts[0].to(torch.float32).clone()
    for p in parts[1:]:
        acc += p.to(torch.float32)
    return acc.to(out_dtype)


# The CUDA stream calls of the IPC schedules, in one place (tests/test_overlap_capture.py replaces them
# with a model of the GPU's streams to check the protocol on the CPU).
def _current(device: torch.device) -> int:
    """The current cudaStream_t of `device` as an int (torch's C binding: the Python wrapper builds a
    Stream object per call, and an overlapped layer step asks ~40 times)."""
    return launch_on(device)[1]


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def _event(stream, timing: bool) -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(stream)
    return ev


def _on(stream):
    """Context: `stream` is the current stream."""
    return torch.cuda.stream(stream)


def _keep(t: torch.Tensor, stream) -> None:
    """t's memory is used on `stream` too (the caching allocator keeps it until that work is done)."""
    t.record_stream(stream)


def _check_gather(t, x_local: torch.Tensor) -> int:
    nbytes = x_local.numel() * x_local.element_size()
    if nbytes > t.chunk_bytes:
        raise ValueError(f"comm-GEMM overlap: all-gather chunk of {tuple(x_local.shape)} {x_local.dtype} is "
                         f"{nbytes} bytes; the buffer from initialize_ub holds {t.chunk_bytes} per chunk "
                         f"(pass a larger shape to initialize_ub)")
    return nbytes


def _check_scatter(t, rows: int, cols: int, dtype: torch.dtype) -> int:
    if rows % t.tp:
        raise ValueError(f"comm-GEMM overlap: reduce-scatter of {rows} rows over {t.tp} ranks; rows must divide")
    nbytes = rows // t.tp * cols * torch.empty((), dtype=dtype).element_size()
    if nbytes > t.chunk_bytes:
        raise ValueError(f"comm-GEMM overlap: reduce-scatter of [{rows}, {cols}] {dtype} needs {nbytes} bytes per "
                         f"chunk; the buffer from initialize_ub holds {t.chunk_bytes} (pass a larger shape)")
    return nbytes


class _CudaArray:
    """Exposes a raw device allocation to torch.as_tensor (zero-copy, via __cuda_array_interface__)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class IpcTransport:
    """CUDA IPC buffers shared by the TP group (te_parallel.native.comm_overlap.Communicator) and
    copy-engine copies."""

    name = "ipc"

    def __init__(self, rank: int, tp: int, chunk_bytes: int, bootstrap, device: torch.device) -> None:
        chunk_bytes = -(-chunk_bytes // 256) * 256
        total = chunk_bytes * 2 * tp
        with torch.cuda.device(device):
            comm = native_comm.Communicator(rank, tp, total, 2 * 2 * tp, bootstrap)
            own = torch.as_tensor(_CudaArray(comm.buffer(rank), total), device=device)
            streams = {AG: torch.cuda.Stream(device), RS: torch.cuda.Stream(device)}
        self._attach(rank, tp, chunk_bytes, device, comm, own, streams)

    def _attach(self, rank: int, tp: int, chunk_bytes: int, device, comm, own: torch.Tensor, streams) -> None:
        """The transport's state, all of it fixed at construction: no op changes it (see the module
        docstring), which is what lets a captured op replay."""
        self.rank, self.tp, self.device, self.chunk_bytes = rank, tp, device, chunk_bytes
        self.offsets = {AG: 0, RS: tp * chunk_bytes}  # [AG: tp chunk slots | RS: tp chunk slots]
        self.comm, self.own, self.streams = comm, own, streams
        self.raw = {ch: st.cuda_stream for ch, st in streams.items()}  # the side streams' handles
        self.timing = False  # True: record timed events around every pull (benchmarks' overlap proof)

    # flags on every rank: [channel][ready | busy][peer]
    def _ready(self, ch: int, peer: int) -> int:
        """Own flag that `peer` sets when its data for this rank is there."""
        return (2 * ch) * self.tp + peer

    def _busy(self, ch: int, peer: int) -> int:
        """Own flag set while `peer` may still read what this rank shared with it (peer clears it)."""
        return (2 * ch + 1) * self.tp + peer

    def _peer_addr(self, ch: int, peer: int) -> int:
        return self.comm.buffer(peer) + self.offsets[ch]

    def _own_view(self, ch: int, nbytes: int) -> torch.Tensor:
        start = self.offsets[ch]
        return self.own[start : start + nbytes]

    def _peers(self):
        return [(self.rank + k) % self.tp for k in range(1, self.tp)]

    def mark(self):
        return _event(_current_stream(self.device), False)

    def all_gather(self, x_local: torch.Tensor, out: Optional[torch.Tensor], after=None) -> "IpcAllGather":
        return IpcAllGather(self, x_local, out, after)

    def reduce_scatter(self, rows: int, cols: int, dtype: torch.dtype, device, pieces: int = 1) -> "IpcReduceScatter":
        return IpcReduceScatter(self, rows, cols, dtype, pieces)

    def gemm_rs(self, a: torch.Tensor, a_scale_inv: Optional[torch.Tensor], b: torch.Tensor,
                b_scale_inv: Optional[torch.Tensor], out_dtype: torch.dtype, pieces: int,
                fast_accum: bool = False, own_group: int = 1) -> torch.Tensor:
        """Row-parallel GEMM + reduce-scatter in one native call (tep_comm_gemm_rs): the [m, n] sum over
        ranks of a[rows of me]·bᵀ. a [tp·m, k], b [n, k]: contiguous, both FP8 (with their scale_inv)
        or both bf16/fp16. Same flags and values as IpcReduceScatter, so the two can alternate.
        own_group: pulled pieces per GEMM of the own partial."""
        rows = a.shape[0]
        n = b.shape[0]
        m = rows // self.tp
        nbytes = _check_scatter(self, rows, n, out_dtype)
        spans = row_pieces(m, pieces)
        stream = _current(self.device)
        out = torch.empty((m, n), dtype=out_dtype, device=self.device)
        received = torch.empty((self.tp - 1, m, n), dtype=out_dtype, device=self.device)
        starts = [r for r, _ in spans] + [m] if len(spans) > 1 else []
        self.comm.gemm_rs(a, a_scale_inv, b, b_scale_inv, out, received, send_offset=self.offsets[RS],
                          slot_stride=_slot_stride(nbytes), piece_starts=starts, own_group=own_group,
                          ready_flag=self._ready(RS, 0), busy_flag=self._busy(RS, 0), stream=stream,
                          side_stream=self.raw[RS], fast_accum=fast_accum)
        _keep(received, self.streams[RS])  # (the copies write it there)
        return out

    def ag_gemm(self, a: torch.Tensor, a_scale_inv: Optional[torch.Tensor], b: torch.Tensor,
                b_scale_inv: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                keep_gathered: bool, fast_accum: bool = False):
        """Column-parallel all-gather + GEMM in one native call (tep_comm_ag_gemm): (out [tp·m, n] =
        AG(a)·bᵀ (+ bias), the gathered a [tp·m, k] if keep_gathered else None). Operands as gemm_rs;
        the same flags and values as IpcAllGather, so the two can alternate."""
        m, k = a.shape
        n = b.shape[0]
        _check_gather(self, a)
        stream = _current(self.device)
        out = torch.empty((self.tp * m, n), dtype=out_dtype, device=self.device)
        gathered = torch.empty((self.tp * m, k), dtype=a.dtype, device=self.device) if keep_gathered else None
        self.comm.ag_gemm(a, a_scale_inv, b, b_scale_inv, bias, out, gathered, recv_offset=self.offsets[AG],
                          slot_bytes=self.chunk_bytes, ready_flag=self._ready(AG, 0), busy_flag=self._busy(AG, 0),
                          stream=stream, side_stream=self.raw[AG], fast_accum=fast_accum)
        _keep(a, self.streams[AG])  # (the pushes read it there)
        return out, gathered

    def close(self) -> None:
        self.own = None
        self.comm.close()


class IpcAllGather:
    """Push: each rank copies its chunk into every peer's AG region (slot = its rank) with the copy
    engine, in the order the peers consume it; `chunk(src)` makes the caller's stream wait for src's
    flag and returns the slot itself (no copy); `release(src)` after the GEMM that read it tells src
    the slot may be overwritten. (A local copy into one's own region would not do: an intra-GPU
    copy may wait for SMs the GEMM holds; copies to a peer go through the copy engines.) After the
    last release the caller's stream waits for this rank's pushes (in a captured graph, the join of
    the side stream's branch)."""

    def __init__(self, t: IpcTransport, x_local: torch.Tensor, out: Optional[torch.Tensor], after=None) -> None:
        if not x_local.is_contiguous():
            raise ValueError("comm-GEMM overlap: the all-gather input must be contiguous")
        self.t, self.m, self.x_local, self.full = t, x_local.shape[0], x_local, out
        self.nbytes = _check_gather(t, x_local)
        s = t.streams[AG]
        if after is None:
            s.wait_stream(_current_stream(t.device))  # x_local is ready
        else:
            s.wait_event(after)
        comm, sp = t.comm, t.raw[AG]
        self.events: Dict[int, torch.cuda.Event] = {}
        self.push_started: Dict[int, torch.cuda.Event] = {}
        for k in range(1, t.tp):  # rank me-k multiplies my chunk at its step k: push to it k-th
            p = (t.rank - k) % t.tp
            comm.claim([t._busy(AG, p)], sp)  # p finished reading my slot of the last gather
            if t.timing:
                self.push_started[p] = _event(s, True)
            comm.copy(t._peer_addr(AG, p) + t.rank * t.chunk_bytes, x_local.data_ptr(), self.nbytes, sp)
            comm.signal(p, t._ready(AG, t.rank), 1, sp)
            self.events[p] = _event(s, t.timing)
        self.pushed = self.events[(t.rank + 1) % t.tp] if t.tp > 1 else None  # (the last push)
        _keep(x_local, s)
        self.released = set()

    def _slot(self, src: int) -> torch.Tensor:
        start = self.t.offsets[AG] + src * self.t.chunk_bytes
        flat = self.t.own[start : start + self.nbytes].view(self.x_local.dtype)
        return flat.view(self.x_local.shape)

    def chunk(self, src: int) -> torch.Tensor:
        """src's rows, on the caller's stream (which waits for src's push)."""
        if src == self.t.rank:
            return self.x_local
        self.t.comm.wait(self.t._ready(AG, src), 1, _current(self.t.device))
        return self._slot(src)

    def release(self, src: int) -> None:
        """The caller's stream is done reading src's slot (issue after the GEMM that used it)."""
        t = self.t
        if src == t.rank or src in self.released:
            return
        self.released.add(src)
        if self.full is not None:
            self.full[src * self.m : (src + 1) * self.m].copy_(self._slot(src))
        t.comm.release(t._ready(AG, src), src, t._busy(AG, t.rank), _current(t.device))
        if len(self.released) == t.tp - 1:
            _current_stream(t.device).wait_event(self.pushed)

    def wait(self) -> torch.Tensor:
        """The whole gathered tensor (`out` given at the start), on the caller's stream."""
        self.full[self.t.rank * self.m : (self.t.rank + 1) * self.m].copy_(self.x_local)
        for src in self.t._peers():
            if src not in self.released:  # (a released chunk was already waited for and copied)
                self.chunk(src)
                self.release(src)
        return self.full


def row_pieces(m: int, pieces: int) -> List[Tuple[int, int]]:
    """`pieces` row ranges covering [0, m), as even as multiples of 16 rows allow (FP8 GEMMs need
    16-row multiples); fewer when m is too short, never an empty one."""
    bounds = sorted({min(m, round(m * j / pieces / 16) * 16) for j in range(pieces)} | {m})
    starts = [b for b in bounds if b < m] or [0]
    return [(a, b) for a, b in zip(starts, starts[1:] + [m])]


class IpcReduceScatter:
    """The caller writes the partial for destination d into `slot(d)` (a view of the shared buffer)
    and calls `ready(d)`; `finish()` pulls the partials meant for this rank and adds them in fp32.

    Pieces: a partial may be written and signalled in row pieces (`ready(d, piece=j)`, rows
    `pieces[j]`) and pulled piece by piece (`pull_step(k, piece=j)`), so its owner starts pulling
    before the whole partial exists. `received(src, j)` then gives a pulled piece on the caller's
    stream, for a GEMM that adds it in its epilogue (`finish_accumulated` replaces the sum).

    Flags: the op claims this rank's busy flags first (every consumer released the previous op's
    partials); piece j is ready at value j+1 (a whole partial at len(pieces)); the owner releases a
    producer after its last pull from it. The RS stream forks from the caller's stream here and
    joins it again in `wait` / `finish_accumulated`."""

    def __init__(self, t: IpcTransport, rows: int, cols: int, dtype: torch.dtype, pieces: int = 1) -> None:
        self.t, self.m, self.cols, self.dtype = t, rows // t.tp, cols, dtype
        nbytes = _check_scatter(t, rows, cols, dtype)
        self.nbytes, self.stride = nbytes, _slot_stride(nbytes)  # slot d at d·stride
        self.pieces = row_pieces(self.m, pieces)
        cur = _current_stream(t.device)
        # The fork comes before the claim: the pulls must not wait for what the claim waits for (the
        # peers' pulls of this rank's previous partials).
        t.streams[RS].wait_stream(cur)
        if t.tp > 1:  # GEMMs write the send slots next: every consumer is done with the last op
            t.comm.claim([t._busy(RS, p) for p in t._peers()], cur.cuda_stream)
        self.partials = self.t._own_view(RS, t.tp * t.chunk_bytes)
        self.received_buf, self.parts, self.pulls = None, {t.rank: self._own_slot(t.rank)}, []
        self.pulled: Dict[int, set] = {}  # src -> pieces pulled
        self.piece_events: Dict[tuple, torch.cuda.Event] = {}

    def _own_slot(self, d: int) -> torch.Tensor:
        start = d * self.stride
        return self.partials[start : start + self.nbytes].view(self.dtype).view(self.m, self.cols)

    def slot(self, d: int) -> torch.Tensor:
        return self._own_slot(d)

    def full(self) -> Optional[torch.Tensor]:
        """All tp slots as one [tp·m, cols] tensor when they are packed back to back, else None."""
        if self.stride != self.nbytes:
            return None
        return self.partials[: self.t.tp * self.nbytes].view(self.dtype).view(self.t.tp * self.m, self.cols)

    def ready(self, d: int, piece: Optional[int] = None) -> None:
        """Rows `pieces[piece]` of slot d are written (None: the whole slot)."""
        if d != self.t.rank:
            value = len(self.pieces) if piece is None else piece + 1
            self.t.comm.signal(d, self.t._ready(RS, self.t.rank), value, _current(self.t.device))

    def pull_step(self, k: int, piece: Optional[int] = None) -> None:
        """Issue, on the RS stream, the pull of the partial that rank me-k computed for this rank at its
        step k (1 <= k < tp): one piece, or (None) every piece not pulled yet. It waits for that rank's
        ready flag, so issue it only after this rank's own step-k GEMM and ready(): with
        CUDA_DEVICE_MAX_CONNECTIONS=1 all streams share one hardware queue and a stream wait blocks
        everything issued after it, including work a peer is waiting for."""
        t, comm = self.t, self.t.comm
        s = t.streams[RS]
        if self.received_buf is None:
            with _on(s):  # memory owned by the copy stream (it writes first)
                self.received_buf = torch.empty((t.tp - 1, self.m, self.cols), dtype=self.dtype, device=t.device)
        src, sp = (t.rank - k) % t.tp, t.raw[RS]
        done = self.pulled.setdefault(src, set())
        todo = [j for j in (range(len(self.pieces)) if piece is None else [piece]) if j not in done]
        if not todo:
            return
        whole = len(todo) == len(self.pieces)  # one copy for the whole partial
        comm.wait(t._ready(RS, src), len(self.pieces) if whole else todo[-1] + 1, sp)
        started = _event(s, True) if t.timing else None
        row_bytes = self.cols * self.received_buf.element_size()
        for a, b in ([(0, self.m)] if whole else [self.pieces[j] for j in todo]):
            comm.copy(self.received_buf[k - 1, a:b].data_ptr(), t._peer_addr(RS, src) + t.rank * self.stride + a * row_bytes,
                      (b - a) * row_bytes, sp)
        done.update(todo)
        if piece is not None:
            self.piece_events[(src, piece)] = _event(s, False)
        if len(done) == len(self.pieces):
            comm.release(t._ready(RS, src), src, t._busy(RS, t.rank), sp)
            self.parts[src] = self.received_buf[k - 1]
        if t.timing:
            self.pulls.append((started, _event(s, True)))

    def received(self, src: int, piece: int) -> torch.Tensor:
        """Rows `pieces[piece]` of src's partial for this rank, on the caller's stream (after its pull)."""
        self.pull_step((self.t.rank - src) % self.t.tp, piece)
        _current_stream(self.t.device).wait_event(self.piece_events[(src, piece)])
        a, b = self.pieces[piece]
        return self.received_buf[(self.t.rank - src) % self.t.tp - 1, a:b]

    def start_pulls(self) -> None:
        """All pulls (after every ready(d) of this rank has been issued)."""
        for k in range(1, self.t.tp):
            self.pull_step(k)

    def finish_accumulated(self, out: torch.Tensor) -> torch.Tensor:
        """`out` holds the sum already: GEMMs on the caller's stream added every received piece."""
        self.start_pulls()  # (nothing left, unless a piece was never used)
        cur = _current_stream(self.t.device)
        cur.wait_stream(self.t.streams[RS])  # the join: later work waits for the releases too
        _keep(self.received_buf, cur)
        self.out = out
        return out

    def finish(self, out_dtype: torch.dtype, async_op: bool = False) -> Optional[torch.Tensor]:
        """[m, cols] sum of the partials for this rank (after `start_pulls`), in fp32 in rank order.
        async_op: only the pulls are issued now; the sum runs on the caller's stream at `wait()`. Issue
        the work to overlap (the wgrad GEMM) between the two: with CUDA_DEVICE_MAX_CONNECTIONS=1 a
        kernel issued behind the pulls holds back everything issued after it until they end."""
        self.start_pulls()  # any step not pulled yet (each step is issued once)
        self.out_dtype, self.out = out_dtype, None
        return None if async_op else self.wait()

    def wait(self) -> torch.Tensor:
        if self.out is None:
            t = self.t
            cur = _current_stream(t.device)
            cur.wait_stream(t.streams[RS])  # pulls done (and the join)
            out = torch.empty((self.m, self.cols), dtype=self.out_dtype, device=t.device)
            self._sum([self.parts[r] for r in range(t.tp)], out, cur)
            _keep(self.received_buf, cur)
            self.out = out
        return self.out

    def _sum(self, parts, out, stream) -> None:
        native_comm.reduce_sum(parts, out, stream.cuda_stream)


class P2PTransport:
    """The same exchanges over torch.distributed isend/irecv on the TP group (any backend)."""

    name = "p2p"

    def __init__(self, group, rank: int, tp: int, chunk_bytes: int) -> None:
        self.group, self.rank, self.tp = group, rank, tp
        self.chunk_bytes = -(-chunk_bytes // 256) * 256  # the IPC limit, enforced alike so CPU runs catch it
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(tp)]

    def _peers(self):
        return [(self.rank + k) % self.tp for k in range(1, self.tp)]

    def mark(self) -> None:
        return None

    def all_gather(self, x_local: torch.Tensor, out: Optional[torch.Tensor], after=None) -> "P2PAllGather":
        return P2PAllGather(self, x_local, out)

    def reduce_scatter(self, rows: int, cols: int, dtype: torch.dtype, device, pieces: int = 1) -> "P2PReduceScatter":
        return P2PReduceScatter(self, rows, cols, dtype, device)  # (pieces: one message per partial)

    def close(self) -> None:
        pass


def _p2p(ops) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


class P2PAllGather:
    def __init__(self, t: P2PTransport, x_local: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        m = x_local.shape[0]
        self.t, self.m, self.x_local = t, m, x_local.contiguous()
        _check_gather(t, self.x_local)
        self.out = out if out is not None else torch.empty((t.tp * m, *x_local.shape[1:]), dtype=x_local.dtype,
                                                           device=x_local.device)
        if out is not None:
            self._rows(t.rank).copy_(self.x_local)
        self.works: Dict[int, list] = {}
        for k in range(1, t.tp):  # step k: send mine to me-k, receive me+k's
            dst, src = (t.rank - k) % t.tp, (t.rank + k) % t.tp
            ops = [dist.P2POp(dist.isend, self.x_local, t.global_ranks[dst], t.group),
                   dist.P2POp(dist.irecv, self._rows(src), t.global_ranks[src], t.group)]
            self.works[src] = _p2p(ops)

    def _rows(self, r: int) -> torch.Tensor:
        return self.out[r * self.m : (r + 1) * self.m]

    def chunk(self, src: int) -> torch.Tensor:
        if src == self.t.rank:
            return self.x_local
        for w in self.works.pop(src, []):
            w.wait()
        return self._rows(src)

    def release(self, src: int) -> None:
        """Chunks are received into the gathered tensor itself: nothing to hand back."""

    def wait(self) -> torch.Tensor:
        for src in list(self.works):
            self.chunk(src)
        return self.out


class P2PReduceScatter:
    def __init__(self, t: P2PTransport, rows: int, cols: int, dtype: torch.dtype, device) -> None:
        _check_scatter(t, rows, cols, dtype)
        self.t, self.m, self.cols, self.dtype = t, rows // t.tp, cols, dtype
        self.pieces = [(0, self.m)]  # one message per partial
        self.partials = torch.empty((rows, cols), dtype=dtype, device=device)
        self.works: list = []
        self.received: Dict[int, torch.Tensor] = {}

    def slot(self, d: int) -> torch.Tensor:
        return self.partials[d * self.m : (d + 1) * self.m]

    def full(self) -> torch.Tensor:
        return self.partials

    def pull_step(self, k: int) -> None:
        """Receives are posted with each send in `ready` (P2P pairs them step by step)."""

    def start_pulls(self) -> None:
        pass

    def ready(self, d: int) -> None:
        t = self.t
        if d == t.rank:
            return
        k = (d - t.rank) % t.tp  # the step at which this rank computes d's chunk; d receives from d-k = me
        src = (t.rank - k) % t.tp
        recv = torch.empty((self.m, self.cols), dtype=self.dtype, device=self.partials.device)
        self.received[src] = recv
        self.works += _p2p([dist.P2POp(dist.isend, self.slot(d), t.global_ranks[d], t.group),
                            dist.P2POp(dist.irecv, recv, t.global_ranks[src], t.group)])

    def finish(self, out_dtype: torch.dtype, async_op: bool = False) -> Optional[torch.Tensor]:
        """The sum now, or (async_op) at `wait()`, leaving the transfers in flight until then."""
        self.out_dtype, self.out = out_dtype, None
        return None if async_op else self.wait()

    def wait(self) -> torch.Tensor:
        if self.out is None:
            for w in self.works:
                w.wait()
            parts = [self.slot(r) if r == self.t.rank else self.received[r] for r in range(self.t.tp)]
            self.out = reduce_sum_reference(parts, self.out_dtype)
        return self.out


def warn_fallback(reason: str) -> None:
    warnings.warn(f"te_parallel comm-GEMM overlap: {reason}; the same ring runs over torch.distributed "
                  f"point-to-point instead of CUDA IPC + copy engines", stacklevel=3)
