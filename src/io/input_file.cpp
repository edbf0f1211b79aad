#include "io/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace memfl {

namespace {

std::string human_bytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1 << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20));
  return fmt::format("{} bytes", b);
}

Status not_regular(const std::string& path, std::string_view what, unsigned mode) {
  return invalid_argument("{}: '{}' is {}, not a regular file; nothing was read from it", what, path,
                          describe_file_type(mode));
}

Status too_large(const std::string& path, std::string_view what, uint64_t size, uint64_t max_bytes) {
  return invalid_argument("{}: '{}' holds {} ({} bytes), more than the {} such a file may hold", what, path,
                          human_bytes(size), size, human_bytes(max_bytes));
}

Status stat_error(const std::string& path, std::string_view what, int err) {
  if (err == ENOENT || err == ENOTDIR) return not_found("{}: '{}' does not exist", what, path);
  return invalid_argument("{}: '{}' cannot be opened: {}", what, path, std::strerror(err));
}

}  // namespace

std::string describe_file_type(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO (named pipe)";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "not a file";
  }
}

InputFile& InputFile::operator=(InputFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    size_ = o.size_;
    o.fd_ = -1;
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

StatusOr<InputFile> open_input_file(const std::string& path, std::string_view what, uint64_t max_bytes) {
  if (path.empty()) return invalid_argument("{}: the path is empty", what);
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
  // writer forever, before fstat could tell what it is.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return stat_error(path, what, errno);
  InputFile f;
  f.fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return stat_error(path, what, errno);
  if (!S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) return too_large(path, what, size, max_bytes);
  // Regular files ignore O_NONBLOCK; cleared anyway so that whoever reads the
  // descriptor (zlib) sees the ordinary blocking semantics.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  f.size_ = size;
  return f;
}

StatusOr<std::string> read_input_file(const std::string& path, std::string_view what, uint64_t max_bytes) {
  MEMFL_ASSIGN_OR_RETURN(InputFile f, open_input_file(path, what, max_bytes));
  std::string out;
  out.resize(static_cast<size_t>(f.size()));
  size_t got = 0;
  // Read to the end, not to the size fstat gave: a file that grows while it
  // is read still stops at the limit.
  for (;;) {
    if (got == out.size()) {
      if (out.size() >= max_bytes + 1) break;
      out.resize(std::min<uint64_t>(max_bytes + 1, std::max<uint64_t>(out.size() * 2, 4096)));
    }
    const ssize_t n = ::read(f.fd(), out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return data_loss("{}: reading '{}' failed: {}", what, path, std::strerror(errno));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) return too_large(path, what, got, max_bytes);
  out.resize(got);
  return out;
}

Status check_input_file_if_present(const std::string& path, std::string_view what, uint64_t max_bytes) {
  if (path.empty()) return Status::Ok();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::Ok();
  if (!S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return too_large(path, what, static_cast<uint64_t>(st.st_size), max_bytes);
  }
  return Status::Ok();
}

Status check_input_dir(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return not_found("{}: directory '{}' does not exist", what, path);
    return invalid_argument("{}: '{}' cannot be read: {}", what, path, std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode)) {
    return invalid_argument("{}: '{}' is {}, not a directory", what, path, describe_file_type(st.st_mode));
  }
  return Status::Ok();
}

}  // namespace memfl
