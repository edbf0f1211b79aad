#!/usr/bin/env bash
# gRPC against raw TCP on the same loopback, alternated in one run. For each cell (model MiB × clients × model_chunk_size MiB) and
# each repetition: raw TCP with xxh3 on both sides (bench/tcp_raw_bandwidth.cpp,
# the same shape as memfl's transfer: one server, N client processes), raw
# TCP without, raw TCP with xxh3 and the server folding every chunk in fold
# order (the ceiling of an aggregating server's upload: tcp_raw_bandwidth's
# FOLD), bare gRPC in memfl's message pattern with xxh3 on both sides and
# no memfl in between, served by the synchronous and by the callback API
# (bench/grpc_raw_bandwidth.cpp, built with memfl; 1 MiB chunks only), then
# `memfl bench transfer --transport grpc` (DummyTrainer,
# 2 rounds; round 2's figures: every client's arena is resident by then, as
# the raw clients' buffers are) with the chunks in the gRPC stream (grpc_*)
# and on the data channel (grpc_configs.data_channel: tcp) over its TCP port
# (grpc_tcp_*) and over its Unix socket (grpc_unix_*), beside raw Unix-socket
# transfers with xxh3 (+ fold on upload: unix_xxh3_*).
# One JSON object per line, with memfl ÷ raw per direction, and each role's
# peak RSS ÷ model (the memory table). BARE=0 leaves out the bare gRPC runs.
# Raw TCP's xxh3 is a real check since 2026-11-27 (before, the compiler had
# removed it: see tcp_raw_bandwidth.cpp); older data files measured none.
# Usage: [CELLS="1024:1:1 1024:2:1 …"] [REPS=3] [BARE=0] bench/grpc_vs_tcp.sh [BUILD_DIR] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
REPS=${REPS:-3}
BARE=${BARE:-1}
CELLS=${CELLS:-"1024:1:1 1024:2:1 1024:4:1 1024:1:64 1024:1:1024 1024:4:1024"}
RAW=$BUILD/tcp_raw_bandwidth
c++ -O2 -std=c++20 -march=x86-64-v3 "$(dirname "$0")/tcp_raw_bandwidth.cpp" -o "$RAW" -pthread
for rep in $(seq 1 "$REPS"); do
  for cell in $CELLS; do
    IFS=: read -r mb n chunk_mb <<<"$cell"
    # Raw TCP moves the chunks memfl's gRPC moves: model_chunk_size, at
    # most 1 MiB (comm/chunk.h: kMaxGrpcChunk).
    wire_kib=$((chunk_mb > 1 ? 1024 : chunk_mb * 1024))
    raw_hash=$("$RAW" "$mb" "$n" "$wire_kib" 1 2)
    raw_plain=$("$RAW" "$mb" "$n" "$wire_kib" 0 2)
    raw_fold=$("$RAW" "$mb" "$n" "$wire_kib" 1 2 1)
    grpc_sync='{}'
    grpc_callback='{}'
    if [ "$BARE" != 0 ]; then
      grpc_sync=$("$BUILD/grpc_raw_bandwidth" "$mb" "$n" 1 2 sync)
      grpc_callback=$("$BUILD/grpc_raw_bandwidth" "$mb" "$n" 1 2 callback)
    fi
    memfl=$("$BUILD/memfl" bench transfer --transport grpc --data-channel grpc --model-mb "$mb" --clients "$n" \
      --chunk-mb "$chunk_mb" --memory-mode streaming 2>/dev/null)
    memfl_tcp=$("$BUILD/memfl" bench transfer --transport grpc --data-channel tcp --model-mb "$mb" --clients "$n" \
      --chunk-mb "$chunk_mb" --memory-mode streaming 2>/dev/null)
    memfl_unix=$("$BUILD/memfl" bench transfer --transport grpc --data-channel unix --model-mb "$mb" --clients "$n" \
      --chunk-mb "$chunk_mb" --memory-mode streaming 2>/dev/null)
    raw_unix=$("$RAW" "$mb" "$n" "$wire_kib" 1 2 1 unix)
    python3 - "$rep" "$chunk_mb" "$raw_hash" "$raw_plain" "$memfl" "$raw_fold" "$grpc_sync" "$grpc_callback" \
      "$memfl_tcp" "$memfl_unix" "$raw_unix" <<'PY'
import json, sys
rep, chunk_mb = int(sys.argv[1]), int(sys.argv[2])
rh, rp, m, rf, gs, gc, mt, mu, ru = (json.loads(a) for a in sys.argv[3:12])
last = m["rounds"][-1]
last_tcp = mt["rounds"][-1]
last_unix = mu["rounds"][-1]
out = {
    "rep": rep, "model_bytes": m["model_bytes"], "clients": m["clients"],
    "model_chunk_size_mib": chunk_mb, "wire_chunk_bytes": rh["chunk_bytes"],
    "grpc_download_gbps": round(last["download_gbps"], 3), "grpc_upload_gbps": round(last["upload_gbps"], 3),
    "tcp_xxh3_download_gbps": rh["download_gbps_median"], "tcp_xxh3_upload_gbps": rh["upload_gbps_median"],
    "tcp_download_gbps": rp["download_gbps_median"], "tcp_upload_gbps": rp["upload_gbps_median"],
    "tcp_xxh3_fold_upload_gbps": rf["upload_gbps_median"],
    "grpc_tcp_download_gbps": round(last_tcp["download_gbps"], 3),
    "grpc_tcp_upload_gbps": round(last_tcp["upload_gbps"], 3),
    "grpc_unix_download_gbps": round(last_unix["download_gbps"], 3),
    "grpc_unix_upload_gbps": round(last_unix["upload_gbps"], 3),
    "unix_xxh3_download_gbps": ru["download_gbps_median"], "unix_xxh3_fold_upload_gbps": ru["upload_gbps_median"],
    "server_peak_over_model": round(m["server_peak_over_model"], 4),
    "client_peak_over_model": round(m["client_peak_over_model"], 4),
    "grpc_tcp_server_peak_over_model": round(mt["server_peak_over_model"], 4),
    "grpc_tcp_client_peak_over_model": round(mt["client_peak_over_model"], 4),
    "grpc_unix_server_peak_over_model": round(mu["server_peak_over_model"], 4),
    "grpc_unix_client_peak_over_model": round(mu["client_peak_over_model"], 4),
}
if gs:
    out["bare_grpc_sync_download_gbps"] = gs["download_gbps_median"]
    out["bare_grpc_sync_upload_gbps"] = gs["upload_gbps_median"]
    out["bare_grpc_callback_download_gbps"] = gc["download_gbps_median"]
    out["bare_grpc_callback_upload_gbps"] = gc["upload_gbps_median"]
for d in ("download", "upload"):
    out[f"grpc_over_tcp_xxh3_{d}"] = round(out[f"grpc_{d}_gbps"] / out[f"tcp_xxh3_{d}_gbps"], 3)
    out[f"grpc_over_tcp_{d}"] = round(out[f"grpc_{d}_gbps"] / out[f"tcp_{d}_gbps"], 3)
    out[f"grpc_tcp_over_tcp_xxh3_{d}"] = round(out[f"grpc_tcp_{d}_gbps"] / out[f"tcp_xxh3_{d}_gbps"], 3)
    out[f"grpc_tcp_over_grpc_{d}"] = round(out[f"grpc_tcp_{d}_gbps"] / out[f"grpc_{d}_gbps"], 3)
out["grpc_over_tcp_xxh3_fold_upload"] = round(out["grpc_upload_gbps"] / out["tcp_xxh3_fold_upload_gbps"], 3)
out["grpc_tcp_over_tcp_xxh3_fold_upload"] = round(out["grpc_tcp_upload_gbps"] / out["tcp_xxh3_fold_upload_gbps"], 3)
out["grpc_unix_over_unix_xxh3_download"] = round(out["grpc_unix_download_gbps"] / out["unix_xxh3_download_gbps"], 3)
out["grpc_unix_over_unix_xxh3_fold_upload"] = round(out["grpc_unix_upload_gbps"] / out["unix_xxh3_fold_upload_gbps"], 3)
for d in ("download", "upload"):
    out[f"grpc_unix_over_grpc_{d}"] = round(out[f"grpc_unix_{d}_gbps"] / out[f"grpc_{d}_gbps"], 3)
if gs:
    for d in ("download", "upload"):
        out[f"grpc_over_bare_grpc_sync_{d}"] = round(out[f"grpc_{d}_gbps"] / out[f"bare_grpc_sync_{d}_gbps"], 3)
print(json.dumps(out))
PY
  done
done
