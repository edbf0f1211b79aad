#include "aggregate/fedavg_aggregator.h"

#include <cassert>
#include <cmath>
#include <cstring>

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
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__)
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
}  // namespace

class FedAvgAggregator::Stream final : public UpdateStream {
 public:
  Stream(FedAvgAggregator& agg, std::string client_id, double weight)
      : agg_(agg), client_id_(std::move(client_id)), weight_(weight) {}
  ~Stream() override {
    if (!done_) abort();
  }

  using UpdateStream::accept;
  Status accept(const ChunkHeader& h, Payload payload) override {
    if (done_) return failed_precondition("update from {}: chunk after commit", client_id_);
    Status s = verify_chunk(h, payload, agg_.layout_, next_offset_, client_id_);
    if (!s.ok()) {
      abort();  // a peer that sends bad bytes loses its update
      return s;
    }
    std::lock_guard lock(agg_.mu_);
    double w = weight_;
    if (agg_.accumulation_ == Accumulation::kRunningMean) {
      if (agg_.mean_owner_ != this) {
        if (agg_.mean_owner_ != nullptr) {
          agg_.tainted_by_ = client_id_;
          return failed_precondition(
              "update from {}: a running-mean aggregation folds one update at a time, and another is still open",
              client_id_);
        }
        agg_.mean_owner_ = this;  // our share is fixed when our first byte folds
        agg_.mean_weight_ += weight_;
        fraction_ = weight_ / agg_.mean_weight_;
      }
      w = fraction_;
    }
    size_t at = h.offset;
    for (auto part : payload) {  // pieces may cut elements anywhere: fold carries them
      agg_.fold(at, part, w, carry_);
      at += part.size();
    }
    next_offset_ += h.length;
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
    if (agg_.mean_owner_ == this) agg_.mean_owner_ = nullptr;
    agg_.open_streams_--;
    agg_.total_weight_ += weight_;
    agg_.committed_++;
    return Status::Ok();
  }

 private:
  void abort() {
    if (done_) return;
    done_ = true;
    std::lock_guard lock(agg_.mu_);
    agg_.open_streams_--;
    if (agg_.mean_owner_ == this) agg_.mean_owner_ = nullptr;
    if (next_offset_ > 0 && agg_.tainted_by_.empty()) agg_.tainted_by_ = client_id_;
  }

  FedAvgAggregator& agg_;
  std::string client_id_;
  double weight_;
  uint64_t next_offset_ = 0;
  std::byte carry_[8] = {};
  double fraction_ = 1.0;  // kRunningMean: w_k / W_k
  bool done_ = false;
};

size_t FedAvgAggregator::sum_bytes(const Layout& layout) {
  size_t acc = 0;
  for (const auto& e : layout.entries()) {
    acc += (e.numel() * acc_element_size(e.dtype) + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment;
  }
  return acc;
}

FedAvgAggregator::FedAvgAggregator(const Layout& layout, ClientWeightsMode mode)
    : FedAvgAggregator(layout, mode, Arena(sum_bytes(layout), MemoryCategory::kAggregation)) {}

FedAvgAggregator::FedAvgAggregator(const Layout& layout, ClientWeightsMode mode, Arena&& sum_storage)
    : layout_(layout), mode_(mode) {
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
    : layout_(layout), mode_(mode), accumulation_(accumulation) {
  assert((accumulation == Accumulation::kRunningMean || can_sum_in_place(layout)) &&
         in_place.size() >= layout.total_bytes());
  for (const auto& e : layout.entries()) acc_offsets_.push_back(e.offset);
  in_place_ = &in_place;
}

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

Status FedAvgAggregator::begin_round(int round) {
  std::lock_guard lock(mu_);
  if (open_streams_ > 0) return failed_precondition("begin_round({}) while {} updates are open", round, open_streams_);
  if (accumulation_ == Accumulation::kRunningMean) {
    // Nothing to clear: the first update of the round is copied over.
    mean_weight_ = 0;
    mean_owner_ = nullptr;
  } else if (in_place_ != nullptr) {
    in_place_->zero();  // the global model becomes the running sum
  } else if (round_ >= 0) {
    sum_.zero();  // a fresh arena is already zero; don't touch its pages twice
  }
  round_ = round;
  total_weight_ = 0;
  committed_ = 0;
  tainted_by_.clear();
  return Status::Ok();
}

StatusOr<std::unique_ptr<UpdateStream>> FedAvgAggregator::open_update(const std::string& client_id,
                                                                      double sample_count) {
  if (!(sample_count >= 0) || !std::isfinite(sample_count)) {
    return invalid_argument("update from {}: sample count {} is not a non-negative number", client_id, sample_count);
  }
  double w = mode_ == ClientWeightsMode::kEqual ? 1.0 : sample_count;
  if (mode_ == ClientWeightsMode::kSampleSize && w == 0) {
    return invalid_argument("update from {}: sample count 0 under client_weights_mode: sample_size", client_id);
  }
  std::lock_guard lock(mu_);
  if (round_ < 0) return failed_precondition("open_update before begin_round");
  open_streams_++;
  return std::unique_ptr<UpdateStream>(std::make_unique<Stream>(*this, client_id, w));
}

int FedAvgAggregator::num_committed() const {
  std::lock_guard lock(mu_);
  return committed_;
}

void FedAvgAggregator::fold(size_t offset, std::span<const std::byte> payload, double w, std::byte* carry) {
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
      if (within + n == es) fold_elements(e, acc_offsets_[idx], elem, carry, 1, w);
      pos += n;
      continue;
    }
    const size_t count = avail / es;
    fold_elements(e, acc_offsets_[idx], elem, src, count, w);
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
                                     size_t count, double w) {
  if (accumulation_ == Accumulation::kRunningMean) {
    mean_elements(e, first, src, count, w);
    return;
  }
  if (dtype_is_float(e.dtype)) {
    float* acc = reinterpret_cast<float*>(this->acc(acc_offset)) + first;
    const float wf = static_cast<float>(w);
    switch (e.dtype) {
      case DType::kF32:
        fold_f32(acc, src, count, wf);
        break;
      case DType::kBF16:
        fold_bf16(acc, src, count, wf);
        break;
      case DType::kF16:
        for (size_t i = 0; i < count; ++i) acc[i] += wf * f16_to_f32(load<uint16_t>(src + 2 * i));
        break;
      default:
        break;
    }
    return;
  }
  double* acc = reinterpret_cast<double*>(this->acc(acc_offset)) + first;
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
  if (!tainted_by_.empty()) {
    return Status(StatusCode::kAborted, fmt::format("round {}: the update of {} broke after part of it was counted; "
                                                    "the round must be redone",
                                                    round_, tainted_by_));
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
      switch (e.dtype) {
        case DType::kF32: {
          auto* out = reinterpret_cast<float*>(dst);
          for (size_t i = 0; i < n; ++i) out[i] = acc[i] * inv;
          break;
        }
        case DType::kBF16: {
          auto* out = reinterpret_cast<uint16_t*>(dst);
          for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(acc[i] * inv);
          break;
        }
        case DType::kF16: {
          auto* out = reinterpret_cast<uint16_t*>(dst);
          for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16(acc[i] * inv);
          break;
        }
        default:
          break;
      }
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
