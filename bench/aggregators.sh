#!/usr/bin/env bash
# Server memory per aggregator: `memfl bench transfer
# --aggregator NAME`, a MODEL_MB MiB f32 DummyTrainer model, 2 and 8
# clients, gRPC and MPI; one JSON line per cell with the server's peak RSS
# ÷ model. Usage: bench/aggregators.sh [BUILD_DIR] [MODEL_MB] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
MB=${2:-1024}
AGGREGATORS=${AGGREGATORS:-"FedAvgAggregator FedAvgMAggregator FedAdamAggregator"}
ARENA_BACKING=${ARENA_BACKING:-memory}  # file: model and optimizer state in mapped files
for agg in $AGGREGATORS; do
  for transport in grpc mpi; do
    for n in 2 8; do
      echo "run: $agg $transport ${MB} MiB × $n" >&2
      out=$("$BUILD/memfl" bench transfer --transport $transport --model-mb "$MB" --clients $n --aggregator $agg --arena-backing "$ARENA_BACKING")
      python3 -c 'import json,sys; j=json.loads(sys.argv[1]); j.pop("rounds",None); print(json.dumps(j))' "$out"
    done
  done
done
