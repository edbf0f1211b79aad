// ClientDriver: what a client does with a model it received, written once
// for every transport — the mirror of the server's RoundDriver. A transport
// moves the model in (checked chunks into the arena or the shards) and the
// update out; between the two, every client of every transport (the
// simulator's, the C++ gRPC client, the MPI client ranks, sync and async)
// calls train():
//
//   received → [async, gradient_based: keep the base] → local training
//   (TrainerBackend; a non-finite loss refuses the update) → privacy record
//   (DP-SGD: privacy.csv) → encode (the change from the base when
//   gradient_based) → what to send (TripUpdate)
//
// The stages that act on every client's update (compression, secure
// aggregation masks) belong in encode, here, once.
//
//   ClientDriver driver(cfg, run_dir, data ? &*data : nullptr, parts);
//   ... the transport receives the model into model.arena() or driver.receive_shards(model) ...
//   MEMFL_ASSIGN_OR_RETURN(TripUpdate up, driver.train(model, client, round, begin.local_steps));
//   ... the transport sends up.upload (or up.shards) with up's metadata ...
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "client/client_work.h"

namespace memfl {

// What one trip sends, and what the server is told with it.
struct TripUpdate {
  // The bytes to send: an arena (the trained model, or its change from the
  // base), or — a model sharded over ranks that training left in its
  // shards — the shards (upload is then null).
  const Arena* upload = nullptr;
  ShardedModelIo* shards = nullptr;
  double sample_count = 0;  // FedAvg's weight
  TrainResult trained;      // losses, accuracies, DP steps and rate
  int64_t local_steps = 0;  // what the trip took (a DummyTrainer's as configured)
  bool has_epsilon = false;
  double epsilon = 0;  // DP-SGD: the client's ε over all its steps so far
};

class ClientDriver {
 public:
  // `parts` may be empty (a synthetic model: no data set). When
  // `record_privacy` is false the caller records DP-SGD's spending itself
  // (the simulator does so after each round, in client order, since its
  // workers finish in any order).
  // `keep_base` false: the caller still holds the model each trip started
  // from (the simulator's global model) and encodes a gradient_based change
  // against it itself, so the driver keeps no copy and sends the trained
  // model. Train may be called from several threads at once (the
  // simulator's workers), each with its own `model`.
  ClientDriver(const ExperimentConfig& cfg, std::string run_dir, const DatasetSplits* data,
               const std::vector<ClientPartition>& parts, bool record_privacy = true, bool keep_base = true);

  // Where a transport puts the next model for a client whose model is
  // sharded over ranks (num_gpus > 1): its shards; null when it has an arena.
  static ShardedModelIo* receive_shards(LocalModel& model);

  // `model` holds the model the server sent for `round` (for an
  // asynchronous trip: the global version, which repeats; `local_steps` > 0
  // is the trip's own step count, FedCompass). Trains client `client` on
  // it and returns what to send. The update's arena lives in `model` or in
  // this driver until the next call.
  StatusOr<TripUpdate> train(LocalModel& model, int client, int round, int local_steps = 0);

 private:
  const ExperimentConfig& cfg_;
  std::string run_dir_;
  const DatasetSplits* data_;
  const std::vector<ClientPartition>& parts_;
  bool record_privacy_, keep_base_;
  std::mutex mu_;                    // the per-client counters below
  std::map<int, int64_t> trips_;     // asynchronous: each trip trains with its own seed
  std::map<int, int64_t> dp_steps_;  // DP-SGD steps over every round, per client
  Arena base_;                       // gradient_based: the model received, then the change sent
};

}  // namespace memfl
