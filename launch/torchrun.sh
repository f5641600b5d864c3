#!/usr/bin/env bash
# Launch a script with torchrun, one process per GPU (or NPROC CPU processes under gloo).
#
#   single node:  NPROC=8 launch/torchrun.sh train.py --args
#   multi node:   on every node, the same command with
#                 NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0's host> MASTER_PORT=29500 NPROC=8 \
#                 launch/torchrun.sh train.py --args
#
# The script then calls launch/common.py's init_distributed(), which reads torchrun's RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
set -euo pipefail

if [[ $# -eq 0 ]]; then
  echo "usage: [NPROC=N] [NNODES=N NODE_RANK=R MASTER_ADDR=H MASTER_PORT=P] $0 SCRIPT.py [ARGS...]" >&2
  exit 2
fi
NPROC="${NPROC:-2}"
NNODES="${NNODES:-1}"
# One hardware queue per GPU, so a tensor-parallel collective is scheduled before the GEMM issued after
# it (te_parallel's backward overlaps them); must be set before CUDA starts in the workers.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

# torchrun is the console script of torch.distributed.run; the module works where the script is not on PATH.
if command -v torchrun >/dev/null 2>&1; then
  TORCHRUN=(torchrun)
else
  TORCHRUN=("${PYTHON:-python}" -m torch.distributed.run)
fi

if [[ "$NNODES" -le 1 ]]; then
  # --standalone: a local c10d rendezvous on a free port, nothing to configure.
  exec "${TORCHRUN[@]}" --standalone --nnodes=1 --nproc-per-node="$NPROC" "$@"
fi

missing=()
for v in NODE_RANK MASTER_ADDR MASTER_PORT; do
  [[ -n "${!v:-}" ]] || missing+=("$v")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "$0: NNODES=$NNODES needs ${missing[*]} set on every node (MASTER_ADDR/PORT: node 0's host and a free port)" >&2
  exit 2
fi
# c10d rendezvous hosted by node 0's agent at MASTER_ADDR:MASTER_PORT; the rendezvous id keeps two jobs
# on the same endpoint apart.
exec "${TORCHRUN[@]}" --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-te_parallel}" "$@"
