#!/usr/bin/env bash
# memfl's LoRA trainer beside Hugging Face transformers + PEFT on one GPU:
# the same shapes, batch and adapters (r 16, lora_alpha 32, all seven linear
# layers), bf16 base, float32 adapters, Adam on the adapters alone. One JSON
# line per run into OUT (memfl bench llm --lora-r, bench/llm_train_hf.py
# --lora-r, through bench/llm_train_vs_hf.sh): tokens/s, the CUDA
# allocator's peak, and the MFU against 989 TFLOPS bf16 (FLOPs per token:
# 2/3 × (6 N + 12 L H T), no weight-gradient matmuls over a frozen base).
# Usage: bench/llm_lora_vs_peft.sh MEMFL OUT [CELLS]
#   CELLS: space-separated name:batch:seq, default 886m:4:1024 8b:4:512 8b:1:4096.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
R=${R:-16}
ALPHA=${ALPHA:-32}
lora="--lr 1e-4 --lora-r $R --lora-alpha $ALPHA"
MEMFL_ARGS="$lora --target-modules all-linear ${MEMFL_ARGS:-}" HF_ARGS="$lora" \
  exec bash "$HERE/llm_train_vs_hf.sh" "$1" "$2" "${3:-886m:4:1024 8b:4:512 8b:1:4096}"
