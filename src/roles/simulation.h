// In-process federated simulation (`memfl run`): one server (global model
// arena, scheduler, aggregator) and N virtual clients that take turns on K
// worker replicas (server/sim_workers.h). A virtual client is its partition
// and sample count; a worker's arena receives the global model as chunks
// (broadcast), trains in place, and streams its chunks into the aggregator
// (upload) — so memory is global + running sum + K replicas, whatever N is.
// Asynchronous schedulers run on the virtual clock of
// server/async_simulation.h. This file wires the process: sampler, data,
// workers, transport, driver, summary.json.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "io/run_dir.h"
#include "schedule/scheduler.h"

namespace memfl {

struct SimulationResult {
  std::vector<RoundMetrics> rounds;
  int64_t peak_rss_bytes = 0;
  double wall_seconds = 0;
  size_t model_bytes = 0;
  size_t num_params = 0;
  double max_epsilon = 0;        // DP-SGD: the largest client ε at the end (0 without DP)
  double dp_fedavg_epsilon = 0;  // client-level DP-FedAvg: ε after the last round
};

struct SimulationOptions {
  std::string run_dir;
  bool progress = true;  // one line per round on stdout
  bool resume = false;   // continue after the newest committed round of run_dir
};

StatusOr<SimulationResult> run_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts);

}  // namespace memfl
