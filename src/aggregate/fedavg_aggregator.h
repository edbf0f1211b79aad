// FedAvgAggregator: the weighted mean of client models (McMahan et al. 2017),
// computed as a running sum Σ wᵢ·xᵢ over chunks as they arrive, then divided
// by Σ wᵢ at finalize.
//
// Per dtype, with the default running sum (Accumulation::kSum): f32, bf16
// and f16 entries accumulate in f32 (4 bytes per element) and are rounded
// back to their dtype at finalize (round to nearest even); integer entries
// (i64/i32/u8, e.g. BatchNorm's num_batches_tracked) accumulate in f64 and are
// rounded to the nearest integer. So the state is 1× an f32 model, 2× a bf16
// one.
//
// Accumulation::kRunningMean keeps the state in the model's own bytes, for
// LLM-sized bf16/f16 models where 2× does not fit: after the k-th update
// (weight w_k, W_k = w_1 + … + w_k) each element is m ← m + (w_k / W_k)·(x_k − m),
// computed in f32 (f64 for integers) and rounded once to the dtype. The first
// update is copied exactly; two bf16 updates of equal weight give the
// correctly rounded mean (x₁ + x₂ fits in f32 exactly); N updates are within
// (N − 1)/2 units in the last place of the largest input (half an ulp per
// rounding after the first, exact, update; tested). Updates fold one after
// another in fold order (below), which fixes each one's share.
//
// Weights (`client_weights_mode`): `equal` gives every client weight 1;
// `sample_size` weighs by the sample count the client reported.
//
// Chunks may be any size and cut elements anywhere: a stream keeps the bytes
// of an element split between two chunks (at most 7) until the rest arrives.
//
// Order. Float addition is not associative, so the sum depends on the order
// updates fold in. The aggregator fixes that order — the round's fold order
// given to begin_round (the selected clients, in client order), or the order
// updates were opened in when none is given — and never makes an upload wait
// for it: an update whose turn has come folds chunk by chunk as it arrives;
// one that arrives early is *parked*: its verified chunks are written to an
// unnamed spool file (O_TMPFILE in `spool_dir`, page cache, not anonymous
// memory), and fold from there, 4 MiB at a time, when its turn comes (or
// straight away from the point its turn comes, if it is still arriving).
// So the result is bit-identical whatever the arrival order and the
// transport. Cost: a parked update is written and read once more (disk
// space ≤ (clients − 1) × model in the worst case, given back slot by slot
// as each folds); memory: one 4 MiB block while a parked update folds. A
// parked update that breaks never touched the sum: it is simply out, where a
// live one that breaks after folding bytes taints the round (redo).
// Streams may be open concurrently; folding into the sum is serialised.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "aggregate/aggregator.h"
#include "io/spool_file.h"

namespace memfl {

enum class ClientWeightsMode { kEqual, kSampleSize };
enum class Accumulation { kSum, kRunningMean };

class FedAvgAggregator final : public Aggregator {
 public:
  FedAvgAggregator(const Layout& layout, ClientWeightsMode mode);
  // The running sum lives in `in_place` (the server's global arena) instead
  // of an arena of its own, so the server holds one model-sized buffer. Only
  // possible when every accumulator element is as wide as its model element
  // (f32 and i64 entries); see sums_in_place(). The caller must have finished
  // broadcasting `in_place` before begin_round() (the round's first update
  // overwrites it), and keeps the pre-round checkpoint as the undo.
  FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena& in_place,
                   Accumulation accumulation = Accumulation::kSum);
  // The sum in `sum_storage` (e.g. a file-backed arena) instead of memory.
  FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena&& sum_storage);
  ~FedAvgAggregator() override;
  // Size of the f32/f64 running sum of `layout` (what sum_storage must hold).
  static size_t sum_bytes(const Layout& layout);
  // Points the in-place state at another model-sized arena (a file-backed
  // server folds each round into the next checkpoint's file). Only between
  // rounds.
  Status retarget(Arena& in_place) override;
  Accumulation accumulation() const { return accumulation_; }
  // Whether a layout's running sum can share the model's bytes.
  static bool can_sum_in_place(const Layout& layout);
  bool sums_in_place() const override { return in_place_ != nullptr; }
  std::string_view name() const override { return "FedAvgAggregator"; }
  // Where parked updates are spooled (default: the system's temp directory).
  void set_spool_dir(std::string dir) override { spool_dir_ = std::move(dir); }
  Status begin_round(int round, std::vector<std::string> fold_order = {}) override;
  Status withdraw(const std::string& client_id) override;
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override;
  Status finalize(Arena& global) override;
  int num_committed() const override;
  size_t state_bytes() const override { return sum_.size(); }
  // One 4 MiB block while a parked update folds from the spool.
  size_t working_bytes() const override { return kSpoolBlock; }
  static constexpr size_t kSpoolBlock = 4 << 20;
  // Whether a stream broke after some of its bytes were folded this round.
  bool tainted() const;

 private:
  class Stream;
  friend class Stream;
  enum class SlotState { kPending, kOpen, kLive, kParked, kCommittedParked, kFolded, kOut };
  // How long a live stream may go without a chunk and still count as
  // streaming (an early update holds its first chunk meanwhile, see accept).
  static constexpr std::chrono::milliseconds kLiveIdle{20};
  // Called with mu_ held: the update whose turn it is received a chunk
  // within kLiveIdle.
  bool live_streaming_locked() const;
  // One place in the round's fold order.
  struct Slot {
    std::string client_id;
    SlotState state = SlotState::kPending;
    double weight = 0;       // wᵢ
    double fold_weight = 0;  // what it folds with (wᵢ, or wᵢ/Wᵢ for a running mean)
    bool folded_any = false;
    // The round's first update to fold writes the sum (w·x) instead of
    // adding to it: no zeroing pass over the sum, no read of it.
    bool writes_sum = false;
  };
  // Called with mu_ held: the update in `slot` starts folding; the first
  // `parked_bytes` of it come from the spool.
  Status start_folding_locked(size_t slot, uint64_t parked_bytes, std::byte* carry);
  // Moves the cursor past every update that is done, folding the parked ones.
  Status advance_locked();
  Status park(size_t slot, uint64_t offset, Payload payload, const std::string& client_id);
  void spool_release_locked(size_t slot);
  // Folds `payload` (model bytes starting at `offset`, whole elements only
  // or the tail/head of one) into the sum with weight `w`.
  // With `write`, the sum's elements are set (w·x + 0, the same bits as
  // adding w·x to a zeroed sum, signed zeros included) instead of added to.
  void fold(size_t offset, std::span<const std::byte> payload, double w, bool write, std::byte* carry);
  void fold_elements(const LayoutEntry& e, size_t acc_offset, size_t first, const std::byte* src, size_t count,
                     double w, bool write);
  // kRunningMean: m ← m + f·(x − m) in the model's dtype (f = 1 copies).
  void mean_elements(const LayoutEntry& e, size_t first, const std::byte* src, size_t count, double f);

  const Layout& layout_;
  ClientWeightsMode mode_;
  std::byte* acc(size_t offset) { return (in_place_ != nullptr ? in_place_->data() : sum_.data()) + offset; }
  std::vector<size_t> acc_offsets_;  // per entry, byte offset into the sum
  Arena sum_;
  Arena* in_place_ = nullptr;
  Accumulation accumulation_ = Accumulation::kSum;
  double mean_weight_ = 0;  // kRunningMean: W of the updates that have folded
  // kSum: no update has started folding this round; the sum holds whatever
  // it held (the last model, in place), not zeros.
  bool sum_unwritten_ = true;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  bool ordered_ = false;
  std::atomic<size_t> cursor_{0};    // the slot whose turn it is to fold
  std::condition_variable turn_cv_;  // the cursor moved
  std::chrono::steady_clock::time_point last_live_fold_;
  std::unique_ptr<SpoolFile> spool_;
  std::string spool_dir_;
  int round_ = -1;
  double total_weight_ = 0;
  int committed_ = 0;
  int open_streams_ = 0;
  std::string tainted_by_;  // client whose stream broke after bytes were counted
};

}  // namespace memfl
