#!/usr/bin/env bash
# MPI transfers over the shared-memory ring, 5 runs per cell, with raw
# OpenMPI point to point measured in each repetition beside them. Each line: one run of `memfl bench transfer --transport mpi`
# (DummyTrainer, 2 rounds; round 2's figures) and the raw figures of the same
# repetition (bench/mpi_raw_bandwidth.cpp: 1 MiB chunks, 4 in flight, best of
# 3, CMA single copy, without and with xxh3 on both sides), and the same
# cell's ceiling: the work memfl's ring does per chunk (copy with xxh3 into a
# slot, the xxh3 check, the FedAvg fold) by two threads of one process with
# no MPI in between (bench/transfer_ceiling.cpp: 1 MiB chunks, 8 slots, as
# memfl's ring gives `memfl bench transfer`'s 1 MiB chunks), and the bound
# the work itself sets on this machine's cores (bench/transfer_work.cpp, the
# same chunks: each stage's cost on one core alone; the cores
# divided by the core-seconds per GB, and for one client the slower stage of
# the pipeline). Summarise with bench/spread.py.
# EXTRAS=0 runs memfl alone (no raw MPI, ceiling or bound: a 5-run spread in
# minutes rather than an hour; each line then has memfl's fields only).
# Usage: [CELLS="1024:1 …"] [REPS=5] [EXTRAS=0] bench/mpi_spread.sh [BUILD_DIR] > out.jsonl
# Each memfl line also carries the kernel's counters over that run
# (/proc/vmstat deltas: faults, huge-page faults and fallbacks, compaction
# stalls, reclaim scans) and the page cache before it, so a slow run can be
# told apart from one the kernel slowed.
set -euo pipefail
BUILD=${1:-build}
VM_KEYS="pgfault pgmajfault thp_fault_alloc thp_fault_fallback compact_stall pgscan_kswapd pgscan_direct"
vmsnap() {
  awk -v keys="$VM_KEYS" 'BEGIN { n = split(keys, k); for (i = 1; i <= n; i++) want[k[i]] = 1 }
    want[$1] { printf "%s\"%s\": %s", sep, $1, $2; sep = ", " }' /proc/vmstat |
    sed 's/^/{/; s/$/, "page_cache_mb": '"$(free -m | awk '/^Mem/ { print $6 }')"'}/'
}
vmdelta() {  # vmdelta BEFORE_JSON AFTER_JSON -> {"vm_<key>": after - before, "page_cache_mb_before": ...}
  python3 -c '
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
d = {"vm_" + k: b[k] - a[k] for k in a if k != "page_cache_mb"}
d["page_cache_mb_before"] = a["page_cache_mb"]
print(json.dumps(d))' "$1" "$2"
}
REPS=${REPS:-5}
CELLS=${CELLS:-"1024:1 1024:2 1024:4 4096:1 4096:2"}
EXTRAS=${EXTRAS:-1}
if [ "$EXTRAS" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  for rep in $(seq 1 "$REPS"); do
    for cell in $CELLS; do
      IFS=: read -r mb n <<<"$cell"
      before=$(vmsnap)
      memfl=$("$BUILD/memfl" bench transfer --transport mpi --model-mb "$mb" --clients "$n" --memory-mode streaming \
        2>/dev/null)
      vm=$(vmdelta "$before" "$(vmsnap)")
      python3 -c '
import json, sys
m, vm = json.loads(sys.argv[2]), json.loads(sys.argv[3])
first, last = m["rounds"][0], m["rounds"][-1]
print(json.dumps({"rep": int(sys.argv[1]), "model_bytes": m["model_bytes"], "clients": m["clients"],
                  "chunk_path": m.get("chunk_path"), "mpi_download_gbps": round(last["download_gbps"], 3),
                  "mpi_upload_gbps": round(last["upload_gbps"], 3),
                  "round1_download_gbps": round(first["download_gbps"], 3),
                  "round1_upload_gbps": round(first["upload_gbps"], 3),
                  "server_peak_over_model": round(m["server_peak_over_model"], 4),
                  "client_peak_over_model": round(m["client_peak_over_model"], 4), **vm}))' "$rep" "$memfl" "$vm"
    done
  done
  exit 0
fi
RAW=$BUILD/mpi_raw_bandwidth
mpicxx -O2 -std=c++20 "$(dirname "$0")/mpi_raw_bandwidth.cpp" -o "$RAW" -lxxhash
CEILING=$BUILD/transfer_ceiling
c++ -O2 -std=c++20 -march=x86-64-v3 "$(dirname "$0")/transfer_ceiling.cpp" -o "$CEILING" -pthread
WORK=$BUILD/transfer_work
c++ -O2 -std=c++20 -march=x86-64-v3 "$(dirname "$0")/transfer_work.cpp" -o "$WORK" -pthread
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for rep in $(seq 1 "$REPS"); do
  raw=$(mpirun -np 2 --bind-to none "$RAW" 1024 4 0 | tr -d '\n')
  raw_hash=$(mpirun -np 2 --bind-to none "$RAW" 1024 4 1 | tr -d '\n')
  for cell in $CELLS; do
    IFS=: read -r mb n <<<"$cell"
    before=$(vmsnap)
    memfl=$("$BUILD/memfl" bench transfer --transport mpi --model-mb "$mb" --clients "$n" --memory-mode streaming \
      2>/dev/null)
    vm=$(vmdelta "$before" "$(vmsnap)")
    ceiling=$("$CEILING" "$mb" "$n" 1024 8 2)
    work=$("$WORK" "$mb" 2 1024)
    python3 - "$rep" "$raw" "$raw_hash" "$memfl" "$ceiling" "$work" "$vm" <<'PY'
import json, sys
rep = int(sys.argv[1])
raw, rh, m, c, w, vm = (json.loads(a) for a in sys.argv[2:8])
last = m["rounds"][-1]
out = {
    "rep": rep, "model_bytes": m["model_bytes"], "clients": m["clients"], "chunk_path": m.get("chunk_path"),
    "mpi_download_gbps": round(last["download_gbps"], 3), "mpi_upload_gbps": round(last["upload_gbps"], 3),
    "raw_mpi_gbps": raw["best_of_3_gbps"], "raw_mpi_xxh3_gbps": rh["best_of_3_gbps"],
    "ceiling_download_gbps": round(c["download_gbps_median"], 3),
    "ceiling_upload_gbps": round(c["upload_sequential_gbps_median"], 3),
    "ceiling_upload_interleaved_gbps": round(c["upload_interleaved_gbps_median"], 3),
    "ceiling_upload_direct_gbps": round(c["upload_direct_gbps_median"], 3),
    "server_peak_over_model": round(m["server_peak_over_model"], 4),
    "client_peak_over_model": round(m["client_peak_over_model"], 4),
}
for d in ("download", "upload"):
    out[f"memfl_over_raw_{d}"] = round(out[f"mpi_{d}_gbps"] / out["raw_mpi_gbps"], 3)
    out[f"memfl_over_raw_xxh3_{d}"] = round(out[f"mpi_{d}_gbps"] / out["raw_mpi_xxh3_gbps"], 3)
    out[f"memfl_over_ceiling_{d}"] = round(out[f"mpi_{d}_gbps"] / out[f"ceiling_{d}_gbps"], 3)
n = m["clients"]
if n in (1, 2, 4):
    for d, k in (("download", "down"), ("upload", "up")):
        b = w["bound_gbps"][f"ring_{k}_{n}"]
        if n == 1:  # one client and the server: a pipeline of two threads
            b = min(b, w["pipeline_bound_gbps"][f"ring_{k}_1"])
        out[f"work_bound_{d}_gbps"] = round(b, 3)
        out[f"memfl_over_work_bound_{d}"] = round(out[f"mpi_{d}_gbps"] / b, 3)
out["round1_download_gbps"] = round(m["rounds"][0]["download_gbps"], 3)
out["round1_upload_gbps"] = round(m["rounds"][0]["upload_gbps"], 3)
out.update(vm)
print(json.dumps(out))
PY
  done
done
