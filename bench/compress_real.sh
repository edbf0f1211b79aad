#!/usr/bin/env bash
# Codecs on real updates: for the Fashion-MNIST CNN, ResNet18 (synthetic
# CIFAR-10) and llama-tiny (synthetic tokens), a 2-round run with one client a
# round and one local epoch; with FedAvg over one client, round 2's global model
# is that client's model, so round 2's checkpoint − round 1's is one client's
# update after one local epoch. memfl_bench_codecs then encodes and decodes it
# with each codec and bound (one JSON line per case).
# Usage: bench/compress_real.sh [BUILD_DIR] [REPS]
set -euo pipefail
BUILD=${1:-build}
REPS=${2:-3}
MEMFL=$(realpath "$BUILD/memfl")
CODECS=$(realpath "$BUILD/memfl_bench_codecs")
ROOT=$(dirname "$(realpath "$0")")/..
TMP=$(mktemp -d /tmp/memfl_compress_real.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
COMMON=(-q --set server_configs.num_global_epochs=2 --set server_configs.clients_per_round=1
        --set server_configs.checkpoint_keep=2 --set memory_configs.profile=false)
T=client_configs.train_configs
update() {  # label config extra-args…
  local label=$1 cfg=$2; shift 2
  "$MEMFL" run "$ROOT/configs/$cfg" --out "$TMP/$label" "${COMMON[@]}" "$@" > "$TMP/$label.log" 2>&1
  mapfile -t files < <(ls "$TMP/$label/state/"*.safetensors | sort -V)
  "$CODECS" "${files[-2]}" "${files[-1]}" "$label" "$REPS"
}
update fmnist_cnn fedavg_fmnist_cnn.yaml
update resnet18 resnet18_synthetic_profile.yaml --set $T.mode=epoch --set $T.num_local_epochs=1 \
  --set $T.do_validation=false
update llama_tiny llama_tiny_tokens.yaml --set $T.mode=epoch --set $T.num_local_epochs=1
