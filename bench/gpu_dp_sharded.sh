#!/usr/bin/env bash
# On the GPU machine (device tool, kind nvidia-h100-x2): the sharded
# DP-SGD sweep, modes no_dp, naive, ghost, fused × seq 1024, 2048, 4096, batch 2
# per rank, Adam, for each model × parameter dtype × number of GPUs. One
# dp_sweep JSON, CSV and HTML page per (model, dtype, GPUs) under OUT_DIR.
# 1 GPU runs the same sharded code on one rank (--sharded --gpus 1).
# Usage: [ITERS=3 WARMUP=1 SEQS=… MODES=…] bench/gpu_dp_sharded.sh BUILD_DIR OUT_DIR [MODELS] [DTYPES] [GPUS]
set -uo pipefail
BUILD=${1:-build-gpu}
OUT=${2:-runs/gpu_dp_sharded}
MODELS=${3:-llama-dp-0.5b,llama-3.2-1b-dp}
DTYPES=${4:-float32,bfloat16}
GPUS=${5:-1,2}
SEQS=${SEQS:-1024,2048,4096}
MODES=${MODES:-no_dp,naive,ghost,fused}
mkdir -p "$OUT"
for model in ${MODELS//,/ }; do
  for dtype in ${DTYPES//,/ }; do
    for g in ${GPUS//,/ }; do
      name="$model-$dtype-${g}gpu"
      ranks="--gpus $g"
      [ "$g" = 1 ] && ranks="--gpus 1 --sharded"
      echo "== $name"
      timeout "${RUN_TIMEOUT:-400}" "$BUILD/memfl" bench dp --model "$model" --seq "$SEQS" --batch 2 --modes "$MODES" \
        --warmup "${WARMUP:-1}" --iters "${ITERS:-3}" --device cuda --optimizer adam --dtype "$dtype" $ranks \
        --json "$OUT/$name.json" --report "$OUT/$name" 2>&1 | tee "$OUT/$name.txt"
    done
  done
done
