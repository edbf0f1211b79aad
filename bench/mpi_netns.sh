#!/usr/bin/env bash
# MPI ranks on separate simulated hosts: the server rank and CLIENTS client
# ranks each in a network namespace of its own (tests/netem/netns.sh),
# started by mpirun through tests/netem/mpi_netns_agent.sh in place of ssh,
# so chunks travel point to point over TCP through veth links — each link
# shaped by a tbf rate limit of RATE (e.g. 1gbit; "none": no qdisc). A
# NETEM (e.g. "delay 20ms 5ms loss 0.5%") makes it netem with that and RATE
# where the kernel has sch_netem. A MODEL_MB MiB f32 DummyTrainer model, ROUNDS rounds. One JSON line: the link,
# the mean round seconds and broadcast / upload GB/s of rounds 2+ (all
# clients together, from the server's metrics.csv), and each role's peak
# RSS ÷ model, whole and above the process's baseline (summary.json).
# Usage: [RATE=1gbit] [NETEM=...] bench/mpi_netns.sh [BUILD_DIR] [MODEL_MB] [ROUNDS] [CLIENTS]   (root)
set -euo pipefail
. "$(dirname "$0")/synthetic_config.sh"
BUILD=${1:-build}
MB=${2:-64}
ROUNDS=${3:-6}
CLIENTS=${4:-2}
RATE=${RATE:-1gbit}
MEMFL=$(realpath "$BUILD/memfl")
HERE=$(dirname "$(realpath "$0")")/../tests/netem
NS=$HERE/netns.sh
if ! "$NS" check-ns; then
  echo '{"skipped": "network namespaces cannot be made here"}'
  exit 0
fi
TMP=$(mktemp -d /tmp/memfl_mpi_netns.XXXXXX)
# A tag no other test or benchmark uses ("mp…" plus the pid).
TAG=mpb$(($$ % 100000))
trap '"$NS" down "$TAG" "$CLIENTS"; rm -rf "$TMP"' EXIT
"$NS" up "$TAG" "$CLIENTS"
QDISC=none
if [ -n "${NETEM:-}" ] && "$NS" check-netem; then
  QDISC="netem $NETEM${RATE:+ rate $RATE}"
  QDISC=${QDISC% rate none}
elif [ -n "${NETEM:-}" ]; then
  echo "this kernel has no sch_netem: NETEM is left out, the link is only rate-limited" >&2
fi
if [ "$QDISC" = none ] && [ "$RATE" != none ]; then QDISC="tbf rate $RATE burst 256kb latency 50ms"; fi
if [ "$QDISC" != none ]; then "$NS" shape "$TAG" "$CLIENTS" "$QDISC"; fi
write_synthetic_config "$TMP/c.yaml" $((MB * 262144)) "num_global_epochs: $ROUNDS" "do_server_eval: false"
{
  echo "10.77.0.1 slots=1"
  for ((i = 0; i < CLIENTS; i++)); do echo "10.77.0.$((10 + i)) slots=1"; done
} > "$TMP/hosts"
MEMFL_NETNS_TAG=$TAG OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  "$NS" exec "$TAG" server mpirun --mca plm_rsh_agent "$HERE/mpi_netns_agent.sh" \
  --mca plm_rsh_no_tree_spawn 1 --hostfile "$TMP/hosts" -np $((CLIENTS + 1)) --bind-to none \
  --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  "$MEMFL" mpi "$TMP/c.yaml" -q --out "$TMP/run" > "$TMP/mpirun.log" 2>&1 || {
  cat "$TMP/mpirun.log" >&2
  exit 1
}
python3 - "$TMP/run" "$RATE" "$QDISC" "$MB" "$CLIENTS" <<'PY'
import csv, glob, json, sys
run, rate, qdisc, mb, clients = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rows = [r for r in csv.DictReader(open(f"{run}/rank_0/metrics.csv")) if int(r["round"]) >= 2]
mean = lambda xs: sum(xs) / len(xs)
server = json.load(open(f"{run}/rank_0/summary.json"))
ranks = [json.load(open(p)) for p in sorted(glob.glob(f"{run}/rank_*/summary.json")) if not p.endswith("rank_0/summary.json")]
m = server["model_bytes"]
print(json.dumps({
    "transport": "mpi", "hosts": "network namespaces", "chunk_path": server["chunk_path"],
    "link_rate": rate, "qdisc": qdisc, "model_mb": mb, "clients": clients, "rounds": len(rows),
    "round_seconds": round(mean([float(r["round_seconds"]) for r in rows]), 3),
    "broadcast_gbps": round(mean([int(r["bytes_down"]) / float(r["download_seconds"]) / 1e9 for r in rows]), 3),
    "upload_gbps": round(mean([int(r["bytes_up"]) / float(r["upload_seconds"]) / 1e9 for r in rows]), 3),
    "server_peak_over_model": round(server["peak_rss_bytes"] / m, 3),
    "client_peak_over_model": round(max(r["peak_rss_bytes"] for r in ranks) / m, 3),
    # Above what the process held before its model (libraries, MPI): what the run itself costs.
    "server_above_baseline_over_model": round((server["peak_rss_bytes"] - server["baseline_rss_bytes"]) / m, 3),
    "client_above_baseline_over_model": round(max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks) / m, 3),
    "excluded_ranks": server["excluded_ranks"],
}))
PY
