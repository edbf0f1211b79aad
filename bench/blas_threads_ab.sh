#!/usr/bin/env bash
# OpenBLAS's own threads under libtorch's intra-op threads.
# memfl runs each BLAS call on one thread unless OPENBLAS_NUM_THREADS is set
# (src/train/torch_trainer.cpp, set_intra_op_threads); setting it to the
# machine's cores gives OpenBLAS's default back, in the same binary. Runs
# memfl_bench_trainer with each variant in turn, PAIRS times
# (bench/trainer_env_ab.sh); one JSON line per model and run, with
# "variant": "openblas_cores" (the default OpenBLAS would take) or
# "one_per_call" (memfl's policy).
# Usage: bench/blas_threads_ab.sh [BUILD_DIR] [PAIRS] [REPS] [THREADS] > out.jsonl
set -euo pipefail
here=$(dirname "$0")
exec bash "$here/trainer_env_ab.sh" "${1:-build}" "${2:-2}" "${3:-5}" "${4:-2}" "" \
  openblas_cores "OPENBLAS_NUM_THREADS=$(nproc)" one_per_call "-u OPENBLAS_NUM_THREADS"
