#!/usr/bin/env bash
# Issue #18, part 1: OpenBLAS's own threads under libtorch's intra-op threads.
# memfl runs each BLAS call on one thread unless OPENBLAS_NUM_THREADS is set
# (src/train/torch_trainer.cpp, set_intra_op_threads); setting it to the
# machine's cores gives OpenBLAS's default back, in the same binary. Runs
# memfl_bench_trainer (bare loop and memfl's trainer, ABBA pairs) with each
# variant in turn, PAIRS times; one JSON line per model and run, with
# "variant": "openblas_cores" (the default OpenBLAS would take) or
# "one_per_call" (memfl's policy).
# Usage: bench/blas_threads_ab.sh [BUILD_DIR] [PAIRS] [REPS] [THREADS] > out.jsonl
set -euo pipefail
BUILD=${1:-build}
PAIRS=${2:-2}
REPS=${3:-5}
THREADS=${4:-2}
CORES=$(nproc)
for pair in $(seq 1 "$PAIRS"); do
  for variant in openblas_cores one_per_call; do
    if [ "$variant" = openblas_cores ]; then
      out=$(OPENBLAS_NUM_THREADS=$CORES "$BUILD/memfl_bench_trainer" "$REPS" "$THREADS")
    else
      out=$(env -u OPENBLAS_NUM_THREADS "$BUILD/memfl_bench_trainer" "$REPS" "$THREADS")
    fi
    echo "$out" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"variant": sys.argv[1], "pair": int(sys.argv[2]), **r}))' "$variant" "$pair"
  done
done
