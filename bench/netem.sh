#!/usr/bin/env bash
# Round time and throughput over shaped links against a clean one: the server and 4 DummyTrainer clients in network namespaces
# (tests/netem/netns.sh), a MODEL_MB MiB model, ROUNDS rounds, once with no
# qdisc and once shaped — netem 20 ms ± 5 ms, 0.5 % loss, 1 Gbit/s where the
# kernel has sch_netem, else a tbf rate limit of 1 Gbit/s. One JSON line per
# link: mean round seconds and broadcast/upload GB/s (metrics.csv), rounds 2+.
# Usage: bench/netem.sh [BUILD_DIR] [MODEL_MB] [ROUNDS]   (root)
set -euo pipefail
. "$(dirname "$0")/synthetic_config.sh"
BUILD=${1:-build}
MB=${2:-64}
ROUNDS=${3:-6}
MEMFL=$(realpath "$BUILD/memfl")
NS=$(dirname "$(realpath "$0")")/../tests/netem/netns.sh
if ! "$NS" check-ns; then
  echo '{"skipped": "network namespaces cannot be made here"}'
  exit 0
fi
SHAPED="tbf rate 1gbit burst 256kb latency 50ms"
"$NS" check-netem && SHAPED="netem delay 20ms 5ms loss 0.5% rate 1gbit"
TMP=$(mktemp -d /tmp/memfl_netem.XXXXXX)
TAG=$(($$ % 100000))
trap '"$NS" down $TAG 4; rm -rf "$TMP"' EXIT
"$NS" up $TAG 4
write_synthetic_config "$TMP/c.yaml" $((MB * 262144)) "num_clients: 4" "num_global_epochs: $ROUNDS" "comm_configs:" \
  "  grpc_configs:" "    server_uri: 10.77.0.1:50051" "    connect_timeout_s: 60"
for link in clean shaped; do
  if [ $link = shaped ]; then "$NS" shape $TAG 4 "$SHAPED"; fi
  rm -rf "$TMP/run"
  for c in 0 1 2 3; do
    "$NS" exec $TAG $c "$MEMFL" client "$TMP/c.yaml" --client-id $c -q --out "$TMP/run/client_$c" > /dev/null 2>&1 &
  done
  "$NS" exec $TAG server "$MEMFL" server "$TMP/c.yaml" -q --out "$TMP/run/server" > "$TMP/server.log" 2>&1
  wait
  python3 - "$TMP/run/server/metrics.csv" "$link" "$([ $link = shaped ] && echo "$SHAPED" || echo none)" "$MB" <<'PY'
import csv, json, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if int(r["round"]) >= 2]
mean = lambda xs: sum(xs) / len(xs)
print(json.dumps({
    "link": sys.argv[2], "qdisc": sys.argv[3], "model_mb": int(sys.argv[4]), "clients": 4, "rounds": len(rows),
    "round_seconds": round(mean([float(r["round_seconds"]) for r in rows]), 3),
    "broadcast_gbps": round(mean([int(r["bytes_down"]) / float(r["download_seconds"]) / 1e9 for r in rows]), 3),
    "upload_gbps": round(mean([int(r["bytes_up"]) / float(r["upload_seconds"]) / 1e9 for r in rows]), 3),
}))
PY
done
