// Arena: the one flat, aligned buffer a model's tensors live in.
//
// Move-only and RAII. Large arenas are anonymous mmaps, so their pages are
// zero, touched only when written, and returned to the kernel on free (malloc
// would keep them in its heap), advised to use transparent huge pages (a
// fault and a TLB entry per 2 MiB, not per 4 KiB); small ones come from
// aligned_alloc. The bytes
// are counted in the ledger under the category given at construction.
//
//   Arena global(layout.total_bytes(), MemoryCategory::kModel);
//   std::span<std::byte> w = global.bytes(entry.offset, entry.nbytes());
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "common/status.h"

#include "memory/ledger.h"

namespace memfl {

class Arena {
 public:
  Arena() = default;
  // Zero-filled buffer of `size` bytes, aligned to 64. `populate` faults
  // every page in now (one batch in the kernel) instead of one by one on
  // first write: right for an arena that is about to receive a model at
  // line rate; wrong where its pages are written one tensor at a time while
  // the tensors' old storage is freed (binding a libtorch module), since it
  // would hold both at once.
  Arena(size_t size, MemoryCategory category, bool populate = false);
  // File-backed arenas (memory_configs.arena_backing: file): the bytes are a
  // shared mapping of a file, so they are page cache the kernel can write
  // back and drop, not anonymous memory — a model larger than free RAM can be
  // received, aggregated and sent. `scratch_file` makes an unnamed file in
  // `dir` (O_TMPFILE: gone when the arena is, even after a crash);
  // `map_file` maps [offset, offset + size) of `path` (offset a multiple of
  // the page size), growing the file when `writable` and it is shorter.
  static StatusOr<Arena> scratch_file(const std::string& dir, size_t size, MemoryCategory category);
  static StatusOr<Arena> map_file(const std::string& path, size_t offset, size_t size, bool writable,
                                  MemoryCategory category);
  bool file_backed() const { return file_backed_; }
  // Writes a file-backed arena's dirty pages to its file (msync); a no-op
  // for anonymous memory.
  Status sync();
  // Tells the kernel these pages will not be needed soon (file-backed: they
  // may be dropped from the page cache once written back).
  void release_pages();
  // The same for the pages that hold bytes [offset, offset + length) (whole
  // pages around them: a shared file mapping loses nothing by it).
  void release_pages(size_t offset, size_t length);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> bytes() { return {data_, size_}; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  // Bounds are the caller's bug, not input: asserted.
  std::span<std::byte> bytes(size_t offset, size_t length);
  std::span<const std::byte> bytes(size_t offset, size_t length) const;
  template <typename T>
  T* as(size_t offset) {
    return reinterpret_cast<T*>(data_ + offset);
  }
  template <typename T>
  const T* as(size_t offset) const {
    return reinterpret_cast<const T*>(data_ + offset);
  }
  void zero();

 private:
  void release();
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // >0 when data_ is an mmap of this many bytes
  bool file_backed_ = false;
  MemoryCategory category_ = MemoryCategory::kOther;
};

}  // namespace memfl
