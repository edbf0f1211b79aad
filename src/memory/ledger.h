// Ledger: bytes held per category (model, gradients, optimizer state,
// communication buffers, aggregation, data), current and peak, kept by the
// code that allocates them. The sampler's RSS says how much; the ledger says
// what for. Lock-free: updates are relaxed atomics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace memfl {

enum class MemoryCategory : uint8_t {
  kModel = 0,
  kGradients,
  kOptimizer,
  kCommBuffers,
  kAggregation,
  kData,
  kOther,
  kCount
};

std::string_view memory_category_name(MemoryCategory c);

struct LedgerSnapshot {
  std::array<int64_t, static_cast<size_t>(MemoryCategory::kCount)> current{};
  std::array<int64_t, static_cast<size_t>(MemoryCategory::kCount)> peak{};
};

class Ledger {
 public:
  static Ledger& instance();
  void add(MemoryCategory c, int64_t bytes);
  void sub(MemoryCategory c, int64_t bytes) { add(c, -bytes); }
  // Sets a category to an absolute value (for state owned by libraries, such
  // as optimizer moments, measured after the fact).
  void set(MemoryCategory c, int64_t bytes);
  int64_t current(MemoryCategory c) const;
  int64_t peak(MemoryCategory c) const;
  LedgerSnapshot snapshot() const;
  void reset_peaks();

 private:
  std::array<std::atomic<int64_t>, static_cast<size_t>(MemoryCategory::kCount)> current_{};
  std::array<std::atomic<int64_t>, static_cast<size_t>(MemoryCategory::kCount)> peak_{};
};

}  // namespace memfl
