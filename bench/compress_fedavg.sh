#!/usr/bin/env bash
# FedAvg on Fashion-MNIST (CNN, 10 clients, Dirichlet α = 0.3, 20 rounds on the first
# 12 000 training images, 2 000 test images) uncompressed and with compressed updates:
# the quantiser (SZ2Compressor) at REL 1e-3 with and without error feedback, ZFP at
# REL 1e-3 with error feedback, the quantiser at REL 1e-2 with error feedback. One JSON
# line per run: final and best test accuracy, bytes uploaded per round on the wire and
# uncompressed, their ratio, peak RSS, and each round's accuracy and bytes.
# Usage: bench/compress_fedavg.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${2:-20}
MEMFL=$(realpath "$BUILD/memfl")
CFG=$(dirname "$(realpath "$0")")/../configs/fedavg_fmnist_cnn.yaml
TMP=$(mktemp -d /tmp/memfl_compress.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
C=client_configs.comm_configs.compressor_configs
D=client_configs.data_configs.dataset_kwargs
COMMON=(--set server_configs.num_global_epochs=$ROUNDS --set $D.partition_strategy=dirichlet --set $D.alpha=0.3
        --set $D.max_train_samples=12000 --set $D.max_test_samples=2000)
run() {
  local name=$1; shift
  "$MEMFL" run "$CFG" -q --out "$TMP/$name" "${COMMON[@]}" "$@" > "$TMP/$name.log" 2>&1
  python3 - "$TMP/$name" "$name" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1] + "/metrics.csv")))
summary = json.load(open(sys.argv[1] + "/summary.json"))
up = sum(int(r["bytes_up"]) for r in rows) / len(rows)
raw = sum(int(r["bytes_up_raw"]) for r in rows) / len(rows)
acc = [float(r["test_accuracy"]) for r in rows]
print(json.dumps({"run": sys.argv[2], "compression": summary.get("compression"), "rounds": len(rows),
                  "final_accuracy": acc[-1], "best_accuracy": max(acc), "bytes_up_per_round": up,
                  "bytes_up_raw_per_round": raw, "ratio": round(raw / up, 3),
                  "peak_rss_bytes": summary.get("peak_rss_bytes"),
                  "accuracy": acc, "bytes_up": [int(r["bytes_up"]) for r in rows]}))
PY
}
run uncompressed
run sz2_rel1e-3 --set $C.enable_compression=true --set $C.lossy_compressor=SZ2Compressor --set $C.error_bound=1e-3
run sz2_rel1e-3_feedback --set $C.enable_compression=true --set $C.lossy_compressor=SZ2Compressor --set $C.error_bound=1e-3 \
  --set $C.error_feedback=true
run zfp_rel1e-3_feedback --set $C.enable_compression=true --set $C.lossy_compressor=ZFPCompressor --set $C.error_bound=1e-3 \
  --set $C.error_feedback=true
run sz2_rel1e-2_feedback --set $C.enable_compression=true --set $C.lossy_compressor=SZ2Compressor --set $C.error_bound=1e-2 \
  --set $C.error_feedback=true
