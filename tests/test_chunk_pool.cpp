// ChunkPool: the buffers a server's sessions share for chunks in flight.
#include "comm/chunk_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <mutex>
#include <thread>
#include <vector>

#include "memory/ledger.h"

namespace memfl {
namespace {

TEST(ChunkPool, NeverHandsOutMoreThanItsBound) {
  ChunkPool pool(3, 4096);
  std::atomic<int> holding{0}, most{0};
  std::vector<std::thread> sessions;
  for (int t = 0; t < 16; ++t) {
    sessions.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto lease = pool.acquire({}, 0, std::chrono::milliseconds(1));
        ASSERT_TRUE(lease.has_value());
        const int now = holding.fetch_add(1) + 1;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        lease->bytes()[0] = std::byte{1};
        std::this_thread::yield();
        holding.fetch_sub(1);
      }
    });
  }
  for (auto& t : sessions) t.join();
  EXPECT_LE(most.load(), 3);
  EXPECT_LE(pool.allocated(), 3u);
  EXPECT_EQ(pool.leased(), 0u);
}

TEST(ChunkPool, CountsItsBuffersInTheLedger) {
  auto& ledger = Ledger::instance();
  const int64_t before = ledger.current(MemoryCategory::kCommBuffers);
  {
    ChunkPool pool(2, 1 << 20);
    auto a = pool.acquire({});
    EXPECT_EQ(ledger.current(MemoryCategory::kCommBuffers) - before, 1 << 20);
    { auto b = pool.acquire({}); }
    // Kept for reuse: still held, still counted.
    EXPECT_EQ(ledger.current(MemoryCategory::kCommBuffers) - before, 2 << 20);
    auto c = pool.acquire({});  // the kept one, not a third
    EXPECT_EQ(pool.allocated(), 2u);
    EXPECT_EQ(pool.bound_bytes(), 2u << 20);
  }
  EXPECT_EQ(ledger.current(MemoryCategory::kCommBuffers), before);
}

TEST(ChunkPool, AWaiterGivesUpWhenAskedAndTakesAReturnedBuffer) {
  ChunkPool pool(1, 64);
  auto held = pool.acquire({});
  ASSERT_TRUE(held.has_value());
  // Full: a waiter whose session is over gets nothing.
  std::atomic<bool> over{false};
  std::thread quitter(
      [&] { EXPECT_FALSE(pool.acquire([&] { return over.load(); }, 0, std::chrono::milliseconds(1))); });
  over = true;
  quitter.join();
  // One that waits gets the buffer once it comes back.
  std::thread waiter([&] { EXPECT_TRUE(pool.acquire({}, 0, std::chrono::milliseconds(1)).has_value()); });
  held.reset();
  waiter.join();
  EXPECT_EQ(pool.allocated(), 1u);
}

// Waiters are served by their order, not by who asked first or who the
// scheduler wakes: the buffer that comes back goes to the lowest order (ties
// first come, first served), as a server needs for the update whose turn it
// is in its fold order.
TEST(ChunkPool, AReturnedBufferGoesToTheWaiterOfTheLowestOrder) {
  ChunkPool pool(1, 64);
  auto held = pool.acquire({});
  ASSERT_TRUE(held.has_value());
  std::mutex mu;
  std::vector<int> served;
  std::vector<std::thread> waiters;
  // Asked in this order; served as 2, 5 (first of the two), 5, 9.
  const std::pair<int, int> asks[] = {{9, 0}, {5, 1}, {2, 2}, {5, 3}};
  for (size_t i = 0; i < std::size(asks); ++i) {
    const auto [order, tag] = asks[i];
    waiters.emplace_back([&, order, tag] {
      auto lease = pool.acquire({}, static_cast<uint64_t>(order), std::chrono::milliseconds(1));
      ASSERT_TRUE(lease.has_value());
      std::lock_guard lock(mu);
      served.push_back(tag);
    });
    while (pool.waiting() < i + 1) std::this_thread::yield();  // each is queued before the next asks
  }
  // A newcomer of a higher order than the first waiter does not jump the queue.
  EXPECT_FALSE(pool.acquire([] { return true; }, 3, std::chrono::milliseconds(1)).has_value());
  held.reset();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(served, (std::vector<int>{2, 1, 3, 0}));
  EXPECT_EQ(pool.leased(), 0u);
  EXPECT_EQ(pool.waiting(), 0u);
}

}  // namespace
}  // namespace memfl
