"""Where the host time of the comm-GEMM-overlapped TransformerLayer step goes, against the NCCL step.

    torchrun --standalone --nproc-per-node=2 benchmarks/profile_overlap.py [--batch 4] [--steps 10] [--out DIR]

Builds the layer of `bench_overlap.py --layer` (hidden 4096, ffn 16384, 32 heads, s 2048 × b, TP+SP,
FP8 DelayedScaling(), fwd+bwd) twice: plain NCCL collectives, and ub_tp_comm_overlap=True
with the communicator made as bench_overlap.main makes it. For each case, after a warm-up:
  timing   --steps steps back to back, three times: host issue time per step (perf_counter, no
           synchronisation inside the loop) beside the GPU time per step (CUDA events around the loop);
           Python's garbage collector time is counted apart
  blocking one step issued while the GPU is kept busy by a long sleep kernel: if the host returns in
           about its usual issue time nothing in the step waits for the GPU; otherwise the cProfile of
           that step (rank 0) names the call that waited
  cProfile --steps steps on rank 0 (rank 1 runs the same steps unprofiled): top functions by tottime
           and cumtime, per step
  torch.profiler (CPU activity only): operators by self CPU time
then the functions whose tottime per step grew most from the NCCL case to the overlap case.
Rank 0 prints the summary; --out DIR also gets the full text (pstats tables, callers of the hottest
functions) in DIR/profile_overlap.txt and the overlap case's raw cProfile in DIR/profile_overlap_ub.prof.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from bench_overlap import gpt_layer_step  # noqa: E402
from common import init_torchrun_nccl, max_over_ranks  # noqa: E402

HIDDEN, FFN, HEADS, SEQ = 4096, 16384, 32, 2048


class _GcTimer:
    """Seconds spent in Python's garbage collector while installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t = 0.0, 0, None

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.collections += 1
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def _quiet() -> None:
    """GPU idle and both ranks lined up before a measured region."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def timing(step, steps: int) -> dict:
    """Host issue ms/step and GPU ms/step of `steps` steps back to back (median of 3 loops, max over ranks)."""
    host, gpu, first, worst, gc_ms, gc_n = [], [], [], [], [], []
    for _ in range(3):
        _quiet()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = []
        with _GcTimer() as g:
            t0 = time.perf_counter()
            start.record()
            for _ in range(steps):
                step()
                marks.append(time.perf_counter())
            end.record()
        end.synchronize()
        per = [b - a for a, b in zip([t0] + marks[:-1], marks)]
        host.append((marks[-1] - t0) / steps * 1e3)
        gpu.append(start.elapsed_time(end) / steps)
        first.append(per[0] * 1e3)
        worst.append(max(per) * 1e3)
        gc_ms.append(g.seconds / steps * 1e3)
        gc_n.append(g.collections / steps)
    med = statistics.median
    return {"host_ms": max_over_ranks(med(host)), "gpu_ms": max_over_ranks(med(gpu)),
            "first_step_host_ms": max_over_ranks(med(first)), "worst_step_host_ms": max_over_ranks(med(worst)),
            "gc_ms_per_step": max_over_ranks(med(gc_ms)), "gc_per_step": max_over_ranks(med(gc_n))}


def _sleep_cycles_per_ms() -> float:
    cycles = int(5e7)
    torch.cuda._sleep(cycles)  # warm
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / a.elapsed_time(b)


def blocking_probe(step, rank: int, sleep_ms: float, cycles_per_ms: float):
    """Host ms of one step issued behind `sleep_ms` of GPU sleep, and (rank 0) its cProfile."""
    _quiet()
    torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    prof = cProfile.Profile() if rank == 0 else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    step()
    if prof:
        prof.disable()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return max_over_ranks(host), prof


def host_profile(step, rank: int, steps: int):
    _quiet()
    prof = cProfile.Profile() if rank == 0 else None
    if prof:
        prof.enable()
    for _ in range(steps):
        step()
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    return prof


def op_profile(step, rank: int, steps: int) -> str:
    _quiet()
    if rank != 0:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return ""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def _label(func) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    for marker in ("/te_parallel/", "/torch/", "/benchmarks/"):
        if marker in filename:
            filename = marker.strip("/") + "/" + filename.split(marker, 1)[1]
            break
    else:
        filename = os.path.basename(filename)
    return f"{filename}:{line}({name})"


def per_step(prof: cProfile.Profile, steps: int) -> dict:
    """{label: (calls/step, tottime us/step, cumtime us/step)}."""
    out = {}
    for func, (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items():
        out[_label(func)] = (nc / steps, tt / steps * 1e6, ct / steps * 1e6)
    return out


def table(rows, title: str) -> str:
    lines = [title, f"{'calls/step':>10} {'tottime us/step':>15} {'cumtime us/step':>15}  function"]
    lines += [f"{n:10.1f} {tt:15.1f} {ct:15.1f}  {name}" for name, (n, tt, ct) in rows]
    return "\n".join(lines)


def pstats_text(prof: cProfile.Profile, top: int, callers: int) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_callers(callers)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sleep-ms", type=float, default=300.0, help="GPU sleep ahead of the blocking probe")
    ap.add_argument("--out", default=None, help="folder for profile_overlap.txt and profile_overlap_ub.prof")
    args = ap.parse_args()
    rank, tp, group = init_torchrun_nccl()
    # as bench_overlap.main with its defaults (--m 4096 --k 4096 --n 6144) and --layer-batch <batch>
    ub = te.initialize_ub([max(tp * 4096, SEQ * args.batch), 6144], group, use_fp8=True, dtype=torch.bfloat16)
    full_path = os.path.join(args.out, "profile_overlap.txt") if args.out and rank == 0 else None
    if full_path:
        os.makedirs(args.out, exist_ok=True)
        open(full_path, "w").close()

    def emit(text: str, stdout: bool = True) -> None:
        if rank != 0:
            return
        if stdout:
            print(text, flush=True)
        if full_path:
            with open(full_path, "a") as f:
                f.write(text + "\n")

    cycles_per_ms = _sleep_cycles_per_ms()
    emit(f"TransformerLayer h{HIDDEN} ffn{FFN} heads{HEADS} s{SEQ} b{args.batch} TP={tp}+SP FP8 DelayedScaling "
         f"fwd+bwd; transport {ub.transport_name}; {args.steps} steps per measurement; torch {torch.__version__}; "
         f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    results, profiles = {}, {}
    for name, extra in [("nccl", {}), ("overlap", {"ub_tp_comm_overlap": True, "ub_comm": ub})]:
        layer, step = gpt_layer_step(group, tp, args.batch, extra)
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        counts0 = dict(ub.counts)
        res = timing(step, args.steps)
        res["ub_ops_per_step"] = {k: (ub.counts[k] - counts0[k]) / (3 * args.steps) for k in counts0}
        probe_ms, probe_prof = blocking_probe(step, rank, args.sleep_ms, cycles_per_ms)
        res["probe_host_ms"] = probe_ms
        prof = host_profile(step, rank, args.steps)
        ops = op_profile(step, rank, args.steps)
        results[name] = res
        emit(f"\n=== {name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in res.items()))
        emit(f"blocking probe: one step behind {args.sleep_ms:.0f} ms of GPU sleep took {probe_ms:.2f} ms of host "
             f"time (usual {res['host_ms']:.2f} ms): " + ("the host WAITED for the GPU" if probe_ms > res["host_ms"]
                                                           + 0.5 * args.sleep_ms else "no wait for the GPU"))
        if rank == 0:
            probe = sorted(per_step(probe_prof, 1).items(), key=lambda kv: -kv[1][1])[:12]
            emit(table(probe, f"{name}: probe step, top by tottime"))
            stats = per_step(prof, args.steps)
            profiles[name] = stats
            emit(table(sorted(stats.items(), key=lambda kv: -kv[1][1])[: args.top],
                       f"\n{name}: cProfile of {args.steps} steps (rank 0), top {args.top} by tottime, per step"))
            emit(table(sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.top],
                       f"\n{name}: top {args.top} by cumtime, per step"))
            emit(f"\n{name}: pstats of {args.steps} steps\n" + pstats_text(prof, args.top, 25), stdout=False)
            emit(f"\n{name}: torch.profiler CPU ops of {args.steps} steps (totals), by self CPU time\n{ops}")
            if name == "overlap" and args.out:
                prof.dump_stats(os.path.join(args.out, "profile_overlap_ub.prof"))
        del layer, step
        gc.collect()
    if rank == 0:
        a, b = profiles["nccl"], profiles["overlap"]
        delta = {k: (b.get(k, (0, 0, 0))[0] - a.get(k, (0, 0, 0))[0], b.get(k, (0, 0, 0))[1] - a.get(k, (0, 0, 0))[1],
                     b.get(k, (0, 0, 0))[2] - a.get(k, (0, 0, 0))[2]) for k in set(a) | set(b)}
        tot_a, tot_b = sum(v[1] for v in a.values()), sum(v[1] for v in b.values())
        emit(table(sorted(delta.items(), key=lambda kv: -kv[1][1])[:30],
                   f"\noverlap minus nccl: top 30 by extra tottime per step (profiled totals {tot_a / 1e3:.2f} "
                   f"vs {tot_b / 1e3:.2f} ms/step)"))
        emit(table(sorted(delta.items(), key=lambda kv: kv[1][1])[:10], "\noverlap minus nccl: most saved"))
        r0, r1 = results["nccl"], results["overlap"]
        emit(f"\nSUMMARY b={args.batch}: host issue ms/step nccl {r0['host_ms']:.2f} overlap {r1['host_ms']:.2f}; "
             f"GPU ms/step nccl {r0['gpu_ms']:.2f} overlap {r1['gpu_ms']:.2f}; probe host ms nccl "
             f"{r0['probe_host_ms']:.2f} overlap {r1['probe_host_ms']:.2f}")
    ub.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
