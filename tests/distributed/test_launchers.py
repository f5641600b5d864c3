"""The launchers end to end (launch/check_world.py under torchrun and mpirun, the trainer under
launch/slurm.sbatch with stand-ins for srun and scontrol), and world discovery
(te_parallel.parallel.bootstrap.env_world, launch/common.py's choice of launcher) on faked environments.
"""
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import common
from te_parallel.parallel import bootstrap

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "NNODES", "NODE_RANK")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "PRTE_")


def _child_env() -> dict:
    """This checkout and this interpreter's tools first on the paths, and no launcher variables
    inherited from whatever started pytest (pytest under srun would otherwise look like a rank)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHON"] = sys.executable
    env["NPROC"] = env["NP"] = "2"
    if os.environ.get("TE_PARALLEL_TEST_DEVICE") == "cpu" or torch.cuda.device_count() < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""  # two ranks need two GPUs for NCCL; else gloo on the CPU
    return env


def _run_launcher(script: str, env: dict) -> str:
    try:
        out = subprocess.run(["bash", str(REPO / "launch" / script), str(REPO / "launch" / "check_world.py")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} check_world.py did not finish in {TIMEOUT_S} s; output: {e.stdout!r} {e.stderr!r}")
    log = f"rc={out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"
    assert out.returncode == 0, log
    assert re.search(r"^check_world: ok world=2 backend=(gloo|nccl)$", out.stdout, re.MULTILINE), log
    return out.stdout


def test_torchrun_check_world():
    _run_launcher("torchrun.sh", _child_env())


def mpi_env_or_skip() -> dict:
    """_child_env() for launch/mpirun.sh, or skip when mpirun / mpi4py are missing."""
    env = _child_env()
    if shutil.which("mpirun", path=env["PATH"]) is None:
        pytest.skip("mpirun is not on PATH; install an MPI with: bash .ci/install_mpi.sh")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed; install it with: bash .ci/install_mpi.sh")
    return env


def test_mpirun_check_world():
    _run_launcher("mpirun.sh", mpi_env_or_skip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_ins(directory: Path) -> None:
    """srun and scontrol for one node: srun drops its options and runs the command once (one task on
    this node), scontrol names this node as the job's only host."""
    srun = directory / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    scontrol = directory / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1\n')
    for f in (srun, scontrol):
        f.chmod(0o755)


def test_slurm_sbatch_runs_the_trainer_on_a_mesh(tmp_path):
    """launch/slurm.sbatch on one node (stand-ins for srun and scontrol): its torchrun starts the trainer
    as 2 processes of a dp2 x tp1 mesh under DDP, which trains and writes its log."""
    _stand_ins(tmp_path)
    env = _child_env()
    env.update(PATH=os.pathsep.join([str(tmp_path), env["PATH"]]), SLURM_JOB_NODELIST="node[1]",
               SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO),
               MASTER_PORT=str(_free_port()))
    out = tmp_path / "run"
    args = ["examples/train_gpt.py", "--tp", "1", "--dp-engine", "ddp", "--steps", "3", "--layers", "1", "--hidden",
            "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "2", "--eval-every", "3", "--eval-batches", "1",
            "--warmup", "1", "--corpus-bytes", "65536", "--device", "cpu", "--quiet", "--no-plot", "--out", str(out)]
    try:
        result = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), *args], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"slurm.sbatch did not finish in {TIMEOUT_S} s; output: {e.stdout!r} {e.stderr!r}")
    log = f"rc={result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    assert result.returncode == 0, log
    assert result.stdout.count("train_gpt: 2 processes on the CPU (gloo): tp=1 dp=2 (ddp)") == 1, log
    record = json.loads((out / "log.json").read_text())
    assert (record["config"]["world"], record["config"]["dp"], len(record["log"])) == (2, 2, 3), log


# --- world discovery on faked environments ---------------------------------------------------------

def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29511"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456"}


def test_env_world_reads_torchrun_variables():
    assert bootstrap.env_world(TORCHRUN) == {"rank": 3, "world_size": 4, "local_rank": 1,
                                             "master_addr": "node0", "master_port": 29511,
                                             "launcher": "torchrun"}


def test_env_world_reads_slurm_variables_with_master_addr_set():
    world = bootstrap.env_world({**SLURM, "MASTER_ADDR": "gpu-a", "MASTER_PORT": "40000"})
    assert world == {"rank": 5, "world_size": 8, "local_rank": 1, "master_addr": "gpu-a",
                     "master_port": 40000, "launcher": "slurm"}
    # without MASTER_PORT every task derives the same port from the job id
    world = bootstrap.env_world({**SLURM, "MASTER_ADDR": "gpu-a"})
    assert world["master_port"] == 15000 + 123456 % 15000


def test_env_world_takes_the_first_slurm_host(tmp_path, monkeypatch):
    assert bootstrap.env_world({**SLURM, "SLURM_NODELIST": "gpu7,gpu8"})["master_addr"] == "gpu7"
    fake = tmp_path / "scontrol"  # stands in for SLURM's scontrol, which expands bracketed lists
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[01-02]" ] && printf "gpu01\\ngpu02\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert bootstrap.env_world({**SLURM, "SLURM_JOB_NODELIST": "gpu[01-02]"})["master_addr"] == "gpu01"
    with pytest.raises(RuntimeError) as e:
        bootstrap.env_world({**SLURM, "SLURM_NODELIST": "cpu[1-3]"})  # the fake fails on other lists
    assert "'cpu[1-3]'" in _one_line(e) and "MASTER_ADDR" in str(e.value)


def test_env_world_names_the_missing_variables():
    with pytest.raises(RuntimeError) as e:
        bootstrap.env_world({"RANK": "0", "WORLD_SIZE": "2"})
    assert "missing LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in _one_line(e)
    with pytest.raises(RuntimeError) as e:
        bootstrap.env_world({"SLURM_PROCID": "0"})
    assert "missing SLURM_NTASKS, SLURM_LOCALID, MASTER_ADDR or SLURM_NODELIST" in _one_line(e)
    with pytest.raises(RuntimeError) as e:
        bootstrap.env_world({})
    msg = _one_line(e)
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in msg and "SLURM_PROCID" in msg


def test_env_world_rejects_bad_values():
    with pytest.raises(ValueError) as e:
        bootstrap.env_world({**TORCHRUN, "WORLD_SIZE": "four"})
    assert "WORLD_SIZE must be an integer, got 'four'" in _one_line(e)
    with pytest.raises(ValueError) as e:
        bootstrap.env_world({**TORCHRUN, "RANK": "4"})
    assert "rank 4 is not in [0, world size 4)" in _one_line(e)


def test_mpi_world_without_mpi4py_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `from mpi4py import MPI` fail
    with pytest.raises(ImportError) as e:
        bootstrap.mpi_world()
    assert "pip install mpi4py" in _one_line(e)


def test_launchers_are_told_apart(monkeypatch):
    monkeypatch.setattr(bootstrap, "mpi_world", lambda: {"launcher": "mpi"})
    assert common.discover_world(TORCHRUN)["launcher"] == "torchrun"
    assert common.discover_world({"OMPI_COMM_WORLD_RANK": "1", **SLURM})["launcher"] == "mpi"
    assert common.discover_world({"PMI_RANK": "0"})["launcher"] == "mpi"
    assert common.discover_world({**SLURM, "MASTER_ADDR": "h"})["launcher"] == "slurm"
    assert common.discover_world({**TORCHRUN, "PMIX_RANK": "0"})["launcher"] == "torchrun"
