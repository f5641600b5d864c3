"""Bandwidth of the ways one GPU can move a reduce-scatter partial to another (two GPUs).

The overlap's reduce-scatter at TP=2 is bound by how fast a partial crosses NVLink while a GEMM runs
(docs/overlap.md). This measures, for the same bytes:
- copy engine, push (the source's stream issues cudaMemcpyAsync) and pull (the destination's stream);
- one direction, and both directions at once (what TP=2 does: each rank sends half its partial);
- SM-driven pull (tep_reduce_sum reading the peer's buffer: a copy with 1 input, the owner's
  pull-and-add with 2);
- each of them alone and beside a GEMM on both GPUs, with the GEMM's slowdown.

    python benchmarks/bench_p2p.py [--mib 32 64] [--json out.json]
    torchrun --nproc-per-node=2 benchmarks/bench_p2p.py --ipc    # between processes, as the overlap copies

With --ipc, each of two processes maps the other's buffer through te_parallel's communicator (CUDA IPC)
and the copies are tep_comm_copy calls on a side stream, exactly as the overlap issues them. It also
probes what one hardware queue serialises (run it with CUDA_DEVICE_MAX_CONNECTIONS=1 and unset): a GEMM
issued after [peer copy; one command] on a side stream, and how long it waits for the copy.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from typing import Callable, Dict, List

import torch


def _cudart() -> ctypes.CDLL:
    """The libcudart torch loaded (found in /proc/self/maps), so streams and peer access are shared."""
    torch.zeros(1, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    if not paths:
        raise RuntimeError("bench_p2p: torch's libcudart is not loaded in this process; need a CUDA build of torch")
    lib = ctypes.CDLL(paths[0])
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def _enable_peer_access(rt: ctypes.CDLL) -> None:
    for dev, peer in ((0, 1), (1, 0)):
        with torch.cuda.device(dev):
            err = rt.cudaDeviceEnablePeerAccess(peer, 0)
            if err not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
                raise RuntimeError(f"bench_p2p: cudaDeviceEnablePeerAccess({dev} -> {peer}) failed with error {err}")
            rt.cudaGetLastError()


def _time_on_streams(jobs: Dict[int, Callable[[], None]], streams: Dict[int, torch.cuda.Stream],
                     reps: int, repeats: int = 5) -> Dict[int, float]:
    """Median ms per call of each job, every job issued `reps` times back to back on its own stream, all
    jobs started together (both devices synchronised first)."""
    per: Dict[int, List[float]] = {k: [] for k in jobs}
    for _ in range(repeats + 1):
        for dev in (0, 1):
            torch.cuda.synchronize(dev)
        events = {}
        for key, job in jobs.items():
            s = streams[key]
            with torch.cuda.device(s.device), torch.cuda.stream(s):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(s)
                for _ in range(reps):
                    job()
                end.record(s)
                events[key] = (start, end)
        for key, (start, end) in events.items():
            end.synchronize()
            per[key].append(start.elapsed_time(end) / reps)
    return {k: statistics.median(v[1:]) for k, v in per.items()}


def _queue_rows(comm, peer, side, main_s, gemm, local, remote, reps, group, rank):
    """Does a stream-ordered command issued after a copy (on the copy's stream) hold back work issued
    after it on another stream? With CUDA_DEVICE_MAX_CONNECTIONS=1 all streams feed one hardware queue."""
    import torch.distributed as dist

    from common import max_over_ranks

    nb = min(64 * 1024 * 1024, local.numel() * 2)  # longer than GEMM 1
    short = gemm.short  # a flag no op uses in this benchmark
    flag = 7  # a flag no op uses in this benchmark
    counter = [1000]
    scratch = torch.zeros(1024, device="cuda")

    def signal():
        counter[0] += 1
        comm.signal(peer, flag, counter[0], side.cuda_stream)

    def wait_satisfied():
        comm.wait(flag, 0, side.cuda_stream)

    def kernel():
        with torch.cuda.stream(side):
            scratch.add_(1.0)

    variants = [("nothing", None), ("flag write to the peer (signal)", signal),
                ("flag wait, already satisfied", wait_satisfied), ("small kernel", kernel)]
    rows = []
    for name, after in variants:
        gaps, copies = [], []
        for i in range(reps + 1):
            dist.barrier(group)
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
            ev[0].record(main_s)
            short()
            ev[1].record(main_s)
            side.wait_event(ev[0])  # the copy starts with GEMM 1
            ev[2].record(side)
            comm.copy(remote, local.data_ptr(), nb, side.cuda_stream)
            ev[3].record(side)
            if after is not None:
                after()
            ev[4].record(main_s)
            gemm()
            ev[5].record(main_s)
            torch.cuda.synchronize()
            if i:
                gaps.append(ev[1].elapsed_time(ev[4]) * 1e3)
                copies.append(ev[2].elapsed_time(ev[3]))
        rows.append((name, max_over_ranks(statistics.median(gaps)), max_over_ranks(statistics.median(copies))))
    return rows


def ipc_main(args) -> int:
    """Push and pull between two processes' IPC-mapped buffers (te_parallel's communicator), alone and
    beside a GEMM on the compute stream; rank 0 prints."""
    import os

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import te_parallel as te
    from common import init_torchrun_nccl, max_over_ranks

    rank, tp, group = init_torchrun_nccl()
    if tp != 2:
        raise SystemExit(f"bench_p2p --ipc: runs on 2 ranks, got {tp}")
    peer = 1 - rank
    mib_max = max(args.mib)
    ub = te.initialize_ub([2 * mib_max * 1024 * 1024 // 2 // 1024, 1024], group, use_fp8=False,
                          dtype=torch.bfloat16)
    t = ub.transport
    comm, side, main_s = t.comm, torch.cuda.Stream(), torch.cuda.current_stream()
    a = torch.randn(8192, 6144, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(4096, 6144, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    local = torch.randn(mib_max * 1024 * 1024 // 2, device="cuda").to(torch.bfloat16)

    def gemm():
        torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    gemm.short = lambda: torch._scaled_mm(a[:2048], w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def timed(copy, nbytes, with_gemm):
        vals, gemm_vals = [], []
        for i in range(6):
            dist.barrier(group)
            torch.cuda.synchronize()
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record(side)
            for _ in range(args.reps):
                copy(nbytes)
            s1.record(side)
            if with_gemm:
                g0.record(main_s)
                for _ in range(args.reps):
                    gemm()
                g1.record(main_s)
            torch.cuda.synchronize()
            if i:
                vals.append(s0.elapsed_time(s1) / args.reps)
                if with_gemm:
                    gemm_vals.append(g0.elapsed_time(g1) / args.reps)
        ms = max_over_ranks(statistics.median(vals))
        g = max_over_ranks(statistics.median(gemm_vals)) if with_gemm else 0.0
        return ms, g

    remote = comm.buffer(peer)
    own = comm.buffer(rank)
    queue_rows = _queue_rows(comm, peer, side, main_s, gemm, local, remote, args.reps, group, rank)
    push = lambda nb: comm.copy(remote, local.data_ptr(), nb, side.cuda_stream)  # noqa: E731
    pull = lambda nb: comm.copy(local.data_ptr(), remote, nb, side.cuda_stream)  # noqa: E731
    local_copy = lambda nb: comm.copy(local.data_ptr(), own, nb, side.cuda_stream)  # noqa: E731
    rows = []
    for mib in args.mib:
        nb = mib * 1024 * 1024
        for name, fn in (("IPC CE push, both ways", push), ("IPC CE pull, both ways", pull),
                         ("local copy (same GPU)", local_copy)):
            alone, _ = timed(fn, nb, False)
            beside, g = timed(fn, nb, True)
            rows.append({"mib": mib, "case": name, "ms": alone, "GBps": nb / alone / 1e6,
                         "GBps_beside_gemm": nb / beside / 1e6, "gemm_ms_beside": g})
    if rank == 0:
        conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")
        print(f"CUDA_DEVICE_MAX_CONNECTIONS={conn}")
        print(f"{'MiB':>4} | {'case':<26} | {'ms':>7} | {'GB/s':>6} | {'GB/s beside GEMM':>16} | GEMM ms beside")
        for r in rows:
            print(f"{r['mib']:>4} | {r['case']:<26} | {r['ms']:7.3f} | {r['GBps']:6.0f} | "
                  f"{r['GBps_beside_gemm']:16.0f} | {r['gemm_ms_beside']:.3f}")
        print("\nWhat a side stream's command after a 64 MiB peer copy does to the next GEMM on the compute "
              "stream\n(GEMM 1, 2048 rows, shorter than the copy, on the compute stream; the copy, then the command, on the side stream; then GEMM 2 "
              "on the compute stream; us, median, max over ranks)")
        print(f"  {'command after the copy':<44} {'GEMM 2 start - GEMM 1 end':>26} {'copy ms':>8}")
        for name, gap, copy_ms in queue_rows:
            print(f"  {name:<44} {gap:26.1f} {copy_ms:8.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0), "connections": conn, "rows": rows,
                           "queue": queue_rows}, f, indent=1)
    ub.destroy()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ipc", action="store_true", help="two processes (torchrun), te_parallel's IPC copies")
    args = ap.parse_args(argv)
    if args.ipc:
        return ipc_main(args)
    if torch.cuda.device_count() < 2:
        print("bench_p2p: needs two GPUs in this process", file=sys.stderr)
        return 2
    from te_parallel.native import comm_overlap as native_comm

    rt = _cudart()
    _enable_peer_access(rt)

    # One GEMM per device to run beside the transfers: the FP8 row-parallel shape of bench_overlap.py at TP=2.
    gemm = {}
    for d in (0, 1):
        a = torch.randn(8192, 6144, device=d).to(torch.float8_e4m3fn)
        w = torch.randn(4096, 6144, device=d).to(torch.float8_e4m3fn)
        one = torch.ones((), device=d)
        gemm[d] = (lambda a=a, w=w, one=one: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16))
    rows = []
    for mib in args.mib:
        n = mib * 1024 * 1024 // 2
        buf = {d: torch.randn(n, device=d).to(torch.bfloat16) for d in (0, 1)}   # what each rank sends
        own = {d: torch.randn(n, device=d).to(torch.bfloat16) for d in (0, 1)}
        dst = {d: torch.empty(n, device=d, dtype=torch.bfloat16) for d in (0, 1)}
        comm = {d: torch.cuda.Stream(device=d) for d in (0, 1)}
        comp = {d: torch.cuda.Stream(device=d) for d in (0, 1)}
        nbytes = n * 2

        def ce(dst_dev: int, issuer: int):
            src_dev = 1 - dst_dev
            s = comm[issuer]

            def copy():
                err = rt.cudaMemcpyAsync(dst[dst_dev].data_ptr(), buf[src_dev].data_ptr(), nbytes, 3, s.cuda_stream)
                if err != 0:
                    raise RuntimeError(f"bench_p2p: cudaMemcpyAsync on device {issuer} failed with error {err}")
            return copy

        def sm(dst_dev: int, add: bool):
            src_dev = 1 - dst_dev
            ins = [buf[src_dev]] + ([own[dst_dev]] if add else [])  # the peer's buffer read in place
            s = comm[dst_dev]
            return lambda: native_comm.reduce_sum(ins, dst[dst_dev], s.cuda_stream)

        cases = {
            "CE push, one way": {"t0": ce(1, 0)},
            "CE pull, one way": {"t1": ce(1, 1)},
            "CE push, both ways": {"t0": ce(1, 0), "t1": ce(0, 1)},
            "CE pull, both ways": {"t0": ce(0, 0), "t1": ce(1, 1)},
            "SM pull, both ways": {"t0": sm(0, False), "t1": sm(1, False)},
            "SM pull + add, both ways": {"t0": sm(0, True), "t1": sm(1, True)},
        }
        gemm_alone = _time_on_streams({"g0": gemm[0], "g1": gemm[1]}, {"g0": comp[0], "g1": comp[1]}, args.reps)
        g_ms = max(gemm_alone.values())
        for name, jobs in cases.items():
            streams = {k: comm[int(k[1])] for k in jobs}
            alone = max(_time_on_streams(jobs, streams, args.reps).values())
            # Beside a GEMM on each device: the transfers repeated as often as fit in the GEMMs' run.
            both = dict(jobs)
            both.update({"g0": gemm[0], "g1": gemm[1]})
            streams.update({"g0": comp[0], "g1": comp[1]})
            timed = _time_on_streams(both, streams, args.reps)
            with_gemm = max(v for k, v in timed.items() if k.startswith("t"))
            gemm_with = max(v for k, v in timed.items() if k.startswith("g"))
            rows.append({"mib": mib, "case": name, "ms": alone, "GBps": nbytes / alone / 1e6,
                         "ms_beside_gemm": with_gemm, "GBps_beside_gemm": nbytes / with_gemm / 1e6,
                         "gemm_ms_alone": g_ms, "gemm_ms_beside": gemm_with})
    print(f"{'MiB':>4} | {'case':<26} | {'ms':>7} | {'GB/s':>6} | {'GB/s beside GEMM':>16} | GEMM ms alone -> beside")
    for r in rows:
        print(f"{r['mib']:>4} | {r['case']:<26} | {r['ms']:7.3f} | {r['GBps']:6.0f} | {r['GBps_beside_gemm']:16.0f} | "
              f"{r['gemm_ms_alone']:.3f} -> {r['gemm_ms_beside']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
