// memfl over MPI (`mpirun -np N+1 memfl mpi CONFIG`): rank 0 is the server,
// ranks 1..N host the clients — `clients_per_rank` virtual clients each, one
// after another, so 100 clients fit on a few ranks. Client ids follow APPFL's
// MPI convention: rank r hosts clients (r−1)·k … (r−1)·k + k − 1, and
// num_clients is the number of client ranks × k.
//
// The same semantics as gRPC — register, global model down, update up, fold
// while the bytes arrive, in client order — over chunked point-to-point
// messages: a header message (layout hash, offset, length, xxh3), then the
// bytes, sent from the arena and received straight into the destination
// arena (downloads) or a small ring folded into the running sum by a worker
// thread (uploads), several chunks in flight each way. When every rank
// shares the server's node, the bytes pass through a shared-memory ring of
// chunk slots (an MPI-3 window) instead and only the headers are messages
// (`server_configs.mpi_shared_memory`). MPI counts are ints: chunking is what
// lets models above 2 GiB pass. The transport (messages, chunk streams, the
// ring) is comm/mpi/mpi_transport.h; this file wires the ranks on top.
//
// A dead rank ends the job: MPI's default error handler aborts every rank
// (mpirun names the rank that failed). The server's checkpoint is written
// with tmp + rename after each round, so the last complete round survives.
#pragma once

#include <functional>

#include "config/config.h"

namespace memfl {

struct MpiOptions {
  std::string run_dir;  // each rank writes RUN_DIR/rank_<r>/
  bool progress = true;
  bool resume = false;  // the server continues after the newest committed round of RUN_DIR/rank_0
  // Rank 0 only, once its directory exists and before its loop (memfl mpi
  // --http starts the live endpoint there); an error ends the job.
  std::function<Status(const std::string& rank0_dir)> on_server_start;
};

// Runs this process's role (by rank). Calls MPI_Init/MPI_Finalize.
Status run_mpi(int* argc, char*** argv, const ExperimentConfig& cfg, const MpiOptions& opts);

}  // namespace memfl
