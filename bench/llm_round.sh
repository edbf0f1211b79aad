#!/usr/bin/env bash
# One LLM round (configs/llama_70b_dummy.yaml: bf16, DummyTrainer, 2 clients,
# weights drawn from the seed), server and clients on this host, memory
# backing, then one JSON line of figures (bench/llm_round.py) with the wall
# time and the disk the run took. Run it on a host that holds three copies of
# the model (70B: 3 × 141 GB; the 4-GPU lent host has 503 GiB).
# Usage: bench/llm_round.sh MEMFL OUT_DIR MODEL mpi|grpc [--set KEY=VALUE ...]
#   MODEL: llama-8b, llama-70b, ...   MPIRUN_ARGS: extra mpirun options
set -uo pipefail
MEMFL=$1 OUT=$2 MODEL=$3 TRANSPORT=$4
shift 4
SRC=$(cd "$(dirname "$0")/.." && pwd)
CFG=$SRC/configs/llama_70b_dummy.yaml
RUN=$OUT/$MODEL-$TRANSPORT
rm -rf "$RUN"
mkdir -p "$OUT"
SETS=(--set "client_configs.model_configs.model_name=$MODEL" --set memory_configs.arena_backing=memory "$@")
disk_before=$(df -B1 --output=used "$OUT" | tail -1)
start=$(date +%s%N)
if [ "$TRANSPORT" = mpi ]; then
  root=()
  [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
  # shellcheck disable=SC2086
  mpirun "${root[@]}" -np 3 --oversubscribe --bind-to none ${MPIRUN_ARGS:-} \
    "$MEMFL" mpi "$CFG" --out "$RUN" "${SETS[@]}" > "$RUN.log" 2>&1
else
  "$MEMFL" launch "$CFG" --clients 2 --out "$RUN" "${SETS[@]}" > "$RUN.log" 2>&1
fi
rc=$?
wall=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
disk_after=$(df -B1 --output=used "$OUT" | tail -1)
run_bytes=$(du -sb "$RUN" | cut -f1)
tail -5 "$RUN.log"
# The roles' directories: rank_<r>/ (mpi) or server/, client_<i>/ (launch).
python3 "$SRC/bench/llm_round.py" "$RUN" model="$MODEL" transport="$TRANSPORT" exit_code="$rc" \
  wall_s="$wall" disk_used_delta_bytes="$((disk_after - disk_before))" run_dir_bytes="$run_bytes" \
  cores="$(nproc)" mem_total_kb="$(awk '/MemTotal/{print $2}' /proc/meminfo)" | tee -a "$OUT/llm_round.jsonl"
