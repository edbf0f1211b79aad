#include "io/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace memfl {

Status fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return internal_error("{}: cannot open to fsync: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return internal_error("{}: fsync failed: {}", path, std::strerror(errno));
  return Status::Ok();
}

Status write_text_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return not_found("{}: cannot write", tmp);
    out << text;
    out.flush();
    if (!out) return internal_error("{}: write failed", tmp);
  }
  MEMFL_RETURN_IF_ERROR(fsync_path(tmp, false));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return internal_error("{}: rename from {} failed: {}", path, tmp, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace memfl
