#include "io/spool_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace memfl {

SpoolFile::~SpoolFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SpoolFile::open(const std::string& dir) {
  if (fd_ >= 0) return Status::Ok();
  dir_ = dir.empty() ? std::filesystem::temp_directory_path().string() : dir;
  fd_ = ::open(dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd_ < 0) {  // a file system without O_TMPFILE: a named file, unlinked at once
    std::string tmpl = dir_ + "/memfl-spool-XXXXXX";
    fd_ = ::mkstemp(tmpl.data());
    if (fd_ >= 0) ::unlink(tmpl.c_str());
  }
  if (fd_ < 0) return resource_exhausted("{} in {}: {}", what_, dir_, std::strerror(errno));
  return Status::Ok();
}

Status SpoolFile::write(uint64_t at, std::span<const std::byte> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return resource_exhausted("{} in {}: write of {} bytes failed: {}", what_, dir_, bytes.size(),
                                std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status SpoolFile::read(uint64_t at, std::span<std::byte> into) const {
  size_t done = 0;
  while (done < into.size()) {
    const ssize_t n = ::pread(fd_, into.data() + done, into.size() - done, static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return resource_exhausted("{} in {}: read of {} bytes failed: {}", what_, dir_, into.size(),
                                std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

void SpoolFile::release(uint64_t at, uint64_t length) {
  if (fd_ >= 0 && length > 0)
    (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(at),
                      static_cast<off_t>(length));
}

void SpoolFile::clear() {
  // Best effort, as release(): a spool that keeps its old bytes is only
  // bigger on disk (glibc's warn_unused_result ignores a (void) cast).
  if (fd_ >= 0 && ::ftruncate(fd_, 0) != 0) return;
}

}  // namespace memfl
