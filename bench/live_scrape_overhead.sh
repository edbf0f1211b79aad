#!/usr/bin/env bash
# Live endpoint overhead: the same simulation with --http, scraped by a curl
# loop every 100 ms (/metrics, and /api/state every 10th time, as the page
# polls) or not scraped, alternated PAIRS times. The figure is the round
# loop's own time (the sum of metrics.csv's round_seconds), scraped over
# not scraped, per pair and as the median of pairs (goal: < 1.01).
# The scraper is one process holding a keep-alive connection.
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
    # One scraper process with a kept-alive connection, as Prometheus
    # scrapes: a curl started per scrape would cost this 2-core machine
    # more CPU (process start) than the endpoint does, and be counted here.
    scrapes=$(python3 - "$addr" "$pid" <<'PY'
import http.client, os, sys, time
host, port = sys.argv[1].rsplit(":", 1)
pid = int(sys.argv[2])
conn = http.client.HTTPConnection(host, int(port), timeout=10)
n = 0
def alive():
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
while alive():
    try:
        conn.request("GET", "/api/state" if n % 10 == 9 else "/metrics")
        conn.getresponse().read()
        n += 1
    except Exception:
        conn.close()
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        if not alive():
            break
    time.sleep(0.1)
print(n)
PY
)
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
# What one scrape costs the process, measured back to back during a run
# (client latency over a kept-alive connection: an upper bound on the
# endpoint's CPU per scrape). At one scrape per 100 ms (a tenth of them
# /api/state) that bounds the CPU share the endpoint takes from the loop,
# a figure this shared 2-core machine's wall-time noise cannot hide.
"$BUILD/memfl" "${ARGS[@]/num_global_epochs=$ROUNDS/num_global_epochs=$((ROUNDS * 3))}" --out "$OUT/cost" >/dev/null 2>&1 &
cpid=$!
for _ in $(seq 600); do [ -s "$OUT/cost/http_address" ] && break; sleep 0.05; done
sleep 5  # into the rounds: clients and rows to list
cost=$(python3 - "$(cat "$OUT/cost/http_address")" <<'PY'
import http.client, sys, time
host, port = sys.argv[1].rsplit(":", 1)
conn = http.client.HTTPConnection(host, int(port), timeout=10)
def mean_ms(path, n):
    t0 = time.perf_counter()
    size = 0
    for _ in range(n):
        conn.request("GET", path)
        size = len(conn.getresponse().read())
    return (time.perf_counter() - t0) * 1000 / n, size
m, ms = mean_ms("/metrics", 500)
s, ss = mean_ms("/api/state", 100)
share = (0.9 * m + 0.1 * s) / 100.0
print('{"metrics_ms": %.3f, "metrics_bytes": %d, "state_ms": %.3f, "state_bytes": %d, "cpu_share_bound_at_100ms": %.5f}' % (m, ms, s, ss, share))
PY
)
kill "$cpid" 2>/dev/null || true
wait "$cpid" 2>/dev/null || true

median=$(printf '%s\n' $ratios | sort -g | awk '{v[NR] = $1} END {if (NR % 2) printf "%.4f", v[(NR + 1) / 2]; else printf "%.4f", (v[NR / 2] + v[NR / 2 + 1]) / 2}')
printf '{"bench": "live_scrape_overhead", "rounds": %s, "pairs": [%s], "median_ratio": %s, "per_scrape": %s, "interval_ms": 100, "cores": %s, "date": "%s"}\n' \
  "$ROUNDS" "$rows" "$median" "$cost" "$(nproc)" "$(date +%F)"
