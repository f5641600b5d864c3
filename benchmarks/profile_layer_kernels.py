"""Where the GPU time of the TP GPT-layer step goes: NCCL vs comm-GEMM overlap vs no communication.

    torchrun --standalone --nproc-per-node=2 benchmarks/profile_layer_kernels.py [--batch 8] [--steps 5]

The layer of `bench_overlap.py --layer` in three cases: plain NCCL collectives, ub_tp_comm_overlap, and
the NCCL layer with its sequence all-gathers / reduce-scatters replaced by nothing (`_NoTransfer`:
wrong numbers, right compute). For each, torch.profiler's CUDA activity over `steps` steps on rank 0,
summed per kernel class and per stream: GEMM kernels, NCCL kernels, copies (copy engine), the rest;
"busy" is the union of kernel intervals on the compute stream(s). The step time minus that union is
time the GPU's SMs idled (waiting for a flag, an event, or the host). A table per case, the top
kernels of each class, and the GEMM time per step against the no-communication case: GEMMs that run
beside copies or in chunks take longer than the same GEMMs alone.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from bench_overlap import _LocalTransfer, _NoTransfer, gpt_layer_step  # noqa: E402
from common import init_torchrun_nccl, report  # noqa: E402

GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "wgmma")


def kernel_class(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if low.startswith("memcpy") or "memcpy" in low:
        return "copy"
    if low.startswith("memset"):
        return "memset"
    if any(m in low for m in GEMM_MARKS):
        return "gemm"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    return "other"


def union_ms(intervals) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def profile_case(step, steps: int, rank: int):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        stop.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(stop) / steps
    by_class, by_name, per_stream = defaultdict(float), defaultdict(lambda: [0.0, 0]), defaultdict(list)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        cls = kernel_class(ev.name)
        dur = ev.time_range.end - ev.time_range.start  # us
        by_class[cls] += dur
        by_name[(cls, ev.name[:90])][0] += dur
        by_name[(cls, ev.name[:90])][1] += 1
        if cls not in ("copy", "memset"):
            per_stream["sm"].append((ev.time_range.start, ev.time_range.end))
            if cls != "nccl":
                per_stream["compute"].append((ev.time_range.start, ev.time_range.end))
    busy = union_ms(per_stream["sm"]) / steps
    gaps = idle_gaps(prof, steps)
    row = {"step_ms": step_ms, "sm_busy_ms": busy, "sm_idle_ms": step_ms - busy,
           # NCCL kernel time with no other kernel running beside it: all that hiding communication
           # can take off this step (the async backward collectives already run under GEMMs)
           "nccl_exposed_ms": busy - union_ms(per_stream["compute"]) / steps}
    for cls in ("gemm", "nccl", "attention", "other", "copy"):
        row[f"{cls}_ms"] = by_class[cls] / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return row, [(cls, name, t / 1e3 / steps, n // steps) for (cls, name), (t, n) in top], gaps


def _short(name: str) -> str:
    name = name.replace("void ", "").replace("(anonymous namespace)::", "")
    for key in ("nvjet", "nccl", "flash", "fmha", "Memcpy"):
        if key in name:
            return name[:52]
    return name.split("<")[0].split("(")[0][:52]


def idle_gaps(prof, steps: int, min_us: float = 5.0, top: int = 16):
    """The SMs' idle gaps of at least min_us between kernels, summed per (kernel before, kernel after)
    pair: [(before, after, us per step, gaps per step, us of copies inside, us the host was late)].
    "Host late": the next kernel's launch call returned after the gap began, so the GPU waited for the
    host; the rest of a gap is a wait on the GPU (a peer's flag, a copy's event). Times are CUPTI's,
    on the host's clock."""
    kernels, copies, launched = [], [], {}
    for ev in prof.profiler.kineto_results.events():
        name = ev.name()
        if ev.device_type() == torch.autograd.DeviceType.CUDA:
            cls = kernel_class(name)
            span = (ev.start_ns() / 1e3, (ev.start_ns() + ev.duration_ns()) / 1e3, name, ev.correlation_id())
            if cls == "copy":
                copies.append(span)
            elif cls != "memset":
                kernels.append(span)
        elif name.startswith("cu") and ev.correlation_id():
            launched[ev.correlation_id()] = (ev.start_ns() + ev.duration_ns()) / 1e3
    kernels.sort()
    per_pair = defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    end, before = None, None
    for a, b, name, corr in kernels:
        if end is not None and a - end >= min_us:
            inside = sum(max(0.0, min(cb, a) - max(ca, end)) for ca, cb, _, _ in copies)
            late = min(a - end, max(0.0, launched.get(corr, end) - end))
            entry = per_pair[(_short(before), _short(name))]
            entry[0] += a - end
            entry[1] += 1
            entry[2] += inside
            entry[3] += late
        if end is None or b > end:
            end, before = b, name
    ranked = sorted(per_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return [(b, a, us / steps, n / steps, cp / steps, late / steps) for (b, a), (us, n, cp, late) in ranked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    rank, tp, group = init_torchrun_nccl()
    ub = te.initialize_ub([2048 * a.batch, 4096], group, use_fp8=True, dtype=torch.bfloat16)
    cases = [("NCCL", {}, contextlib.nullcontext), ("overlap", dict(ub_tp_comm_overlap=True, ub_comm=ub),
             contextlib.nullcontext), ("no communication, unwritten", {}, _NoTransfer),
             ("no communication at all, written locally", {}, _LocalTransfer)]
    rows, tops, all_gaps = [], [], []
    for name, extra, ctx in cases:
        _, step = gpt_layer_step(group, tp, a.batch, extra)
        with ctx():
            row, top, gaps = profile_case(step, a.steps, rank)
        rows.append({"case": name, **row})
        tops.append((name, top))
        all_gaps.append((name, gaps))
        del step
        torch.cuda.empty_cache()
    if rank == 0:
        no_comm_gemm = rows[3]["gemm_ms"]
        for r in rows:
            r["gemm_vs_no_comm"] = r["gemm_ms"] / no_comm_gemm
            # what the step would take with every NCCL kernel hidden and nothing else changed
            r["bound_speedup"] = rows[0]["step_ms"] / (rows[0]["step_ms"] - rows[0]["nccl_exposed_ms"])
        report(f"TP={tp} GPT layer b={a.batch}, FP8, per step, rank 0 (CUDA kernel time by class; sm_busy = union "
               f"of SM kernels)", rows, ["case", "step_ms", "sm_busy_ms", "sm_idle_ms", "gemm_ms", "gemm_vs_no_comm",
                                         "nccl_ms", "nccl_exposed_ms", "attention_ms", "other_ms", "copy_ms"],
               None)
        nccl_step, no_comm_step = rows[0]["step_ms"], rows[3]["step_ms"]
        print(f"\nbound on the overlap's speedup: NCCL step / (NCCL step - exposed NCCL) = "
              f"{rows[0]['bound_speedup']:.3f}; NCCL step / no-communication step = {nccl_step / no_comm_step:.3f}, or "
              f"{nccl_step / (no_comm_step - rows[3]['copy_ms']):.3f} without its local copies")
        for name, top in tops:
            print(f"\ntop kernels, {name} (ms per step, launches per step)")
            for cls, kname, ms, n in top:
                print(f"  {cls:<9} {ms:7.3f} {n:4d}  {kname}")
        for name, gaps in all_gaps:
            print(f"\nSM idle gaps >= 5 us, {name} (per step: us idle, gaps, us of copies running inside them, us "
                  f"of them the host was late)")
            for before, after, us, n, cp, late in gaps:
                print(f"  {us:7.1f} {n:5.1f} {cp:7.1f} {late:7.1f}  {before}  ->  {after}")
    ub.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
