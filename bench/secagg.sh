#!/usr/bin/env bash
# Secure aggregation against plain FedAvg, as JSON lines on stdout:
#   round   `memfl run`, synthetic f32 model of PARAMS parameters, DummyTrainer,
#           CLIENTS clients, 2 rounds, plain and secure_aggregation.enable:
#           mean round seconds and peak RSS ÷ model (summary.json)
#   costs   build/memfl_bench_secagg: mask GB/s per core, unmask cost per dropped client
# Usage: bench/secagg.sh [BUILD_DIR] > bench/results/NAME.jsonl
set -euo pipefail
BUILD=${1:-build}
PARAMS=${PARAMS:-10000000}
CLIENT_COUNTS=${CLIENT_COUNTS:-"10"}
ROUNDS=${ROUNDS:-2}
# More secure_aggregation keys for the secure runs, e.g. SECAGG_SET="num_shares=5 reconstruction_threshold=3"
SECAGG_SET=${SECAGG_SET:-}
TMP=$(mktemp -d /tmp/memfl_secagg.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

for n in $CLIENT_COUNTS; do
  for secure in false true; do
    cat > "$TMP/c.yaml" <<YAML
client_configs:
  train_configs:
    trainer: DummyTrainer
  model_configs:
    model_name: synthetic
    model_kwargs:
      num_params: $PARAMS
server_configs:
  num_clients: $n
  num_global_epochs: $ROUNDS
  do_server_eval: false
  secure_aggregation:
    enable: $secure
YAML
    sets=()
    if [ "$secure" = true ]; then
      for kv in $SECAGG_SET; do sets+=(--set "server_configs.secure_aggregation.$kv"); done
    fi
    echo "run: $n clients, secure_aggregation $secure ${SECAGG_SET}" >&2
    "$BUILD/memfl" run "$TMP/c.yaml" -q --out "$TMP/run_${n}_$secure" "${sets[@]}" >&2
    python3 - "$TMP/run_${n}_$secure" "$n" "$secure" "$PARAMS" "$SECAGG_SET" <<'PY'
import csv, json, sys
d, n, secure, params = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", int(sys.argv[4])
rows = list(csv.DictReader(open(d + "/metrics.csv")))
s = json.load(open(d + "/summary.json"))
peak = max(float(r["peak_rss_bytes"]) for r in rows)
print(json.dumps({"bench": "round", "clients": n, "secagg_set": sys.argv[5], "params": params, "secure_aggregation": secure,
                  "round_seconds": [float(r["round_seconds"]) for r in rows],
                  "peak_rss_bytes": peak, "peak_rss_per_model": peak / (4 * params),
                  "summary_peak_rss_bytes": s.get("peak_rss_bytes"),
                  "summary_peak_rss_over_model": s.get("peak_rss_over_model")}))
PY
  done
done
[ -n "${SKIP_COSTS:-}" ] && exit 0
echo "run: memfl_bench_secagg $PARAMS 10" >&2
"$BUILD/memfl_bench_secagg" "$PARAMS" 10 | python3 -c 'import json,sys; j=json.load(sys.stdin); j["bench"]="costs"; print(json.dumps(j))'
