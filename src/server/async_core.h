// AsyncServerCore: the asynchronous server's rules, written once for every
// transport — the simulator's virtual clock (server/async_driver.h) and
// real client processes over gRPC and MPI (their transports' serve_async)
// drive it with their own time. It holds the global model's version, applies each
// arriving update with its staleness (FedAsync), adds it to the buffer
// (FedBuff), or keeps it for its arrival group (FedCompass, with the
// CompassPlanner), and says which clients to send the model to next, with
// how many local steps. It writes async_log.csv, one row per applied update.
// It never holds a client's model: an update is an UpdateSource (a spool
// slot) that the core reads when it applies it and then gives back.
//
//   AsyncServerCore core(cfg, layout, global, aggregator, weights, log_path);
//   int steps = core.start(client, now);                  // first trip
//   auto next = core.arrive(std::move(trip), now);        // on each update
//   for (auto& d : next->send) send_off(d.client, d.local_steps);
//   for (auto& [when, g] : next->deadlines) keep(when, g); // → core.deadline(g, when)
#pragma once

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aggregate/async_aggregator.h"
#include "comm/transport.h"
#include "config/config.h"
#include "schedule/compass.h"

namespace memfl {

class AsyncServerCore final : public AsyncUpdateHandler {
 public:
  // `weights`: w per client; `release` is called when an update's bytes are
  // no longer needed (applied, or folded into FedBuff's buffer).
  AsyncServerCore(const ExperimentConfig& cfg, const Layout& layout, Arena& global, AsyncAggregator& aggregator,
                  std::vector<double> weights, std::function<void(AsyncTripRecord&)> release);
  ~AsyncServerCore();
  Status open_log(const std::string& path);
  // Where an update's bytes go once it is no longer needed (a transport
  // that owns the spool sets it).
  void set_release(std::function<void(AsyncTripRecord&)> release) override { release_ = std::move(release); }

  // The client's first trip: its local steps (FedCompass: max_local_steps).
  int start(int client, double now) override;
  // An update arrived at `now` (whole and checked).
  StatusOr<AsyncNext> arrive(AsyncTripRecord trip, double now) override;
  // A FedCompass group's latest arrival time passed.
  StatusOr<AsyncNext> deadline(int group, double now) override;

  int64_t version() const override { return version_; }
  int64_t arrivals() const override { return arrivals_; }
  double mean_staleness() const { return applied_ > 0 ? staleness_sum_ / static_cast<double>(applied_) : 0.0; }
  int64_t max_staleness() const { return max_staleness_; }
  bool compass() const { return compass_; }
  Status flush_log() override;

 private:
  StatusOr<bool> apply(std::vector<AsyncTripRecord>& trips);
  void log_row(const AsyncTripRecord& t, double now);
  Status group_aggregate(int group, double now, AsyncNext* next);
  void send_off(int client, double now, AsyncNext* next);

  const ExperimentConfig& cfg_;
  const Layout& layout_;
  Arena& global_;
  AsyncAggregator& agg_;
  std::vector<double> weights_;
  std::function<void(AsyncTripRecord&)> release_;
  bool compass_ = false;
  CompassPlanner planner_;
  std::vector<AsyncTripRecord> general_buffer_, fedbuff_pending_;
  std::map<int, std::vector<AsyncTripRecord>> group_buffer_;
  int64_t version_ = 0, arrivals_ = 0, applied_ = 0, max_staleness_ = 0;
  double staleness_sum_ = 0;
  FILE* log_ = nullptr;
  std::string log_path_;
};

// The asynchronous rule the config names (server_configs.aggregator and
// aggregator_kwargs), with FedBuff's Δ where memory_configs.arena_backing
// says (in run_dir unless scratch_dir is set).
StatusOr<std::unique_ptr<AsyncAggregator>> make_async_aggregator(const ExperimentConfig& cfg, const Layout& layout,
                                                                 const std::string& run_dir);

}  // namespace memfl
