// Files and directories a user names (a config, a data set, a model file):
// opened as what they must be, with a size limit that fits them, so that a
// FIFO waits for no writer, /dev/zero is not read until memory runs out and
// a directory is not taken for an empty file. Every refusal names the key
// (or the argument) and what the path turned out to be.
//
//   MEMFL_ASSIGN_OR_RETURN(std::string yaml, read_input_file(path, "CONFIG", kConfigFileLimit));
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memfl {

// Size limits by what the file is (a limit is a refusal, not a truncation).
inline constexpr uint64_t kConfigFileLimit = uint64_t{4} << 20;        // YAML configs are a few KiB
inline constexpr uint64_t kTextCorpusLimit = uint64_t{2} << 30;        // held whole, then copied into sequences
inline constexpr uint64_t kIdxFileLimit = uint64_t{16} << 30;          // read_idx_file's own data bound
inline constexpr uint64_t kTorchScriptFileLimit = uint64_t{16} << 30;  // a module with its weights

// What a path that is not a regular file is, for messages: "a directory",
// "a FIFO", "a character device" ...
std::string describe_file_type(unsigned mode);

// An open regular file: its descriptor (closed by the destructor) and size.
class InputFile {
 public:
  InputFile() = default;
  InputFile(InputFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  InputFile& operator=(InputFile&& o) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();
  int fd() const { return fd_; }
  uint64_t size() const { return size_; }
  // Hands the descriptor over (to gzdopen, say), which then closes it.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  friend StatusOr<InputFile> open_input_file(const std::string&, std::string_view, uint64_t);
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Opens `path` for reading if it is a regular file of at most `max_bytes`;
// `what` names it in errors ("CONFIG", "client_configs.data_configs.dataset_path").
// Opening never blocks: a FIFO is opened non-blocking, seen for what it is and
// refused before anything is read.
[[nodiscard]] StatusOr<InputFile> open_input_file(const std::string& path, std::string_view what, uint64_t max_bytes);

// The whole of a regular file of at most `max_bytes`.
[[nodiscard]] StatusOr<std::string> read_input_file(const std::string& path, std::string_view what, uint64_t max_bytes);

// For a file another library opens by name (libtorch's loader): refuses a
// path that exists and is not a regular file of at most `max_bytes`. A
// missing path passes: the loader says so in its own words, and a process
// that never loads the file (a server checking a client's config) is not
// refused for it.
[[nodiscard]] Status check_input_file_if_present(const std::string& path, std::string_view what, uint64_t max_bytes);

// Refuses a path that is not a directory, saying whether it is missing or
// what it is instead.
[[nodiscard]] Status check_input_dir(const std::string& path, std::string_view what);

}  // namespace memfl
