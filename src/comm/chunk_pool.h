// ChunkPool: a fixed number of chunk-sized buffers that every session of a
// server shares, so what the sessions hold for chunks in flight is bounded
// by the pool, not by the number of clients. A session that finds every
// buffer taken waits for one (its client's socket fills: backpressure, not
// memory). Buffers are allocated on first use, kept for reuse, and counted
// in the memory ledger (kCommBuffers) while they exist.
//
//   ChunkPool pool(/*buffers=*/8, chunk + kMaxFrameOverhead);
//   auto lease = pool.acquire([&] { return session_over(); });
//   if (!lease) return cancelled;
//   read_exact(lease->bytes().first(len));
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
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

  // A buffer, once one is free; nullopt if `give_up` says so first (asked
  // at least every `poll`, and whenever a buffer comes back).
  std::optional<Lease> acquire(const std::function<bool()>& give_up,
                               std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t max_buffers() const { return max_buffers_; }
  // The most the pool can hold: what a server's bound counts for it.
  uint64_t bound_bytes() const { return static_cast<uint64_t>(max_buffers_) * buffer_bytes_; }
  // Buffers allocated so far (never more than max_buffers) and leased now.
  size_t allocated() const;
  size_t leased() const;

 private:
  void give_back(std::unique_ptr<std::byte[]> buffer);
  const size_t max_buffers_, buffer_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
  size_t allocated_ = 0, leased_ = 0;
};

}  // namespace memfl
