// Asynchronous aggregation rules, APPFL's names and keys: FedAsyncAggregator
// (Xie et al. 2019), FedBuffAggregator (Nguyen et al. 2022) and
// FedCompassAggregator (Li et al. 2023). The server keeps one global model
// and applies each client's update — or each buffer, or each arrival group —
// weighted by how stale it is, without holding a client's model in memory:
// an update is read block by block from where it waits (a spool file, or
// the sender's arena in a test).
//
//   α_i = alpha · s(τ_i) · w_i        τ_i: global versions since client i's base model
//                                      w_i: 1/num_clients (equal) or n_i/Σn (sample_size)
//   s(τ): constant 1 · polynomial (τ+1)^(−a) · hinge 1 if τ ≤ b else 1/(a(τ−b)+1)
//
//   FedAsync    x ← x + α(y − x)                      one update, version + 1
//   FedCompass  x ← x + Σ_i α_i (y_i − x)             a group at once, version + 1
//   FedBuff     Δ ← Δ + α(y − x) per update; after K: x ← x + Δ, version + 1
//   gradient_based: the update is g = x_base − y, and (y − x) above becomes −g.
//
// Only f32 tensors combine; a tensor of another float type is refused at
// construction, naming it. Non-float tensors (counters) take the newest
// contributing update's value (APPFL averages them in FedBuff and
// FedCompass; a step counter's mean has no meaning either way).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "comm/chunk.h"
#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

enum class StalenessKind { kConstant, kPolynomial, kHinge };

struct StalenessFn {
  StalenessKind kind = StalenessKind::kConstant;
  double a = 0.5, b = 4;
  double operator()(int64_t staleness) const;
};

// aggregator_kwargs.staleness_fn and staleness_fn_kwargs.{a,b}; an unknown
// name is an error naming the key.
StatusOr<StalenessFn> make_staleness_fn(const std::string& name, double a, double b);

enum class AsyncRule { kFedAsync, kFedBuff, kFedCompass };

struct AsyncAggregatorOptions {
  AsyncRule rule = AsyncRule::kFedAsync;
  double alpha = 0.9;
  StalenessFn staleness;
  int buffer_size = 3;  // FedBuff's K
  bool gradient_based = false;
  // Elements read and combined at a time (the memory it works in: two f32
  // blocks); any size gives the same model, bit for bit.
  size_t block_elements = 64 * 1024;
};

struct AsyncContribution {
  const UpdateSource* update = nullptr;
  double weight = 1;      // w_i
  int64_t staleness = 0;  // τ_i
};

class AsyncAggregator {
 public:
  // `name`: FedAsyncAggregator, FedBuffAggregator or FedCompassAggregator.
  // `make_state_arena` gives FedBuff its Δ (model-sized f32, file-backed
  // when the model is).
  static StatusOr<std::unique_ptr<AsyncAggregator>> create(
      const std::string& name, const AsyncAggregatorOptions& options, const Layout& layout,
      const std::function<StatusOr<Arena>(size_t bytes)>& make_state_arena);

  const std::string& name() const { return name_; }
  const AsyncAggregatorOptions& options() const { return options_; }
  double alpha_t(const AsyncContribution& c) const {
    return options_.alpha * options_.staleness(c.staleness) * c.weight;
  }

  // Applies `group` to `global` (FedAsync: one update; FedCompass: an
  // arrival group; FedBuff: each joins the buffer). Returns whether the
  // global model moved to a new version.
  StatusOr<bool> apply(Arena& global, std::span<const AsyncContribution> group);
  // FedBuff: updates in the buffer, not yet applied.
  int buffered() const { return buffered_; }
  // Bytes held between updates (FedBuff's Δ).
  size_t state_bytes() const { return step_.size(); }

 private:
  AsyncAggregator(std::string name, AsyncAggregatorOptions options, const Layout& layout, Arena step)
      : name_(std::move(name)), options_(options), layout_(layout), step_(std::move(step)) {}
  Status fold(Arena& global, std::span<const AsyncContribution> group, bool into_step);
  void flush(Arena& global);

  std::string name_;
  AsyncAggregatorOptions options_;
  const Layout& layout_;
  Arena step_;  // FedBuff's Δ, f32 at the layout's offsets
  int buffered_ = 0;
};

// Writes g = base − trained for f32 tensors (what a gradient_based client
// sends) and the trained bytes of the others, `block` elements at a time,
// through `write(offset, bytes)`.
Status write_gradient(const Layout& layout, const Arena& base, const Arena& trained, size_t block,
                      const std::function<Status(size_t offset, std::span<const std::byte>)>& write);

}  // namespace memfl
