#!/usr/bin/env bash
# The default gRPC path (grpc_configs.data_channel: auto — on one host, the
# data channel's Unix socket) against raw TCP doing the same checks (xxh3
# on both sides; on upload the server also folds every chunk: the ceiling of
# an aggregating server), alternated in one run, REPS times, with the
# chunks-in-the-stream path (data_channel: grpc) beside them. One JSON object
# per line with memfl ÷ raw per direction (round 2 of each memfl run: every
# arena is resident by then, as the raw clients' buffers are).
# Usage: [MB=1024] [CLIENTS=4] [REPS=3] bench/default_path.sh [BUILD_DIR] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
MB=${MB:-1024}
CLIENTS=${CLIENTS:-4}
REPS=${REPS:-3}
RAW=$BUILD/tcp_raw_bandwidth
c++ -O2 -std=c++20 -march=x86-64-v3 "$(dirname "$0")/tcp_raw_bandwidth.cpp" -o "$RAW" -pthread
for rep in $(seq 1 "$REPS"); do
  raw=$("$RAW" "$MB" "$CLIENTS" 1024 1 2)
  raw_fold=$("$RAW" "$MB" "$CLIENTS" 1024 1 2 1)
  auto=$("$BUILD/memfl" bench transfer --transport grpc --model-mb "$MB" --clients "$CLIENTS" 2>/dev/null)
  stream=$("$BUILD/memfl" bench transfer --transport grpc --data-channel grpc --model-mb "$MB" --clients "$CLIENTS" \
    2>/dev/null)
  python3 - "$rep" "$raw" "$raw_fold" "$auto" "$stream" <<'PY'
import json, sys
rep = int(sys.argv[1])
raw, fold, auto, stream = (json.loads(a) for a in sys.argv[2:6])
a, s = auto["rounds"][-1], stream["rounds"][-1]
out = {
    "rep": rep, "model_bytes": auto["model_bytes"], "clients": auto["clients"],
    "default_path": auto.get("data_channel", "auto"),
    "default_download_gbps": round(a["download_gbps"], 3), "default_upload_gbps": round(a["upload_gbps"], 3),
    "stream_download_gbps": round(s["download_gbps"], 3), "stream_upload_gbps": round(s["upload_gbps"], 3),
    "tcp_xxh3_download_gbps": raw["download_gbps_median"], "tcp_xxh3_fold_upload_gbps": fold["upload_gbps_median"],
    "default_server_peak_over_model": round(auto["server_peak_over_model"], 4),
    "default_client_peak_over_model": round(auto["client_peak_over_model"], 4),
}
out["default_over_tcp_xxh3_download"] = round(out["default_download_gbps"] / out["tcp_xxh3_download_gbps"], 3)
out["default_over_tcp_xxh3_fold_upload"] = round(out["default_upload_gbps"] / out["tcp_xxh3_fold_upload_gbps"], 3)
out["stream_over_tcp_xxh3_download"] = round(out["stream_download_gbps"] / out["tcp_xxh3_download_gbps"], 3)
out["stream_over_tcp_xxh3_fold_upload"] = round(out["stream_upload_gbps"] / out["tcp_xxh3_fold_upload_gbps"], 3)
print(json.dumps(out))
PY
done
