"""Process world of the examples: launched by torchrun / mpirun, or started here (--nproc workers).

This is application code, so it owns init_process_group (the library itself never calls it). The
world is a 2-D DeviceMesh ("dp", "tp"): rank r sits at (r // tp, r % tp), so the ranks
[k*tp, (k+1)*tp) form a TP group (neighbours: the TP collectives stay on the fast links of a node)
and the ranks r, r+tp, r+2tp, ... a data-parallel group.
"""
from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from te_parallel.parallel.bootstrap import env_world, mpi_world

MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class World:
    """This process's place in the ("dp", "tp") mesh, and the groups the trainer hands out."""

    device: torch.device
    mesh: DeviceMesh

    @property
    def rank(self) -> int:
        return self.mesh.get_rank()

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def tp(self) -> int:
        return self.mesh["tp"].size()

    @property
    def dp(self) -> int:
        return self.mesh["dp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        """The TP axis the modules get as their tp_group (None at tp=1: their one-rank path)."""
        return self.mesh["tp"] if self.tp > 1 else None

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh["tp"].get_group() if self.tp > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def fp8_group(self) -> Optional[dist.ProcessGroup]:
        """Amaxes reduced over the whole mesh: TP ranks must share scales, and DP replicas then hold
        the same scales too (their FP8 state, saved once per checkpoint, is identical). The mesh spans
        the whole world by construction, so its group is the default one."""
        return dist.group.WORLD if self.size > 1 else None

    def dp_mean(self, value: torch.Tensor) -> float:
        if self.dp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.dp_group)
            value /= self.dp
        return value.item()


def make_world(tp: int, device: torch.device) -> World:
    """The ("dp", "tp") mesh over the default process group, which the caller has initialised."""
    size = dist.get_world_size()
    if size % tp:
        raise ValueError(f"train_gpt: --tp {tp} does not divide the world size {size}")
    mesh = init_device_mesh(device.type, (size // tp, tp), mesh_dim_names=MESH_DIMS)
    return World(device, mesh)


def init_world(tp: int, device: str) -> World:
    """Starts torch.distributed from the launcher's variables (torchrun, mpirun, or those run_world
    sets), on `device` ("cuda": one GPU per process at the local rank, NCCL; "cpu": gloo)."""
    if "RANK" not in os.environ and any(v in os.environ for v in MPI_VARS):
        os.environ.update({k.upper(): str(v) for k, v in mpi_world().items()})
    info = env_world()
    rank, size, local = info["rank"], info["world_size"], info["local_rank"]
    cuda = device == "cuda"
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size, device_id=dev if cuda else None)
    return make_world(tp, dev)


def destroy(world: Optional[World] = None) -> None:
    """Ends torch.distributed; with `world`, also frees its process groups while Python still runs.

    destroy_process_group() only unregisters the groups: each lives on while something holds it, and
    a gloo group's worker threads with it. The mesh holds its groups (DeviceMesh._pg_registry) and
    DTensor's sharding caches hold the mesh (FSDP2), so those threads would outlive the interpreter.
    A worker thread that drops the last C++ reference to a collective's tensor takes the GIL to release
    the tensor's Python object; if the interpreter is finalizing by then, Python ends that thread inside
    a noexcept destructor: std::terminate, SIGABRT at exit, after the run has finished. Freed here, the
    groups' destructors join their worker threads, each once it has released what it holds."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if world is not None:
        gc.collect()  # the trainer's reference cycles (FSDP2's states, DDP's reducer) let go of the groups first
        # the mesh's references go last: their Python wrappers release the GIL while a group is
        # destroyed, so that its worker threads can finish with it
        getattr(world.mesh, "_pg_registry", {}).clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
