#!/bin/bash
# Context parallelism, expert parallelism and block-scaled TP on every GPU of one host: the distributed test
# suites on NCCL, then the multi-GPU benchmarks at each world size 2, 4, 8 that the host has GPUs for.
#
#   bash benchmarks/multi_gpu.sh [tests|bench|short|long|all]   (default all; from the repository root, with
#                                                                te_parallel built and installed)
#
#   tests  tests/compat's Megatron CP=2 and EP=2 runs (skipped where megatron-core is not installed; the tests are
#          written against CI's pin in .ci/client_requirements.txt, and another version is refused here), then
#          tests/distributed (pytest -v; each suite on NCCL with a GPU per rank: tests/distributed/harness.py; a
#          suite with more ranks than GPUs runs on gloo, as in CI). A rank stuck in a collective for
#          TE_PARALLEL_TEST_HANG_S seconds (150 here) dumps every thread's stack and fails its test, and
#          TE_PARALLEL_TEST_TRACE=1 names each check as it starts, so a cut run still says where it stood.
#          OMP_NUM_THREADS (2 here, CI's cores) keeps gloo ranks from oversubscribing a many-core host.
#   short  per world size: bench_block_gather.py, bench_ep.py, bench_cp_ring.py at 32k tokens per GPU (p2p,
#          all_gather, a2a), each under torchrun
#   long   bench_cp_ring.py at 128k tokens per GPU (p2p), world sizes 8, 4, 2
#   bench  short, then long
#
# Each part keeps within MULTI_GPU_BUDGET_S seconds (default 540; `all` gets it twice): every step runs under
# `timeout`, a step that would not fit what is left is skipped and says so, and a failed step does not stop the
# others. Logs and JSON go to $OUT/multi/ (./multi_gpu_out/multi/ without $OUT), tarred into
# $OUT/multi_gpu_<part>.tar.gz at the end; summary.txt lists every step with its exit status and seconds.
# MULTI_GPU_WORLDS="4 8" limits the benchmarks to those world sizes (default: 2, 4 and 8, as far as the GPUs go).
# MULTI_GPU_DRY_RUN=<GPUs> prints the steps that many GPUs would run, with their time limits, and runs nothing.
set -u
PART="${1:-all}"
case "$PART" in
  tests|bench|short|long|all) ;;
  *) echo "multi_gpu.sh: unknown part '$PART'; use tests, bench (= short, then long), short, long or all" >&2; exit 2 ;;
esac
OUT="${OUT:-$PWD/multi_gpu_out}"
LOG="$OUT/multi"
mkdir -p "$LOG"
BUDGET="${MULTI_GPU_BUDGET_S:-540}"
[ "$PART" = all ] && BUDGET=$((2 * BUDGET))
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=1
export GIT_COMMIT="${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PY="${PYTHON:-python3}"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
DRY="${MULTI_GPU_DRY_RUN:-}"  # a number of GPUs: print the plan for that many instead of running it
[ -n "$DRY" ] && GPUS="$DRY"
{
  echo "date $(date -u +%FT%TZ)  commit $GIT_COMMIT  GPUs $GPUS  part $PART  budget ${BUDGET}s"
  nvidia-smi --query-gpu=index,name,power.limit,clocks.max.sm --format=csv,noheader 2>/dev/null
  nvidia-smi topo -m 2>/dev/null | head -12
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
                  torch.cuda.nccl.version() if torch.cuda.is_available() else None)" 2>&1
} > "$LOG/machine.txt"
cat "$LOG/machine.txt"
if [ "$GPUS" -lt 2 ]; then
  echo "multi_gpu.sh: needs at least 2 GPUs for NCCL, this machine has $GPUS" | tee -a "$LOG/summary.txt" >&2
  exit 2
fi

# step NAME TIMEOUT_S CMD...: run CMD under timeout (cut to what is left of the budget), log to NAME.log
step() {
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "$name: skipped (${left}s of the budget left)" | tee -a "$LOG/summary.txt"
    return
  fi
  if [ -n "$DRY" ]; then
    echo "$name (limit ${limit}s): $*" | tee -a "$LOG/summary.txt"
    return
  fi
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$LOG/summary.txt"
  tail -n 25 "$LOG/$name.log"
}

run_tests() {
  local pin want
  pin=$(grep -E '^megatron-core==' .ci/client_requirements.txt | cut -d= -f3)
  want=$("$PY" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || echo none)
  if [ "$want" != none ] && [ "$want" != "$pin" ]; then
    echo "megatron_cp2_ep2: skipped (megatron-core $want is installed; the tests need CI's pin $pin)" | tee -a "$LOG/summary.txt"
  else
    step megatron_cp2_ep2 150 env OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$PY" -m pytest -q -p no:randomly \
      -p no:cacheprovider -rs tests/compat/test_megatron_cp.py tests/compat/test_megatron_moe.py
  fi
  # (-v: every test's result is in the log as it ends, so a run cut by its timeout still says what passed)
  step tests_distributed 480 env OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" \
    TE_PARALLEL_TEST_HANG_S="${TE_PARALLEL_TEST_HANG_S:-150}" TE_PARALLEL_TEST_TRACE=1 \
    "$PY" -m pytest -v -p no:randomly -p no:cacheprovider -rs --durations=15 --junitxml="$LOG/tests_distributed.xml" tests/distributed
}

run_bench() {  # bench_block_gather, bench_ep, bench_cp_ring at 32k tokens per GPU, for each world size
  local w
  for w in ${MULTI_GPU_WORLDS:-2 4 8}; do
    [ "$w" -gt "$GPUS" ] && continue
    local run=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$w")
    step "block_gather_w$w" 60 "${run[@]}" benchmarks/bench_block_gather.py --json "$LOG/block_gather_w$w.json"
    step "ep_w$w" 120 "${run[@]}" benchmarks/bench_ep.py --json "$LOG/ep_w$w.json"
    step "cp_ring_32k_w$w" 120 "${run[@]}" benchmarks/bench_cp_ring.py --seq 32768 --json "$LOG/cp_ring_32k_w$w.json"
  done
}

run_long() {  # bench_cp_ring at 128k tokens per GPU, p2p (a rank's work grows with w: w × s²/2 pairs); largest first
  local w
  for w in $(echo ${MULTI_GPU_WORLDS:-2 4 8} | tr ' ' '\n' | sort -rn); do
    [ "$w" -gt "$GPUS" ] && continue
    step "cp_ring_128k_w$w" $((60 + 25 * w)) "$PY" -m torch.distributed.run --standalone --nproc-per-node="$w" \
      benchmarks/bench_cp_ring.py --seq 131072 --comm p2p --rounds 2 --json "$LOG/cp_ring_128k_w$w.json"
  done
}

case "$PART" in
  tests) run_tests ;;
  short) run_bench ;;
  long) run_long ;;
  bench) run_bench; run_long ;;
  all) run_tests; run_bench; run_long ;;
esac
tar -czf "$OUT/multi_gpu_$PART.tar.gz" -C "$OUT" multi
echo "logs and JSON: $LOG/ (tarred: $OUT/multi_gpu_$PART.tar.gz); ${SECONDS}s in all"
