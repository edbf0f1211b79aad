#!/usr/bin/env bash
# Live endpoint overhead: the same simulation with --http, scraped by a curl
# loop every 100 ms (/metrics, and /api/state every 10th time, as the page
# polls) or not scraped, alternated PAIRS times. The figure is the round
# loop's own time (the sum of metrics.csv's round_seconds), scraped over
# not scraped, per pair and as the median of pairs (goal: < 1.01).
# Prints one JSON object; each run's row goes to stderr as it finishes.
# Usage: bench/live_scrape_overhead.sh [BUILD_DIR] [PAIRS] [ROUNDS] > live_overhead.json
set -euo pipefail
BUILD=${1:-build}
PAIRS=${2:-4}
ROUNDS=${3:-4}
OUT=$(mktemp -d /tmp/memfl_live_overhead_XXXXXX)
trap 'rm -rf "$OUT"' EXIT
ARGS=(run -q --set server_configs.num_global_epochs="$ROUNDS" --set server_configs.num_clients=4
  --set client_configs.data_configs.dataset_kwargs.max_train_samples=8000
  --set client_configs.data_configs.dataset_kwargs.max_test_samples=1000
  --set client_configs.train_configs.num_threads=1 --http 127.0.0.1:0)

# Round-loop seconds of metrics.csv (column round_seconds, found by name).
loop_seconds() {
  awk -F, 'NR == 1 {for (i = 1; i <= NF; i++) if ($i == "round_seconds") c = i; next} {s += $c} END {printf "%.3f", s}' "$1"
}

one() {  # one run; $1 = name, $2 = 1 to scrape
  local dir="$OUT/$1" scrapes=0 pid
  "$BUILD/memfl" "${ARGS[@]}" --out "$dir" >/dev/null 2>&1 &
  pid=$!
  if [ "$2" = 1 ]; then
    for _ in $(seq 600); do [ -s "$dir/http_address" ] && break; sleep 0.05; done
    local addr
    addr=$(cat "$dir/http_address")
    while kill -0 "$pid" 2>/dev/null; do
      curl -sf -o /dev/null "http://$addr/metrics" || true
      scrapes=$((scrapes + 1))
      if [ $((scrapes % 10)) = 0 ]; then curl -sf -o /dev/null "http://$addr/api/state" || true; fi
      sleep 0.1
    done
  fi
  wait "$pid"
  local s
  s=$(loop_seconds "$dir/metrics.csv")
  echo "{\"run\": \"$1\", \"scraped\": $2, \"round_loop_seconds\": $s, \"scrapes\": $scrapes}" >&2
  echo "$s $scrapes"
}

rows=""
ratios=""
for p in $(seq "$PAIRS"); do
  # Alternate which goes first, so a drifting machine does not favour one side.
  if [ $((p % 2)) = 1 ]; then
    read -r a _ < <(one "plain_$p" 0)
    read -r b n < <(one "scraped_$p" 1)
  else
    read -r b n < <(one "scraped_$p" 1)
    read -r a _ < <(one "plain_$p" 0)
  fi
  r=$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.4f", b / a}')
  ratios="$ratios $r"
  rows="$rows${rows:+, }{\"pair\": $p, \"not_scraped_s\": $a, \"scraped_s\": $b, \"scrapes\": $n, \"ratio\": $r}"
done
median=$(printf '%s\n' $ratios | sort -g | awk '{v[NR] = $1} END {if (NR % 2) printf "%.4f", v[(NR + 1) / 2]; else printf "%.4f", (v[NR / 2] + v[NR / 2 + 1]) / 2}')
printf '{"bench": "live_scrape_overhead", "rounds": %s, "pairs": [%s], "median_ratio": %s, "interval_ms": 100, "cores": %s, "date": "%s"}\n' \
  "$ROUNDS" "$rows" "$median" "$(nproc)" "$(date +%F)"
