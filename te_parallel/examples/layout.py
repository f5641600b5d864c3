"""Where the trainer runs, decided before any process starts: under a launcher (torchrun, mpirun) or
with processes it starts itself, on the GPUs or the CPU, with which TP size and FP8 recipe.

Defaults: with GPUs, one process per GPU and --tp 2 (1 with a single GPU); on the CPU, 2 processes
(or --tp if larger) with gloo. Every choice the user did not make is said in the layout line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

import torch

from te_parallel.examples.cli import CliError

RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
DEFAULT_TP = 2


def _first_int(env: Mapping[str, str], names) -> tuple:
    """(value, 'NAME=value') of the first variable that holds an integer, else (None, '')."""
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value), f"{name}={value.strip()}"
    return None, ""


@dataclass
class Launch:
    """The launcher's view of this process (launched=False: the trainer starts the processes)."""

    launched: bool
    world: Optional[int] = None
    world_var: str = ""
    local: Optional[int] = None
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Launch":
        if not any(name in env for name in RANK_VARS):
            return cls(False)
        world, world_var = _first_int(env, WORLD_VARS)
        local, _ = _first_int(env, LOCAL_SIZE_VARS)
        rank, _ = _first_int(env, RANK_VARS)
        local_rank, _ = _first_int(env, LOCAL_RANK_VARS)
        return cls(True, world, world_var, local, rank or 0, local_rank or 0)

    @property
    def leader(self) -> bool:
        """The process that prints the run's lines (rank 0, or the starting process)."""
        return self.rank == 0

    @property
    def speaks(self) -> bool:
        """The process that prints an argument error (one per machine)."""
        return self.local_rank == 0


@dataclass
class Layout:
    device: str                 # "cpu" or "cuda"
    nproc: int                  # processes in the world
    tp: int
    world_fixed: bool           # False: the process count followed --tp
    what: str                   # where the process count comes from, for messages
    can_add: bool               # more processes can be asked for with --nproc
    gpus: int = 0               # GPUs of this machine
    notes: List[str] = field(default_factory=list)


def _launched(args, launch: Launch, ngpu: int) -> Layout:
    if args.nproc is not None:
        raise CliError(f"--nproc {args.nproc} is for runs without a launcher, and this one was started by a launcher "
                       f"({launch.world_var or 'RANK is set'}); drop --nproc and set the process count in the launcher")
    world = launch.world or 1
    local = launch.local or world
    notes = []
    cuda = args.device == "cuda" or (args.device == "auto" and ngpu >= local)
    if cuda and ngpu < local:
        raise CliError(f"--device cuda: this machine runs {local} processes of the launcher and has {ngpu} GPU(s); "
                       f"start one process per GPU (e.g. torchrun --nproc-per-node={max(ngpu, 1)})")
    if args.device == "auto" and 0 < ngpu < local:
        notes.append(f"{local} processes on this machine and {ngpu} GPU(s): training on the CPU")
    tp, cp = args.tp, getattr(args, "cp", 1)
    if tp is None:
        tp = DEFAULT_TP if world % (DEFAULT_TP * cp) == 0 else 1
        if tp != DEFAULT_TP:
            with_cp = f" x --cp {cp}" if cp > 1 else ""
            notes.append(f"--tp 1: the default --tp {DEFAULT_TP}{with_cp} does not divide {world} process(es)")
    return Layout("cuda" if cuda else "cpu", world, tp, True, f"{launch.world_var or 'the launcher'}", False,
                  ngpu, notes)


def _started(args, ngpu: int) -> Layout:
    cuda = args.device == "cuda" or (args.device == "auto" and ngpu > 0)
    notes = []
    room = ngpu if cuda else None              # processes that fit (one per GPU)
    if cuda and args.nproc is not None and args.nproc > ngpu:
        raise CliError(f"--nproc {args.nproc} needs {args.nproc} GPUs (one process per GPU), and this machine has "
                       f"{ngpu}; use --nproc {ngpu}, or --device cpu for {args.nproc} processes on the CPU")
    tp, cp = args.tp, getattr(args, "cp", 1)  # (the processes come in groups of tp x cp)
    with_cp = f" x --cp {cp}" if cp > 1 else ""
    if tp is None:
        tp = DEFAULT_TP
        unit = DEFAULT_TP * cp
        fixed = args.nproc if args.nproc is not None else (room if room is not None and room < unit else None)
        if fixed is not None and fixed % unit:
            tp = 1
            notes.append(f"--tp 1: the default --tp {DEFAULT_TP}{with_cp} does not fit "
                         + (f"--nproc {args.nproc}" if args.nproc is not None else f"{ngpu} GPU"))
    if cuda and tp * cp > ngpu:
        fix = f"--tp {max(t for t in (1, 2, 4, 8) if t <= ngpu)}" if cp == 1 else "a smaller --tp or --cp"
        raise CliError(f"--tp {tp}{with_cp} needs {tp * cp} GPUs (one process per GPU), and this machine has {ngpu}; "
                       f"use {fix}, or --device cpu")
    nproc = args.nproc
    if nproc is None:
        nproc = ngpu // (tp * cp) * tp * cp if cuda else max(2, tp * cp)
        if cuda and nproc < ngpu:
            notes.append(f"using {nproc} of the {ngpu} GPUs, a multiple of --tp {tp}{with_cp}")
    what = f"--nproc {nproc}" if args.nproc is not None else f"{nproc} by default"
    return Layout("cuda" if cuda else "cpu", nproc, tp, args.nproc is not None or cuda, what,
                  not cuda or nproc < ngpu, ngpu, notes)


def plan_layout(args, launch: Launch) -> Layout:
    """Device, process count and TP size; raises CliError when the machine cannot hold the request."""
    ngpu = torch.cuda.device_count() if args.device != "cpu" else 0
    if args.device == "cuda" and ngpu == 0:
        why = "this PyTorch is a CPU-only build" if torch.version.cuda is None else "PyTorch sees no CUDA GPU"
        raise CliError(f"--device cuda: {why}; use --device cpu (or auto)")
    layout = _launched(args, launch, ngpu) if launch.launched else _started(args, ngpu)
    _choose_fp8(args, layout, launch)
    return layout


def _choose_fp8(args, layout: Layout, launch: Launch) -> None:
    """--fp8 defaults to delayed; on a GPU without FP8 (compute capability < 8.9) to off, or an error when asked."""
    recipe = args.fp8 or "delayed"
    if layout.device == "cuda" and recipe != "off":
        index = launch.local_rank if launch.launched else 0
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(index)
            if args.fp8 is not None:
                raise CliError(f"--fp8 {args.fp8} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                               f"Blackwell), and {name} has {major}.{minor}; use --fp8 off")
            recipe = "off"
            layout.notes.append(f"--fp8 off: {name} (compute capability {major}.{minor}) has no FP8")
    args.fp8 = recipe


def describe(args, layout: Layout) -> str:
    """The one line that says where and how the run trains."""
    if layout.device == "cuda":
        name = torch.cuda.get_device_name(0)
        where = f"{layout.nproc} x {name} (nccl)" if layout.nproc > 1 else f"1 x {name}"
    else:
        where = "the CPU (gloo)"
    procs = f"{layout.nproc} process{'es' if layout.nproc > 1 else ''}"
    sp = "sequence parallel" if args.sequence_parallel and layout.tp > 1 else "no sequence parallelism"
    precision = args.precision or ("bf16" if layout.device == "cuda" else "fp32")
    fp8 = f"fp8 {args.fp8}" if args.fp8 != "off" else "no fp8"
    extra = f" ({'; '.join(layout.notes)})" if layout.notes else ""
    overlap = ", comm-GEMM overlap" if args.overlap else ""
    cp = getattr(args, "cp", 1)
    dp = layout.nproc // (layout.tp * cp)
    engine = f" ({args.dp_engine})" if dp * cp > 1 else ""
    cp_part = f" cp={cp} ({args.cp_comm})" if cp > 1 else ""
    return (f"train_gpt: {procs} on {where}: tp={layout.tp}{cp_part} dp={dp}{engine}, {sp}{overlap}, {fp8}, "
            f"{precision}{extra}")
