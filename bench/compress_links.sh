#!/usr/bin/env bash
# Compressed updates over shaped links: the server and 4 DummyTrainer clients
# over gRPC, each in a network namespace (tests/netem/netns.sh), a MODEL_MB MiB
# model, ROUNDS rounds, every link limited by tbf to each rate in RATES:
# uncompressed (plain), with the quantiser (SZ2Compressor) at REL 1e-3 with
# error feedback on the uploads (sz2_rel1e-3_feedback), and the same with the
# broadcast sent as its lossy change too (sz2_rel1e-3_feedback_broadcast); the
# variants rotate, REPS times. One JSON line per run: mean round, broadcast
# and upload seconds over rounds 3+ (round 2's broadcast is the first that can
# go as a change), bytes down and up on the wire and raw, and the server's
# peak RSS ÷ the model.
# The clients' updates are the DummyTrainer's: its pattern (which repeats
# every 5 elements and would compress thousands of times) plus seeded Gaussian
# noise of NOISE × dummy_update_scale (default 4), so the quantiser at REL 1e-3
# sees a change that compresses about as much as trained ones do (between
# ResNet18's and the Fashion-MNIST CNN's, docs/BENCHMARKS.md); each run's JSON
# line gives the ratio it got.
# With NOISE_FROM=fmnist the noise is drawn instead from the values of a real
# update: one Fashion-MNIST CNN client's change after a local epoch (made
# first, as bench/compress_real.sh makes it; each tensor standardised, then
# pooled), scaled to σ = NOISE × the scale. Its values are heavy-tailed and mostly near zero, as trained
# updates are, where a Gaussian's are not; the JSON line says which ran.
# Usage: bench/compress_links.sh [BUILD_DIR] [MODEL_MB] [ROUNDS] [REPS]   (root)
#        RATES="100mbit 1gbit" and VARIANTS="plain sz2_rel1e-3_feedback
#        sz2_rel1e-3_feedback_broadcast" by default; NOISE_FROM=gaussian|fmnist.
set -euo pipefail
. "$(dirname "$0")/synthetic_config.sh"
BUILD=${1:-build}
MB=${2:-64}
ROUNDS=${3:-4}
REPS=${4:-1}
RATES=${RATES:-"100mbit 1gbit"}
VARIANTS=(${VARIANTS:-plain sz2_rel1e-3_feedback sz2_rel1e-3_feedback_broadcast})
NOISE=${NOISE:-4}
NOISE_FROM=${NOISE_FROM:-gaussian}
MEMFL=$(realpath "$BUILD/memfl")
NS=$(dirname "$(realpath "$0")")/../tests/netem/netns.sh
if ! "$NS" check-ns; then
  echo '{"skipped": "network namespaces cannot be made here"}'
  exit 0
fi
TMP=$(mktemp -d /tmp/memfl_compress_links.XXXXXX)
TAG=$(($$ % 100000))
trap '"$NS" down $TAG 4; rm -rf "$TMP"' EXIT
"$NS" up $TAG 4
write_synthetic_config "$TMP/c.yaml" $((MB * 262144)) "num_clients: 4" "num_global_epochs: $ROUNDS" "comm_configs:" \
  "  grpc_configs:" "    server_uri: 10.77.0.1:50051" "    connect_timeout_s: 60"
C=client_configs.comm_configs.compressor_configs
NOISE_ARGS=(--set client_configs.train_configs.dummy_update_noise=$NOISE)
if [ "$NOISE_FROM" = fmnist ]; then
  # One client a round, FedAvg over it: round 2's model − round 1's is that
  # client's update after one local epoch.
  "$MEMFL" run "$(dirname "$(realpath "$0")")/../configs/fedavg_fmnist_cnn.yaml" --out "$TMP/fmnist" -q \
    --set server_configs.num_global_epochs=2 --set server_configs.clients_per_round=1 \
    --set server_configs.checkpoint_keep=2 --set memory_configs.profile=false > "$TMP/fmnist.log" 2>&1
  python3 - "$TMP/fmnist/state/round-000001.safetensors" "$TMP/fmnist/state/round-000002.safetensors" \
    "$TMP/fmnist_update.f32" <<'PY'
import array, json, struct, sys
def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head, data = json.loads(b[8:8 + n]), b[8 + n:]
    out = {}
    for name, t in head.items():
        if name != "__metadata__" and t["dtype"] == "F32":
            s, e = t["data_offsets"]
            out[name] = array.array("f", data[s:e])
    return out
# Each tensor's change standardised on its own, then pooled: the shape of a
# trained change (a codec's REL bound is per tensor), not the spread of
# scales between tensors.
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
change = array.array("f")
for name in a:
    d = [y - x for x, y in zip(a[name], b[name])]
    if len(d) < 2:
        continue
    mean = sum(d) / len(d)
    sd = (sum((v - mean) ** 2 for v in d) / len(d)) ** 0.5
    if sd > 0:
        change.extend((v - mean) / sd for v in d)
change.tofile(open(sys.argv[3], "wb"))
PY
  NOISE_ARGS+=(--set client_configs.train_configs.dummy_update_noise_values="$TMP/fmnist_update.f32")
fi
run() {  # rate variant rep
  local rate=$1 variant=$2 rep=$3 extra=("${NOISE_ARGS[@]}")
  if [ "$variant" != plain ]; then
    extra+=(--set $C.enable_compression=true --set $C.lossy_compressor=SZ2Compressor --set $C.error_bound=1e-3
            --set $C.error_feedback=true)
  fi
  if [ "$variant" = sz2_rel1e-3_feedback_broadcast ]; then extra+=(--set $C.broadcast_compression=lossy); fi
  rm -rf "$TMP/run"
  for c in 0 1 2 3; do
    "$NS" exec $TAG $c "$MEMFL" client "$TMP/c.yaml" --client-id $c -q --out "$TMP/run/client_$c" "${extra[@]}" \
      > "$TMP/client_$c.log" 2>&1 &
  done
  "$NS" exec $TAG server "$MEMFL" server "$TMP/c.yaml" -q --out "$TMP/run/server" "${extra[@]}" > "$TMP/server.log" 2>&1
  wait
  python3 - "$TMP/run/server" "$rate" "$variant" "$rep" "$MB" "$NOISE" "$NOISE_FROM" <<'PY'
import csv, json, sys
d, rate, variant, rep, mb, noise, noise_from = sys.argv[1:8]
rows = [r for r in csv.DictReader(open(d + "/metrics.csv")) if int(r["round"]) >= 3]
summary = json.load(open(d + "/summary.json"))
mean = lambda xs: sum(xs) / len(xs)
model = int(mb) * 262144 * 4
print(json.dumps({
    "transport": "grpc", "link_rate": rate, "variant": variant, "rep": int(rep), "model_mb": int(mb), "clients": 4,
    "dummy_update_noise": float(noise),
    "noise_from": "fashion_mnist_cnn_update" if noise_from == "fmnist" else "gaussian",
    "rounds": len(rows),
    "round_seconds": round(mean([float(r["round_seconds"]) for r in rows]), 3),
    "broadcast_seconds": round(mean([float(r["download_seconds"]) for r in rows]), 3),
    "upload_seconds": round(mean([float(r["upload_seconds"]) for r in rows]), 3),
    "bytes_down": int(mean([int(r["bytes_down"]) for r in rows])),
    "bytes_up": int(mean([int(r["bytes_up"]) for r in rows])),
    "bytes_up_raw": int(mean([int(r["bytes_up_raw"]) for r in rows])),
    "server_peak_rss_bytes": summary.get("peak_rss_bytes"),
    "server_peak_over_model": round(summary.get("peak_rss_bytes", 0) / model, 3),
}), flush=True)
PY
}
for rate in $RATES; do
  "$NS" shape $TAG 4 "tbf rate $rate burst 256kb latency 50ms"
  for ((rep = 1; rep <= REPS; rep++)); do
    n=${#VARIANTS[@]}
    for ((i = 0; i < n; i++)); do run "$rate" "${VARIANTS[$(((i + rep - 1) % n))]}" "$rep"; done
  done
done
