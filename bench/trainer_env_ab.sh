#!/usr/bin/env bash
# An A/B of memfl_bench_trainer (bare loop and memfl's trainer, ABBA pairs)
# under two environments, alternated PAIRS times, the order flipped each
# pair so a machine that speeds up or slows down favours neither. One JSON
# line per model and run, with "variant" (the name given) and "pair".
# Usage: bench/trainer_env_ab.sh BUILD_DIR PAIRS REPS THREADS MODELS \
#          NAME_A 'VAR=value …' NAME_B 'VAR=value …' > out.jsonl
# An environment is what `env` takes: assignments, and `-u VAR` to unset.
# MODELS: as memfl_bench_trainer takes it ("" for all three).
set -euo pipefail
BUILD=$1 PAIRS=$2 REPS=$3 THREADS=$4 MODELS=$5
NAMES=("$6" "$8")
ENVS=("$7" "$9")
for pair in $(seq 1 "$PAIRS"); do
  order=(0 1)
  if [ $((pair % 2)) -eq 0 ]; then order=(1 0); fi
  for i in "${order[@]}"; do
    # shellcheck disable=SC2086  # the environment is word-split on purpose
    out=$(env ${ENVS[$i]} "$BUILD/memfl_bench_trainer" "$REPS" "$THREADS" $MODELS)
    echo "$out" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"variant": sys.argv[1], "pair": int(sys.argv[2]), **r}))' "${NAMES[$i]}" "$pair"
  done
done
