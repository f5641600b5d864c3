"""Process world of the examples: launched by torchrun / mpirun, or started here (--nproc workers).

This is application code, so it owns init_process_group (the library itself never calls it).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from te_parallel.parallel.bootstrap import env_world, mpi_world

MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


@dataclass
class World:
    rank: int
    size: int
    tp: int
    device: torch.device
    tp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]

    @property
    def dp(self) -> int:
        return self.size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def fp8_group(self):
        """Amaxes reduced over every rank: TP ranks must share scales, DP replicas should too."""
        return dist.group.WORLD if self.size > 1 else None

    def average_grads(self, model: torch.nn.Module) -> None:
        if self.dp == 1:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def dp_mean(self, value: torch.Tensor) -> float:
        if self.dp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.dp_group)
            value /= self.dp
        return value.item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_cuda(device: str, local_procs: int) -> bool:
    if device == "cpu":
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_procs or device == "cuda"


def init_world(tp: int, device: str) -> World:
    if "RANK" not in os.environ and any(v in os.environ for v in MPI_VARS):
        os.environ.update({k.upper(): str(v) for k, v in mpi_world().items()})
    info = env_world()
    rank, size, local = info["rank"], info["world_size"], info["local_rank"]
    cuda = _use_cuda(device, int(os.environ.get("LOCAL_WORLD_SIZE", size)))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, device_id=dev if cuda else None)
    if size % tp:
        raise ValueError(f"train_gpt: --tp {tp} does not divide the world size {size}")
    tp_groups = [dist.new_group(list(range(k * tp, (k + 1) * tp))) for k in range(size // tp)]
    dp_groups = [dist.new_group(list(range(r, size, tp))) for r in range(tp)]
    tp_group = tp_groups[rank // tp] if tp > 1 else None
    return World(rank, size, tp, dev, tp_group, dp_groups[rank % tp])


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned(local_rank: int, fn, args, nproc: int, port: int) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(args)


def run_world(fn, args, nproc: int, device: str) -> None:
    """Under a launcher run fn(args) here; otherwise start nproc local processes that each run it."""
    launched = "RANK" in os.environ or any(v in os.environ for v in MPI_VARS)
    if launched:
        fn(args)
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    mp.spawn(_spawned, args=(fn, args, nproc, _free_port()), nprocs=nproc, join=True)
