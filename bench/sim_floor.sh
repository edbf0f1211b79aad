#!/usr/bin/env bash
# the in-process simulator against its floor, alternated
# REPS times. The floor is memfl_bench_sim_floor: the same images (ROUNDS
# rounds of 10 of 100 clients: 540 trained + 60 validated each; the 10 000
# test images evaluated every round) trained and evaluated by bare libtorch
# loops on WORKERS threads × THREADS intra-op threads. Then `memfl run` of the
# same experiment with parallel_clients=WORKERS and num_threads=THREADS. One
# JSON line per run; memfl's carries its ratio to its repetition's floor.
# Repetitions alternate the order (floor first in odd ones, memfl first in
# even ones), so a machine that drifts during the hour favours neither.
# Usage: bench/sim_floor.sh [BUILD_DIR] [ROUNDS] [WORKERS] [THREADS] [REPS]
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${2:-100}
WORKERS=${3:-2}
THREADS=${4:-1}
REPS=${5:-2}
OUT=$(mktemp -d /tmp/memfl_simfloor_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
run_floor() {
  floor=$("$BUILD/memfl_bench_sim_floor" "$ROUNDS" 10 "$WORKERS" "$THREADS" 100)
  echo "$floor"
  floor_s=$(echo "$floor" | grep -o '"wall_seconds": [0-9.]*' | grep -o '[0-9.]*$')
}
run_memfl() {
  rm -rf "$OUT/run"
  "$BUILD/memfl" run -q --out "$OUT/run" --set server_configs.num_clients=100 --set server_configs.clients_per_round=10 \
    --set server_configs.num_global_epochs="$ROUNDS" --set server_configs.parallel_clients="$WORKERS" \
    --set client_configs.train_configs.num_threads="$THREADS" >/dev/null
}
for rep in $(seq 1 "$REPS"); do
  if [ $((rep % 2)) = 1 ]; then
    run_floor
    run_memfl
  else
    run_memfl
    run_floor
  fi
  # memfl's wall from its summary (data loading included; the floor's excludes it).
  wall=$(grep -o '"wall_seconds": [0-9.]*' "$OUT/run/summary.json" | grep -o '[0-9.]*$')
  rounds_s=$(awk -F, 'NR>1 {s+=$10} END {printf "%.3f", s}' "$OUT/run/metrics.csv")
  acc=$(tail -1 "$OUT/run/metrics.csv" | cut -d, -f8)
  printf '{"memfl": "run", "rep": %s, "rounds": %s, "parallel_clients": %s, "intra_op_threads": %s, "wall_seconds": %s, "rounds_seconds": %s, "final_accuracy": %s, "floor_seconds": %s, "wall_over_floor": %s}\n' \
    "$rep" "$ROUNDS" "$WORKERS" "$THREADS" "$wall" "$rounds_s" "$acc" "$floor_s" \
    "$(awk -v a="$wall" -v b="$floor_s" 'BEGIN {printf "%.3f", a / b}')"
done
