#!/usr/bin/env bash
# Server-core figures, as JSON lines on stdout, progress on stderr:
#   slow_client   4 clients × 1 GiB f32, one client 3× slower (DummyTrainer
#                 train_configs.dummy_delay_s), gRPC and MPI: round seconds
#   chunk_bound   2 GiB f32 × 2 clients, model_chunk_size 1 MiB … 1 GiB,
#                 gRPC and MPI: server and client peak RSS ÷ model
#   resume        1 GiB f32, 4 clients: seconds from kill -9 of the server
#                 (in round 2's upload) to round 2 completed after --resume,
#                 in process and over gRPC
# With OLD=path/to/old/memfl the slow_client and chunk_bound cells also run
# that binary (patched only to read the delays from MEMFL_DUMMY_DELAY_S,
# since it has no dummy_delay_s key) for the before/after comparison.
# Usage: bench/server_core.sh [BUILD_DIR] > bench_server_core.jsonl
set -euo pipefail
. "$(dirname "$0")/synthetic_config.sh"
BUILD=${1:-build}
MEMFL="$BUILD/memfl"
OLD=${OLD:-}
SECTIONS=${SECTIONS:-"slow_client chunk_bound resume"}
TMP=$(mktemp -d /tmp/memfl_server_core.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

cell() {  # label binary transport model_mb clients chunk_mb delays
  local label=$1 bin=$2 transport=$3 mb=$4 n=$5 chunk=$6 delays=$7 out
  echo "run: $label $transport ${mb} MiB × $n, chunk ${chunk} MiB, delays '${delays}'" >&2
  if [ "$bin" = "$MEMFL" ]; then
    out=$("$bin" bench transfer --transport "$transport" --model-mb "$mb" --clients "$n" --chunk-mb "$chunk" \
      ${delays:+--dummy-delays "$delays"})
  else
    out=$(MEMFL_DUMMY_DELAY_S="$delays" "$bin" bench transfer --transport "$transport" --model-mb "$mb" \
      --clients "$n" --chunk-mb "$chunk")
  fi
  python3 -c 'import json,sys; j=json.loads(sys.argv[1]); j["label"]=sys.argv[2]; j["delays"]=sys.argv[3]; j.pop("rounds",None); print(json.dumps(j))' "$out" "$label" "$delays"
}

for section in $SECTIONS; do
  case $section in
  slow_client)
    for transport in grpc mpi; do
      for delays in "1.5,0.5,0.5,0.5" "0.5,0.5,0.5,1.5" "0.5,0.5,0.5,0.5"; do
        cell after "$MEMFL" $transport 1024 4 1 "$delays"
        [ -z "$OLD" ] || cell before "$OLD" $transport 1024 4 1 "$delays"
      done
    done
    ;;
  chunk_bound)
    for transport in grpc mpi; do
      for chunk in 1 64 256 1024; do
        cell after "$MEMFL" $transport 2048 2 $chunk ""
        [ -z "$OLD" ] || cell before "$OLD" $transport 2048 2 $chunk ""
      done
    done
    ;;
  resume)
    cfg=$TMP/resume.yaml
    write_synthetic_config "$cfg" 268435456 "num_clients: 4" "num_global_epochs: 3" "round_timeout_s: 600" \
      "comm_configs:" "  grpc_configs:" "    server_uri: 127.0.0.1:$((20000 + $$ % 20000))" "    connect_timeout_s: 120"
    # In process: killed in round 2's upload, resumed.
    rm -rf "$TMP/run"
    MEMFL_CRASH_AT=2:upload "$MEMFL" run "$cfg" -q --out "$TMP/run" >/dev/null 2>&1 || true
    t0=$(date +%s.%N)
    "$MEMFL" run -q --resume "$TMP/run" >/dev/null 2>&1 &
    pid=$!
    until grep -q '^2,' "$TMP/run/metrics.csv" 2>/dev/null; do sleep 0.02; done
    t1=$(date +%s.%N)
    wait $pid
    echo "{\"label\": \"resume\", \"transport\": \"inproc\", \"model_bytes\": 1073741824, \"clients\": 4, \"kill_to_round_seconds\": $(echo "$t1 - $t0" | bc)}"
    # gRPC: clients keep running and reconnect to the resumed server.
    rm -rf "$TMP/g"; mkdir -p "$TMP/g"
    for c in 0 1 2 3; do
      "$MEMFL" client "$cfg" --client-id $c -q --out "$TMP/g/client_$c" > "$TMP/g/client_$c.log" 2>&1 &
    done
    MEMFL_CRASH_AT=2:upload "$MEMFL" server "$cfg" -q --out "$TMP/g/server" >/dev/null 2>&1 || true
    t0=$(date +%s.%N)
    "$MEMFL" server -q --resume "$TMP/g/server" >/dev/null 2>&1 &
    pid=$!
    until grep -q '^2,' "$TMP/g/server/metrics.csv" 2>/dev/null; do sleep 0.02; done
    t1=$(date +%s.%N)
    wait $pid
    wait
    echo "{\"label\": \"resume\", \"transport\": \"grpc\", \"model_bytes\": 1073741824, \"clients\": 4, \"kill_to_round_seconds\": $(echo "$t1 - $t0" | bc)}"
    ;;
  esac
done
