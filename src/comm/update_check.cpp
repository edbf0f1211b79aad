#include "comm/update_check.h"

#include "common/parallel.h"

#include <atomic>
#include <cmath>
#include <cstring>

namespace memfl {

Status check_sample_count(double sample_count, const UpdateLimits& limits, std::string_view peer, int round) {
  if (std::isfinite(sample_count) && sample_count > 0 && sample_count <= limits.max_num_samples) {
    return Status::Ok();
  }
  return Status(StatusCode::kRejected,
                fmt::format("round {}: the update of {} is refused: its sample count {} is not a finite number in "
                            "(0, {}] (server_configs.max_num_samples)",
                            round, peer, sample_count, limits.max_num_samples));
}

Status check_update_round(int claimed, int round, std::string_view peer) {
  if (claimed == round) return Status::Ok();
  return Status(StatusCode::kRejected,
                fmt::format("round {}: the update of {} is refused: it says it is for round {}", round, peer, claimed));
}

Status check_update_metric(std::string_view name, double value, std::string_view peer, int round) {
  if (std::isfinite(value)) return Status::Ok();
  // ε = +∞ is the accountant's true answer for DP-SGD without noise: no
  // privacy, reported as such, not a broken value.
  if (name == "epsilon" && value > 0 && std::isinf(value)) return Status::Ok();
  return Status(StatusCode::kRejected,
                fmt::format("round {}: the update of {} is refused: its metric {} is {}, not a finite number", round,
                            peer, name, value));
}

namespace {

// An element is not finite when its exponent bits are all ones. The loop
// ORs a flag per element with no early exit, in blocks of a fixed count:
// GCC's -O2 vectorises only loops whose trip count needs no scalar
// epilogue (its "very cheap" cost model), and a variable-length loop ran
// scalar at 3.6–7.6 GB/s where these blocks check 22–39 GB/s in cache
// (docs/BENCHMARKS.md, "Hostile input and value checks").
// Only a block that fails is searched again for the index.
template <typename Bits, Bits kExponent>
bool all_finite(const std::byte* p, size_t n) {
  constexpr size_t kVectorBlock = 64;
  Bits bad = 0;
  size_t i = 0;
  for (; i + kVectorBlock <= n; i += kVectorBlock) {
    const std::byte* q = p + i * sizeof(Bits);
    for (size_t j = 0; j < kVectorBlock; ++j) {
      Bits v;
      std::memcpy(&v, q + j * sizeof(Bits), sizeof v);
      bad |= static_cast<Bits>((v & kExponent) == kExponent);
    }
  }
  for (; i < n; ++i) {
    Bits v;
    std::memcpy(&v, p + i * sizeof(Bits), sizeof v);
    bad |= static_cast<Bits>((v & kExponent) == kExponent);
  }
  return bad == 0;
}

template <typename Bits, Bits kExponent>
size_t first_bad(const std::byte* p, size_t n) {
  constexpr size_t kBlock = 4096;
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t m = std::min(kBlock, n - i);
    if (all_finite<Bits, kExponent>(p + i * sizeof(Bits), m)) continue;
    for (size_t j = i; j < i + m; ++j) {
      Bits v;
      std::memcpy(&v, p + j * sizeof(Bits), sizeof v);
      if ((v & kExponent) == kExponent) return j;
    }
  }
  return n;
}

std::string describe(DType dtype, const std::byte* p) {
  float f = 0;
  if (dtype == DType::kF32) {
    std::memcpy(&f, p, 4);
  } else {
    uint16_t b;
    std::memcpy(&b, p, 2);
    if (dtype == DType::kBF16) {
      f = bf16_to_f32(b);
    } else {
      // f16: only the class matters here (exponent all ones).
      f = (b & 0x03ff) != 0 ? std::nanf("") : ((b & 0x8000) != 0 ? -INFINITY : INFINITY);
    }
  }
  return std::isnan(f) ? "NaN" : (f > 0 ? "+Inf" : "-Inf");
}

}  // namespace

size_t first_non_finite(DType dtype, const std::byte* p, size_t n) {
  switch (dtype) {
    case DType::kF32:
      return first_bad<uint32_t, 0x7f800000u>(p, n);
    case DType::kBF16:
      return first_bad<uint16_t, 0x7f80>(p, n);
    case DType::kF16:
      return first_bad<uint16_t, 0x7c00>(p, n);
    default:
      return n;
  }
}

size_t first_non_finite_parallel(DType dtype, const std::byte* p, size_t n) {
  // Pieces of 1 MiB: an LLM's 16 MiB chunk is checked on several cores, as
  // it is folded (one thread a stream held a 36B model's uploads to
  // ≈ 3 GB/s). The first bad element is the least of the pieces' firsts.
  constexpr size_t kPieceBytes = size_t{1} << 20;
  const size_t es = dtype_size(dtype);
  if (n * es < 2 * kPieceBytes) return first_non_finite(dtype, p, n);
  std::atomic<size_t> first{n};
  parallel_for(n, kPieceBytes / es, [&](size_t a, size_t b) {
    const size_t bad = first_non_finite(dtype, p + a * es, b - a);
    if (bad == b - a) return;
    size_t seen = first.load();
    while (a + bad < seen && !first.compare_exchange_weak(seen, a + bad)) {
    }
  });
  return first.load();
}

Status FiniteValueCheck::check(uint64_t offset, Payload payload, std::string_view peer, int round) {
  for (auto piece : payload) {
    MEMFL_RETURN_IF_ERROR(check_span(offset, piece, peer, round));
    offset += piece.size();
  }
  return Status::Ok();
}

Status FiniteValueCheck::check_span(uint64_t offset, std::span<const std::byte> bytes, std::string_view peer,
                                    int round) {
  const auto& entries = layout_.entries();
  const uint64_t end = offset + bytes.size();
  auto refuse = [&](const LayoutEntry& e, size_t index, const std::byte* at) {
    return Status(StatusCode::kRejected, fmt::format("{}the update of {} is refused: tensor '{}' element {} is {}",
                                                     round >= 0 ? fmt::format("round {}: ", round) : std::string(),
                                                     peer, e.name, index, describe(e.dtype, at)));
  };
  if (entry_ >= entries.size() || entries[entry_].end() <= offset || entries[entry_].offset > offset) {
    entry_ = layout_.entry_at_or_after(static_cast<size_t>(offset));
    carry_len_ = 0;
  }
  while (offset < end && entry_ < entries.size()) {
    const LayoutEntry& e = entries[entry_];
    if (e.offset >= end) break;  // the rest of this span is padding before it
    if (!dtype_is_float(e.dtype)) {
      if (e.end() > end) break;
      offset = e.end();
      ++entry_;
      continue;
    }
    const size_t es = dtype_size(e.dtype);
    uint64_t at = std::max<uint64_t>(offset, e.offset);
    const uint64_t stop = std::min<uint64_t>(end, e.end());
    const std::byte* base = bytes.data() + (at - (end - bytes.size()));
    // An element cut by the last chunk's edge: its first bytes wait in carry_.
    if (carry_len_ > 0) {
      const size_t take = std::min<uint64_t>(es - carry_len_, stop - at);
      std::memcpy(carry_ + carry_len_, base, take);
      carry_len_ += take;
      at += take;
      base += take;
      if (carry_len_ == es) {
        carry_len_ = 0;
        const size_t index = (at - es - e.offset) / es;
        if (first_non_finite(e.dtype, carry_, 1) == 0) return refuse(e, index, carry_);
      }
    }
    const size_t whole = static_cast<size_t>((stop - at) / es);
    const size_t bad = first_non_finite_parallel(e.dtype, base, whole);
    if (bad < whole) return refuse(e, (at - e.offset) / es + bad, base + bad * es);
    at += whole * es;
    base += whole * es;
    if (at < stop) {  // a cut element: keep its first bytes
      carry_len_ = static_cast<size_t>(stop - at);
      std::memcpy(carry_, base, carry_len_);
      at = stop;
    }
    offset = at;
    if (at == e.end()) ++entry_;
  }
  return Status::Ok();
}

namespace {

class CheckedUpdateStream final : public UpdateStream {
 public:
  CheckedUpdateStream(std::unique_ptr<UpdateStream> inner, const Layout& layout, std::string peer, int round,
                      bool hashed)
      : inner_(std::move(inner)),
        layout_(layout),
        check_(layout),
        peer_(std::move(peer)),
        round_(round),
        hashed_(hashed) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& header, Payload payload) override {
    // The header first (as the aggregator will again): the values are
    // followed by offset, so a chunk out of order must not reach the check.
    MEMFL_RETURN_IF_ERROR(verify_chunk_header(header, payload_size(payload), layout_, next_offset_, peer_));
    Status st = check_.check(header.offset, payload, peer_, round_);
    // Bytes damaged on the way are a checksum error, not the client's
    // values: say which (only a refused chunk is hashed again).
    if (!st.ok() && hashed_ && chunk_checksum(payload) != header.checksum) return checksum_mismatch(header, peer_);
    MEMFL_RETURN_IF_ERROR(st);
    MEMFL_RETURN_IF_ERROR(inner_->accept(header, payload));
    next_offset_ += header.length;
    return Status::Ok();
  }
  Status commit() override { return inner_->commit(); }

 private:
  std::unique_ptr<UpdateStream> inner_;
  const Layout& layout_;
  FiniteValueCheck check_;
  uint64_t next_offset_ = 0;
  std::string peer_;
  int round_;
  bool hashed_;  // false: a local update's chunks, which carry no checksum
};

}  // namespace

StatusOr<std::unique_ptr<UpdateStream>> CheckedUpdateOpener::open_update(const std::string& client_id,
                                                                         double sample_count) {
  return open_checked(client_id, sample_count, /*hashed=*/true);
}

StatusOr<std::unique_ptr<UpdateStream>> CheckedUpdateOpener::open_local_update(const std::string& client_id,
                                                                               double sample_count) {
  return open_checked(client_id, sample_count, /*hashed=*/false);
}

StatusOr<std::unique_ptr<UpdateStream>> CheckedUpdateOpener::open_checked(const std::string& client_id,
                                                                          double sample_count, bool hashed) {
  MEMFL_RETURN_IF_ERROR(check_sample_count(sample_count, limits_, client_id, round_));
  MEMFL_ASSIGN_OR_RETURN(auto inner, hashed ? inner_.open_update(client_id, sample_count)
                                            : inner_.open_local_update(client_id, sample_count));
  return std::unique_ptr<UpdateStream>(
      std::make_unique<CheckedUpdateStream>(std::move(inner), layout_, client_id, round_, hashed));
}

}  // namespace memfl
