#include "tensor/arena.h"

#include "memory/alloc_tracker.h"

#include <sys/mman.h>

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
    // MAP_POPULATE (when asked): one batch of page faults here rather than
    // one at a time in the middle of the first download, which halved its
    // throughput.
    void* p =
        mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0), -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
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
}

Arena::Arena(Arena&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      category_(other.category_) {}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
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
