// FedAvgAggregator: the weighted mean of client models (McMahan et al. 2017),
// computed as a running sum Σ wᵢ·xᵢ over chunks as they arrive, then divided
// by Σ wᵢ at finalize.
//
// Per dtype: f32, bf16 and f16 entries accumulate in f32 (4 bytes per element)
// and are rounded back to their dtype at finalize (round to nearest even);
// integer entries (i64/i32/u8, e.g. BatchNorm's num_batches_tracked)
// accumulate in f64 and are rounded to the nearest integer. So the state is
// 1× an f32 model, 2× a bf16 one.
//
// Weights (`client_weights_mode`): `equal` gives every client weight 1;
// `sample_size` weighs by the sample count the client reported.
//
// Chunks may be any size and cut elements anywhere: a stream keeps the bytes
// of an element split between two chunks (at most 7) until the rest arrives.
// Streams may be open concurrently; folding a chunk into the sum is serialised.
#pragma once

#include <mutex>
#include <vector>

#include "aggregate/aggregator.h"

namespace memfl {

enum class ClientWeightsMode { kEqual, kSampleSize };

class FedAvgAggregator final : public Aggregator {
 public:
  FedAvgAggregator(const Layout& layout, ClientWeightsMode mode);
  // The running sum lives in `in_place` (the server's global arena) instead
  // of an arena of its own, so the server holds one model-sized buffer. Only
  // possible when every accumulator element is as wide as its model element
  // (f32 and i64 entries); see sums_in_place(). The caller must have finished
  // broadcasting `in_place` before begin_round(), which zeroes it, and keeps
  // the pre-round checkpoint as the undo.
  FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena& in_place);
  // Whether a layout's running sum can share the model's bytes.
  static bool can_sum_in_place(const Layout& layout);
  bool sums_in_place() const { return in_place_ != nullptr; }
  std::string_view name() const override { return "FedAvgAggregator"; }
  Status begin_round(int round) override;
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override;
  Status finalize(Arena& global) override;
  int num_committed() const override;
  size_t state_bytes() const override { return sum_.size(); }
  // Whether a stream broke after some of its bytes were folded this round.
  bool tainted() const;

 private:
  class Stream;
  friend class Stream;
  // Folds `payload` (model bytes starting at `offset`, whole elements only
  // or the tail/head of one) into the sum with weight `w`.
  void fold(size_t offset, std::span<const std::byte> payload, double w, std::byte* carry);
  void fold_elements(const LayoutEntry& e, size_t acc_offset, size_t first, const std::byte* src, size_t count,
                     double w);

  const Layout& layout_;
  ClientWeightsMode mode_;
  std::byte* acc(size_t offset) { return (in_place_ != nullptr ? in_place_->data() : sum_.data()) + offset; }
  std::vector<size_t> acc_offsets_;  // per entry, byte offset into the sum
  Arena sum_;
  Arena* in_place_ = nullptr;
  mutable std::mutex mu_;
  int round_ = -1;
  double total_weight_ = 0;
  int committed_ = 0;
  int open_streams_ = 0;
  std::string tainted_by_;  // client whose stream broke after bytes were counted
};

}  // namespace memfl
