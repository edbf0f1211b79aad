// Files written whole or not at all, for commits: a leaf every layer may use
// (it includes nothing of memfl but Status).
//
//   MEMFL_RETURN_IF_ERROR(write_text_file_durably(dir + "/state.json", text));
//   MEMFL_RETURN_IF_ERROR(fsync_path(dir, /*directory=*/true));
#pragma once

#include <string>

#include "common/status.h"

namespace memfl {

// Writes `text` to `path` as a whole or not at all: a new file, fsynced, then
// renamed over `path` (a crash leaves the old file or the new one).
[[nodiscard]] Status write_text_file_durably(const std::string& path, const std::string& text);
// fsync of a file or (directory) of a folder's entries, naming the path.
[[nodiscard]] Status fsync_path(const std::string& path, bool directory);

}  // namespace memfl
