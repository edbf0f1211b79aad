#!/usr/bin/env bash
# In-process simulator at scale: Fashion-MNIST CNN, N clients, 10
# per round, one local epoch, K worker replicas. Prints one JSON line per
# run: wall, rounds/s, peak RSS, and the RSS slope over the rounds.
# Usage: bench/simulation.sh [BUILD_DIR] [ROUNDS] [CLIENTS...]
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${2:-100}
shift 2 || true
CLIENTS=${*:-"100 1000"}
OUT=$(mktemp -d /tmp/memfl_sim_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
for n in $CLIENTS; do
  for k in 1 2; do
    d="$OUT/n${n}_k${k}"
    t0=$(date +%s.%N)
    "$BUILD/memfl" run -q --out "$d" --set server_configs.num_clients="$n" --set server_configs.clients_per_round=10 \
      --set server_configs.num_global_epochs="$ROUNDS" --set server_configs.parallel_clients="$k" >/dev/null
    t1=$(date +%s.%N)
    # Least-squares slope of RSS (MiB) over the second half of the rounds.
    slope=$(awk -F, -v r="$ROUNDS" 'NR>1 && $1>r/10 {x=$1; y=$16/1048576; n++; sx+=x; sy+=y; sxx+=x*x; sxy+=x*y}
      END {if (n>1) printf "%.4f", (n*sxy-sx*sy)/(n*sxx-sx*sx); else print 0}' "$d/metrics.csv")
    acc=$(tail -1 "$d/metrics.csv" | cut -d, -f8)
    peak=$(grep -o '"peak_rss_bytes": [0-9]*' "$d/summary.json" | grep -o '[0-9]*$')
    wall=$(awk -v a="$t1" -v b="$t0" 'BEGIN {printf "%.3f", a - b}')
    printf '{"clients": %s, "parallel_clients": %s, "rounds": %s, "wall_seconds": %s, "rounds_per_second": %s, "peak_rss_bytes": %s, "rss_slope_mib_per_round": %s, "final_accuracy": %s}\n' \
      "$n" "$k" "$ROUNDS" "$wall" "$(awk -v r="$ROUNDS" -v w="$wall" 'BEGIN {printf "%.4f", r / w}')" "$peak" "$slope" "$acc"
  done
done
