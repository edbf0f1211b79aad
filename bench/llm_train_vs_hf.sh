#!/usr/bin/env bash
# memfl's trainer beside Hugging Face transformers on one GPU, same shapes,
# same batch, bf16, Adam: tokens/s and the CUDA allocator's peak of each, one
# JSON line per run into OUT (memfl bench llm, bench/llm_train_hf.py).
# Usage: bench/llm_train_vs_hf.sh MEMFL OUT [CELLS]
#   CELLS: space-separated name:batch:seq, default the three of BENCHMARKS.md
#   (886m:4:1024 886m:2:2048 8b:4:512). MEMFL_ARGS: extra bench llm options;
#   HF_ARGS: extra bench/llm_train_hf.py options.
set -uo pipefail
MEMFL=$1 OUT=$2
CELLS=${3:-"886m:4:1024 886m:2:2048 8b:4:512"}
HERE=$(cd "$(dirname "$0")" && pwd)
STEPS=${STEPS:-10}
shape_886m=(--model llama --hidden 2048 --layers 16 --heads 16 --kv-heads 8 --intermediate 5632 --vocab 32000)
shape_8b=(--model llama-8b)
for cell in $CELLS; do
  IFS=: read -r name batch seq <<<"$cell"
  var="shape_$name[@]"
  shape=("${!var}")
  # shellcheck disable=SC2086
  "$MEMFL" bench llm "${shape[@]}" --dtype bf16 --device cuda --batch "$batch" --seq "$seq" --steps "$STEPS" \
    --warmup 3 ${MEMFL_ARGS:-} --json "$OUT" | tail -1
  # shellcheck disable=SC2086
  python3 "$HERE/llm_train_hf.py" "${shape[@]}" --batch "$batch" --seq "$seq" --steps "$STEPS" --warmup 3 \
    ${HF_ARGS:-} | tail -1 | tee -a "$OUT"
done
