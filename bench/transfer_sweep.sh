#!/usr/bin/env bash
# gRPC transfer sweep: model size M × client count N, streaming and
# naive, DummyTrainer, 2 rounds each. Skips what would not fit this machine's
# memory (estimated from the bound) and says so.
# Usage: [TRANSPORT=grpc|mpi] [BENCH_ARGS="--mpi-path point_to_point"] bench/transfer_sweep.sh [BUILD_DIR] [MAX_GIB] > bench_transfer.json
set -euo pipefail
BUILD=${1:-build}
MAX_GIB=${2:-18}
SIZES=${SIZES:-"256 1024 4096"}
CLIENTS=${CLIENTS:-"1 2 4 8"}
MODES=${MODES:-"streaming naive"}
TRANSPORT=${TRANSPORT:-grpc}
BENCH_ARGS=${BENCH_ARGS:-}  # more `memfl bench transfer` flags for every cell
echo "["
first=1
for mode in $MODES; do
  for mb in $SIZES; do
    for n in $CLIENTS; do
      # Estimated peak of all processes together, in MiB.
      if [ "$mode" = naive ]; then est=$(( mb * (n + 2) + mb * n )); else est=$(( mb * (n + 1) )); fi
      if [ $est -gt $(( MAX_GIB * 1024 )) ]; then
        echo "skip: $mode ${mb} MiB × $n clients needs ≈ $est MiB > ${MAX_GIB} GiB" >&2
        continue
      fi
      echo "run: $TRANSPORT $mode ${mb} MiB × $n clients" >&2
      out=$("$BUILD/memfl" bench transfer --transport "$TRANSPORT" --model-mb "$mb" --clients "$n" --memory-mode "$mode" $BENCH_ARGS)
      [ $first -eq 1 ] || echo ","
      first=0
      echo "$out"
    done
  done
done
echo "]"
