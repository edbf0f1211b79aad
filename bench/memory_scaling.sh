#!/usr/bin/env bash
# Peak RSS of the in-process simulation against model size and client count
# (the claim: memory does not grow with the number of clients, because a
# virtual client is an index list and clients take turns on one replica).
# Usage: bench/memory_scaling.sh [BUILD_DIR] > bench_memory.json
set -euo pipefail
BUILD=${1:-build}
OUT=$(mktemp -d /tmp/memfl_bench_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
echo "["
first=1
for model in "MLP hidden_size=256" "MLP hidden_size=2048" "ResNet18 hidden_size=200"; do
  set -- $model
  name=$1; hidden=${2#hidden_size=}
  for clients in 10 100; do
    dir="$OUT/${name}_${hidden}_${clients}"
    "$BUILD/memfl" run -q --out "$dir" \
      --set client_configs.model_configs.model_name="$name" \
      --set client_configs.model_configs.model_kwargs.hidden_size="$hidden" \
      --set client_configs.data_configs.dataset_name=SyntheticCIFAR10 \
      --set client_configs.data_configs.dataset_kwargs.num_train_samples=4000 \
      --set client_configs.data_configs.dataset_kwargs.num_test_samples=200 \
      --set client_configs.model_configs.model_kwargs.num_channel=0 \
      --set client_configs.model_configs.model_kwargs.num_pixel=0 \
      --set client_configs.train_configs.mode=step \
      --set client_configs.train_configs.num_local_steps=1 \
      --set client_configs.train_configs.train_batch_size=16 \
      --set client_configs.train_configs.do_validation=false \
      --set client_configs.train_configs.num_threads=2 \
      --set server_configs.num_clients="$clients" \
      --set server_configs.num_global_epochs=2 >/dev/null
    [ $first -eq 1 ] || echo ","
    first=0
    printf '{"model": "%s", "hidden_size": %s, "num_clients": %s, "summary": %s}' \
      "$name" "$hidden" "$clients" "$(cat "$dir/summary.json")"
  done
done
echo
echo "]"
