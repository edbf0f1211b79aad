#!/usr/bin/env bash
# Server memory of the asynchronous aggregators: FedAsync,
# FedBuff and FedCompass with a DummyTrainer f32 model of each MODEL_MB in
# SIZES, CLIENTS clients, in the simulator (one process: the global model and
# one worker replica) and as real processes over gRPC and MPI (the server
# process alone). One JSON line per cell: peak RSS (the sampler and the
# kernel's VmHWM), the RSS before the model existed, and both ÷ the model.
# Usage: bench/async_memory.sh [BUILD_DIR] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
SIZES=${SIZES:-"128 512"}
CLIENTS=${CLIENTS:-"2 8"}
TRANSPORTS=${TRANSPORTS:-"simulator grpc mpi"}
AGGREGATORS=${AGGREGATORS:-"FedAsyncAggregator FedBuffAggregator FedCompassAggregator"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d /tmp/memfl-async-mem-XXXXXX)
trap 'rm -rf "$work"' EXIT
for mb in $SIZES; do
  for agg in $AGGREGATORS; do
    sched=AsyncScheduler
    [ "$agg" = FedCompassAggregator ] && sched=CompassScheduler
    for n in $CLIENTS; do
      updates=$((3 * n))
      cat > "$work/c.yaml" <<YAML
client_configs:
  train_configs:
    trainer: DummyTrainer
    dummy_update_scale: 0.001
    mode: step
    num_local_steps: 10
  model_configs:
    model_name: synthetic
    model_kwargs:
      num_params: $((mb * 1024 * 1024 / 4))
server_configs:
  num_clients: $n
  num_global_epochs: $updates
  scheduler: $sched
  scheduler_kwargs:
    max_local_steps: 10
    min_local_steps: 2
  aggregator: $agg
  aggregator_kwargs:
    staleness_fn: polynomial
    K: 3
  client_speed_distribution: lognormal
  comm_configs:
    grpc_configs:
      server_uri: 127.0.0.1:0
YAML
      for transport in $TRANSPORTS; do
        echo "run: $agg $transport ${mb} MiB × $n" >&2
        rm -rf "$work/out"
        start=$(date +%s.%N)
        case $transport in
          simulator) "$BUILD/memfl" run "$work/c.yaml" -q --out "$work/out" >&2; s="$work/out/summary.json" ;;
          grpc) "$BUILD/memfl" launch "$work/c.yaml" --clients "$n" -q --out "$work/out" >&2; s="$work/out/server/summary.json" ;;
          mpi) mpirun -np $((n + 1)) --oversubscribe "$BUILD/memfl" mpi "$work/c.yaml" -q --out "$work/out" >&2
               s="$work/out/rank_0/summary.json" ;;
        esac
        end=$(date +%s.%N)
        python3 - "$s" "$agg" "$transport" "$mb" "$n" "$start" "$end" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m = s["model_bytes"]
print(json.dumps({
    "aggregator": sys.argv[2], "transport": sys.argv[3], "model_mb": int(sys.argv[4]), "clients": int(sys.argv[5]),
    "updates": s["updates"], "global_versions": s["global_versions"],
    "peak_rss_bytes": s["peak_rss_bytes"], "baseline_rss_bytes": s["baseline_rss_bytes"],
    "peak_over_model": round(s["peak_rss_bytes"] / m, 3),
    "peak_above_baseline_over_model": round((s["peak_rss_bytes"] - s["baseline_rss_bytes"]) / m, 3),
    "aggregator_state_bytes": s.get("aggregator_state_bytes", 0),
    "wall_seconds": round(float(sys.argv[7]) - float(sys.argv[6]), 2)}))
PY
      done
    done
  done
done
