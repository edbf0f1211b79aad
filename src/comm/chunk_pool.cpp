#include "comm/chunk_pool.h"

#include "memory/ledger.h"

namespace memfl {

ChunkPool::Lease::~Lease() {
  if (pool_ != nullptr) pool_->give_back(std::move(buffer_));
}

ChunkPool::~ChunkPool() {
  std::lock_guard lock(mu_);
  Ledger::instance().sub(MemoryCategory::kCommBuffers, static_cast<int64_t>(allocated_ * buffer_bytes_));
}

std::optional<ChunkPool::Lease> ChunkPool::acquire(const std::function<bool()>& give_up,
                                                   std::chrono::milliseconds poll) {
  std::unique_lock lock(mu_);
  while (true) {
    if (!free_.empty()) {
      auto buffer = std::move(free_.back());
      free_.pop_back();
      ++leased_;
      return Lease(this, std::move(buffer));
    }
    if (allocated_ < max_buffers_) {
      ++allocated_;
      ++leased_;
      Ledger::instance().add(MemoryCategory::kCommBuffers, static_cast<int64_t>(buffer_bytes_));
      // Uninitialised: a chunk is read into it before any byte is used.
      return Lease(this, std::unique_ptr<std::byte[]>(new std::byte[buffer_bytes_]));
    }
    lock.unlock();
    const bool stop = give_up && give_up();
    lock.lock();
    if (stop) return std::nullopt;
    cv_.wait_for(lock, poll, [&] { return !free_.empty(); });
  }
}

void ChunkPool::give_back(std::unique_ptr<std::byte[]> buffer) {
  {
    std::lock_guard lock(mu_);
    free_.push_back(std::move(buffer));
    --leased_;
  }
  cv_.notify_one();
}

size_t ChunkPool::allocated() const {
  std::lock_guard lock(mu_);
  return allocated_;
}

size_t ChunkPool::leased() const {
  std::lock_guard lock(mu_);
  return leased_;
}

}  // namespace memfl
