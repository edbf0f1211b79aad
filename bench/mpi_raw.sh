#!/usr/bin/env bash
# Raw MPI bandwidth here (the MPI transport's ceiling): 1 MiB chunks, 4 in flight,
# with OpenMPI's default single copy (CMA: the receiver copies) and with
# copy-in/copy-out through shared memory, each without and with xxh3 of
# every chunk on both sides. One JSON object per line.
# Usage: bench/mpi_raw.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-/tmp/memfl_mpi_raw}
mkdir -p "$OUT"
mpicxx -O2 -std=c++20 "$(dirname "$0")/mpi_raw_bandwidth.cpp" -o "$OUT/mpi_raw_bandwidth" -lxxhash
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for mech in cma none; do
  for hash in 0 1; do
    printf '{"single_copy_mechanism": "%s", "result": ' "$mech"
    mpirun -np 2 --bind-to none --mca btl_vader_single_copy_mechanism "$mech" "$OUT/mpi_raw_bandwidth" 1024 4 "$hash" |
      tr -d '\n'
    echo "}"
  done
done
