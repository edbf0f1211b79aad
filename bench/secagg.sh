#!/usr/bin/env bash
# Secure aggregation against plain FedAvg, as JSON lines on stdout:
#   round   `memfl run` (TRANSPORT=inproc, the default) or `memfl launch`
#           (TRANSPORT=grpc: a server and CLIENTS client processes), synthetic
#           f32 model of PARAMS parameters, DummyTrainer, 2 rounds, plain and
#           secure_aggregation.enable: round seconds and peak RSS ÷ model
#           (server; over gRPC also the largest client's)
#   costs   build/memfl_bench_secagg: mask GB/s per core, unmask cost per dropped client
# Usage: bench/secagg.sh [BUILD_DIR] > bench/results/NAME.jsonl
set -euo pipefail
BUILD=${1:-build}
PARAMS=${PARAMS:-10000000}
CLIENT_COUNTS=${CLIENT_COUNTS:-"10"}
ROUNDS=${ROUNDS:-2}
TRANSPORT=${TRANSPORT:-inproc}
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
    echo "run: $TRANSPORT, $n clients, secure_aggregation $secure ${SECAGG_SET}" >&2
    out="$TMP/run_${n}_$secure"
    if [ "$TRANSPORT" = grpc ]; then
      "$BUILD/memfl" launch "$TMP/c.yaml" --clients "$n" --out "$out" "${sets[@]}" >&2
    else
      "$BUILD/memfl" run "$TMP/c.yaml" -q --out "$out" "${sets[@]}" >&2
    fi
    python3 - "$out" "$n" "$secure" "$PARAMS" "$SECAGG_SET" "$TRANSPORT" <<'PY'
import csv, glob, json, os, sys
d, n, secure, params, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", int(sys.argv[4]), sys.argv[6]
server = d + "/server" if transport == "grpc" else d
rows = list(csv.DictReader(open(server + "/metrics.csv")))
s = json.load(open(server + "/summary.json"))
peak = max(float(r["peak_rss_bytes"]) for r in rows)
line = {"bench": "round", "transport": transport, "clients": n, "secagg_set": sys.argv[5], "params": params,
        "secure_aggregation": secure, "round_seconds": [float(r["round_seconds"]) for r in rows],
        "upload_seconds": [float(r["upload_seconds"]) for r in rows],
        "peak_rss_bytes": peak, "peak_rss_per_model": peak / (4 * params),
        "summary_peak_rss_bytes": s.get("peak_rss_bytes"),
        "summary_peak_rss_over_model": s.get("peak_rss_over_model")}
if transport == "grpc":
    clients = [json.load(open(f)) for f in sorted(glob.glob(d + "/client_*/summary.json"))]
    line["client_peak_rss_bytes"] = max(c.get("peak_rss_bytes", 0) for c in clients)
    line["client_peak_rss_per_model"] = line["client_peak_rss_bytes"] / (4 * params)
print(json.dumps(line))
PY
  done
done
[ -n "${SKIP_COSTS:-}" ] && exit 0
echo "run: memfl_bench_secagg $PARAMS 10" >&2
"$BUILD/memfl_bench_secagg" "$PARAMS" 10 | python3 -c 'import json,sys; j=json.load(sys.stdin); j["bench"]="costs"; print(json.dumps(j))'
