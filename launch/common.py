"""Process-group setup shared by the launch scripts. Scripts own the world; the library never does.

    from common import init_distributed      # launch/ is on sys.path when you run launch/<script>.py
    rank, world_size, local_rank, device = init_distributed()

Works under torchrun (launch/torchrun.sh, and launch/slurm.sbatch, which starts one torchrun per
node), mpirun (launch/mpirun.sh) and srun starting one task per GPU.
"""
import datetime
import os
from typing import Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from te_parallel.parallel import bootstrap

# Set by the MPI launchers on every rank: OpenMPI (OMPI_COMM_WORLD_RANK), MPICH / Intel MPI hydra
# (PMI_RANK), PMIx-based launchers such as OpenMPI 5's prterun (PMIX_RANK).
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def discover_world(environ: Optional[Mapping[str, str]] = None) -> dict:
    """torchrun's variables first (they are explicit), then MPI, then SLURM.

    MPI goes before SLURM because mpirun inside an sbatch allocation inherits SLURM_PROCID and
    SLURM_NTASKS describing the batch step or mpirun's daemons, not the ranks: they would give every
    rank the same rank. Under srun, launch without PMI (`srun --mpi=none`, as launch/slurm.sbatch does)
    so the SLURM variables are used and mpi4py is not needed.
    """
    env = os.environ if environ is None else environ
    if env.get("RANK"):
        return bootstrap.env_world(env)
    if any(env.get(v) for v in MPI_RANK_VARS):
        return bootstrap.mpi_world()
    return bootstrap.env_world(env)


def _device(local_rank: int, use_cuda: bool) -> torch.device:
    if not use_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"local rank {local_rank} needs a GPU but this node shows {count} "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                           f"start at most {count} processes per node")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(backend: Optional[str] = None,
                     timeout_s: float = 60.0) -> Tuple[int, int, int, torch.device]:
    """Discover the world, initialize torch.distributed, return (rank, world_size, local_rank, device).

    backend: "nccl" when CUDA is available, else "gloo". The device is cuda:<local rank> (made the
    current device) under NCCL, cpu under gloo. timeout_s bounds every collective, so a rank that died shows up as an
    error within a minute instead of a hang.
    """
    # NVLink SHARP / multicast (NVLS) is disabled on our shared GPU machines; NCCL would otherwise try
    # to create multicast objects at communicator init and fail there. It must be in the environment
    # before the first NCCL communicator exists. setdefault: a cluster that has NVLS may turn it on.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # Collectives scheduled ahead of the GEMMs they overlap; only effective if CUDA has not started yet.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    world = discover_world()
    rank, world_size, local_rank = world["rank"], world["world_size"], world["local_rank"]
    # env:// reads these; a script's own code (or a library like Megatron) may read them too.
    os.environ.update(MASTER_ADDR=str(world["master_addr"]), MASTER_PORT=str(world["master_port"]),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA, which is not available here; use backend='gloo'")
    device = _device(local_rank, use_cuda=backend == "nccl")  # gloo: the tensors live on the CPU
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        # Binding NCCL to the device eagerly avoids its "guessing the device" path in the first barrier.
        device_id=device if backend == "nccl" else None,
    )
    return rank, world_size, local_rank, device
