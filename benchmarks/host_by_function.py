"""Host time per te_parallel function in the TP GPT-layer step, NCCL vs comm-GEMM overlap.

    torchrun --standalone --nproc-per-node=2 benchmarks/host_by_function.py [--batch 4] [--top 70]

Every function and method of te_parallel's modules is wrapped in a timer (inclusive time, all
threads: autograd's backward thread too, which cProfile does not see). The GPU is held back by a
sleep while `steps` steps are issued, so no call waits for it; rank 0 prints ms per step, calls per
step and µs per call, largest first. The timers add about a microsecond per call, so the totals run
a little above the unwrapped host time.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_parallel as te  # noqa: E402
from bench_overlap import gpt_layer_step  # noqa: E402
from common import init_torchrun_nccl  # noqa: E402

MODULES = ["te_parallel.native", "te_parallel.native.activation", "te_parallel.native.cast",
           "te_parallel.native.comm_overlap", "te_parallel.native.gemm", "te_parallel.native.norm",
           "te_parallel.native.scaling", "te_parallel.fp8.autocast", "te_parallel.module.attention",
           "te_parallel.module.base", "te_parallel.module.layernorm_linear", "te_parallel.module.layernorm_mlp",
           "te_parallel.module.linear", "te_parallel.module.multi_head_attention", "te_parallel.module.transformer",
           "te_parallel.ops.attention", "te_parallel.ops.cast", "te_parallel.ops.fp8_gemm_config",
           "te_parallel.ops.gemm", "te_parallel.ops.linear", "te_parallel.ops.linear_overlap", "te_parallel.ops.mlp",
           "te_parallel.ops.activation", "te_parallel.ops.norm",
           "te_parallel.parallel.collectives", "te_parallel.parallel.ub_transport"]
TOTALS: dict = defaultdict(lambda: [0.0, 0])  # label -> [seconds, calls]


def timed(fn, label: str):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = TOTALS[label]
            entry[0] += time.perf_counter() - start
            entry[1] += 1
    return run


def wrap_everything() -> None:
    """A timer around every function of MODULES (under each name a module holds it by) and every
    method of their classes (autograd Functions' forward/backward included)."""
    mods = [importlib.import_module(name) for name in MODULES]
    labels = {}
    for m in mods:
        for name, obj in vars(m).items():
            if inspect.isfunction(obj) and obj.__module__ == m.__name__:
                labels[obj] = f"{m.__name__.split('.')[-1]}.{name}"
    for m in mods:
        for name, obj in list(vars(m).items()):
            if inspect.isfunction(obj) and obj in labels:
                setattr(m, name, timed(obj, labels[obj]))
        for cls_name, cls in list(vars(m).items()):
            if not (inspect.isclass(cls) and cls.__module__ == m.__name__):
                continue
            for name, attr in list(vars(cls).items()):
                if name.startswith("__") and name not in ("__init__", "__call__", "__enter__", "__exit__"):
                    continue
                label = f"{m.__name__.split('.')[-1]}.{cls_name}.{name}"
                if isinstance(attr, staticmethod):
                    setattr(cls, name, staticmethod(timed(attr.__func__, label)))
                elif inspect.isfunction(attr):
                    setattr(cls, name, timed(attr, label))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps timed (more may fill CUDA's launch queue)")
    ap.add_argument("--top", type=int, default=70)
    args = ap.parse_args()
    wrap_everything()
    rank, tp, group = init_torchrun_nccl()
    ub = te.initialize_ub([2048 * args.batch, 4096], group, use_fp8=True, dtype=torch.bfloat16)
    for case, extra in (("NCCL", {}), ("overlap", dict(ub_tp_comm_overlap=True, ub_comm=ub))):
        _, step = gpt_layer_step(group, tp, args.batch, extra)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        TOTALS.clear()
        torch.cuda._sleep(int(1e9))  # the GPU stays behind: no launch waits for it
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        host_ms = (time.perf_counter() - start) / args.steps * 1e3
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            print(f"\n{case}, TP={tp} b={args.batch}: host ms per step {host_ms:.2f} (timers included)")
            print("  ms/step  calls/step   us/call  function")
            for label, (seconds, calls) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"  {seconds / args.steps * 1e3:7.3f}  {calls / args.steps:10.1f}  {seconds / calls * 1e6:8.1f}  {label}")
        del step
        torch.cuda.empty_cache()
    ub.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
