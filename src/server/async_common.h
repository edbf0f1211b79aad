// What the asynchronous drivers share, whatever plays the clock: the
// simulator's AsyncDriver (server/async_driver.h, virtual time) and the
// server process of gRPC and MPI (roles/async_server.h, real time). How
// often the model is evaluated, the metrics.csv row written at each
// evaluation, and the head of summary.json. What the transports share sits
// below the server, in comm/: an applied update's spool slot goes back
// through SpoolSlots::release (comm/spool_update.h), and whether an update
// is followed by an evaluation is async_eval_due (comm/transport.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "io/run_dir.h"
#include "memory/sampler.h"

namespace memfl {

// Client updates between evaluations: server_configs.async_eval_every, or
// (0) num_clients.
int64_t async_eval_every(const ServerConfig& sc);

// metrics.csv of an asynchronous run: one row per evaluation, for the
// updates since the row before ("round" k: the k-th evaluation).
class AsyncMetricsLog {
 public:
  explicit AsyncMetricsLog(const MemorySampler& sampler) : sampler_(sampler) {}
  // Creates run_dir/metrics.csv (its header first); the first window starts now.
  Status open(const std::string& run_dir);
  // The next row's window starts now.
  void start_window();
  // Completes `m` (the window's wall seconds, the process's columns),
  // appends it to metrics.csv and rows(), and starts the next window.
  Status append(RoundMetrics& m);
  const std::vector<RoundMetrics>& rows() const { return rows_; }

 private:
  const MemorySampler& sampler_;
  std::unique_ptr<MetricsWriter> writer_;
  std::chrono::steady_clock::time_point window_start_;
  std::vector<RoundMetrics> rows_;
};

// The keys every asynchronous summary.json starts with: role, scheduler,
// aggregator, updates, global_versions, mean_staleness, max_staleness.
nlohmann::ordered_json async_summary_head(const std::string& role, const ServerConfig& sc, int64_t updates,
                                          int64_t versions, double mean_staleness, int64_t max_staleness);

}  // namespace memfl
