#include "tensor/safetensors_arena.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tensor/safetensors.h"

namespace memfl {

bool layout_is_dense(const Layout& layout) {
  size_t pos = 0;
  for (const auto& e : layout.entries()) {
    if (e.offset != pos) return false;
    pos += e.nbytes();
  }
  return pos == layout.total_bytes();  // no padding after the last one either
}

StatusOr<Arena> create_safetensors_arena(const std::string& path, const Layout& layout,
                                         const std::map<std::string, std::string>& metadata, MemoryCategory category) {
  if (!layout_is_dense(layout)) {
    return failed_precondition(
        "{}: the model's layout has padding between tensors, which a safetensors file cannot hold; "
        "it can live in a scratch file instead",
        path);
  }
  const std::string prefix = safetensors_prefix(layout.entries(), metadata, static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  const size_t data_offset = prefix.size();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return not_found("{}: cannot write: {}", path, std::strerror(errno));
  bool ok = std::fwrite(prefix.data(), 1, prefix.size(), f) == prefix.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return internal_error("{}: write failed: {}", path, std::strerror(errno));
  // The data region is grown as a hole: zero, and on disk only once written.
  return Arena::map_file(path, data_offset, layout.total_bytes(), /*writable=*/true, category);
}

StatusOr<Arena> open_safetensors_arena(const std::string& path, const Layout& layout, bool writable,
                                       MemoryCategory category) {
  size_t data_offset = 0;
  {
    MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    const auto& tensors = file->tensors();
    if (tensors.size() != layout.size()) {
      return data_loss("{}: holds {} tensors, the model has {}", path, tensors.size(), layout.size());
    }
    if (!layout_is_dense(layout)) return failed_precondition("{}: the model's layout is not dense", path);
    const std::byte* base = tensors.empty() ? nullptr : tensors.front().data.data();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      const auto& e = layout.entries()[i];
      if (t.name != e.name || t.dtype != e.dtype || t.shape != e.shape ||
          static_cast<size_t>(t.data.data() - base) != e.offset) {
        return data_loss("{}: tensor {} is {} {} at byte {}, the model expects {} {} at byte {}", path, i, t.name,
                         dtype_name(t.dtype), static_cast<size_t>(t.data.data() - base), e.name, dtype_name(e.dtype),
                         e.offset);
      }
    }
    uint64_t header_len = 0;
    FILE* f = std::fopen(path.c_str(), "rb");
    uint8_t len[8] = {};
    const bool read = f != nullptr && std::fread(len, 1, 8, f) == 8;
    if (f != nullptr) std::fclose(f);
    if (!read) return data_loss("{}: cannot read its header length", path);
    for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len[i]) << (8 * i);
    data_offset = 8 + header_len;
  }
  return Arena::map_file(path, data_offset, layout.total_bytes(), writable, category);
}

}  // namespace memfl
