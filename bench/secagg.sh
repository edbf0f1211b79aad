#!/usr/bin/env bash
# Secure aggregation against plain FedAvg, as JSON lines on stdout:
#   round   `memfl run` (TRANSPORT=inproc, the default) or `memfl launch`
#           (TRANSPORT=grpc: a server and CLIENTS client processes), synthetic
#           f32 model of PARAMS parameters, DummyTrainer, 2 rounds, plain and
#           secure_aggregation.enable: round seconds and peak RSS ÷ model
#           (server; over gRPC also the largest client's)
#   costs   build/memfl_bench_secagg: mask GB/s per core, unmask cost per dropped client
#   floor   for each secure run, the least round time the masks allow here:
#           the plain round plus the keystreams a round needs (each client
#           k of the model's size, k its neighbourhood with itself; the
#           server one per survivor) at mask_gbps_all_cores, measured first
#           (`memfl_bench_secagg ceiling`), and the secure round against it
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

echo "run: memfl_bench_secagg ceiling" >&2
CEILING=$("$BUILD/memfl_bench_secagg" ceiling)
echo "$CEILING" | python3 -c 'import json,sys; j=json.load(sys.stdin); j["bench"]="ceiling"; print(json.dumps(j))'
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
    python3 - "$out" "$n" "$secure" "$PARAMS" "$SECAGG_SET" "$TRANSPORT" "$CEILING" "$TMP/plain_$n" <<'PY'
import csv, glob, json, os, sys
d, n, secure, params, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "true", int(sys.argv[4]), sys.argv[6]
ceiling, plain_file = json.loads(sys.argv[7]), sys.argv[8]
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
# The last round (every arena resident) is the one compared.
if not secure:
    open(plain_file, "w").write(str(line["round_seconds"][-1]))
else:
    # k as the server resolves it: num_shares a proportion ≤ 1 or a count,
    # the neighbourhood odd (or everyone).
    shares = 1.0
    for kv in sys.argv[5].split():
        key, _, v = kv.partition("=")
        if key == "num_shares":
            shares = float(v)
    import math
    k = math.ceil(shares * n) if shares <= 1 else int(shares)
    k = min(max(k, 1), n)
    if k < n and k % 2 == 0:
        k += 1
    k = min(k, n)
    model = 4 * params
    streams = n * k + n  # clients' masks, then the server's unmasking (no dropout)
    plain = float(open(plain_file).read())
    floor = plain + streams * model / (ceiling["mask_gbps_all_cores"] * 1e9)
    line.update({"neighbours": k, "mask_streams": streams, "plain_round_seconds": plain,
                 "floor_round_seconds": floor, "secure_over_plain": line["round_seconds"][-1] / plain,
                 "secure_over_floor": line["round_seconds"][-1] / floor})
print(json.dumps(line))
PY
  done
done
[ -n "${SKIP_COSTS:-}" ] && exit 0
echo "run: memfl_bench_secagg $PARAMS 10" >&2
"$BUILD/memfl_bench_secagg" "$PARAMS" 10 | python3 -c 'import json,sys; j=json.load(sys.stdin); j["bench"]="costs"; print(json.dumps(j))'
