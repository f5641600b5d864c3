#!/usr/bin/env bash
# Float8BlockScaling against bf16 on a 12-layer Llama-style model (RMSNorm, SwiGLU, grouped-query attention),
# 2000 steps of the main job on one GPU, all runs side by side (docs/convergence.md). Logs under
# $OUT/<run>/log.json. RUNS picks the runs (default: all below); SEEDS the seeds of the bf16 and block runs.
set -u
OUT=${OUT:-runs/convergence_block}
STEPS=${STEPS:-2000}
SEEDS=${SEEDS:-"1234 99 7"}
COMMON="--arch llama --layers 12 --hidden 512 --heads 8 --kv-heads 2 --ffn 1536 --seq-len 256 --micro-batch 32
        --steps $STEPS --warmup 100 --lr 1e-3 --eval-every 100 --eval-batches 16 --corpus-bytes 33554432 --quiet
        --no-plot --device cuda --nproc 1 --tp 1"
export PYTHONUNBUFFERED=1
run() { local name=$1; shift; python examples/train_gpt.py $COMMON "$@" --out "$OUT/$name" > "$OUT/$name.txt" 2>&1; echo "$name rc=$?"; }
mkdir -p "$OUT"
ALL=""
for s in $SEEDS; do ALL="$ALL bf16:$s block:$s"; done
ALL="$ALL current:1234 block_hybrid:1234 block_fp32:1234"
for r in ${RUNS:-$ALL}; do
  kind=${r%%:*}; seed=${r##*:}
  case $kind in
    bf16) run "llama_bf16_s$seed" --fp8 off --seed "$seed" & ;;
    block) run "llama_fp8_block_s$seed" --fp8 block --seed "$seed" & ;;
    current) run "llama_fp8_current_s$seed" --fp8 current --seed "$seed" & ;;
    block_hybrid) run "llama_fp8_block_hybrid_s$seed" --fp8 block --fp8-format hybrid --seed "$seed" & ;;
    block_fp32) run "llama_fp8_block_fp32_s$seed" --fp8 block --fp8-block-scales fp32 --seed "$seed" & ;;
    *) echo "convergence_block.sh: unknown run $r (use bf16, block, current, block_hybrid or block_fp32, then :seed)" >&2; exit 2 ;;
  esac
done
wait
