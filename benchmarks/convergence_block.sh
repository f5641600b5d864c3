#!/usr/bin/env bash
# Float8BlockScaling against bf16 on a 12-layer Llama-style model (RMSNorm, SwiGLU, grouped-query attention),
# 2000 steps of the main job on one GPU, the two runs side by side (docs/convergence.md). Logs under
# $OUT/<run>/log.json.
set -u
OUT=${OUT:-runs/convergence_block}
STEPS=${STEPS:-2000}
COMMON="--arch llama --layers 12 --hidden 512 --heads 8 --kv-heads 2 --ffn 1536 --seq-len 256 --micro-batch 32
        --steps $STEPS --warmup 100 --lr 1e-3 --eval-every 100 --eval-batches 16 --corpus-bytes 33554432 --quiet
        --no-plot --device cuda --nproc 1 --tp 1"
export PYTHONUNBUFFERED=1
run() { local name=$1; shift; python examples/train_gpt.py $COMMON "$@" --out "$OUT/$name" > "$OUT/$name.txt" 2>&1; echo "$name rc=$?"; }
mkdir -p "$OUT"
run llama_bf16 --fp8 off & run llama_fp8_block --fp8 block & wait
