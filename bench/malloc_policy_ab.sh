#!/usr/bin/env bash
# the training roles' malloc policy (memory/malloc_policy.h:
# the heap is kept between batches) against glibc's defaults
# (MEMFL_MALLOC_POLICY=glibc), in the same binary. Runs memfl_bench_trainer
# with each in turn, PAIRS times (bench/trainer_env_ab.sh); one JSON line per
# model and run, with "variant": "glibc" or "training", and each loop's page
# faults.
# Usage: bench/malloc_policy_ab.sh [BUILD_DIR] [PAIRS] [REPS] [THREADS] [MODELS] > out.jsonl
set -euo pipefail
here=$(dirname "$0")
exec bash "$here/trainer_env_ab.sh" "${1:-build}" "${2:-2}" "${3:-5}" "${4:-2}" "${5:-}" \
  glibc "MEMFL_MALLOC_POLICY=glibc" training "-u MEMFL_MALLOC_POLICY"
