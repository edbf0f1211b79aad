#!/usr/bin/env bash
# LLM rounds on a lent host that has no build tools for memfl's
# dependencies (no gRPC there): runs a memfl built on Debian 12 and carried
# as a kit — build-devkit/{memfl, lib/ (libmemfl_core and Debian's gRPC,
# protobuf, abseil, spdlog, ... shared libraries), fallback/ (Debian's
# OpenMPI 4.1 libraries, used only where the host has none)}. Make the kit
# with `make devkit`. The host's own mpirun and libmpi are used when present.
# Usage: bench/llm_round_kit.sh OUT_DIR "MODEL:TRANSPORT ..." [--set KEY=VALUE ...]
# Each run's small files (summary, metrics, memory timelines, logs) are
# copied to OUT_DIR; its checkpoints are deleted before the next run.
set -uo pipefail
OUT=$1 RUNS=$2
shift 2
SRC=$(cd "$(dirname "$0")/.." && pwd)
KIT=$SRC/build-devkit
WORK=${WORK:-$SRC/runs/llm}
mkdir -p "$OUT" "$WORK"
{
  date -u +%FT%TZ; nproc; free -g; df -h "$WORK"
  lscpu | grep -E "Model name|Socket|NUMA node\(s\)"
  cat /sys/kernel/mm/transparent_hugepage/enabled
  command -v mpirun && mpirun --version 2>&1 | head -1
} > "$OUT/host.txt" 2>&1
export LD_LIBRARY_PATH=$KIT/lib
if ldd "$KIT/memfl" | grep -q "not found"; then export LD_LIBRARY_PATH=$KIT/lib:$KIT/fallback; fi
ldd "$KIT/memfl" >> "$OUT/host.txt" 2>&1
vmstat -t 5 > "$OUT/vmstat.txt" 2>&1 &
vm=$!
for run in $RUNS; do
  model=${run%%:*} transport=${run##*:}
  timeout "${RUN_TIMEOUT:-560}" bash "$SRC/bench/llm_round.sh" "$KIT/memfl" "$WORK" "$model" "$transport" "$@"
  dir=$WORK/$model-$transport
  # One archive a run: the device tool brings back few files, none deep.
  (cd "$WORK" && find "$model-$transport" "$model-$transport.log" \( -name '*.json' -o -name '*.csv' -o -name '*.log' \) \
    -size -20M -print0 | tar czf "$OUT/$model-$transport.tgz" --null -T -)
  rm -rf "$dir"
done
cp "$WORK/llm_round.jsonl" "$OUT/" 2>/dev/null
kill $vm
