// Layout: where each named tensor of a model lives in its arena.
//
// A model is an arena (one flat aligned buffer) plus a layout (name, dtype,
// shape, byte offset per entry). Two processes agree on a model when their
// layout hashes agree; every chunk on the wire names that hash.
//
//   LayoutBuilder b;
//   b.add("conv1.weight", DType::kF32, {32, 1, 5, 5});
//   Layout layout = std::move(b).build();
//   Arena arena(layout.total_bytes());
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "tensor/dtype.h"

namespace memfl {

// Every entry starts on this boundary, so libtorch views and vector loops see
// aligned data. Bytes between entries are padding and carry no meaning.
inline constexpr size_t kEntryAlignment = 64;

struct LayoutEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t offset = 0;  // byte offset in the arena
  size_t numel() const;
  size_t nbytes() const { return numel() * dtype_size(dtype); }
  size_t end() const { return offset + nbytes(); }
};

class Layout {
 public:
  Layout() = default;
  const std::vector<LayoutEntry>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }
  // Arena bytes including alignment padding.
  size_t total_bytes() const { return total_bytes_; }
  // Bytes of tensor data only (what a safetensors file holds).
  size_t payload_bytes() const;
  size_t num_params() const;  // total elements
  // xxh3-64 over names, dtypes, shapes and offsets: two layouts with the same
  // hash put the same tensors at the same bytes.
  uint64_t hash() const { return hash_; }
  const LayoutEntry* find(std::string_view name) const;
  // Index of the entry whose bytes contain or follow `offset` (the first entry
  // with end() > offset), or size() when none.
  size_t entry_at_or_after(size_t offset) const;

 private:
  friend class LayoutBuilder;
  std::vector<LayoutEntry> entries_;
  size_t total_bytes_ = 0;
  uint64_t hash_ = 0;
};

class LayoutBuilder {
 public:
  // Appends an entry at the next aligned offset. Duplicate names or negative
  // dimensions are reported by build().
  LayoutBuilder& add(std::string name, DType dtype, std::vector<int64_t> shape);
  StatusOr<Layout> build() &&;

 private:
  std::vector<LayoutEntry> entries_;
  size_t next_offset_ = 0;
};

std::string format_bytes(double bytes);

}  // namespace memfl
