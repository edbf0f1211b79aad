// safetensors read and write, the weights format of the Hugging Face
// ecosystem: an 8-byte little-endian header length, a JSON header
// ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}), then
// the tensors' bytes back to back.
//
// Reading maps the file (no copy); every size and offset in the header is
// checked against the file before a byte is used, since a file is input.
// Writing streams each tensor from its arena to a temporary file that is
// renamed into place, so a crash never leaves a half-written checkpoint.
//
//   auto file = SafetensorsFile::open("model.safetensors");
//   MEMFL_RETURN_IF_ERROR(file->load_into(layout, arena));
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // points into the mapping
  uint64_t file_offset = 0;         // where `data` starts in the file (for pread)
};

class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in file order (by data offset).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsTensor* find(std::string_view name) const;
  // The layout of these tensors as an arena would hold them (file order).
  StatusOr<Layout> layout() const;
  // Copies every tensor of `layout` from the file into `arena`, by name, with
  // dtype and shape checks. Tensors in the file but not in the layout are an
  // error too, so a wrong checkpoint is not half-loaded silently. Every check
  // runs before the first byte is copied.
  Status load_into(const Layout& layout, Arena& arena) const;
  // Copies every tensor of this file into the entry of `layout` with the same
  // name (dtype and shape checked, all before the first copy); entries of
  // `layout` that the file lacks are left as they are. A tensor of the file
  // that `layout` lacks is an error. One shard of a sharded checkpoint is
  // loaded this way (tensor/sharded_safetensors.h).
  Status copy_into(const Layout& layout, Arena& arena) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// What precedes a safetensors file's data: the 8-byte little-endian length
// and the JSON header of `entries` packed back to back in their order, padded
// with spaces so the data starts at a multiple of `data_alignment` (8 for a
// plain file, the page size for one whose data is mapped as an arena).
std::string safetensors_prefix(std::span<const LayoutEntry> entries, const std::map<std::string, std::string>& metadata,
                               size_t data_alignment);

// Writes the tensors of `layout` from `arena` to `path` (atomically, through
// `path`.tmp and rename).
Status write_safetensors(const std::string& path, const Layout& layout, const Arena& arena,
                         const std::map<std::string, std::string>& metadata = {});
// The same for some entries of a layout (in the order given; their offsets
// are where their bytes lie in `arena`): one shard of a sharded checkpoint.
Status write_safetensors(const std::string& path, std::span<const LayoutEntry> entries, const Arena& arena,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace memfl
