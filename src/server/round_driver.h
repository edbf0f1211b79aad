// RoundDriver: the server's round loop, written once for every transport
// (in-process simulation, gRPC, MPI):
//
//   select (Scheduler) → broadcast (transport) → collect: each update folds
//   into the aggregator as it arrives → aggregate (finalize, DP-FedAvg noise)
//   → evaluate (optional hook) → commit the server's state (resumable; which
//   rounds, and how many commits stay, is server_configs.checkpoint_*)
//
// A round whose aggregate cannot be trusted (an update broke after some of
// its bytes were counted) is redone from the pre-round model with the clients
// still in. `resume` continues after the newest committed round of run_dir.
//
//   RoundDriver driver(cfg, global, transport, *scheduler, sampler, opts);
//   MEMFL_RETURN_IF_ERROR(driver.run());
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compress/broadcast_delta.h"
#include "compress/settings.h"
#include "config/config.h"
#include "memory/sampler.h"
#include "io/run_dir.h"
#include "schedule/scheduler.h"
#include "server/global_model.h"
#include "server/server_state.h"
#include "comm/transport.h"
#include "train/trainer_backend.h"

namespace memfl {

class SecAggChannel;

struct RoundDriverOptions {
  std::string run_dir;
  std::string role = "server";  // names log lines
  bool resume = false;
  // Server-side evaluation of the global model after a round; empty: none.
  std::function<StatusOr<EvalResult>(int round, Arena& global)> evaluate;
  // The same evaluation done by another process (the model worker), in two
  // halves: begin hands it the round's model and returns once the model is
  // on its way (the worker evaluates its own copy); end waits for the
  // result. Round r's evaluation then runs while round r+1 broadcasts and
  // its clients train — no client waits for it — and r's metrics row (and
  // on_round) follow when it ends: once r+1's updates are in, or at the end
  // of the run. A run stopped in between resumes with r's test metrics
  // empty (its model is committed).
  std::function<Status(int round, const Arena& global)> begin_evaluation;
  std::function<StatusOr<EvalResult>(int round)> end_evaluation;
  // Called after each round's metrics are final (progress lines): once its
  // commit is durable, which is during the next round.
  std::function<void(const RoundMetrics&)> on_round;
  // Called when a round is over and before the next one begins (its commit
  // may still be writing).
  std::function<void(int round)> between_rounds;
  // The simulated duration of `round` (its slowest client's local steps ×
  // its time per step), added up into RoundMetrics::virtual_seconds; empty:
  // no simulated time.
  std::function<double(int round)> round_virtual_seconds;
  // What a transport keeps across rounds beyond the driver's state (e.g.
  // the simulator's per-client DP), saved and restored with each commit.
  std::function<nlohmann::json()> save_extra;
  std::function<Status(const nlohmann::json&)> load_extra;
  // server_configs.secure_aggregation: how the key-exchange stages reach the
  // round's clients (secagg/channel.h); null where the transport does not
  // carry them yet, and then such a run is refused.
  SecAggChannel* secure_aggregation = nullptr;
};

class RoundDriver {
 public:
  RoundDriver(const ExperimentConfig& cfg, GlobalModel& global, ServerTransport& transport, Scheduler& scheduler,
              MemorySampler& sampler, RoundDriverOptions opts);
  // Plays rounds up to server_configs.num_global_epochs.
  Status run();
  const std::vector<RoundMetrics>& rounds() const { return rounds_; }
  // Client-level DP-FedAvg: ε after the last round (0 when off).
  double dp_fedavg_epsilon() const { return dp_fedavg_epsilon_; }

 private:
  Status resume();
  Status play_round(int round, RoundMetrics* m, bool* redo);
  // Round pending_evaluation_'s evaluation result into its metrics, then its
  // metrics row and on_round (a no-op when none is pending).
  Status finish_evaluation();
  // Round `m`'s metrics are final: the row, and on_round.
  Status publish(const RoundMetrics& m);
  // Starts writing the round's checkpoint (the next round's undo) and, on
  // the rounds the checkpoint policy names, its commit, on a thread of its
  // own: the next round broadcasts and trains meanwhile. What the commit
  // records (the scheduler, the metrics, the aggregator's record) is taken
  // now; the global model and the aggregator's state are not written again
  // before settle_commit().
  Status start_commit(int round);
  // Waits for the commit in flight (none: OK) and then publishes its round:
  // a round's metrics row follows its durable commit. Called before anything
  // writes the global model or the aggregator's state, and before the run
  // ends, errors included.
  Status settle_commit();
  // The writes start_commit() runs.
  Status write_commit(int round, CommittedState st);
  // crash_point (server/server_state.h) once the commit in flight is durable.
  void crash_after_commit(int round, const char* point);
  // The checkpoint policy's disk need against the run directory's free bytes.
  Status check_disk() const;

  const ExperimentConfig& cfg_;
  GlobalModel& global_;
  ServerTransport& transport_;
  Scheduler& scheduler_;
  MemorySampler& sampler_;
  RoundDriverOptions opts_;
  CompressionSettings compression_;                  // how client updates arrive
  std::unique_ptr<BroadcastDelta> broadcast_delta_;  // broadcast_compression: lossy
  int first_round_ = 1;
  std::vector<RoundMetrics> rounds_;
  std::unique_ptr<MetricsWriter> metrics_;
  int pending_evaluation_ = 0;  // a round whose evaluation runs (begin_evaluation); 0: none
  std::vector<int> dropped_;    // clients out for the rest of the run
  double dp_fedavg_epsilon_ = 0;
  // Secure aggregation: this run's id (secagg_experiment_id), which every
  // round's masks, shares and upload tags are bound to.
  std::array<uint8_t, 32> secagg_experiment_{};
  // The commit in flight (start_commit): last, so that it is waited for
  // before anything it reads is destroyed.
  struct PendingCommit {
    int round = 0;
    std::chrono::steady_clock::time_point started;
    std::future<Status> done;
  };
  std::optional<PendingCommit> pending_commit_;
};

// The server's stated bound — the global model (anonymous unless
// file-backed) + the aggregator's state between rounds + what it may hold
// during one + the transport's buffers for chunks in flight — against
// server_configs.memory_budget; an error names the key. RoundDriver::run
// checks it; a role may check it sooner (before clients wait).
Status check_server_memory_bound(const ExperimentConfig& cfg, GlobalModel& global, uint64_t transport_bytes = 0);

// summary.json's "secure_aggregation": the configured num_shares and
// reconstruction_threshold and the k and t they resolve to for a full
// round (null when secure aggregation is off).
nlohmann::json secure_aggregation_summary(const ExperimentConfig& cfg);

nlohmann::json round_metrics_to_json(const RoundMetrics& m);
RoundMetrics round_metrics_from_json(const nlohmann::json& j);

}  // namespace memfl
