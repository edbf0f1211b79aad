// Scheduler: decides which clients a round asks and when the server
// aggregates. SyncScheduler (APPFL's name) waits for every selected client of
// a round, then aggregates once. The asynchronous schedulers (AsyncScheduler,
// CompassScheduler) have no rounds: server/async_core.h plays them, and
// make_scheduler refuses them by name. The scheduler's state (selection RNG, per-client stats) is part
// of the server's committed state, so a resumed run selects as the
// uninterrupted one would.
//
//   MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(cfg.server.scheduler, opts));
//   auto selected = scheduler->select(round);
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "schedule/client_selection.h"

namespace memfl {

struct SchedulerOptions {
  int num_clients = 1;
  int clients_per_round = 0;  // 0 or ≥ num_clients: all
  uint64_t seed = 0;
  std::string client_selection = "random";
  SelectionOptions selection;
  std::vector<double> client_samples;  // per client (selection methods weigh by it)
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual std::string_view name() const = 0;
  // The clients `round` asks for an update, sorted.
  virtual std::vector<int> select(int round) = 0;
  // What a client's update said (its last loss, DP steps…), for later selections.
  virtual void record(int round, int client, double train_loss, int64_t dp_steps, double dp_sample_rate) = 0;
  virtual const std::vector<ClientStats>& stats() const = 0;
  virtual nlohmann::json save() const = 0;
  virtual Status load(const nlohmann::json& state) = 0;
};

// Names the registry knows, for config checks and messages.
const std::vector<std::string>& scheduler_names();
// Refuses an unknown name, listing the known ones.
StatusOr<std::unique_ptr<Scheduler>> make_scheduler(const std::string& name, const SchedulerOptions& opts);

// SyncScheduler's `random` choice for `round`: all when clients_per_round is
// 0 or ≥ num_clients, else a seeded sample without replacement (sorted). A
// pure function of (seed, round), so every MPI rank computes it alike.
std::vector<int> select_clients(int num_clients, int clients_per_round, uint64_t seed, int round);

}  // namespace memfl
