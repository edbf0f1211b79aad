#!/usr/bin/env bash
# a TorchScript ResNet18 (examples/export_torchscript.py, scripted
# with Debian's python3-torch) against memfl's built-in ResNet18, trained by the
# same C++ trainer: 1 client, 1 round of STEPS steps of batch 16 on synthetic
# CIFAR-10, 1 thread, alternated REPS times. images/s = STEPS·16 ÷ round_seconds
# (metrics.csv; the round also holds a 16-image evaluation, the same for both).
# Usage: bench/torchscript_resnet18.sh [BUILD] [REPS] [STEPS] → one JSON line per run
set -euo pipefail
BUILD=${1:-build}
REPS=${2:-3}
STEPS=${3:-40}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
/usr/bin/python3 examples/export_torchscript.py --model resnet18 --out "$TMP/r18.pt" >&2
common=(--set memory_configs.profile=false --set server_configs.num_clients=1 --set server_configs.num_global_epochs=1
  --set client_configs.train_configs.num_local_steps="$STEPS" --set client_configs.train_configs.do_validation=false
  --set client_configs.data_configs.dataset_kwargs.num_test_samples=16 -q)
for rep in $(seq 1 "$REPS"); do
  for model in ResNet18 TorchScript; do
    extra=()
    [ "$model" = TorchScript ] && extra=(--set client_configs.model_configs.model_name=TorchScript
      --set client_configs.model_configs.torchscript_path="$TMP/r18.pt")
    "$BUILD/memfl" run configs/resnet18_synthetic_profile.yaml "${common[@]}" "${extra[@]}" --out "$TMP/$model-$rep" >&2
    secs=$(awk -F, 'NR==1{for(i=1;i<=NF;i++) if($i=="round_seconds") c=i} NR==2{print $c}' "$TMP/$model-$rep/metrics.csv")
    echo "{\"model\": \"$model\", \"rep\": $rep, \"steps\": $STEPS, \"batch\": 16, \"round_seconds\": $secs, \"images_per_s\": $(awk -v s="$STEPS" -v t="$secs" 'BEGIN{printf "%.2f", s*16/t}')}"
  done
done
