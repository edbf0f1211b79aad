// The simulator's asynchronous run (`memfl run` with AsyncScheduler or
// CompassScheduler): one worker replica trains each client when it is sent
// off, through ClientDriver as every transport's client does;
// server/async_driver.h plays the virtual clock. Writes client_speeds.csv
// (each client's time per step and weight), async_log.csv, metrics.csv and
// the final global_model.safetensors.
//
//   MEMFL_ASSIGN_OR_RETURN(AsyncSimulationResult r,
//                          simulate_async(cfg, run_dir, clients, workers->first(), sampler, on_eval));
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "client/client_work.h"
#include "config/config.h"
#include "io/run_dir.h"
#include "memory/sampler.h"
#include "server/sim_workers.h"

namespace memfl {

// What the run leaves for its summary.
struct AsyncSimulationResult {
  std::vector<RoundMetrics> evaluations;  // metrics.csv's rows
  int64_t versions = 0;                   // of the global model
  double mean_staleness = 0;
  int64_t max_staleness = 0;
  size_t aggregator_state_bytes = 0;
};

// `worker` (the first worker replica) trains every trip; `on_eval` sees
// each metrics.csv row as it is written.
StatusOr<AsyncSimulationResult> simulate_async(const ExperimentConfig& cfg, const std::string& run_dir,
                                               const SimClients& clients, LocalModel& worker, MemorySampler& sampler,
                                               std::function<void(const RoundMetrics&)> on_eval);

}  // namespace memfl
