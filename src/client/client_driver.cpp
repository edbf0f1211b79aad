#include "client/client_driver.h"

namespace memfl {

ClientDriver::ClientDriver(const ExperimentConfig& cfg, std::string run_dir, const DatasetSplits* data,
                           const std::vector<ClientPartition>& parts, bool record_privacy, bool keep_base)
    : cfg_(cfg),
      run_dir_(std::move(run_dir)),
      data_(data),
      parts_(parts),
      record_privacy_(record_privacy),
      keep_base_(keep_base) {}

ShardedModelIo* ClientDriver::receive_shards(LocalModel& model) {
  return model.replica() != nullptr ? model.replica()->sharded_io() : nullptr;
}

StatusOr<TripUpdate> ClientDriver::train(LocalModel& model, int client, int round, int local_steps) {
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
