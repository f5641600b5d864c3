"""The IPC flag protocol of comm-GEMM overlap on the CPU: eager ops, replays of captured graphs, both mixed.

The real host code (te_parallel.parallel.ub_transport's IPC schedules, driven by ops.linear_overlap)
runs against a recording model of CUDA. Its stream calls and the communicator's flag operations are
recorded per rank and stream, with every tensor access (a torch dispatch mode: a CPU op stands for
the kernel it would launch on the current stream). A capture records into a graph as stream capture
does, and refuses what CUDA refuses: work on a stream that never joined the capture, and a forked
stream not joined back at its end. A model of the GPUs then runs the recorded work of every rank
under random interleavings, eagerly or as graph launches (a replay runs the recorded values again),
and fails on a deadlock or a data race: two accesses to the same bytes, at least one a write, with
no happens-before between them (stream order, event waits, graph launch and completion, a flag wait
satisfied by a flag write). In "one queue" runs every rank's eager work also passes through one
hardware queue in issue order, where a command that cannot start holds back all later ones
(CUDA_DEVICE_MAX_CONNECTIONS=1). Negative controls show that the model catches a ready flag that is
never cleared (what per-op generation numbers amount to under replay), a producer that does not wait
for its consumers, and the capture errors.
"""
from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from te_parallel.ops import linear_overlap as ov
from te_parallel.parallel import ub_transport
from te_parallel.parallel.overlap_config import OverlapConfig
from te_parallel.parallel.ub_transport import AG, RS, IpcTransport

# ----------------------------------------------------------------------------------------------------
# Recording: CUDA streams, events and the communicator, per rank


@dataclass
class _Op:
    kind: str  # wait | write | record | wait_event | access | launch
    stream: str  # the stream's name within its rank (eager) or its graph
    args: tuple


@dataclass
class _Graph:
    ops: list = field(default_factory=list)


class _Stream:
    def __init__(self, rt: "_Runtime", name: str) -> None:
        self.rt, self.name, self.cuda_stream = rt, name, id(self)
        rt.streams[self.cuda_stream] = self

    def wait_stream(self, other: "_Stream") -> None:
        self.wait_event(_Event(self.rt, other))

    def wait_event(self, ev: "_Event") -> None:
        if ev.count:  # (CUDA: waiting for an event never recorded is a no-op)
            self.rt.issue(self, "wait_event", (ev.key, ev.count))


class _Event:
    keys = itertools.count()

    def __init__(self, rt: "_Runtime", stream=None) -> None:
        self.rt, self.key, self.count = rt, next(_Event.keys), 0
        if stream is not None:
            self.record(stream)

    def record(self, stream: _Stream) -> None:
        self.count += 1
        self.rt.issue(stream, "record", (self.key, self.count))


class _Runtime:
    """One rank's CUDA as the host code sees it: streams, the current stream, eager work, captures."""

    def __init__(self, rank: int) -> None:
        self.rank, self.streams = rank, {}
        self.main = self.current = _Stream(self, "main")
        self.program = []  # eager _Ops and ("launch", graph), in issue order
        self.capturing = None  # (graph, captured stream names, records made in the capture)

    def issue(self, stream: _Stream, kind: str, args: tuple) -> None:
        if self.capturing is None:
            self.program.append(_Op(kind, stream.name, args))
            return
        graph, members, recorded = self.capturing
        if stream.name not in members:
            if kind == "wait_event" and args in recorded:
                members.add(stream.name)  # the fork: the stream joins the capture
            else:
                raise AssertionError(f"rank {self.rank}: {kind} issued on stream {stream.name!r} during a capture it "
                                     f"never joined (CUDA would run it once, outside the graph)")
        if kind == "wait_event" and args not in recorded:
            raise AssertionError(f"rank {self.rank}: a captured wait on an event recorded outside the capture")
        if kind == "record":
            recorded.add(args)
        graph.ops.append(_Op(kind, stream.name, args))

    @contextlib.contextmanager
    def capture(self):
        """torch.cuda.graph: capture on a fresh stream; afterwards every forked stream must be joined."""
        graph, origin, previous = _Graph(), _Stream(self, f"capture{len(self.program)}"), self.current
        self.capturing, self.current = (graph, {origin.name}, set()), origin
        try:
            yield graph
        finally:
            self.capturing, self.current = None, previous
        _check_joined(self.rank, graph, origin.name)
        self.program.append(("launch", graph))


def _check_joined(rank: int, graph: _Graph, origin: str) -> None:
    """cudaStreamEndCapture fails unless the origin's last node depends on every stream's last node."""
    vc, records, last = {}, {}, {}
    for i, op in enumerate(graph.ops):
        clock = vc.setdefault(op.stream, {})
        clock[op.stream] = i + 1
        if op.kind == "record":
            records[op.args] = dict(clock)
        elif op.kind == "wait_event":
            for k, v in records[op.args].items():
                clock[k] = max(clock.get(k, 0), v)
        last[op.stream] = i + 1
    end = vc.get(origin, {})
    unjoined = sorted(s for s, i in last.items() if end.get(s, 0) < i)
    assert not unjoined, f"rank {rank}: streams {unjoined} not joined back before the capture ends"


class _Comm:
    """te_parallel.native.comm_overlap.Communicator's stream operations, recorded."""

    def __init__(self, model: "_World", rank: int) -> None:
        self.model, self.rank = model, rank

    def _issue(self, stream: int, kind: str, args: tuple) -> None:
        rt = self.model.runtimes[self.rank]
        rt.issue(rt.streams[stream], kind, args)

    def buffer(self, peer: int) -> int:
        return self.model.own[peer].data_ptr()

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._issue(stream, "access", (((src, src + nbytes),), ((dst, dst + nbytes),)))

    def signal(self, peer: int, flag: int, value: int, stream: int) -> None:
        self._issue(stream, "write", ((peer, flag), value))

    def wait(self, flag: int, value: int, stream: int) -> None:
        self._issue(stream, "wait", ((self.rank, flag), ">=", value))

    def claim(self, flags, stream: int) -> None:
        for f in flags:
            self._issue(stream, "wait", ((self.rank, f), "==", 0))
            self._issue(stream, "write", ((self.rank, f), 1))

    def release(self, flag: int, peer: int, peer_flag: int, stream: int) -> None:
        self._issue(stream, "write", ((self.rank, flag), 0))
        self._issue(stream, "write", ((peer, peer_flag), 0))


def _span(t: torch.Tensor):
    if t.numel() == 0:
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


class _Accesses(TorchDispatchMode):
    """Records each torch op (views and allocations aside) as an access on the current stream; keeps
    every tensor alive so that no address is reused while the model runs."""

    def __init__(self, model: "_World") -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            return out
        reads, writes = [], []
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        for a in func._schema.arguments:
            value = named.get(a.name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and _span(t):
                    (writes if a.alias_info is not None and a.alias_info.is_write else reads).append(_span(t))
                    self.model.alive.append(t)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and _span(t):
                writes.append(_span(t))
                self.model.alive.append(t)
        rt = self.model.runtimes[self.model.active]
        rt.issue(rt.current, "access", (tuple(reads), tuple(writes)))
        return out


class _World:
    """tp ranks of fake IPC transports in one process, each recording into its own _Runtime."""

    def __init__(self, tp: int, chunk_bytes: int, comm=_Comm) -> None:
        self.tp, self.active, self.alive = tp, 0, []
        self.runtimes = [_Runtime(r) for r in range(tp)]
        total = -(-chunk_bytes // 256) * 256 * 2 * tp
        self.own = [torch.zeros(total, dtype=torch.uint8) for _ in range(tp)]
        self.transports = []
        for r, rt in enumerate(self.runtimes):
            t = IpcTransport.__new__(IpcTransport)
            t._attach(r, tp, -(-chunk_bytes // 256) * 256, torch.device("cpu"), comm(self, r), self.own[r],
                      {AG: _Stream(rt, "ag"), RS: _Stream(rt, "rs")})
            self.transports.append(t)

    @contextlib.contextmanager
    def on_rank(self, rank: int, monkeypatch):
        """Host code in the block runs as `rank`'s, its stream work recorded."""
        self.active = rank
        rt = self.runtimes[rank]

        @contextlib.contextmanager
        def on(stream):
            previous, rt.current = rt.current, stream
            try:
                yield
            finally:
                rt.current = previous

        with monkeypatch.context() as mp:
            mp.setattr(ub_transport, "_current", lambda device: rt.current.cuda_stream)
            mp.setattr(ub_transport, "_current_stream", lambda device: rt.current)
            mp.setattr(ub_transport, "_event", lambda stream, timing: _Event(rt, stream))
            mp.setattr(ub_transport, "_on", on)
            mp.setattr(ub_transport, "_keep", lambda t, stream: None)
            mp.setattr(ub_transport.IpcReduceScatter, "_sum",
                       lambda self, parts, out, stream: out.copy_(ub_transport.reduce_sum_reference(parts, out.dtype)))
            with _Accesses(self):
                yield rt


# ----------------------------------------------------------------------------------------------------
# The model of the GPUs


class _Race(AssertionError):
    pass


class _Deadlock(AssertionError):
    pass


def _run(world: _World, one_queue: bool, seed: int) -> None:
    """Runs every rank's recorded program once and raises _Race / _Deadlock. Even seeds pick each
    step uniformly at random; odd seeds schedule by random thread priorities, with a few points where
    the running thread drops to the lowest priority (PCT: it finds orders that need a thread to stall
    at one precise point, which uniform choice rarely makes)."""
    sim = _Machine(world, one_queue)
    rng = random.Random(seed)
    priority, step = {}, 0
    drops = set(rng.sample(range(2 * len(sim.ops) + 3), 3))
    while True:
        actions = sim.actions()
        if not actions:
            break
        if seed % 2:
            what, i = max(actions, key=lambda a: priority.setdefault(sim.ops[a[1]][1], rng.random()))
            if step in drops:
                priority[sim.ops[i][1]] = -step
        else:
            what, i = rng.choice(actions)
        step += 1
        sim.dispatch(i) if what == "dispatch" else sim.finish(i)
    stuck = sim.stuck()
    if stuck:
        raise _Deadlock("no stream can go on:\n  " + "\n  ".join(stuck[:8]))
    left = {key: value for key, (value, _) in sim.flags.items() if value}
    assert not left, f"flags (rank, index) not back to 0 once all work is done: {left}"


class _Machine:
    """The recorded work of all ranks as threads of commands. A command is dispatched when the one
    before it on its thread is done (and, one_queue, when it heads its rank's queue) and its wait, if
    any, is satisfied; memory accesses (kernels, copies) run until finished at a random later step,
    everything else is done at once. Vector clocks carry happens-before."""

    PAGE = 1 << 16

    def __init__(self, world: _World, one_queue: bool) -> None:
        self.one_queue = one_queue
        self.ops = []  # (rank, thread, _Op, launch id or None)
        self.threads, self.queue, self.launches = {}, {}, {}
        for rank, rt in enumerate(world.runtimes):
            self.queue[rank] = []
            for item in rt.program:
                if isinstance(item, tuple):  # a graph launch on eager main; its nodes on threads of their own
                    lid = len(self.launches)
                    self.queue[rank].append(self._add(rank, (rank, "eager", "main"), _Op("launch", "main", (lid,))))
                    nodes = [self._add(rank, (rank, lid, op.stream), op, lid) for op in item[1].ops]
                    self.launches[lid] = {"op": self.queue[rank][-1], "nodes": nodes, "started": False,
                                          "left": len(nodes)}
                else:
                    self.queue[rank].append(self._add(rank, (rank, "eager", item.stream), item))
        self.state = ["todo"] * len(self.ops)  # todo -> running -> done
        self.pos = {t: 0 for t in self.threads}
        self.live = dict.fromkeys(self.threads)  # threads with work left (an ordered set)
        self.head = {r: 0 for r in self.queue}
        self.vc = {t: {} for t in self.threads}
        self.flags, self.records, self.pages = {}, {}, {}

    def _add(self, rank, thread, op, lid=None) -> int:
        self.ops.append((rank, thread, op, lid))
        self.threads.setdefault(thread, []).append(len(self.ops) - 1)
        return len(self.ops) - 1

    def actions(self) -> list:
        found = []
        for thread in self.live:
            i = self.threads[thread][self.pos[thread]]
            if self.state[i] == "todo" and self._ready(i):
                found.append(("dispatch", i))
            elif self.state[i] == "running" and self.ops[i][2].kind == "access":
                found.append(("finish", i))
        return found

    def stuck(self) -> list:
        out = []
        for thread, seq in self.threads.items():
            if self.pos[thread] < len(seq):
                rank, _, op, _ = self.ops[seq[self.pos[thread]]]
                out.append(f"rank {rank} stream {thread[1:]}: {op.kind} {op.args}")
        return out

    def _ready(self, i: int) -> bool:
        rank, _, op, lid = self.ops[i]
        if lid is None and self.one_queue and self.queue[rank][self.head[rank]] != i:
            return False
        if lid is not None and not self.launches[lid]["started"]:
            return False
        if op.kind == "wait":
            key, cmp, value = op.args
            now = self.flags.get(key, (0, {}))[0]
            return now >= value if cmp == ">=" else now == value
        if op.kind == "wait_event":
            return (lid, *op.args) in self.records
        return True

    @staticmethod
    def _join(clock: dict, other: dict) -> None:
        for k, v in other.items():
            if clock.get(k, 0) < v:
                clock[k] = v

    def dispatch(self, i: int) -> None:
        rank, thread, op, lid = self.ops[i]
        clock = self.vc[thread]
        clock[thread] = clock.get(thread, 0) + 1
        if lid is None:
            self.head[rank] += 1
        if op.kind == "wait":
            self._join(clock, self.flags.get(op.args[0], (0, {}))[1])
        elif op.kind == "write":
            self.flags[op.args[0]] = (op.args[1], dict(clock))
        elif op.kind == "record":
            self.records[(lid, *op.args)] = dict(clock)
        elif op.kind == "wait_event":
            self._join(clock, self.records[(lid, *op.args)])
        elif op.kind == "launch":
            launch = self.launches[op.args[0]]
            launch["started"] = True
            for n in launch["nodes"]:
                self.vc[self.ops[n][1]] = dict(clock)
            self.state[i] = "running"
            if not launch["nodes"]:
                self.finish(i)
            return
        elif op.kind == "access":
            self._access(i, clock)
            self.state[i] = "running"
            return
        self.finish(i)

    def _access(self, i: int, clock: dict) -> None:
        rank, thread, op, _ = self.ops[i]
        stamp = clock[thread]
        for spans, write in ((op.args[0], False), (op.args[1], True)):
            for lo, hi in spans:
                for page in range(lo // self.PAGE, (hi - 1) // self.PAGE + 1):
                    bucket = self.pages.setdefault(page, [])
                    for plo, phi, pwrite, pthread, pstamp, pi in bucket:
                        if (pi != i and plo < hi and lo < phi and (write or pwrite)
                                and clock.get(pthread, 0) < pstamp):
                            raise _Race(f"rank {rank} stream {thread[1:]} {'writes' if write else 'reads'} bytes that "
                                        f"stream {pthread[1:]} of rank {pthread[0]} {'wrote' if pwrite else 'read'}, "
                                        f"with nothing ordering the two")
                    bucket.append((lo, hi, write, thread, stamp, i))

    def finish(self, i: int) -> None:
        self.state[i] = "done"
        _, thread, _, lid = self.ops[i]
        self.pos[thread] += 1
        if self.pos[thread] == len(self.threads[thread]):
            del self.live[thread]
        if lid is not None:
            launch = self.launches[lid]
            launch["left"] -= 1
            if not launch["left"]:  # the graph is complete: its launching stream goes on after all of it
                main = self.ops[launch["op"]][1]
                for n in launch["nodes"]:
                    self._join(self.vc[main], self.vc[self.ops[n][1]])
                self.finish(launch["op"])


# ----------------------------------------------------------------------------------------------------
# What the ranks issue: the overlapped GEMMs of a TP + SP MLP step, forward and backward

M, H, F = 64, 32, 48  # rows per rank, hidden, ffn (per rank): small, so that pieces of 16 rows exist
PIECED = OverlapConfig(rs_pieces=4, rs_pieces_short_k=4, rs_min_piece_rows=16, native_schedule=False)
WHOLE = OverlapConfig(rs_pieces=1, rs_pieces_short_k=1, native_schedule=False)


class _Ub:
    """What ops.linear_overlap asks of a CommOverlap, on one rank's recording transport."""

    transport_name = "ipc"

    def __init__(self, t: IpcTransport) -> None:
        self.transport, self.tp_size, self.rank = t, t.tp, t.rank

    def mark_inputs_ready(self):
        return self.transport.mark()

    def all_gather(self, x_local, out=None, after=None):
        return self.transport.all_gather(x_local, out, after)

    def reduce_scatter(self, rows, cols, dtype, device, pieces=1):
        return self.transport.reduce_scatter(rows, cols, dtype, device, pieces)


def _fprop(w):
    return lambda a, out, c=None: ov.fprop_into(a, w, None, out, c)


def _column_fprop(ub, v):  # AG ring
    v["y1"] = ov.ag_gemm(ub, v["x"], _fprop(v["w1"]), F, torch.float32, keep_gathered=False)[0]  # [tp·M, F]


def _row_fprop(ub, v):  # pieced RS at TP=2 (whole partials at TP > 2), the received pieces added by the GEMMs
    ov.gemm_rs(ub, v["y1"], _fprop(v["w2"]), H, torch.float32, PIECED)  # [M, H]


def _row_dgrad(ub, v):  # AG ring, the gathered dy kept for wgrad
    v["dx1"] = ov.ag_gemm(ub, v["dy"], lambda a, out: ov.dgrad_into(a, v["w2"], out), F, torch.float32,
                          keep_gathered=True)[0]


def _column_bwd_bulk(ub, v):  # AG of x under dgrad, RS of dx under wgrad
    bulk = ov.BulkBackward(ub, v["x"])
    bulk.dgrad_rs(v["dx1"], v["w1"], ub.tp_size * M, H, torch.float32, torch.device("cpu"))
    torch.mm(v["dx1"].t(), bulk.x_full())  # wgrad, between the gather and the reduce-scatter's sum
    bulk.dx_local()


def _column_bwd_pipelined(ub, v):
    ov.dgrad_rs(ub, v["dx1"], v["w1"], torch.float32, PIECED)


def _row_fprop_whole(ub, v):  # whole partials and the fp32 sum, at every TP
    ov.gemm_rs(ub, v["y1"], _fprop(v["w2"]), H, torch.float32, WHOLE)


# Every schedule of the IPC transport's Python path, in the order a layer step issues them.
STEP = (_column_fprop, _row_fprop, _row_dgrad, _column_bwd_bulk, _column_bwd_pipelined, _row_fprop_whole)


def _inputs(rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)
    return {name: torch.randn(*shape, generator=g) for name, shape in
            (("x", (M, H)), ("w1", (F, H)), ("w2", (H, F)), ("dy", (M, H)))}


def _record(tp: int, monkeypatch, plan, comm=_Comm) -> _World:
    """Each rank issues `plan`, recorded rank after rank (no host code waits for a peer):
    "eager" runs a step; "capture" captures a step as one graph, "capture ops" as one graph per op
    (make_graphed_callables captures forward and backward apart); "launch" launches what the last
    capture made, in order."""
    world = _World(tp, M * max(H, F) * 4, comm)
    for rank in range(tp):
        with world.on_rank(rank, monkeypatch) as rt:
            v, ub, graphs = _inputs(rank), _Ub(world.transports[rank]), []
            for what in plan:
                if what == "eager":
                    for op in STEP:
                        op(ub, v)
                elif what.startswith("capture"):
                    graphs = []
                    for ops in ([STEP] if what == "capture" else [[op] for op in STEP]):
                        with rt.capture() as graph:
                            for op in ops:
                                op(ub, v)
                        rt.program.pop()  # (launched by the "launch" entries)
                        graphs.append(graph)
                else:
                    rt.program += [("launch", g) for g in graphs]
    return world


EAGER = ("eager", "eager")
GRAPHED = ("eager", "capture", "launch", "launch", "launch")  # warm-up, capture, replays
MIXED = ("eager", "capture ops", "launch", "eager", "launch", "launch", "eager")


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("plan", [EAGER, GRAPHED, MIXED], ids=["eager", "graphed", "mixed"])
def test_overlap_schedules_never_race_eager_or_replayed(tp, plan, monkeypatch):
    world = _record(tp, monkeypatch, plan)
    for seed in range(8):
        _run(world, one_queue=False, seed=seed)
        _run(world, one_queue=True, seed=seed)  # (the eager work through one queue; graphs run as graphs)


def test_capture_records_the_whole_step(monkeypatch):
    """The capture holds all of a step's communication, and nothing ran outside it."""
    world = _record(2, monkeypatch, ("capture",))
    eager = world.runtimes[0].program  # only the inputs' creation ran eagerly: every stream joined the capture
    assert eager and all(op.kind == "access" and op.stream == "main" for op in eager)
    world = _record(2, monkeypatch, ("eager", "capture"))  # (while an eager step works on all three streams)
    eager = [op for op in world.runtimes[0].program if isinstance(op, _Op)]
    assert {op.stream for op in eager} == {"main", "ag", "rs"}


class _StaleReady(_Comm):
    """A consumer that never clears the ready flag: the next op's wait passes on the last op's value,
    as every wait of a replay does when flags are compared with generation numbers fixed at capture
    (it reads too early, or waits forever where a smaller value replaced a larger one)."""

    def release(self, flag, peer, peer_flag, stream):
        self._issue(stream, "write", ((peer, peer_flag), 0))


class _NoClaimWait(_Comm):
    """A producer that takes its region back without waiting for the consumer's release."""

    def claim(self, flags, stream):
        for f in flags:
            self._issue(stream, "write", ((self.rank, f), 1))


@pytest.mark.parametrize("comm, failure", [(_StaleReady, (_Race, _Deadlock)), (_NoClaimWait, _Race)])
def test_the_model_catches_a_broken_protocol(comm, failure, monkeypatch):
    world = _record(2, monkeypatch, GRAPHED, comm)
    with pytest.raises(failure):
        for seed in range(8):
            _run(world, one_queue=False, seed=seed)


def test_the_model_catches_capture_errors(monkeypatch):
    world = _World(2, 4096)
    rt = world.runtimes[0]
    side = world.transports[0].streams[AG]
    with pytest.raises(AssertionError, match="never joined"):
        with rt.capture():
            side.wait_stream(side)  # work on a side stream that never forked from the capture
    with pytest.raises(AssertionError, match=r"streams \['ag'\] not joined back"):
        with rt.capture():
            side.wait_stream(rt.current)
            _Event(rt, side)
    with pytest.raises(_Deadlock):  # a wait nobody satisfies
        rt.program = [_Op("wait", "main", ((0, 0), ">=", 1))]
        _run(world, one_queue=False, seed=0)


def test_transport_state_is_fixed_at_construction(monkeypatch):
    """No op changes the transport (what a replay relies on): its attributes after a step are the
    ones it was built with."""
    world = _World(2, M * max(H, F) * 4)

    def state(t):
        return {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in vars(t).items()}

    before = [state(t) for t in world.transports]
    for rank in range(2):
        with world.on_rank(rank, monkeypatch):
            v, ub = _inputs(rank), _Ub(world.transports[rank])
            for op in STEP:
                op(ub, v)
    for t, attrs in zip(world.transports, before):
        after = state(t)
        assert after.keys() == attrs.keys()
        assert all(after[k][0] is obj and after[k][1] == copied for k, (obj, copied) in attrs.items())
