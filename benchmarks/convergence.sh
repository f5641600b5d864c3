#!/usr/bin/env bash
# Convergence runs of the main job on a 2-GPU machine (docs/convergence.md). Logs under $OUT/<run>/log.json.
# Phase 1 and 2 run two single-GPU jobs side by side (one per GPU); phase 3 is TP=2 + SP over both.
set -u
OUT=${OUT:-runs/convergence}
STEPS=${STEPS:-2000}
COMMON="--layers 6 --hidden 512 --heads 8 --seq-len 256 --micro-batch 32 --steps $STEPS --warmup 100 --lr 1e-3
        --eval-every 100 --eval-batches 16 --corpus-bytes 33554432 --quiet --no-plot --device cuda"
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
run() { local gpus=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpus python examples/train_gpt.py $COMMON "$@" --out "$OUT/$name" > "$OUT/$name.txt" 2>&1; echo "$name rc=$?"; }
mkdir -p "$OUT"
run 0 bf16_tp1 --nproc 1 --tp 1 --fp8 off & run 1 fp8_delayed_tp1 --nproc 1 --tp 1 --fp8 delayed & wait
run 0 fp8_current_tp1 --nproc 1 --tp 1 --fp8 current & run 1 bf16_tp1_seed99 --nproc 1 --tp 1 --fp8 off --seed 99 & wait
run 0,1 bf16_tp2_sp --nproc 2 --tp 2 --sequence-parallel --fp8 off
