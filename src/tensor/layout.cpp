#include "tensor/layout.h"

#include <xxhash.h>

#include <algorithm>
#include <unordered_set>

namespace memfl {

size_t LayoutEntry::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

size_t Layout::payload_bytes() const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.nbytes();
  return n;
}

size_t Layout::num_params() const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.numel();
  return n;
}

const LayoutEntry* Layout::find(std::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

size_t Layout::entry_at_or_after(size_t offset) const {
  auto it = std::upper_bound(entries_.begin(), entries_.end(), offset,
                             [](size_t off, const LayoutEntry& e) { return off < e.end(); });
  return static_cast<size_t>(it - entries_.begin());
}

LayoutBuilder& LayoutBuilder::add(std::string name, DType dtype, std::vector<int64_t> shape) {
  LayoutEntry e;
  e.name = std::move(name);
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.offset = next_offset_;
  bool valid = std::all_of(e.shape.begin(), e.shape.end(), [](int64_t d) { return d >= 0; });
  size_t nbytes = valid ? e.nbytes() : 0;
  next_offset_ = (e.offset + nbytes + kEntryAlignment - 1) / kEntryAlignment * kEntryAlignment;
  entries_.push_back(std::move(e));
  return *this;
}

StatusOr<Layout> LayoutBuilder::build() && {
  std::unordered_set<std::string_view> names;
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const auto& e : entries_) {
    if (!names.insert(e.name).second) {
      XXH3_freeState(state);
      return invalid_argument("layout: duplicate tensor name '{}'", e.name);
    }
    for (int64_t d : e.shape) {
      if (d < 0) {
        XXH3_freeState(state);
        return invalid_argument("layout: tensor '{}' has negative dimension {}", e.name, d);
      }
    }
    XXH3_64bits_update(state, e.name.data(), e.name.size() + 0);
    uint8_t sep = 0;
    XXH3_64bits_update(state, &sep, 1);
    uint8_t dt = static_cast<uint8_t>(e.dtype);
    XXH3_64bits_update(state, &dt, 1);
    uint64_t rank = e.shape.size();
    XXH3_64bits_update(state, &rank, sizeof rank);
    XXH3_64bits_update(state, e.shape.data(), e.shape.size() * sizeof(int64_t));
    uint64_t off = e.offset;
    XXH3_64bits_update(state, &off, sizeof off);
  }
  Layout layout;
  layout.hash_ = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  layout.total_bytes_ = next_offset_;
  layout.entries_ = std::move(entries_);
  return layout;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} {}", bytes, units[u]) : fmt::format("{:.2f} {}", bytes, units[u]);
}

}  // namespace memfl
