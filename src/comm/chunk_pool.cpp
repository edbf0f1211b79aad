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

std::optional<ChunkPool::Lease> ChunkPool::acquire(const std::function<bool()>& give_up, uint64_t order,
                                                   std::chrono::milliseconds poll) {
  std::unique_lock lock(mu_);
  // Taken at once only when nobody who comes first is waiting (a buffer
  // that comes back goes straight to the first waiter, so a free one means
  // none waits, but one allocated fresh must not jump the queue either).
  const bool first = waiters_.empty() || waiters_.begin()->first.first > order;
  if (first && !free_.empty()) {
    auto buffer = std::move(free_.back());
    free_.pop_back();
    ++leased_;
    return Lease(this, std::move(buffer));
  }
  if (first && allocated_ < max_buffers_) {
    ++allocated_;
    ++leased_;
    Ledger::instance().add(MemoryCategory::kCommBuffers, static_cast<int64_t>(buffer_bytes_));
    // Uninitialised: a chunk is read into it before any byte is used.
    return Lease(this, std::unique_ptr<std::byte[]>(new std::byte[buffer_bytes_]));
  }
  Waiter me;
  const auto key = std::make_pair(order, arrivals_++);
  waiters_.emplace(key, &me);
  while (me.handed == nullptr) {
    if (me.cv.wait_for(lock, poll, [&] { return me.handed != nullptr; })) break;
    lock.unlock();
    const bool stop = give_up && give_up();
    lock.lock();
    if (stop && me.handed == nullptr) {
      waiters_.erase(key);
      return std::nullopt;
    }
  }
  // give_back took it off the queue and counted the lease.
  return Lease(this, std::move(me.handed));
}

void ChunkPool::give_back(std::unique_ptr<std::byte[]> buffer) {
  std::lock_guard lock(mu_);
  if (!waiters_.empty()) {
    // Straight to the first waiter: it stays leased.
    auto it = waiters_.begin();
    Waiter* w = it->second;
    waiters_.erase(it);
    w->handed = std::move(buffer);
    w->cv.notify_one();
    return;
  }
  free_.push_back(std::move(buffer));
  --leased_;
}

size_t ChunkPool::allocated() const {
  std::lock_guard lock(mu_);
  return allocated_;
}

size_t ChunkPool::waiting() const {
  std::lock_guard lock(mu_);
  return waiters_.size();
}

size_t ChunkPool::leased() const {
  std::lock_guard lock(mu_);
  return leased_;
}

}  // namespace memfl
