#!/usr/bin/env bash
# memfl's LoRA trainer beside Hugging Face transformers + PEFT on one GPU:
# the same shapes, batch and adapters (r 16, lora_alpha 32, all seven linear
# layers), bf16 base, float32 adapters, Adam on the adapters alone. One JSON
# line per run into OUT (memfl bench llm --lora-r, bench/llm_train_hf.py
# --lora-r): tokens/s, the CUDA allocator's peak, and the MFU against 989
# TFLOPS bf16 (FLOPs per token: 2/3 × (6 N + 12 L H T), no weight-gradient
# matmuls over a frozen base).
# Usage: bench/llm_lora_vs_peft.sh MEMFL OUT [CELLS]
#   CELLS: space-separated name:batch:seq, default 886m:4:1024 8b:4:512 8b:1:4096.
set -uo pipefail
MEMFL=$1 OUT=$2
CELLS=${3:-"886m:4:1024 8b:4:512 8b:1:4096"}
HERE=$(cd "$(dirname "$0")" && pwd)
STEPS=${STEPS:-10}
R=${R:-16}
ALPHA=${ALPHA:-32}
shape_886m=(--model llama --hidden 2048 --layers 16 --heads 16 --kv-heads 8 --intermediate 5632 --vocab 32000)
shape_8b=(--model llama-8b)
for cell in $CELLS; do
  IFS=: read -r name batch seq <<<"$cell"
  var="shape_$name[@]"
  shape=("${!var}")
  # shellcheck disable=SC2086
  "$MEMFL" bench llm "${shape[@]}" --dtype bf16 --device cuda --batch "$batch" --seq "$seq" --steps "$STEPS" \
    --warmup 3 --lr 1e-4 --lora-r "$R" --lora-alpha "$ALPHA" --target-modules all-linear ${MEMFL_ARGS:-} \
    --json "$OUT" | tail -1
  python3 "$HERE/llm_train_hf.py" "${shape[@]}" --batch "$batch" --seq "$seq" --steps "$STEPS" --warmup 3 \
    --lr 1e-4 --lora-r "$R" --lora-alpha "$ALPHA" | tail -1 | tee -a "$OUT"
done
