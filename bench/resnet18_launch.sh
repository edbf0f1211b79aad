#!/usr/bin/env bash
# APPFL's ResNet18 experiment as memfl runs it: a server and 2 clients over
# gRPC on this machine (configs/resnet18_synthetic_profile.yaml: 3 rounds of
# 10 steps of batch 16, Adam, profiled). Prints one JSON line per run: wall
# seconds, the CPU seconds of every process (user + sys), and wall ÷ (CPU ÷
# cores) — how close the run is to what the cores allow when every process
# keeps one busy.
# Usage: bench/resnet18_launch.sh [BUILD_DIR] [RUNS]
set -euo pipefail
BUILD=${1:-build}
RUNS=${2:-3}
CORES=$(nproc)
OUT=$(mktemp -d /tmp/memfl_r18_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
for i in $(seq "$RUNS"); do
  d="$OUT/run$i"
  /usr/bin/time -f '%e %U %S' -o "$OUT/time$i" "$BUILD/memfl" launch configs/resnet18_synthetic_profile.yaml \
    --clients 2 -q --out "$d" >/dev/null
  read -r wall user sys <"$OUT/time$i"
  rounds=$(awk -F, 'NR>1 {printf "%s%s", sep, $10; sep=","}' "$d/server/metrics.csv")
  acc=$(tail -1 "$d/server/metrics.csv" | cut -d, -f8)
  printf '{"run": %s, "wall_seconds": %s, "cpu_seconds": %s, "cores": %s, "wall_over_cpu_floor": %s, "round_seconds": [%s], "final_test_accuracy": %s}\n' \
    "$i" "$wall" "$(awk -v u="$user" -v s="$sys" 'BEGIN {printf "%.2f", u + s}')" "$CORES" \
    "$(awk -v w="$wall" -v u="$user" -v s="$sys" -v c="$CORES" 'BEGIN {printf "%.3f", w / ((u + s) / c)}')" "$rounds" "$acc"
done
