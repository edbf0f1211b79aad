#include "tensor/arena.h"

#include "common/parallel.h"
#include "memory/alloc_tracker.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace memfl {

namespace {
// Above this size the arena is its own mapping (see the header comment).
constexpr size_t kMmapThreshold = 1u << 20;
}  // namespace

Arena::Arena(size_t size, MemoryCategory category, bool populate) : size_(size), category_(category) {
  if (size == 0) return;
  if (size >= kMmapThreshold) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // Transparent huge pages, asked for (the kernel's default, `madvise`,
    // gives them only so): a model-sized arena in 4 KiB pages cost a page
    // fault per 4 KiB on first touch and a TLB walk per 4 KiB on every pass.
    // Measured on the 2-core AMD EPYC VM (docs/BENCHMARKS.md, "MPI"): 4 GiB over MPI, 1 client, round 1's download
    // 0.5–0.6 → 6–9.5 GB/s, round 2's 4.0–6.4 → 11.0–13.1 GB/s, with the same peak RSS. Advice only: where THP is off
    // the arena is in small pages, as before.
    (void)madvise(p, size, MADV_HUGEPAGE);
    // Populated when asked: one batch of page faults here rather than one at
    // a time in the middle of the first download, which halved its
    // throughput. After the advice, so that the pages come huge
    // (MAP_POPULATE would fault them in small pages first); kernels before
    // 5.14 lack MADV_POPULATE_WRITE, and a write per page does the same.
    // In pieces on several threads: the kernel zeroes each page it hands
    // out, and one thread zeroing a 141 GB arena took minutes.
    if (populate) {
      constexpr size_t kPiece = size_t{64} << 20;  // whole huge pages
      auto* base = static_cast<char*>(p);
      parallel_for((size + kPiece - 1) / kPiece, 1, [&](size_t i0, size_t i1) {
        char* from = base + i0 * kPiece;
        const size_t len = std::min(size, i1 * kPiece) - i0 * kPiece;
        if (madvise(from, len, MADV_POPULATE_WRITE) != 0) {
          const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
          for (size_t at = 0; at < len; at += page) static_cast<volatile char*>(from)[at] = 0;
        }
      });
    }
    data_ = static_cast<std::byte*>(p);
    mapped_ = size;
    track_mapping(p, size);  // not malloc: tell the allocation tracker
  } else {
    size_t rounded = (size + 63) / 64 * 64;
    data_ = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_, 0, rounded);
  }
  Ledger::instance().add(category_, static_cast<int64_t>(size_));
}

StatusOr<Arena> Arena::scratch_file(const std::string& dir, size_t size, MemoryCategory category) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  std::string shown = dir + "/<unnamed scratch file>";
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // File systems without O_TMPFILE: a named file unlinked at once.
    std::string templ = dir + "/memfl-arena-XXXXXX";
    fd = mkstemp(templ.data());
    if (fd >= 0) {
      ::unlink(templ.c_str());
      shown = templ;
    }
  }
  if (fd < 0) return not_found("scratch_dir {}: cannot create a scratch file: {}", dir, std::strerror(errno));
  if (size > 0 && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    return resource_exhausted("{}: cannot size to {} bytes: {}", shown, size, std::strerror(err));
  }
  // Reserve the blocks now: a sparse file on a full disk maps fine and then
  // kills the process with SIGBUS at the first page it cannot back.
  if (size > 0) {
    if (const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
      ::close(fd);
      return resource_exhausted("{}: cannot reserve {} bytes on disk: {} (memory_configs.scratch_dir)", shown, size,
                                std::strerror(err));
    }
  }
  Arena a;
  a.category_ = category;
  a.size_ = size;
  a.file_backed_ = true;
  if (size > 0) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return internal_error("{}: mmap of {} bytes failed: {}", shown, size, std::strerror(err));
    }
    a.data_ = static_cast<std::byte*>(p);
    a.mapped_ = size;
    track_mapping(p, size);
  }
  ::close(fd);  // the mapping keeps the file alive
  Ledger::instance().add(category, static_cast<int64_t>(size));
  return a;
}

StatusOr<Arena> Arena::map_file(const std::string& path, size_t offset, size_t size, bool writable,
                                MemoryCategory category) {
  const long page = sysconf(_SC_PAGESIZE);
  if (offset % static_cast<size_t>(page) != 0) {
    return invalid_argument("{}: offset {} is not a multiple of the page size {}", path, offset, page);
  }
  int fd = ::open(path.c_str(), (writable ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC, 0644);
  if (fd < 0) return not_found("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return not_found("{}: cannot stat: {}", path, std::strerror(errno));
  }
  const size_t need = offset + size;
  if (static_cast<size_t>(st.st_size) < need) {
    if (!writable) {
      ::close(fd);
      return data_loss("{}: file is {} bytes, the arena needs {}", path, st.st_size, need);
    }
    if (::ftruncate(fd, static_cast<off_t>(need)) != 0) {
      const int err = errno;
      ::close(fd);
      return resource_exhausted("{}: cannot grow to {} bytes: {}", path, need, std::strerror(err));
    }
  }
  // A writable mapping's blocks are reserved now (see scratch_file): ENOSPC
  // here is an error naming the file, not a SIGBUS later.
  if (writable && size > 0) {
    if (const int err = ::posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(size)); err != 0) {
      ::close(fd);
      return resource_exhausted("{}: cannot reserve {} bytes on disk: {}", path, size, std::strerror(err));
    }
  }
  Arena a;
  a.category_ = category;
  a.size_ = size;
  a.file_backed_ = true;
  if (size > 0) {
    void* p =
        mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, static_cast<off_t>(offset));
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return internal_error("{}: mmap of {} bytes at {} failed: {}", path, size, offset, std::strerror(err));
    }
    a.data_ = static_cast<std::byte*>(p);
    a.mapped_ = size;
    track_mapping(p, size);
  }
  ::close(fd);
  Ledger::instance().add(category, static_cast<int64_t>(size));
  return a;
}

Status Arena::sync() {
  if (!file_backed_ || mapped_ == 0) return Status::Ok();
  if (msync(data_, mapped_, MS_SYNC) != 0)
    return internal_error("msync of a file-backed arena failed: {}", std::strerror(errno));
  return Status::Ok();
}

void Arena::release_pages() {
  if (mapped_ == 0) return;
  // For a shared file mapping this only drops clean pages from this
  // process's RSS; the data stays in the file.
  if (file_backed_) madvise(data_, mapped_, MADV_DONTNEED);
}

void Arena::release_pages(size_t offset, size_t length) {
  if (mapped_ == 0 || !file_backed_ || length == 0 || offset >= size_) return;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t from = offset / page * page;
  const size_t to = std::min(mapped_, (std::min(size_, offset + length) + page - 1) / page * page);
  if (to > from) madvise(data_ + from, to - from, MADV_DONTNEED);
}

Arena::~Arena() { release(); }

void Arena::release() {
  if (data_ == nullptr) return;
  if (mapped_ > 0) {
    untrack_mapping(data_);
    munmap(data_, mapped_);
  } else {
    std::free(data_);
  }
  Ledger::instance().sub(category_, static_cast<int64_t>(size_));
  data_ = nullptr;
  size_ = 0;
  mapped_ = 0;
  file_backed_ = false;
}

Arena::Arena(Arena&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      file_backed_(std::exchange(other.file_backed_, false)),
      category_(other.category_) {}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    file_backed_ = std::exchange(other.file_backed_, false);
    category_ = other.category_;
  }
  return *this;
}

std::span<std::byte> Arena::bytes(size_t offset, size_t length) {
  assert(offset <= size_ && length <= size_ - offset);
  return {data_ + offset, length};
}

std::span<const std::byte> Arena::bytes(size_t offset, size_t length) const {
  assert(offset <= size_ && length <= size_ - offset);
  return {data_ + offset, length};
}

void Arena::zero() {
  if (data_ != nullptr) std::memset(data_, 0, size_);
}

}  // namespace memfl
