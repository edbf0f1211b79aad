// The in-process simulator's clients and workers (`memfl run`). A virtual
// client is its partition and sample count (SimClients); K worker replicas
// (SimWorkers) take the round's clients in turn through the in-process
// transport (comm/inproc.h): a worker receives the global model into its
// arena, trains the client there (ClientDriver, as every transport's client
// does) and streams its arena into the aggregator. So memory is global +
// running sum + K replicas, whatever the number of clients.
//
//   MEMFL_ASSIGN_OR_RETURN(SimClients clients, SimClients::load(cfg, run_dir));
//   MEMFL_ASSIGN_OR_RETURN(auto workers, SimWorkers::create(cfg, clients, run_dir, sampler));
//   MEMFL_RETURN_IF_ERROR(workers->grow(baseline_rss));   // K replicas
//   auto transport = workers->make_transport(chunk);
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "client/client_driver.h"
#include "client/client_work.h"
#include "comm/inproc.h"
#include "config/config.h"
#include "memory/budget.h"
#include "memory/sampler.h"
#include "schedule/scheduler.h"
#include "server/global_model.h"
#include "server/round_driver.h"

namespace memfl {

// The virtual clients: the data set (none for a spec-only model), each
// client's partition, the model's input and the server's test indices.
struct SimClients {
  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> parts;
  InputSpec input;
  std::vector<uint32_t> test_idx;
  const DatasetSplits* splits() const { return data ? &*data : nullptr; }
  // The sample count each client reports with its update (FedAvg's weight).
  std::vector<double> sample_counts(const ExperimentConfig& cfg) const;
  // Loads the data set and partitions it (partition.csv in run_dir); a
  // spec-only model has N empty partitions and no data set.
  static StatusOr<SimClients> load(const ExperimentConfig& cfg, const std::string& run_dir);
};

class SimWorkers {
 public:
  // Builds the first replica, with the seed, so its initial weights are the
  // initial global model. A bad server_configs.memory_budget is refused
  // first. `clients` and `sampler` outlive the workers.
  static StatusOr<std::unique_ptr<SimWorkers>> create(const ExperimentConfig& cfg, const SimClients& clients,
                                                      const std::string& run_dir, MemorySampler& sampler);
  LocalModel& first() { return workers_[0]; }
  const Layout& layout() { return workers_[0].layout(); }
  // The other replicas: parallel_clients in all, or — -1 — as many as the
  // budget holds, from the measured cost of the first replica (RSS above
  // `baseline_rss`) plus its training state. Splits libtorch's intra-op
  // threads among them.
  Status grow(int64_t baseline_rss);
  // The in-process transport over the workers: each trains the clients it
  // takes; the round's privacy spending is recorded after the round (attach).
  std::unique_ptr<InProcessTransport> make_transport(size_t chunk);
  // The simulator's hooks into the round driver: the server's evaluation
  // on the worker replicas (with `global`'s replica when they cannot), the
  // rounds' simulated time, after each round the privacy spending of the
  // clients that took part (`scheduler` gathered it) and the shed workers'
  // replicas freed, then `on_round`; the largest ε is kept with each commit.
  void attach(RoundDriverOptions* dopts, GlobalModel& global, const Scheduler& scheduler,
              std::function<void(const RoundMetrics&)> on_round);
  // DP-SGD: the largest client ε so far.
  double max_epsilon() const { return max_epsilon_; }

  // The workers' part of summary.json: K, intra-op threads, cores, the
  // malloc policy, BLAS threads, and the stated memory bound with the
  // measured peak above `baseline_rss` against it (`sum_bytes`: the
  // aggregator's state).
  Status summarise(nlohmann::ordered_json* summary, int64_t baseline_rss, int64_t peak_rss, double sum_bytes);

 private:
  SimWorkers(const ExperimentConfig& cfg, const SimClients& clients, std::string run_dir, MemorySampler& sampler,
             int64_t budget, int cores);
  // Optimizer state in model sizes (Adam 2, momentum 1), when the replica trains here.
  double optimizer_models();
  Status train(int worker, int client, int round, ClientUpdateInfo* info);
  bool keep_worker(int worker);
  StatusOr<EvalResult> evaluate(LocalModel& global, Arena& global_model);
  void record_round(int round, const Scheduler& scheduler);
  double take_round_virtual_seconds(int round);

  const ExperimentConfig& cfg_;
  const SimClients& clients_;
  std::string run_dir_;
  MemorySampler& sampler_;
  int64_t budget_;
  int cores_;
  int k_workers_ = 1, intra_op_threads_ = 1;
  // (reserved: references to the first replica's layout must not move with the vector)
  std::vector<LocalModel> workers_;
  std::optional<WorkerGovernor> governor_;
  std::mutex governor_mu_;
  std::unique_ptr<ClientDriver> client_driver_;
  std::vector<TripUpdate> trips_;  // each worker's last update, until it is sent
  std::vector<double> step_times_;
  std::mutex virtual_mu_;
  std::map<int, double> round_virtual_;
  double max_epsilon_ = 0;
};

}  // namespace memfl
