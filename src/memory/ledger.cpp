#include "memory/ledger.h"

namespace memfl {

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kModel:
      return "model";
    case MemoryCategory::kGradients:
      return "gradients";
    case MemoryCategory::kOptimizer:
      return "optimizer";
    case MemoryCategory::kCommBuffers:
      return "comm_buffers";
    case MemoryCategory::kAggregation:
      return "aggregation";
    case MemoryCategory::kData:
      return "data";
    case MemoryCategory::kOther:
      return "other";
    case MemoryCategory::kCount:
      break;
  }
  return "?";
}

Ledger& Ledger::instance() {
  // Leaked on purpose: arenas freed by static destructors still find it.
  static Ledger* ledger = new Ledger();
  return *ledger;
}

static void raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t prev = peak.load(std::memory_order_relaxed);
  while (value > prev && !peak.compare_exchange_weak(prev, value, std::memory_order_relaxed)) {
  }
}

void Ledger::add(MemoryCategory c, int64_t bytes) {
  auto i = static_cast<size_t>(c);
  int64_t now = current_[i].fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise_peak(peak_[i], now);
}

void Ledger::set(MemoryCategory c, int64_t bytes) {
  auto i = static_cast<size_t>(c);
  current_[i].store(bytes, std::memory_order_relaxed);
  raise_peak(peak_[i], bytes);
}

int64_t Ledger::current(MemoryCategory c) const {
  return current_[static_cast<size_t>(c)].load(std::memory_order_relaxed);
}
int64_t Ledger::peak(MemoryCategory c) const { return peak_[static_cast<size_t>(c)].load(std::memory_order_relaxed); }

LedgerSnapshot Ledger::snapshot() const {
  LedgerSnapshot s;
  for (size_t i = 0; i < s.current.size(); ++i) {
    s.current[i] = current_[i].load(std::memory_order_relaxed);
    s.peak[i] = peak_[i].load(std::memory_order_relaxed);
  }
  return s;
}

void Ledger::reset_peaks() {
  for (size_t i = 0; i < peak_.size(); ++i) peak_[i].store(current_[i].load());
}

}  // namespace memfl
