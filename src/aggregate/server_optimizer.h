// Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization";
// FedAvgM: Hsu et al. 2019), with APPFL's names and keys. The round's
// client models are averaged exactly as FedAvg does — streamed, folded in
// client order, parked when early (FedAvgAggregator does it) — and then the
// optimizer steps chunk by chunk over the model:
//
//   Δ = x̄ − x              (x̄: weighted mean of client models, x: the
//                            pre-round global model, read from the
//                            committed checkpoint file, not a second copy)
//   FedAvgM:   m ← β1·m + Δ;                        x ← x + η·m
//   FedAdagrad m ← β1·m + (1−β1)·Δ;  v ← v + Δ²;    x ← x + η·m / (√v + τ)
//   FedAdam    m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;        (same)
//   FedYogi    m ← β1·m + (1−β1)·Δ;  v ← v − (1−β2)·Δ²·sign(v − Δ²); (same)
//
// m and v start at 0 and carry no bias correction, as in APPFL. They live
// in arenas of the model's size (file-backed when the model is) and are
// committed with the server's state every round, so --resume continues them.
// Only f32 tensors step; integer ones (counters) take the mean; a model with
// bf16/f16 tensors is refused (registry).
#pragma once

#include <memory>
#include <string>

#include "aggregate/aggregator.h"
#include "aggregate/fedavg_aggregator.h"

namespace memfl {

enum class ServerOptKind { kAvgM, kAdagrad, kAdam, kYogi };

struct ServerOptParams {
  double lr = 1.0;      // server_learning_rate (η)
  double beta1 = 0.9;   // server_momentum_param_1
  double beta2 = 0.99;  // server_momentum_param_2
  double tau = 1e-3;    // server_adapt_param
};

// One step over n elements: `x` holds the mean x̄ on entry and the new
// global model on return; `prev` is the pre-round model; `m`, `v` the
// moments (v unused by FedAvgM).
void server_opt_step(ServerOptKind kind, const ServerOptParams& p, float* x, const float* prev, float* m, float* v,
                     size_t n);

class ServerOptAggregator final : public Aggregator {
 public:
  // `inner` averages; `previous_model` names the file holding the pre-round
  // global model when finalize runs (the committed checkpoint).
  ServerOptAggregator(std::string name, ServerOptKind kind, ServerOptParams params, std::unique_ptr<Aggregator> inner,
                      const Layout& layout, Arena m, Arena v, std::string previous_model);

  std::string_view name() const override { return name_; }
  Status begin_round(int round, std::vector<std::string> fold_order) override {
    return inner_->begin_round(round, std::move(fold_order));
  }
  Status withdraw(const std::string& client_id) override { return inner_->withdraw(client_id); }
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override {
    return inner_->open_update(client_id, sample_count);
  }
  StatusOr<std::unique_ptr<UpdateStream>> open_local_update(const std::string& client_id,
                                                            double sample_count) override {
    return inner_->open_local_update(client_id, sample_count);
  }
  Status finalize(Arena& global) override;
  int num_committed() const override { return inner_->num_committed(); }
  size_t state_bytes() const override;
  uint64_t saved_state_bytes() const override { return m_.size() + v_.size(); }
  size_t working_bytes() const override { return inner_->working_bytes(); }
  bool sums_in_place() const override { return inner_->sums_in_place(); }
  Status retarget(Arena& in_place) override { return inner_->retarget(in_place); }
  // The mean the inner aggregator writes is this one's input; its moments
  // (m_, v_) are kept apart.
  std::span<std::byte> idle_state_bytes() override { return inner_->idle_state_bytes(); }
  void set_spool_dir(std::string dir) override { inner_->set_spool_dir(std::move(dir)); }
  Status save_state(const std::string& state_dir, int round, std::string* record) override;
  Status load_state(const std::string& state_dir, const std::string& record) override;

 private:
  std::string name_;
  ServerOptKind kind_;
  ServerOptParams params_;
  std::unique_ptr<Aggregator> inner_;
  const Layout& layout_;
  Arena m_, v_;  // f32 per model element, at the layout's offsets
  std::string previous_model_;
};

}  // namespace memfl
