// ChunkPool: a fixed number of chunk-sized buffers that every session of a
// server shares, so what the sessions hold for chunks in flight is bounded
// by the pool, not by the number of clients. A session that finds every
// buffer taken waits for one (its client's socket fills: backpressure, not
// memory). Buffers are allocated on first use, kept for reuse, and counted
// in the memory ledger (kCommBuffers) while they exist.
//
// Waiters are served in the order of their `order` (then first come, first
// served): a returned buffer is handed to the waiter with the lowest, and
// only that one is woken. A server passes the update's place in its fold
// order, so when many more clients upload than there are buffers, the
// updates whose turn it is (and those that can trail them) read their
// chunks first and fold as they stream, where a free-for-all handed most
// chunks to updates that could not fold yet and had to be parked on disk
// (FedAvgAggregator).
//
//   ChunkPool pool(/*buffers=*/8, chunk + kMaxFrameOverhead);
//   auto lease = pool.acquire([&] { return session_over(); }, /*order=*/client);
//   if (!lease) return cancelled;
//   read_exact(lease->bytes().first(len));
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace memfl {

class ChunkPool {
 public:
  // A buffer taken from the pool, given back when the lease goes.
  class Lease {
   public:
    Lease(Lease&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), buffer_(std::move(o.buffer_)) {}
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();
    std::span<std::byte> bytes() { return {buffer_.get(), pool_->buffer_bytes_}; }

   private:
    friend class ChunkPool;
    Lease(ChunkPool* pool, std::unique_ptr<std::byte[]> buffer) : pool_(pool), buffer_(std::move(buffer)) {}
    ChunkPool* pool_;
    std::unique_ptr<std::byte[]> buffer_;
  };

  ChunkPool(size_t buffers, size_t buffer_bytes) : max_buffers_(buffers), buffer_bytes_(buffer_bytes) {}
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  // A buffer, once one is free and no waiter of a lower `order` (or of the
  // same, come earlier) wants it; nullopt if `give_up` says so first (asked
  // at least every `poll`).
  std::optional<Lease> acquire(const std::function<bool()>& give_up, uint64_t order = 0,
                               std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t max_buffers() const { return max_buffers_; }
  // The most the pool can hold: what a server's bound counts for it.
  uint64_t bound_bytes() const { return static_cast<uint64_t>(max_buffers_) * buffer_bytes_; }
  // Buffers allocated so far (never more than max_buffers) and leased now.
  size_t allocated() const;
  size_t leased() const;
  // Sessions waiting for a buffer now.
  size_t waiting() const;

 private:
  // A session waiting for a buffer: woken alone when one is handed to it.
  struct Waiter {
    std::condition_variable cv;
    std::unique_ptr<std::byte[]> handed;
  };
  void give_back(std::unique_ptr<std::byte[]> buffer);
  const size_t max_buffers_, buffer_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
  // By (order, arrival): the first is served first.
  std::map<std::pair<uint64_t, uint64_t>, Waiter*> waiters_;
  uint64_t arrivals_ = 0;
  size_t allocated_ = 0, leased_ = 0;
};

}  // namespace memfl
