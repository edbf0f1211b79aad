// A safetensors file whose data region *is* an arena: the file is mapped
// (MAP_SHARED) and the model's tensors are written and read in place. A
// file-backed server keeps its global model this way, so its checkpoint is
// the model itself — no second copy in memory or on disk — and the page cache,
// not anonymous memory, holds what is hot.
//
// Possible when the layout is dense (every entry's bytes end where the next
// begins, as safetensors requires: no holes), which holds when every tensor's
// size is a multiple of kEntryAlignment — true of every llama spec. The JSON
// header is padded with spaces (allowed by the format) so the data starts on
// a page boundary and can be mapped.
//
//   MEMFL_ASSIGN_OR_RETURN(Arena a, create_safetensors_arena(path + ".tmp", layout, {{"round", "3"}}));
//   ...fill a...; MEMFL_RETURN_IF_ERROR(a.sync()); rename(path + ".tmp", path);
#pragma once

#include <map>
#include <string>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// Whether the arena offsets of `layout` are the offsets of a safetensors
// file of its tensors in layout order (no padding between entries).
bool layout_is_dense(const Layout& layout);

// Creates (truncating) `path` as a safetensors file of `layout` whose data
// is zero, and maps its data region writable.
StatusOr<Arena> create_safetensors_arena(const std::string& path, const Layout& layout,
                                         const std::map<std::string, std::string>& metadata,
                                         MemoryCategory category = MemoryCategory::kModel);

// Maps the data region of an existing safetensors file after checking that
// its header describes exactly `layout` (names, dtypes, shapes, offsets) and
// that its data starts on a page boundary; the error names the file and the
// first difference.
StatusOr<Arena> open_safetensors_arena(const std::string& path, const Layout& layout, bool writable,
                                       MemoryCategory category = MemoryCategory::kModel);

}  // namespace memfl
