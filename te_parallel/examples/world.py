"""Process world of the examples: launched by torchrun / mpirun, or started here (--nproc workers).

This is application code, so it owns init_process_group (the library itself never calls it). The
world is a 3-D DeviceMesh ("dp", "cp", "tp") (torchtitan's order): rank r sits at
(r // (cp*tp), r // tp % cp, r % tp), so the ranks [k*tp, (k+1)*tp) form a TP group (neighbours: the TP
collectives stay on the fast links of a node), the ranks r, r+tp, ..., r+(cp-1)*tp (one in each of cp
neighbouring TP groups) a CP group, and the ranks r, r+cp*tp, r+2cp*tp, ... a data-parallel group. The dp and cp ranks together hold different
tokens of a step: flattened into one axis "dp_cp" (torchtitan's "dp_shard_cp") they are what FSDP2 shards
the parameters over and what the gradients and the loss are averaged over.
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
MESH_DIMS = ("dp", "cp", "tp")
DATA_AXIS = "dp_cp"  # the dp and cp axes flattened (made only when cp > 1)


@dataclass(frozen=True)
class World:
    """This process's place in the ("dp", "cp", "tp") mesh, and the groups the trainer hands out."""

    device: torch.device
    mesh: DeviceMesh
    dp_cp_mesh: Optional[DeviceMesh] = None  # the dp and cp axes flattened into one (made when cp > 1)

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
    def cp(self) -> int:
        return self.mesh["cp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

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
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """The CP axis the attention modules get as their cp_group (None at cp=1: no context parallelism)."""
        return self.mesh["cp"].get_group() if self.cp > 1 else None

    @property
    def data_mesh(self) -> DeviceMesh:
        """The ranks that see different tokens of a step, as a 1-D mesh: dp x cp flattened (just "dp" at
        cp=1). FSDP2 shards over it and the gradients are averaged over it: a cp rank's gradient is that of
        its own tokens of the sequences, as a dp rank's is that of its own sequences."""
        return self.dp_cp_mesh if self.cp > 1 else self.mesh["dp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks the gradients and the loss are averaged over: dp x cp (see data_mesh)."""
        return self.data_mesh.get_group()

    @property
    def fp8_group(self) -> Optional[dist.ProcessGroup]:
        """Amaxes reduced over the whole mesh: TP ranks must share scales, and DP replicas then hold
        the same scales too (their FP8 state, saved once per checkpoint, is identical). The mesh spans
        the whole world by construction, so its group is the default one."""
        return dist.group.WORLD if self.size > 1 else None

    def dp_mean(self, value: torch.Tensor) -> float:
        """The mean over the dp x cp ranks of a per-rank mean over its tokens. Every rank holds as many
        tokens (a cp rank s/cp of each of its dp rank's sequences), so this is the mean over all tokens of
        the step: the sum of the per-token values divided by the global token count."""
        ranks = self.dp * self.cp
        if ranks > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.dp_group)
            value /= ranks
        return value.item()


def make_world(tp: int, device: torch.device, cp: int = 1) -> World:
    """The ("dp", "cp", "tp") mesh over the default process group, which the caller has initialised, and
    at cp > 1 its "dp_cp" axis (a collective: every rank calls this)."""
    size = dist.get_world_size()
    if size % (tp * cp):
        raise ValueError(f"train_gpt: --tp {tp} x --cp {cp} does not divide the world size {size}")
    mesh = init_device_mesh(device.type, (size // (tp * cp), cp, tp), mesh_dim_names=MESH_DIMS)
    # (torch's flatten of mesh axes, the one torchtitan uses; the flattened mesh is kept, not sliced from the root)
    dp_cp = mesh["dp", "cp"]._flatten(DATA_AXIS) if cp > 1 else None
    return World(device, mesh, dp_cp)


def init_world(tp: int, device: str, cp: int = 1) -> World:
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
    return make_world(tp, dev, cp)


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
        for mesh in (world.mesh, world.dp_cp_mesh):
            getattr(mesh, "_pg_registry", {}).clear()


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
