// AsyncDriver: asynchronous FL in virtual time — AsyncScheduler with
// FedAsyncAggregator or FedBuffAggregator, CompassScheduler with
// FedCompassAggregator — for the in-process simulator. Every client trains
// all the time: it receives the global model, trains (local steps × its
// time per step, drawn per client from server_configs.client_speed_*), and
// its update arrives that much later on a virtual clock; the server applies
// it (or buffers it, or waits for its arrival group) with its staleness and
// sends the client the model as it is then. Nothing waits in real time, so
// a thousand clients simulate in one process.
//
// Memory: the global model, FedBuff's Δ (1 M), one worker replica and a
// few blocks. A client's trained model is computed when it is sent off (the
// model it trains from is the global model at that virtual time) and waits
// for its arrival in a spool file (page cache, not anonymous memory): disk
// up to (clients + buffered updates) × M.
//
// The run directory gets async_log.csv — one row per update: client, base
// version, staleness, α, local steps, virtual times of dispatch, arrival and
// application, the version it made — so a run can be replayed and compared,
// and metrics.csv with a row every async_eval_every updates ("round" k =
// k × async_eval_every updates; virtual_seconds is the clock).
//
//   AsyncDriver driver(cfg, layout, global_arena, *aggregator, sampler, opts);
//   MEMFL_RETURN_IF_ERROR(driver.run());
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aggregate/async_aggregator.h"
#include "config/config.h"
#include "io/run_dir.h"
#include "memory/sampler.h"
#include "train/trainer_backend.h"

namespace memfl {

// What a client's trip reported.
struct AsyncTrip {
  int64_t version = 0;  // the global model's version the trip trains from (set by the driver)
  double train_loss = 0;
  int64_t steps = 0;  // local steps taken (its virtual duration is steps × its time per step)
};

struct AsyncDriverOptions {
  std::string run_dir;
  // Per client: seconds per local step, and its weight w (1/N or n_c/Σn).
  std::vector<double> step_time_s, weights;
  // Trains `client` from `global` for `local_steps` (0: the config's own),
  // returning the trained model's arena (valid until the next call).
  std::function<StatusOr<const Arena*>(int client, int local_steps, const Arena& global, AsyncTrip* trip)> train;
  // Server-side evaluation of the global model (empty: none).
  std::function<StatusOr<EvalResult>(Arena& global)> evaluate;
  std::function<void(const RoundMetrics&)> on_eval;
};

// Per-client seconds per local step, drawn from the config's distribution
// (seeded by server_configs.seed; the same for every algorithm).
std::vector<double> client_step_times(const ServerConfig& sc);

class AsyncDriver {
 public:
  AsyncDriver(const ExperimentConfig& cfg, const Layout& layout, Arena& global, AsyncAggregator& aggregator,
              MemorySampler& sampler, AsyncDriverOptions opts);
  ~AsyncDriver();
  // Plays server_configs.num_global_epochs client updates (APPFL counts an
  // asynchronous run's global epochs so).
  Status run();
  // metrics.csv's rows so far.
  const std::vector<RoundMetrics>& evaluations() const;
  int64_t versions() const;
  double mean_staleness() const;
  int64_t max_staleness() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memfl
