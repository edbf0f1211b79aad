// A model-sized buffer for the raw reference programs, advised to use
// transparent huge pages and touched before any timing, as memfl's arenas
// are (memory/arena.cpp). On the AMD EPYC VM of 2026-11-27 (THP `madvise`)
// a 4 KiB-paged 1 GiB buffer moved at a fraction of a huge-paged one (a TLB
// walk per 4 KiB under nested paging), so a raw program without the advice
// measured the page size, not the transport.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

class HugeBuffer {
 public:
  HugeBuffer(size_t bytes, int fill) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
#ifdef MADV_HUGEPAGE
    (void)::madvise(p, bytes_, MADV_HUGEPAGE);  // refused where THP is off: 4 KiB pages then
#endif
    data_ = static_cast<char*>(p);
    std::memset(data_, fill, bytes_);  // resident: no page faults in the timed part
  }
  ~HugeBuffer() { ::munmap(data_, bytes_); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  char* data() { return data_; }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  char* data_;
};
