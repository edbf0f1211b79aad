#include "client/client_driver.h"

#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "client/prefetching_place.h"
#include "compress/update_encoder.h"
#include "secagg/masking_place.h"

namespace memfl {

UpdateReport trip_report(const TripUpdate& up) {
  UpdateReport r;
  r.sample_count = up.sample_count;
  r.train_loss = up.trained.train_loss;
  r.train_accuracy = up.trained.train_accuracy;
  if (up.trained.has_validation && up.trained.val_samples > 0) {
    r.val_samples = up.trained.val_samples;
    r.val_loss = up.trained.val_loss;
    r.val_accuracy = up.trained.val_accuracy;
  }
  r.local_steps = up.local_steps;
  r.dp_steps = up.trained.dp_steps;
  r.dp_sample_rate = up.trained.dp_sample_rate;
  r.has_epsilon = up.has_epsilon;
  r.epsilon = up.epsilon;
  return r;
}


ClientDriver::ClientDriver(const ExperimentConfig& cfg, std::string run_dir, const DatasetSplits* data,
                           const std::vector<ClientPartition>& parts, bool record_privacy, bool keep_base)
    : cfg_(cfg),
      run_dir_(std::move(run_dir)),
      data_(data),
      parts_(parts),
      record_privacy_(record_privacy),
      keep_base_(keep_base),
      compression_(compression_settings(cfg)) {
  if (compression_.enabled) spdlog::info("client updates compressed: {}", describe_compression(compression_));
}

StatusOr<std::unique_ptr<ModelPlace>> ClientDriver::upload_place(const TripUpdate& up, int client, const Arena* base) {
  std::unique_ptr<ModelPlace> raw;
  if (up.shards != nullptr) {
    raw = std::make_unique<ShardsPlace>(*up.shards);
  } else {
    raw = std::make_unique<ArenaPlace>(*up.upload);
  }
  if (cfg_.secagg.enable) {
    SecAggClient* keys = secagg_.client(client);
    if (keys == nullptr) {
      return failed_precondition("client_{}: no secure aggregation keys for this round (it missed the key exchange)",
                                 client);
    }
    auto masked = std::make_unique<MaskingPlace>(std::move(raw), *up.layout, *keys);
    // `equal` weights: every client the full weight (ratio 1).
    const double weight = cfg_.server.client_weights_mode == "equal" ? cfg_.secagg.max_weight : up.sample_count;
    MEMFL_RETURN_IF_ERROR(masked->begin(weight));
    return std::unique_ptr<ModelPlace>(std::move(masked));
  }
  if (!compression_.enabled) return raw;
  const Layout& layout = *up.layout;
  Arena* residual = nullptr;
  if (compression_.error_feedback) {
    std::lock_guard lock(mu_);
    auto it = residuals_.find(client);
    if (it == residuals_.end()) {
      // Zeros at first; model-sized, file-backed when the model is.
      MEMFL_ASSIGN_OR_RETURN(Arena r,
                             make_model_arena(cfg_, layout.total_bytes(), run_dir_, MemoryCategory::kCommBuffers));
      it = residuals_.emplace(client, std::move(r)).first;
    }
    residual = &it->second;
  }
  auto framed = std::make_unique<EncodingPlace>(std::move(raw), layout, compression_, fmt::format("client_{}", client));
  MEMFL_RETURN_IF_ERROR(framed->begin(base, residual));
  // The next frame is coded while the transport sends this one.
  return std::unique_ptr<ModelPlace>(std::make_unique<PrefetchingPlace>(std::move(framed), layout.total_bytes()));
}

ShardedModelIo* ClientDriver::receive_shards(LocalModel& model) {
  return model.replica() != nullptr ? model.replica()->sharded_io() : nullptr;
}

StatusOr<TripUpdate> ClientDriver::train(LocalModel& model, int client, int round, int local_steps,
                                         const Arena* received) {
  const Layout& layout = model.layout();
  const ClientPartition* part = parts_.empty() ? nullptr : &parts_[static_cast<size_t>(client)];
  // Asynchronous: the round is the model's version, which repeats; each trip
  // trains with its own seed (its number, as in the simulator), for the
  // steps the server gave (FedCompass), and a gradient_based update is the
  // change from the model received (one more model here).
  const bool async = cfg_.server.is_async();
  const ExperimentConfig trip_cfg = with_local_steps(cfg_, async ? local_steps : 0);
  const bool send_change = async && cfg_.server.gradient_based && keep_base_;
  if (send_change) keep_base(layout, base_, model.arena());
  // Lossy compression sends the change from the model received: keep it
  // (one more model here) unless the caller does.
  const bool keep_for_deltas = !async && keep_base_ && compression_.enabled && compression_.lossy != Lossy::kNone;
  const Arena* delta_base = received;
  if (keep_for_deltas && delta_base == nullptr) {
    if (base_.empty()) {
      // File-backed when the model is: an LLM client keeps its base on disk.
      MEMFL_ASSIGN_OR_RETURN(base_,
                             make_model_arena(cfg_, layout.total_bytes(), run_dir_, MemoryCategory::kCommBuffers));
    }
    // A base that received this round's model (lossy broadcast) holds it already.
    if (!std::exchange(base_is_received_, false)) keep_base(layout, base_, model.arena());
    delta_base = &base_;
  }
  int seed_round = round;
  if (async) {
    std::lock_guard lock(mu_);
    seed_round = static_cast<int>(++trips_[client]);
  }
  TripUpdate up;
  MEMFL_ASSIGN_OR_RETURN(up.trained, local_update(model, trip_cfg, data_, part, seed_round, client));
  // Anything that asked for the arena while training (gradient_based's base,
  // dp_fedavg's clip) gathered a sharded model into it: then send from it.
  up.shards = receive_shards(model);
  up.upload = up.shards != nullptr ? nullptr : &model.arena();
  if (send_change) {
    MEMFL_RETURN_IF_ERROR(change_from_base(layout, base_, model.arena()));
    up.upload = &base_;
    up.shards = nullptr;
  }
  up.layout = &layout;
  if (keep_for_deltas) up.delta_base = delta_base;
  up.local_steps = local_steps_taken(trip_cfg.train, part, up.trained.num_steps);
  up.sample_count = update_sample_count(cfg_, part, client);
  if (cfg_.train.dp.enabled && record_privacy_) {
    std::lock_guard lock(mu_);
    const int64_t steps = dp_steps_[client] += up.trained.dp_steps;
    MEMFL_ASSIGN_OR_RETURN(up.epsilon,
                           record_client_privacy(cfg_, run_dir_, round, client, steps, up.trained.dp_sample_rate));
    up.has_epsilon = true;
  }
  return up;
}

}  // namespace memfl

namespace memfl {

StatusOr<bool> ClientDriver::play_round(ClientTransport& transport, LocalModel& model, Arena* round_model,
                                        MemorySampler* sampler) {
  auto mark = [&](int round, const char* phase) {
    if (sampler != nullptr) sampler->mark(round, phase);
  };
  MEMFL_ASSIGN_OR_RETURN(RoundOffer offer, transport.next_round());
  if (offer.finished()) return true;
  const int round = offer.round;
  mark(round, "broadcast");
  // A model sharded over ranks takes each chunk straight into its shards;
  // several clients start from a copy kept aside (gathered anyway).
  if (ShardedModelIo* shards = round_model == nullptr ? receive_shards(model) : nullptr) {
    ShardsPlace into(*shards);
    MEMFL_RETURN_IF_ERROR(transport.receive(into));
  } else if (round_model == nullptr && compression_.lossy_broadcast) {
    // The broadcast may come as the change from the model received last
    // round: that model stays in the base kept for lossy deltas, where the
    // new one is rebuilt, then copied to be trained.
    if (base_.empty()) {
      MEMFL_ASSIGN_OR_RETURN(
          base_, make_model_arena(cfg_, model.layout().total_bytes(), run_dir_, MemoryCategory::kCommBuffers));
    }
    ArenaPlace into(base_, /*keeps_received_model=*/true);
    MEMFL_RETURN_IF_ERROR(transport.receive(into));
    std::memcpy(model.arena().data(), base_.data(), model.layout().total_bytes());
    base_is_received_ = true;
  } else {
    ArenaPlace into(round_model != nullptr ? *round_model : model.arena());
    MEMFL_RETURN_IF_ERROR(transport.receive(into));
  }
  // Secure aggregation: the keys are exchanged before training, so that
  // the update can be masked as it leaves.
  if (cfg_.secagg.enable) {
    mark(round, "secagg_keys");
    MEMFL_ASSIGN_OR_RETURN(bool over, serve_secure_aggregation(transport, offer.clients, SecAggStage::kDeliverShares));
    // Ended before its keys were in (the server gave up on the round):
    // there is nothing to mask an update with.
    if (over) return false;
  }
  for (int c : offer.clients) {
    if (round_model != nullptr) std::memcpy(model.arena().data(), round_model->data(), model.layout().total_bytes());
    mark(round, "train");
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, train(model, c, round, offer.local_steps, round_model));
    mark(round, "upload");
    UpdateMeta meta{
        .round = round, .client = c, .sample_count = up.sample_count, .metrics = encode_update_report(trip_report(up))};
    MEMFL_ASSIGN_OR_RETURN(std::unique_ptr<ModelPlace> from, upload_place(up, c, up.delta_base));
    MEMFL_RETURN_IF_ERROR(transport.send(meta, *from));
  }
  if (cfg_.secagg.enable) {
    // The server unmasks the sum once every upload is in; the client
    // listens until it says the round is over, so no transport needs to
    // know which of its clients will be asked for shares.
    mark(round, "secagg_unmask");
    MEMFL_RETURN_IF_ERROR(serve_secure_aggregation(transport, offer.clients, SecAggStage::kRoundOver).status());
  }
  mark(round, "idle");
  return false;
}

StatusOr<bool> ClientDriver::serve_secure_aggregation(ClientTransport& transport, const std::vector<int>& clients,
                                                      SecAggStage until) {
  const std::string peer = std::string(transport.name()) + " server";
  // A process that plays several clients answers `until` once for each.
  size_t answered = 0;
  while (until == SecAggStage::kRoundOver || answered < clients.size()) {
    MEMFL_ASSIGN_OR_RETURN(std::string request, transport.next_secagg_request());
    SecAggStage stage = SecAggStage::kRoundOver;
    MEMFL_ASSIGN_OR_RETURN(std::string reply, serve_secagg_request(secagg_, request, peer, clients, &stage));
    if (stage == SecAggStage::kRoundOver) return true;
    MEMFL_RETURN_IF_ERROR(transport.send_secagg_reply(std::move(reply)));
    if (stage == until) ++answered;
  }
  return false;
}

StatusOr<int> ClientDriver::run(ClientTransport& transport, LocalModel& model, const ClientRunOptions& options) {
  Arena round_model;
  if (options.clients_per_process > 1) {
    MEMFL_ASSIGN_OR_RETURN(
        round_model, make_model_arena(cfg_, model.layout().total_bytes(), run_dir_, MemoryCategory::kCommBuffers));
  }
  int rounds = 0;
  while (true) {
    auto finished =
        play_round(transport, model, options.clients_per_process > 1 ? &round_model : nullptr, options.sampler);
    if (finished.ok()) {
      if (*finished) return rounds;
      ++rounds;
      continue;
    }
    MEMFL_RETURN_IF_ERROR(transport.recover(finished.status()));
  }
}

}  // namespace memfl
