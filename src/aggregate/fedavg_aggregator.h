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
// long for it. The update whose turn it is folds chunk by chunk as it
// arrives; an update that streams while every update before it in fold
// order has folded, is out, or streams too, *trails* them: it folds a range
// of the model once each of them has folded that range, on its own
// transport thread, so N concurrent uploads fold at once rather than one
// after another (gRPC, 1 GiB × 4 clients: 1.17 → 2.32 GB/s up). One that
// cannot trail — an update before it is not in yet, or has paused for
// live_idle (kLiveIdle, 20 ms) — is *parked*: its verified chunks are
// written to an unnamed spool file (O_TMPFILE in `spool_dir`, page cache,
// not anonymous memory), and fold from there, 4 MiB at a time, when its
// turn comes or as soon as the updates before it stream again and have
// folded past what it parked (it then trails them). A stream fed by the
// thread that would wait for it never counts as streaming, so a caller that
// feeds several streams in turn from one thread never blocks on itself; an
// update whose chunk's range every update ahead of it has folded folds it at
// once, so such a caller that feeds them chunk by chunk in fold order parks
// nothing (MPI's ring: ServerStreams::receive_updates).
// So the result is bit-identical whatever the arrival order and the
// transport. Cost: a parked update is written and read once more (disk
// space ≤ (clients − 1) × model in the worst case, given back slot by slot
// as each folds); memory: one 4 MiB block while a parked update folds. A
// parked update that breaks never touched the sum: it is simply out, where
// one that breaks after folding bytes taints the round (redo).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  // Its own sum, when that sum is a plain sum at the model's offsets (every
  // entry f32): the round's first update writes it (write_sum), never reads.
  std::span<std::byte> idle_state_bytes() override;
  std::string_view name() const override { return "FedAvgAggregator"; }
  // Where parked updates are spooled (default: the system's temp directory).
  void set_spool_dir(std::string dir) override { spool_dir_ = std::move(dir); }
  Status begin_round(int round, std::vector<std::string> fold_order = {}) override;
  Status withdraw(const std::string& client_id) override;
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override {
    return open_stream(client_id, sample_count, /*hashed=*/true);
  }
  StatusOr<std::unique_ptr<UpdateStream>> open_local_update(const std::string& client_id,
                                                            double sample_count) override {
    return open_stream(client_id, sample_count, /*hashed=*/false);
  }
  Status finalize(Arena& global) override;
  int num_committed() const override;
  size_t state_bytes() const override { return sum_.size(); }
  // One 4 MiB block while a parked update folds from the spool.
  size_t working_bytes() const override { return kSpoolBlock; }
  static constexpr size_t kSpoolBlock = 4 << 20;
  // Whole-element runs of at least twice this fold on several threads.
  static constexpr size_t kParallelFoldBytes = 1 << 20;
  // Whether a stream broke after some of its bytes were folded this round.
  bool tainted() const;
  // Bytes this round's updates wrote to the spool (parked).
  uint64_t parked_bytes() const { return parked_bytes_.load(std::memory_order_relaxed); }
  // How long an update may go without a chunk and still count as streaming
  // (kLiveIdle unless set; tests lengthen it so that a busy machine's
  // scheduling does not decide what they check).
  void set_live_idle(std::chrono::milliseconds idle) { live_idle_ = idle; }

 private:
  class Stream;
  friend class Stream;
  enum class SlotState { kPending, kOpen, kLive, kParked, kCommittedParked, kFolded, kOut };
  // How long a live stream may go without a chunk and still count as
  // streaming (an early update holds its first chunk meanwhile, see accept).
  static constexpr std::chrono::milliseconds kLiveIdle{20};
  // Called with mu_ held: the update whose turn it is received a chunk
  // within live_idle_, on another thread than this one.
  bool live_streaming_locked() const;
  // Called with mu_ held, for the update in `slot`: every update before it
  // has folded, is out, or is folding as it streams (it may trail them).
  bool may_trail_locked(size_t slot) const;
  // ... every update before it has folded the model's bytes before `end`.
  bool folded_ahead_locked(size_t slot, uint64_t end) const;
  // ... every update before it that has not folded is folding as it streams
  // (another thread than this one feeds it).
  bool streaming_ahead_locked(size_t slot) const;
  // Called with mu_ held: every update before `slot` in fold order has
  // folded or is out, or `unfinished_ok` holds for it.
  template <typename Pred>
  bool every_update_ahead_locked(size_t slot, Pred unfinished_ok) const;
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
    uint64_t folded_to = 0;    // its first bytes, up to here, are in the sum
    uint64_t complete_to = 0;  // every element that ends here or before is in the sum
    std::byte carry[8] = {};   // the bytes of an element cut by a chunk, until the rest arrives
    std::chrono::steady_clock::time_point last_fold{};
    // The thread that gave it its last chunk: an update fed by the thread
    // that would wait for it cannot move meanwhile (a caller that feeds
    // several streams in turn), so it never counts as streaming for it.
    std::thread::id feeder{};
  };
  // Called with mu_ held: the update in `slot` starts folding (its weight
  // and whether it writes the sum are fixed here); once per round.
  void begin_folding_locked(size_t slot);
  // Whether `s` is folding as it streams, fed by another thread than this one.
  bool streaming(const Slot& s, std::chrono::steady_clock::time_point now) const;
  // Called with mu_ held: folds the update's parked bytes, from what it has
  // folded up to `to`, from the spool.
  Status fold_spool_locked(size_t slot, uint64_t to);
  // The start of the element that holds byte `offset` (itself between elements).
  uint64_t element_floor(uint64_t offset) const;
  // Moves the cursor past every update that is done, folding the parked ones.
  Status advance_locked();
  StatusOr<std::unique_ptr<UpdateStream>> open_stream(const std::string& client_id, double sample_count, bool hashed);
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
  // A deque: a stream keeps a reference to its slot, and folds through it
  // outside the lock while open_update may add slots.
  std::deque<Slot> slots_;
  std::atomic<uint64_t> parked_bytes_{0};
  std::chrono::milliseconds live_idle_ = kLiveIdle;
  bool ordered_ = false;
  std::atomic<size_t> cursor_{0};    // the slot whose turn it is to fold
  std::condition_variable turn_cv_;  // the cursor moved
  std::unique_ptr<SpoolFile> spool_;
  std::string spool_dir_;
  int round_ = -1;
  double total_weight_ = 0;
  int committed_ = 0;
  int open_streams_ = 0;
  std::string tainted_by_;  // client whose stream broke after bytes were counted
};

}  // namespace memfl
