#!/usr/bin/env bash
# Profiler overhead: the default demo with and without --profile, back to
# back in one run, and the wall-time ratio (goal ≤ 1.10).
# Usage: bench/profile_overhead.sh [BUILD_DIR] [ROUNDS] > profile_overhead.json
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${2:-5}
OUT=$(mktemp -d /tmp/memfl_overhead_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
run() {
  local t0 t1
  t0=$(date +%s.%N)
  "$BUILD/memfl" run -q --set server_configs.num_global_epochs="$ROUNDS" --out "$OUT/$1" $2 >/dev/null
  t1=$(date +%s.%N)
  awk -v a="$t1" -v b="$t0" 'BEGIN {printf "%.3f", a - b}'
}
plain=$(run plain "")
profiled=$(run profiled --profile)
"$BUILD/memfl" report "$OUT/profiled" >/dev/null
tracked=$(grep -o '"peak_tracked_bytes": [0-9]*' "$OUT/profiled/report/data.json" | head -1 | grep -o '[0-9]*$')
printf '{"rounds": %s, "plain_seconds": %s, "profiled_seconds": %s, "ratio": %s, "profile_bytes": %s, "tracked_peak_bytes": %s}\n' \
  "$ROUNDS" "$plain" "$profiled" "$(awk -v a="$profiled" -v b="$plain" 'BEGIN {printf "%.4f", a / b}')" \
  "$(stat -c %s "$OUT/profiled/profile.bin")" "$tracked"
