// ClientDriver: a client's side of a run, written once for every transport
// — the mirror of the server's RoundDriver. run() plays the rounds over a
// ClientTransport (comm/client_transport.h: gRPC for the C++ client, MPI for
// the client ranks; the Python client drives the same gRPC transport with
// its own tensors): next round → receive (checked chunks into the arena or
// the shards) → train() each of the round's clients → send. The simulator,
// whose transport is memory, calls train() from its workers. train():
//
//   received → [async, gradient_based: keep the base] → local training
//   (TrainerBackend; a non-finite loss refuses the update) → privacy record
//   (DP-SGD: privacy.csv) → encode (the change from the base when
//   gradient_based) → what to send (TripUpdate) → upload_place (compressed
//   frames when compressor_configs say so)
//
// The stages that act on every client's update (compression, secure
// aggregation masks) belong in encode, here, once.
//
//   ClientDriver driver(cfg, run_dir, data ? &*data : nullptr, parts);
//   MEMFL_ASSIGN_OR_RETURN(int rounds, driver.run(transport, model, {.sampler = &sampler}));
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "client/client_work.h"
#include "comm/client_transport.h"
#include "comm/update_report.h"
#include "compress/settings.h"
#include "memory/sampler.h"
#include "secagg/channel.h"
#include "secagg/wire.h"

namespace memfl {

// What one trip sends, and what the server is told with it.
struct TripUpdate {
  // The bytes to send: an arena (the trained model, or its change from the
  // base), or — a model sharded over ranks that training left in its
  // shards — the shards (upload is then null).
  Arena* upload = nullptr;
  ShardedModelIo* shards = nullptr;
  // The model the trip started from, kept for lossy compression's deltas
  // (null: none kept — the update is a change already, or no lossy codec).
  const Arena* delta_base = nullptr;
  const Layout* layout = nullptr;  // the model's
  double sample_count = 0;         // FedAvg's weight
  TrainResult trained;             // losses, accuracies, DP steps and rate
  int64_t local_steps = 0;         // what the trip took (a DummyTrainer's as configured)
  bool has_epsilon = false;
  double epsilon = 0;  // DP-SGD: the client's ε over all its steps so far
};

// What a trip reports with its update (comm/update_report.h): the same
// numbers from every transport's client, the simulator's included.
UpdateReport trip_report(const TripUpdate& up);

struct ClientRunOptions {
  MemorySampler* sampler = nullptr;  // phase marks (broadcast, train, upload, idle); may be null
  // More than one client in this process (an MPI rank's virtual clients):
  // the round's model is kept aside and each client starts from it.
  int clients_per_process = 1;
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
  // `received`: the model the trip started from when the caller keeps it
  // anyway (an MPI rank's round model), so that no copy is made for
  // compression's deltas.
  StatusOr<TripUpdate> train(LocalModel& model, int client, int round, int local_steps = 0,
                             const Arena* received = nullptr);

  // Where `up` is sent from: its arena or shards, or — compressor_configs'
  // enable_compression — its frames (compress/update_encoder.h), lossy
  // tensors as their change from `base` (null: from zero), with client
  // `client`'s error-feedback residual added and kept.
  // With server_configs.secure_aggregation.enable the place sends masked
  // words instead (secagg/masking_place.h), with the keys this client made
  // in the round's key exchange.
  StatusOr<std::unique_ptr<ModelPlace>> upload_place(const TripUpdate& up, int client, const Arena* base);

  // Secure aggregation's client stages for the clients this process plays
  // (null when off): what a transport hands the server's key exchange.
  SecAggChannel* secure_aggregation() { return cfg_.secagg.enable ? &secagg_ : nullptr; }

  // Plays rounds over `transport` until the server says the run is over;
  // a round that fails is handed to transport.recover (a new session, or
  // the error that ends the client). Returns the rounds played. Does not
  // close the transport: the caller does, once its outputs are written.
  StatusOr<int> run(ClientTransport& transport, LocalModel& model, const ClientRunOptions& options);

 private:
  const ExperimentConfig& cfg_;
  std::string run_dir_;
  const DatasetSplits* data_;
  const std::vector<ClientPartition>& parts_;
  bool record_privacy_, keep_base_;
  bool base_is_received_ = false;    // base_ holds this round's model as received
  std::mutex mu_;                    // the per-client counters below
  std::map<int, int64_t> trips_;     // asynchronous: each trip trains with its own seed
  std::map<int, int64_t> dp_steps_;  // DP-SGD steps over every round, per client
  Arena base_;                       // gradient_based: the model received, then the change sent;
                                     // lossy compression: the model received
  CompressionSettings compression_;
  std::map<int, Arena> residuals_;  // error feedback: one per client this process plays
  SecAggClientStages secagg_;       // secure aggregation: each client's keys for the round

  // Answers the server's secure-aggregation requests for `clients` over
  // `transport` until `until` is answered for each of them, or (`until` =
  // kRoundOver) until the server says the round's stages are over; true
  // when it said so.
  StatusOr<bool> serve_secure_aggregation(ClientTransport& transport, const std::vector<int>& clients,
                                          SecAggStage until);
  // One round; true when the server said the run is over.
  StatusOr<bool> play_round(ClientTransport& transport, LocalModel& model, Arena* round_model, MemorySampler* sampler);
};

}  // namespace memfl
