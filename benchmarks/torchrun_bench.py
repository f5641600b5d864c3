"""The launch, timing and reporting of the benchmarks that run one process per GPU (bench_cp_ring, bench_ep,
bench_block_gather).

Each such benchmark is started either by torchrun (one process per GPU, NCCL) or as a plain
`python benchmarks/<name>.py --nproc-per-node N [...]`, which checks its arguments and the GPU count first (one
line on stderr, exit status 2, before any process starts) and then runs torchrun itself. With --cpu every rank
runs on the CPU over gloo, at the tiny sizes each benchmark's --cpu defaults give: that checks the plumbing
(collectives, rows, floors, ratios) where there is no GPU; its times mean nothing.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from common import Parser, environment, report, time_interleaved


def launched() -> bool:
    """Started by torchrun (its variables are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class World:
    """This process's place: rank, world size, the group of all ranks, the device its tensors live on."""

    rank: int
    size: int
    group: object
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def parser(doc: str) -> Parser:
    """The benchmark's parser with the launch flags every one of them takes."""
    ap = Parser(description=doc.split("\n")[0])
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="start torchrun with this many processes (when not already started by torchrun)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU at tiny sizes (checks the plumbing)")
    ap.add_argument("--json", default=None, help="rank 0 writes every row here")
    return ap


def world_size_asked(ap: Parser, args) -> int:
    """The number of processes: torchrun's WORLD_SIZE, else --nproc-per-node (checked: at least 2, and a GPU each
    unless --cpu)."""
    if launched():
        size = int(os.environ["WORLD_SIZE"])
    elif args.nproc_per_node is None:
        ap.error("start it under torchrun (torchrun --standalone --nproc-per-node N ...) or give --nproc-per-node N")
    else:
        size = args.nproc_per_node
    if size < 2:
        ap.error(f"{size} process{'es' if size != 1 else ''}: needs at least 2 (one per GPU)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if not args.cpu:
        gpus = torch.cuda.device_count()
        if gpus < local:
            ap.error(f"NCCL with {local} processes on this host needs {local} GPUs, this machine has {gpus}; "
                     f"use fewer processes, or --cpu for gloo on the CPU")
    return size


def launch(ap: Parser, args, argv: List[str]) -> None:
    """Outside torchrun: start it with this script and its arguments (less --nproc-per-node); does not return."""
    world_size_asked(ap, args)
    if launched():
        return
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           os.path.abspath(sys.argv[0]), *rest]
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def check_counts(ap: Parser, args) -> None:
    """--iters (None: the script's default) and --rounds: at least 1 each, else one line and exit status 2."""
    if (args.iters is not None and args.iters < 1) or args.rounds < 1:
        ap.error(f"--iters {args.iters} --rounds {args.rounds}: each needs at least 1")


def start(parse_args: Callable[[List[str]], tuple], argv: Optional[List[str]] = None) -> tuple:
    """A benchmark's start: (args, World) after its parse_args(argv) -> (parser, args), torchrun started where
    it is not running yet (launch), and the process group made (init)."""
    argv = sys.argv[1:] if argv is None else argv
    ap, args = parse_args(argv)
    launch(ap, args, argv)
    return args, init(args.cpu)


def init(cpu: bool) -> World:
    """The process group: NCCL with a GPU per rank (NVLink multicast off unless the environment says otherwise),
    or gloo on the CPU."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cpu:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    return World(rank, size, dist.new_group(list(range(size))), device)


def time_steps(world: World, steps: Dict[str, Callable[[], None]], iters: int, rounds: int,
               warmup: int = 2, settle: int | None = None) -> Dict[str, float]:
    """ms per call of each step on this rank, interleaved in rounds (common.time_interleaved on a GPU; the same
    order with the host's clock on the CPU). Every rank must pass the same steps in the same order: a step's
    collectives meet their peers' in the same call."""
    if world.cuda:
        return time_interleaved(steps, warmup=warmup, iters=iters, rounds=rounds, settle=settle)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    names = list(steps)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[name]()
            samples[name].append((time.perf_counter() - t0) * 1000 / iters)
    return {n: statistics.median(v) for n, v in samples.items()}


def all_rows(world: World, rows: List[dict]) -> List[dict]:
    """Every rank's rows, in rank order (a collective)."""
    got = [None] * world.size
    dist.all_gather_object(got, rows, group=world.group)
    return [r for part in got for r in part]


def worst(rows: List[dict], key: str, by: List[str]) -> List[dict]:
    """Per distinct value of the `by` columns, the row with the largest `key`."""
    out: Dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r.get(b) for b in by)
        if r.get(key) is not None and (k not in out or r[key] > out[k][key]):
            out[k] = r
    return list(out.values())


def write_json(path: str | None, title: str, rows: List[dict], world: World, **extra) -> None:
    if not path:
        return
    import json

    env = dict(environment(), world=world.size, backend="nccl" if world.cuda else "gloo (CPU)")
    with open(path, "w") as f:
        json.dump({"title": title, "env": env, **extra, "rows": rows}, f, indent=2)


def peak_bytes(world: World, fn: Callable[[], None]) -> int:
    """Peak memory allocated on this rank's GPU while fn() runs, above what was allocated before (0 on the CPU)."""
    if not world.cuda:
        fn()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


__all__ = ["World", "parser", "launch", "init", "time_steps", "all_rows", "worst", "write_json", "peak_bytes",
           "finish", "report", "launched"]
