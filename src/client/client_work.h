// What every role that holds a model shares, whatever the transport: loading
// the data set and a client's partition, building the model (a registry model
// through the libtorch plugin, or a synthetic layout without it), and the
// local training step with its seed. The in-process simulation, the gRPC
// client and the gRPC server all go through here, so the same seed gives the
// same model on every transport.
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "data/dataset.h"
#include "data/experiment_data.h"
#include "data/partition.h"
#include "train/trainer_backend.h"

namespace memfl {

// A role's model: the arena and its layout, and the libtorch replica behind
// them when the model is a network.
class LocalModel {
 public:
  const Layout& layout() const { return replica_ ? replica_->layout() : layout_; }
  Arena& arena() { return replica_ ? replica_->arena() : arena_; }
  ModelReplica* replica() { return replica_.get(); }
  // A model with no network behind it: a layout and the arena holding it.
  static LocalModel from_arena(Layout layout, Arena arena);
  // Swaps in another arena of the same layout (a file-backed server moves to
  // the next round's checkpoint file). Only for models without a network.
  void replace_arena(Arena&& arena);

 private:
  friend StatusOr<LocalModel> make_local_model(const ExperimentConfig&, const InputSpec&, bool, uint64_t,
                                               const std::string&);
  std::unique_ptr<ModelReplica> replica_;
  Layout layout_;
  Arena arena_;
};

// Whether the model is described without a network and nothing trains it
// (synthetic models, llama specs under DummyTrainer): no data set, no libtorch.
bool is_spec_only(const ExperimentConfig& cfg);
// A model-sized arena where memory_configs.arena_backing says: anonymous
// memory, or a scratch file in memory_configs.scratch_dir (else `run_dir`).
StatusOr<Arena> make_model_arena(const ExperimentConfig& cfg, size_t bytes, const std::string& run_dir,
                                 MemoryCategory category = MemoryCategory::kModel);
// The initial weights of a model described without a network: with LoRA
// the adapters (train_configs.lora.init_adapters, else A drawn from the
// seed and B zero); model_configs.hf_checkpoint's or initial_model's
// weights when set; else synthetic (seeded).
Status fill_initial_model(const ModelConfig& model, const Layout& layout, Arena& arena, uint64_t seed);

// Builds the model. `fill` asks a synthetic model for seeded values (the
// initial global model); a receiver leaves it zero, to be overwritten.
// A file-backed spec-only model lives in a scratch file of `run_dir` unless
// memory_configs.scratch_dir names another place.
StatusOr<LocalModel> make_local_model(const ExperimentConfig& cfg, const InputSpec& input, bool fill, uint64_t seed,
                                      const std::string& run_dir = {});

// The seed of client `client`'s local training in `round`.
uint64_t client_train_seed(uint64_t seed, int round, int client);

// One local update: VanillaTrainer trains the replica in place; DummyTrainer
// leaves the model as received (it measures transfers, not learning).
StatusOr<TrainResult> local_update(LocalModel& model, const ExperimentConfig& cfg, const DatasetSplits* data,
                                   const ClientPartition* part, int round, int client);

// DP-SGD: appends (round, client, steps so far, q, δ, ε) to
// `run_dir`/privacy.csv (header first) and returns the client's ε over all
// its steps so far; every transport's client calls it after local_update.
StatusOr<double> record_client_privacy(const ExperimentConfig& cfg, const std::string& run_dir, int round, int client,
                                       int64_t total_steps, double sample_rate);

// The local steps a trip took: what the trainer reports, or — DummyTrainer
// takes none — the steps a trainer would have taken (train_configs' mode).
int64_t local_steps_taken(const TrainConfig& train, const ClientPartition* part, int64_t reported);

// Asynchronous, gradient_based: a client sends g = x_base − y, the change
// from the model it received. keep_base copies the received model into
// `base` (allocated on first use: one more model on the client);
// change_from_base then turns it into g, `trained` being y.
void keep_base(const Layout& layout, Arena& base, const Arena& received);
Status change_from_base(const Layout& layout, Arena& base, const Arena& trained);

// The config a trip trains by: `local_steps` > 0 (FedCompass gives each
// trip its own) makes it that many steps; 0 leaves train_configs as they are.
ExperimentConfig with_local_steps(const ExperimentConfig& cfg, int local_steps);

// The sample count client `client` reports with its update (FedAvg's weight).
double update_sample_count(const ExperimentConfig& cfg, const ClientPartition* part, int client);

// DummyTrainer's local update: waits train_configs.dummy_delay_s, then (with
// dummy_update_scale s > 0) adds s·(client+1)·(1 + (i + round) mod 5) to float
// element i of every tensor, so updates differ per client and round.
// With dummy_update_noise ν > 0 each element's change also gets s·ν·z, z a
// standard normal drawn from a counter of (round, client, tensor, element) —
// or, with dummy_update_noise_values, one of that file's values (standardised)
// picked by the same counter. An unreadable or unusable file is an error
// naming the key and the file.
Status dummy_update(const ExperimentConfig& cfg, const Layout& layout, Arena& arena, int round, int client);

}  // namespace memfl
