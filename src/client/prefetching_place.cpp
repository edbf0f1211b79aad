#include "client/prefetching_place.h"

#include <algorithm>
#include <cstring>

namespace memfl {

PrefetchingPlace::PrefetchingPlace(std::unique_ptr<ModelPlace> inner, uint64_t total_bytes)
    : inner_(std::move(inner)), total_(total_bytes) {}

PrefetchingPlace::~PrefetchingPlace() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

Status PrefetchingPlace::code_into(int slot, uint64_t offset, size_t length) {
  auto f = inner_->frame(offset, length);
  if (!f.ok()) return f.status();
  buffers_[slot].assign(f->begin(), f->end());
  return Status::Ok();
}

void PrefetchingPlace::work() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || (requested_ && !ready_); });
    if (stop_) return;
    const Ahead job = ahead_;
    const int slot = 1 - current_;  // the buffer the transport has let go of
    lock.unlock();
    const Status st = code_into(slot, job.offset, job.length);
    lock.lock();
    ahead_.status = st;
    ready_ = true;
    cv_.notify_all();
  }
}

StatusOr<std::span<const std::byte>> PrefetchingPlace::frame(uint64_t offset, size_t length) {
  bool have = false;
  {
    std::unique_lock lock(mu_);
    if (requested_) {
      cv_.wait(lock, [&] { return ready_; });
      requested_ = ready_ = false;
      if (ahead_.offset == offset && ahead_.length == length) {
        MEMFL_RETURN_IF_ERROR(ahead_.status);
        current_ = 1 - current_;
        have = true;
      }
    }
  }
  if (!have) {
    // The first frame, or one off the grid: coded here, in the buffer the
    // transport has let go of.
    MEMFL_RETURN_IF_ERROR(code_into(1 - current_, offset, length));
    current_ = 1 - current_;
  }
  const uint64_t next = offset + length;
  if (next < total_) {
    {
      std::lock_guard lock(mu_);
      ahead_ = Ahead{next, static_cast<size_t>(std::min<uint64_t>(length, total_ - next)), Status::Ok()};
      requested_ = true;
      ready_ = false;
    }
    if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
    cv_.notify_all();
  }
  return std::span<const std::byte>(buffers_[current_]);
}

}  // namespace memfl
