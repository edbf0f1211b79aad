// SpoolFile: an unnamed scratch file (O_TMPFILE, gone with the process even
// after a crash) that holds model-sized byte ranges by pwrite/pread, so what
// waits to be folded sits in the page cache, not in anonymous memory. The
// FedAvg fold spools updates that arrive before their turn; the asynchronous
// simulator spools each in-flight client's trained model until its virtual
// arrival time.
//
//   SpoolFile spool("fold spool");
//   MEMFL_RETURN_IF_ERROR(spool.open(run_dir));
//   MEMFL_RETURN_IF_ERROR(spool.write(slot * model_bytes, chunk));
//   MEMFL_RETURN_IF_ERROR(spool.read(slot * model_bytes + off, block));
//   spool.release(slot * model_bytes, model_bytes);   // disk given back
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"

namespace memfl {

class SpoolFile {
 public:
  // `what` names the spool in error messages ("fold spool").
  explicit SpoolFile(std::string what) : what_(std::move(what)) {}
  ~SpoolFile();
  SpoolFile(const SpoolFile&) = delete;
  SpoolFile& operator=(const SpoolFile&) = delete;

  // Creates the file in `dir` (empty: the system's temporary directory);
  // opening an open spool does nothing.
  Status open(const std::string& dir);
  Status write(uint64_t at, std::span<const std::byte> bytes);
  Status read(uint64_t at, std::span<std::byte> into) const;
  // Gives a range's disk blocks back (hole punching) once it is read.
  void release(uint64_t at, uint64_t length);
  void clear();

 private:
  std::string what_;
  int fd_ = -1;
  std::string dir_;
};

}  // namespace memfl
