#include "aggregate/fedavg_aggregator.h"

#include "common/parallel.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace memfl {

namespace {
size_t acc_element_size(DType d) { return dtype_is_float(d) ? sizeof(float) : sizeof(double); }

template <typename T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // chunk payloads need not be aligned
  return v;
}

// The folds every byte of every update goes through, built for AVX2 and
// for the baseline, picked at load time (GCC/Clang function multiversioning):
// 8 floats per instruction instead of 4 (`memfl_bench --benchmark_filter=Fold`:
// 2.0–2.1 → 2.5–3.7 GB/s with the checks). Each lane does the same IEEE
// operation as the scalar code (no FMA contraction across clones:
// -ffp-contract=off on this file), so the sum is bit-for-bit the same on
// every machine.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define MEMFL_FOLD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MEMFL_FOLD_CLONES
#endif

MEMFL_FOLD_CLONES void fold_f32(float* acc, const std::byte* src, size_t count, float w) {
  for (size_t i = 0; i < count; ++i) acc[i] += w * load<float>(src + 4 * i);
}
MEMFL_FOLD_CLONES void fold_bf16(float* acc, const std::byte* src, size_t count, float w) {
  for (size_t i = 0; i < count; ++i) acc[i] += w * bf16_to_f32(load<uint16_t>(src + 2 * i));
}
// The round's first update: the sum is written, never read. `+ 0.0f` keeps
// the result bit-identical to 0 + w·x (a -0 product becomes +0), and IEEE
// rules forbid the compiler to drop it. kBf16: the update is bf16 (a 16-bit
// shift to f32), else f32.
template <bool kBf16>
float update_element(const std::byte* src, size_t i) {
  if constexpr (kBf16) {
    return bf16_to_f32(load<uint16_t>(src + 2 * i));
  } else {
    return load<float>(src + 4 * i);
  }
}
template <bool kBf16>
void write_scalar(float* acc, const std::byte* src, size_t count, float w) {
  for (size_t i = 0; i < count; ++i) acc[i] = w * update_element<kBf16>(src, i) + 0.0f;
}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Written with streaming stores: a plain store loop into a sum that is not
// in cache first reads each line (read for ownership), and measured slower
// than the fold that reads the sum on purpose (MPI uploads 3.8–4.3 against
// 4.7–6.6 GB/s). The sum is read next by finalize, from memory either way.
template <bool kBf16>
__attribute__((target("avx2"))) void write_avx2(float* acc, const std::byte* src, size_t count, float w) {
  size_t i = 0;
  for (; i < count && (reinterpret_cast<uintptr_t>(acc + i) & 31) != 0; ++i) {
    acc[i] = w * update_element<kBf16>(src, i) + 0.0f;
  }
  const __m256 vw = _mm256_set1_ps(w), zero = _mm256_setzero_ps();
  for (; i + 8 <= count; i += 8) {
    __m256 x;
    if constexpr (kBf16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      x = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
    }
    _mm256_stream_ps(acc + i, _mm256_add_ps(_mm256_mul_ps(vw, x), zero));
  }
  for (; i < count; ++i) acc[i] = w * update_element<kBf16>(src, i) + 0.0f;
  _mm_sfence();  // streaming stores are weakly ordered: visible before the fold's progress is published
}
const bool kWriteAvx2 = __builtin_cpu_supports("avx2");
template <bool kBf16>
void write_sum(float* acc, const std::byte* src, size_t count, float w) {
  (kWriteAvx2 ? write_avx2<kBf16> : write_scalar<kBf16>)(acc, src, count, w);
}
#else
template <bool kBf16>
void write_sum(float* acc, const std::byte* src, size_t count, float w) {
  write_scalar<kBf16>(acc, src, count, w);
}
#endif
}  // namespace

class FedAvgAggregator::Stream final : public UpdateStream {
 public:
  Stream(FedAvgAggregator& agg, size_t slot, std::string client_id, double weight, bool hashed)
      : agg_(agg), slot_(slot), client_id_(std::move(client_id)), weight_(weight), hashed_(hashed) {}
  ~Stream() override {
    if (!done_) abort();
  }

  using UpdateStream::accept;
  Status accept(const ChunkHeader& h, Payload payload) override {
    if (done_) return failed_precondition("update from {}: chunk after commit", client_id_);
    // A local update's chunks (open_local_update) carry no checksum: the
    // header is checked all the same.
    Status s = hashed_ ? verify_chunk(h, payload, agg_.layout_, next_offset_, client_id_)
                       : verify_chunk_header(h, payload_size(payload), agg_.layout_, next_offset_, client_id_);
    if (!s.ok()) {
      abort();  // a peer that sends bad bytes loses its update
      return s;
    }
    const uint64_t end = h.offset + h.length;
    // This chunk folds the elements that end by `whole_to`; an element it
    // cuts waits in the carry for the next chunk. So the updates ahead must
    // have folded that far, not to `end`.
    const uint64_t whole_to = agg_.element_floor(end);
    std::unique_lock lock(agg_.mu_);
    // Taken under the lock (open_update may be adding slots); the deque
    // keeps the reference valid for the fold outside it.
    Slot& slot = agg_.slots_[slot_];
    slot.feeder = std::this_thread::get_id();
    if (mode_ == Mode::kNone) {
      // The first chunk. Every update before ours in fold order has folded,
      // is out, or is folding as it streams: fold behind them (trail), chunk
      // by chunk. Otherwise hold this chunk while the update whose turn it
      // is streams (the transport's flow control holds the sender: parking
      // would only add a write and a read), then park — a slow or stalled
      // client never holds us up longer than kLiveIdle. Updates ahead that
      // have already folded this chunk's range (fed by this very thread, in
      // turn with ours: MPI's ring) let it fold now.
      auto may_fold = [&] { return agg_.may_trail_locked(slot_) || agg_.folded_ahead_locked(slot_, whole_to); };
      while (!may_fold() && agg_.live_streaming_locked()) agg_.turn_cv_.wait_for(lock, agg_.live_idle_);
      if (may_fold()) {
        agg_.begin_folding_locked(slot_);
        mode_ = Mode::kLive;
      } else {
        mode_ = Mode::kParked;
      }
    } else if (mode_ == Mode::kParked && agg_.may_trail_locked(slot_)) {
      // Parked, and every update before ours has folded, is out or is
      // folding as it streams (our turn is the case where none streams):
      // hold this chunk until they have folded what we parked, fold that
      // from the spool, and trail them from here.
      while (!agg_.folded_ahead_locked(slot_, next_offset_) && agg_.streaming_ahead_locked(slot_)) {
        agg_.turn_cv_.wait_for(lock, agg_.live_idle_);
      }
      if (agg_.folded_ahead_locked(slot_, next_offset_)) {
        agg_.begin_folding_locked(slot_);
        MEMFL_RETURN_IF_ERROR(agg_.fold_spool_locked(slot_, next_offset_));
        mode_ = Mode::kLive;
      }
    }
    if (mode_ == Mode::kLive) {
      // Trailing: the updates before ours fold this range first. One that
      // pauses (kLiveIdle) is not waited for: the rest of ours parks.
      while (!agg_.folded_ahead_locked(slot_, whole_to)) {
        if (!agg_.streaming_ahead_locked(slot_)) {
          mode_ = Mode::kParked;
          break;
        }
        agg_.turn_cv_.wait_for(lock, agg_.live_idle_);
      }
    }
    slot.state = mode_ == Mode::kLive ? SlotState::kLive : SlotState::kParked;
    lock.unlock();
    // Outside the lock: the ranges being folded are disjoint (an update
    // folds only what every update before it has folded), so trailing
    // updates fold at the same time, each on its transport's thread.
    if (mode_ == Mode::kLive) {
      size_t at = h.offset;
      for (auto part : payload) {  // pieces may cut elements anywhere: fold carries them
        agg_.fold(at, part, slot.fold_weight, slot.writes_sum, slot.carry);
        at += part.size();
      }
      lock.lock();
      slot.folded_to = end;
      slot.complete_to = agg_.element_floor(end);
      slot.last_fold = std::chrono::steady_clock::now();
      lock.unlock();
      agg_.turn_cv_.notify_all();
    } else {
      MEMFL_RETURN_IF_ERROR(agg_.park(slot_, h.offset, payload, client_id_));
    }
    next_offset_ = end;
    return Status::Ok();
  }

  Status commit() override {
    if (done_) return failed_precondition("update from {}: already closed", client_id_);
    if (next_offset_ != agg_.layout_.total_bytes()) {
      Status s =
          data_loss("update from {} ended after {} of {} bytes", client_id_, next_offset_, agg_.layout_.total_bytes());
      abort();
      return s;
    }
    std::lock_guard lock(agg_.mu_);
    done_ = true;
    agg_.open_streams_--;
    agg_.total_weight_ += weight_;
    agg_.committed_++;
    auto& slot = agg_.slots_[slot_];
    slot.state = mode_ == Mode::kLive ? SlotState::kFolded : SlotState::kCommittedParked;
    return agg_.advance_locked();
  }

 private:
  // kNone: no chunk yet; kLive: folding as chunks arrive; kParked: chunks go
  // to the spool and fold from there when our turn comes.
  enum class Mode { kNone, kLive, kParked };
  void abort() {
    if (done_) return;
    done_ = true;
    std::lock_guard lock(agg_.mu_);
    agg_.open_streams_--;
    auto& slot = agg_.slots_[slot_];
    // Bytes already in the state cannot be taken out: the round is redone.
    // Parked bytes never reached it: the update is simply out.
    if (slot.folded_any && agg_.tainted_by_.empty()) agg_.tainted_by_ = client_id_;
    slot.state = SlotState::kOut;
    agg_.spool_release_locked(slot_);
    (void)agg_.advance_locked();
  }

  FedAvgAggregator& agg_;
  const size_t slot_;
  std::string client_id_;
  double weight_;
  bool hashed_;
  uint64_t next_offset_ = 0;
  Mode mode_ = Mode::kNone;
  bool done_ = false;
};

Status FedAvgAggregator::park(size_t slot, uint64_t offset, Payload payload, const std::string& client_id) {
  {
    std::lock_guard lock(mu_);
    Status s = spool_->open(spool_dir_);
    if (!s.ok()) return s.with_context("update from " + client_id);
  }
  uint64_t at = static_cast<uint64_t>(slot) * layout_.total_bytes() + offset;
  for (auto part : payload) {
    parked_bytes_.fetch_add(part.size(), std::memory_order_relaxed);
    Status s = spool_->write(at, part);
    if (!s.ok()) return s.with_context("update from " + client_id);
    at += part.size();
  }
  return Status::Ok();
}

void FedAvgAggregator::spool_release_locked(size_t slot) {
  spool_->release(static_cast<uint64_t>(slot) * layout_.total_bytes(), layout_.total_bytes());
}

void FedAvgAggregator::begin_folding_locked(size_t slot) {
  Slot& s = slots_[slot];
  if (s.folded_any) return;  // it began before it parked
  // The weight this update folds with is fixed here, in fold order (an
  // update begins only after every update before it has begun or is out),
  // so a running mean is the same whatever order the bytes arrived in.
  s.fold_weight = s.weight;
  if (accumulation_ == Accumulation::kRunningMean) {
    mean_weight_ += s.weight;
    s.fold_weight = s.weight / mean_weight_;
  }
  s.folded_any = true;
  // The first to fold (in fold order) covers every element of the sum
  // before anyone else adds to it; if it breaks part way, the round is
  // tainted and redone from begin_round.
  s.writes_sum = accumulation_ == Accumulation::kSum && sum_unwritten_;
  sum_unwritten_ = false;
  s.last_fold = std::chrono::steady_clock::now();
}

Status FedAvgAggregator::fold_spool_locked(size_t slot, uint64_t to) {
  Slot& s = slots_[slot];
  // What was parked folds from the spool, a block at a time, after what
  // this update folded before it parked (its carry holds a cut element).
  if (to > s.folded_to) {
    std::vector<std::byte> block(std::min<uint64_t>(kSpoolBlock, to - s.folded_to));
    const uint64_t base = static_cast<uint64_t>(slot) * layout_.total_bytes();
    for (uint64_t off = s.folded_to; off < to; off += block.size()) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(block.size(), to - off));
      Status st = spool_->read(base + off, std::span(block.data(), len));
      if (!st.ok()) {
        if (tainted_by_.empty()) tainted_by_ = s.client_id;
        return st;
      }
      fold(off, std::span<const std::byte>(block.data(), len), s.fold_weight, s.writes_sum, s.carry);
    }
    s.folded_to = to;
    s.complete_to = element_floor(to);
  }
  spool_release_locked(slot);
  return Status::Ok();
}

uint64_t FedAvgAggregator::element_floor(uint64_t offset) const {
  const auto& entries = layout_.entries();
  const size_t idx = layout_.entry_at_or_after(offset);
  if (idx >= entries.size() || offset <= entries[idx].offset) return offset;
  const LayoutEntry& e = entries[idx];
  return offset - (offset - e.offset) % dtype_size(e.dtype);
}

bool FedAvgAggregator::streaming(const Slot& s, std::chrono::steady_clock::time_point now) const {
  return s.state == SlotState::kLive && now - s.last_fold < live_idle_ && s.feeder != std::this_thread::get_id();
}

template <typename Pred>
bool FedAvgAggregator::every_update_ahead_locked(size_t slot, Pred unfinished_ok) const {
  for (size_t j = 0; j < slot; ++j) {
    const Slot& s = slots_[j];
    if (s.state == SlotState::kFolded || s.state == SlotState::kOut) continue;
    if (!unfinished_ok(s)) return false;
  }
  return true;
}

bool FedAvgAggregator::may_trail_locked(size_t slot) const {
  const auto now = std::chrono::steady_clock::now();
  return every_update_ahead_locked(slot, [&](const Slot& s) {
    return s.state == SlotState::kLive && (s.complete_to >= layout_.total_bytes() || streaming(s, now));
  });
}

bool FedAvgAggregator::folded_ahead_locked(size_t slot, uint64_t end) const {
  return every_update_ahead_locked(slot,
                                   [&](const Slot& s) { return s.state == SlotState::kLive && s.complete_to >= end; });
}

bool FedAvgAggregator::streaming_ahead_locked(size_t slot) const {
  const auto now = std::chrono::steady_clock::now();
  return every_update_ahead_locked(slot, [&](const Slot& s) { return streaming(s, now); });
}

bool FedAvgAggregator::live_streaming_locked() const {
  const size_t c = cursor_.load(std::memory_order_relaxed);
  return c < slots_.size() && streaming(slots_[c], std::chrono::steady_clock::now());
}

Status FedAvgAggregator::advance_locked() {
  size_t c = cursor_.load(std::memory_order_relaxed);
  Status result = Status::Ok();
  while (c < slots_.size()) {
    Slot& s = slots_[c];
    if (s.state == SlotState::kFolded || s.state == SlotState::kOut) {
      ++c;
      continue;
    }
    if (s.state != SlotState::kCommittedParked) break;  // its turn; it folds live or when it commits
    begin_folding_locked(c);
    Status st = fold_spool_locked(c, layout_.total_bytes());
    if (!st.ok() && result.ok()) result = st;
    s.state = SlotState::kFolded;
    ++c;
  }
  cursor_.store(c, std::memory_order_release);
  turn_cv_.notify_all();
  return result;
}

size_t FedAvgAggregator::sum_bytes(const Layout& layout) {
  size_t acc = 0;
  for (const auto& e : layout.entries()) {
    acc += (e.numel() * acc_element_size(e.dtype) + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment;
  }
  return acc;
}

std::span<std::byte> FedAvgAggregator::idle_state_bytes() {
  if (in_place_ != nullptr || accumulation_ != Accumulation::kSum || sum_.size() < layout_.total_bytes()) return {};
  for (size_t i = 0; i < layout_.entries().size(); ++i) {
    const LayoutEntry& e = layout_.entries()[i];
    if (e.dtype != DType::kF32 || acc_offsets_[i] != e.offset) return {};
  }
  return std::span(sum_.data(), layout_.total_bytes());
}

FedAvgAggregator::FedAvgAggregator(const Layout& layout, ClientWeightsMode mode)
    : FedAvgAggregator(layout, mode, Arena(sum_bytes(layout), MemoryCategory::kAggregation)) {}

FedAvgAggregator::FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena&& sum_storage)
    : layout_(layout), mode_(mode), spool_(std::make_unique<SpoolFile>("fold spool")) {
  assert(sum_storage.size() >= sum_bytes(layout));
  size_t acc = 0;
  for (const auto& e : layout.entries()) {
    acc_offsets_.push_back(acc);
    acc += (e.numel() * acc_element_size(e.dtype) + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment;
  }
  sum_ = std::move(sum_storage);
}

FedAvgAggregator::FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena& in_place,
                                   Accumulation accumulation)
    : layout_(layout), mode_(mode), accumulation_(accumulation), spool_(std::make_unique<SpoolFile>("fold spool")) {
  assert((accumulation == Accumulation::kRunningMean || can_sum_in_place(layout)) &&
         in_place.size() >= layout.total_bytes());
  for (const auto& e : layout.entries()) acc_offsets_.push_back(e.offset);
  in_place_ = &in_place;
}

FedAvgAggregator::~FedAvgAggregator() = default;

Status FedAvgAggregator::retarget(Arena& in_place) {
  std::lock_guard lock(mu_);
  if (in_place_ == nullptr) return failed_precondition("retarget: this aggregator keeps its own sum");
  if (open_streams_ > 0) return failed_precondition("retarget while {} updates are open", open_streams_);
  if (in_place.size() < layout_.total_bytes()) return failed_precondition("retarget: arena smaller than the model");
  in_place_ = &in_place;
  return Status::Ok();
}

bool FedAvgAggregator::can_sum_in_place(const Layout& layout) {
  for (const auto& e : layout.entries()) {
    if (acc_element_size(e.dtype) != dtype_size(e.dtype)) return false;
  }
  return true;
}

bool FedAvgAggregator::tainted() const {
  std::lock_guard lock(mu_);
  return !tainted_by_.empty();
}

Status FedAvgAggregator::begin_round(int round, std::vector<std::string> fold_order) {
  std::lock_guard lock(mu_);
  if (open_streams_ > 0) return failed_precondition("begin_round({}) while {} updates are open", round, open_streams_);
  // Nothing to clear: the round's first update writes the sum (or, for a
  // running mean, is copied over). Zeroing cost a pass over the sum per
  // round, and the first fold a read of the zeros: 1 GiB × 1 client over
  // MPI, a round went from 0.60–0.77 s to 0.45–0.51 s (docs/BENCHMARKS.md).
  mean_weight_ = 0;
  sum_unwritten_ = true;
  round_ = round;
  total_weight_ = 0;
  committed_ = 0;
  tainted_by_.clear();
  slots_.clear();
  ordered_ = !fold_order.empty();
  for (auto& id : fold_order) {
    for (const auto& s : slots_) {
      if (s.client_id == id) return invalid_argument("begin_round({}): {} appears twice in the fold order", round, id);
    }
    slots_.push_back(Slot{std::move(id)});
  }
  cursor_.store(0, std::memory_order_release);
  parked_bytes_.store(0, std::memory_order_relaxed);
  spool_->clear();
  return Status::Ok();
}

Status FedAvgAggregator::withdraw(const std::string& client_id) {
  std::lock_guard lock(mu_);
  for (auto& s : slots_) {
    if (s.client_id != client_id) continue;
    if (s.state != SlotState::kPending) return Status::Ok();  // its stream decides
    s.state = SlotState::kOut;
    return advance_locked();
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<UpdateStream>> FedAvgAggregator::open_stream(const std::string& client_id, double sample_count,
                                                                      bool hashed) {
  if (!(sample_count >= 0) || !std::isfinite(sample_count)) {
    return invalid_argument("update from {}: sample count {} is not a non-negative number", client_id, sample_count);
  }
  double w = mode_ == ClientWeightsMode::kEqual ? 1.0 : sample_count;
  if (mode_ == ClientWeightsMode::kSampleSize && w == 0) {
    return invalid_argument("update from {}: sample count 0 under client_weights_mode: sample_size", client_id);
  }
  std::lock_guard lock(mu_);
  if (round_ < 0) return failed_precondition("open_update before begin_round");
  size_t slot = slots_.size();
  if (ordered_) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].client_id == client_id) slot = i;
    }
    if (slot == slots_.size()) {
      return failed_precondition("update from {}: not selected for round {}", client_id, round_);
    }
    if (slots_[slot].state != SlotState::kPending) {
      return failed_precondition("update from {}: a second update in round {}", client_id, round_);
    }
  } else {
    slots_.push_back(Slot{client_id});  // no fold order given: the order updates are opened in
  }
  slots_[slot].state = SlotState::kOpen;
  slots_[slot].weight = w;
  open_streams_++;
  return std::unique_ptr<UpdateStream>(std::make_unique<Stream>(*this, slot, client_id, w, hashed));
}

int FedAvgAggregator::num_committed() const {
  std::lock_guard lock(mu_);
  return committed_;
}

void FedAvgAggregator::fold(size_t offset, std::span<const std::byte> payload, double w, bool write, std::byte* carry) {
  const auto& entries = layout_.entries();
  size_t pos = offset;
  const size_t end = offset + payload.size();
  size_t idx = layout_.entry_at_or_after(pos);
  while (pos < end && idx < entries.size()) {
    const LayoutEntry& e = entries[idx];
    if (pos < e.offset) {  // alignment padding between entries: not model data
      pos = std::min(end, e.offset);
      continue;
    }
    if (pos >= e.end()) {
      ++idx;
      continue;
    }
    const size_t es = dtype_size(e.dtype);
    const size_t rel = pos - e.offset;
    const size_t elem = rel / es;
    const size_t within = rel % es;
    const std::byte* src = payload.data() + (pos - offset);
    const size_t avail = std::min(end, e.end()) - pos;
    if (within != 0 || avail < es) {
      // Part of an element: gather its bytes in `carry` until it is whole.
      const size_t n = std::min(es - within, avail);
      std::memcpy(carry + within, src, n);
      if (within + n == es) fold_elements(e, acc_offsets_[idx], elem, carry, 1, w, write);
      pos += n;
      continue;
    }
    const size_t count = avail / es;
    // A large chunk (an LLM's 16 MiB) folds on several cores: the bf16
    // running mean alone held a 70B round's uploads to one core's speed.
    // Element-wise, so the split does not change a bit of the result.
    parallel_for(count, kParallelFoldBytes / es, [&](size_t a, size_t b) {
      fold_elements(e, acc_offsets_[idx], elem + a, src + a * es, b - a, w, write);
    });
    pos += count * es;
  }
}

void FedAvgAggregator::mean_elements(const LayoutEntry& e, size_t first, const std::byte* src, size_t count, double f) {
  std::byte* dst = in_place_->data() + e.offset;
  const bool copy = f == 1.0;  // the round's first update: exact
  const float ff = static_cast<float>(f);
  switch (e.dtype) {
    case DType::kF32: {
      float* m = reinterpret_cast<float*>(dst) + first;
      if (copy) {
        std::memcpy(m, src, count * 4);
      } else {
        for (size_t i = 0; i < count; ++i) m[i] += ff * (load<float>(src + 4 * i) - m[i]);
      }
      break;
    }
    case DType::kBF16: {
      uint16_t* m = reinterpret_cast<uint16_t*>(dst) + first;
      if (copy) {
        std::memcpy(m, src, count * 2);
      } else {
        for (size_t i = 0; i < count; ++i) {
          const float a = bf16_to_f32(m[i]);
          m[i] = f32_to_bf16(a + ff * (bf16_to_f32(load<uint16_t>(src + 2 * i)) - a));
        }
      }
      break;
    }
    case DType::kF16: {
      uint16_t* m = reinterpret_cast<uint16_t*>(dst) + first;
      if (copy) {
        std::memcpy(m, src, count * 2);
      } else {
        for (size_t i = 0; i < count; ++i) {
          const float a = f16_to_f32(m[i]);
          m[i] = f32_to_f16(a + ff * (f16_to_f32(load<uint16_t>(src + 2 * i)) - a));
        }
      }
      break;
    }
    case DType::kI64: {
      int64_t* m = reinterpret_cast<int64_t*>(dst) + first;
      for (size_t i = 0; i < count; ++i) {
        const double a = static_cast<double>(m[i]);
        m[i] = static_cast<int64_t>(std::nearbyint(a + f * (static_cast<double>(load<int64_t>(src + 8 * i)) - a)));
      }
      break;
    }
    case DType::kI32: {
      int32_t* m = reinterpret_cast<int32_t*>(dst) + first;
      for (size_t i = 0; i < count; ++i) {
        const double a = m[i];
        m[i] = static_cast<int32_t>(std::nearbyint(a + f * (load<int32_t>(src + 4 * i) - a)));
      }
      break;
    }
    case DType::kU8: {
      uint8_t* m = reinterpret_cast<uint8_t*>(dst) + first;
      for (size_t i = 0; i < count; ++i) {
        const double a = m[i];
        m[i] = static_cast<uint8_t>(std::nearbyint(a + f * (static_cast<uint8_t>(src[i]) - a)));
      }
      break;
    }
  }
}

void FedAvgAggregator::fold_elements(const LayoutEntry& e, size_t acc_offset, size_t first, const std::byte* src,
                                     size_t count, double w, bool write) {
  if (accumulation_ == Accumulation::kRunningMean) {
    mean_elements(e, first, src, count, w);
    return;
  }
  if (dtype_is_float(e.dtype)) {
    float* acc = reinterpret_cast<float*>(this->acc(acc_offset)) + first;
    const float wf = static_cast<float>(w);
    switch (e.dtype) {
      case DType::kF32:
        (write ? write_sum<false> : fold_f32)(acc, src, count, wf);
        break;
      case DType::kBF16:
        (write ? write_sum<true> : fold_bf16)(acc, src, count, wf);
        break;
      case DType::kF16:
        if (write) {
          for (size_t i = 0; i < count; ++i) acc[i] = wf * f16_to_f32(load<uint16_t>(src + 2 * i)) + 0.0f;
        } else {
          for (size_t i = 0; i < count; ++i) acc[i] += wf * f16_to_f32(load<uint16_t>(src + 2 * i));
        }
        break;
      default:
        break;
    }
    return;
  }
  double* acc = reinterpret_cast<double*>(this->acc(acc_offset)) + first;
  if (write) std::fill(acc, acc + count, 0.0);  // integers: rare and small, zeroed then added
  switch (e.dtype) {
    case DType::kI64:
      for (size_t i = 0; i < count; ++i) acc[i] += w * static_cast<double>(load<int64_t>(src + 8 * i));
      break;
    case DType::kI32:
      for (size_t i = 0; i < count; ++i) acc[i] += w * load<int32_t>(src + 4 * i);
      break;
    case DType::kU8:
      for (size_t i = 0; i < count; ++i) acc[i] += w * static_cast<double>(static_cast<uint8_t>(src[i]));
      break;
    default:
      break;
  }
}

Status FedAvgAggregator::finalize(Arena& global) {
  std::lock_guard lock(mu_);
  if (open_streams_ > 0) return failed_precondition("finalize while {} updates are still open", open_streams_);
  // Clients that never sent an update are out; what waited for them folds now.
  for (auto& s : slots_) {
    if (s.state == SlotState::kPending) s.state = SlotState::kOut;
  }
  Status drained = advance_locked();
  if (!drained.ok()) return aborted("round {}: {}; the round must be redone", round_, drained.message());
  if (!tainted_by_.empty()) {
    return aborted("round {}: the update of {} broke after part of it was counted; the round must be redone", round_,
                   tainted_by_);
  }
  if (committed_ == 0 || total_weight_ <= 0) {
    return failed_precondition("round {}: no client update completed; the global model is unchanged", round_);
  }
  if (global.size() < layout_.total_bytes()) return failed_precondition("finalize: global arena too small");
  if (in_place_ != nullptr && in_place_ != &global) {
    return failed_precondition("finalize: the sum lives in another arena than the one given");
  }
  if (accumulation_ == Accumulation::kRunningMean) return Status::Ok();  // already the mean
  // In place, each element is read (sum) and written (mean) at the same
  // address with the same width, so the loops below are safe either way.
  const auto& entries = layout_.entries();
  for (size_t k = 0; k < entries.size(); ++k) {
    const LayoutEntry& e = entries[k];
    const size_t n = e.numel();
    std::byte* dst = global.data() + e.offset;
    if (dtype_is_float(e.dtype)) {
      const float* acc = reinterpret_cast<const float*>(this->acc(acc_offsets_[k]));
      const float inv = static_cast<float>(1.0 / total_weight_);
      // On several cores, as the fold (element-wise: the same bits).
      parallel_for(n, kParallelFoldBytes / 4, [&](size_t a, size_t b) {
        switch (e.dtype) {
          case DType::kF32: {
            auto* out = reinterpret_cast<float*>(dst);
            for (size_t i = a; i < b; ++i) out[i] = acc[i] * inv;
            break;
          }
          case DType::kBF16: {
            auto* out = reinterpret_cast<uint16_t*>(dst);
            for (size_t i = a; i < b; ++i) out[i] = f32_to_bf16(acc[i] * inv);
            break;
          }
          case DType::kF16: {
            auto* out = reinterpret_cast<uint16_t*>(dst);
            for (size_t i = a; i < b; ++i) out[i] = f32_to_f16(acc[i] * inv);
            break;
          }
          default:
            break;
        }
      });
    } else {
      const double* acc = reinterpret_cast<const double*>(this->acc(acc_offsets_[k]));
      for (size_t i = 0; i < n; ++i) {
        const double v = std::nearbyint(acc[i] / total_weight_);
        switch (e.dtype) {
          case DType::kI64:
            reinterpret_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v);
            break;
          case DType::kI32:
            reinterpret_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
            break;
          case DType::kU8:
            reinterpret_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(v);
            break;
          default:
            break;
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace memfl
