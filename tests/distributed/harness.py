"""Spawn `world` worker processes from pytest, each with a torch.distributed group, and collect failures.

Backend: NCCL with one GPU per rank when there are enough GPUs (TE_PARALLEL_TEST_DEVICE=cpu forces
gloo on the CPU), else gloo on the CPU. Each worker runs a whole batch of checks (one launch per
world size keeps CI fast) and raises one AssertionError listing every failed check.
"""
from __future__ import annotations

import os
import socket
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_cuda(world: int) -> bool:
    return os.environ.get("TE_PARALLEL_TEST_DEVICE") != "cpu" and torch.cuda.device_count() >= world


def worlds(*sizes: int) -> list:
    """pytest params for the TP sizes of a suite. A size runs on NCCL when there is a GPU per rank, else
    on CPU/gloo (TP=8 there takes ~100 s of CI's 2 cores for both suites, and caught a shard-size bug);
    on a multi-GPU machine with too few GPUs for a size it is skipped: that machine is there to test
    NCCL, and the CPU suite runs the size on gloo."""
    import pytest

    gpus = 0 if os.environ.get("TE_PARALLEL_TEST_DEVICE") == "cpu" else torch.cuda.device_count()
    params = []
    for n in sizes:
        why = f"TP={n} needs {n} GPUs for NCCL; this machine has {gpus}" if 2 <= gpus < n else None
        params.append(pytest.param(n, id=f"tp{n}", marks=[pytest.mark.skip(reason=why)] if why else []))
    return params


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    import faulthandler

    # a hung collective fails the test with every thread's stack instead of hanging it
    faulthandler.dump_traceback_later(int(os.environ.get("TE_PARALLEL_TEST_HANG_S", "600")), exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    cuda = use_cuda(world)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank) if cuda else None)
    try:
        fn(rank, world, torch.device("cuda", rank) if cuda else torch.device("cpu"), *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, cpu: bool = False) -> None:
    """Run fn(rank, world, device, *args) on `world` processes; re-raises a worker's failure.

    cpu=True: a CPU suite (gloo, CPU tensors) also on a host with GPUs: the workers start with no GPU visible
    (CUDA_VISIBLE_DEVICES empty), so neither the backend choice nor code that asks torch.cuda sees one."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (inherited by the workers when they start)
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
    finally:
        if cpu:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def agree(group, device: torch.device, local_checks: Callable[[], None]) -> None:
    """Run a rank's local assertions, then raise on every rank if any rank failed, so that no rank goes
    on to the next step's collectives while another has left the case."""
    failure = None
    try:
        local_checks()
    except AssertionError as e:
        failure = e
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if flag.item():
        raise AssertionError("a check failed on another rank (its message is in that rank's report)")


class Checks:
    """Collects failures of named checks so one launch reports all of them. A check must reach all of its
    collectives on every rank before it asserts anything local, or one rank's failure hangs the others.
    TE_PARALLEL_TEST_TRACE=1 prints each check's name and failure as it happens."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failures, self.count = rank, [], 0

    def run(self, name: str, fn: Callable, *args) -> None:
        self.count += 1
        if os.environ.get("TE_PARALLEL_TEST_TRACE"):
            print(f"[rank {self.rank}] check: {name}", flush=True)
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - report every failing case, not just the first
            detail = str(e) if isinstance(e, AssertionError) else traceback.format_exc(limit=-3)
            self.failures.append(f"[rank {self.rank}] {name}: {detail}")
            if os.environ.get("TE_PARALLEL_TEST_TRACE"):
                print(self.failures[-1], flush=True)

    def raise_if_failed(self) -> None:
        if self.failures:
            raise AssertionError(f"{len(self.failures)} of {self.count} checks failed:\n" + "\n".join(self.failures))
