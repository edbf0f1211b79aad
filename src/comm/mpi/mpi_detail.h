// The MPI transport's internals, shared by the files of src/comm/mpi/ and by
// no one else: the chunk streams' wire headers, the quiet waits (MPI waits
// that leave the cores to the ranks that work), and the two helpers of the
// server's point-to-point receive (the fold worker and its ring of buffers).
// What the roles use is in comm/mpi/mpi_transport.h.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/status.h"

namespace memfl::mpi_detail {

// Times of the quiet waits and of the transfers.
using Clock = std::chrono::steady_clock;

// Seconds from `t` to now.
inline double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A point-to-point chunk's header (kTagChunkHeader), before its bytes (kTagChunkData).
struct WireHeader {
  uint64_t layout_hash, offset, length, checksum;
};
// A shared-memory ring chunk's header (kTagSlotHeader): the chunk is in `slot`.
struct WireSlotHeader {
  uint64_t layout_hash, offset, length, checksum;
  int32_t slot, pad;
};

// Waiting without taking a core from the ranks that work. With N + 1 ranks
// on a few cores, a rank that spins in MPI_Wait (OpenMPI polls) takes the
// CPU from the ranks doing the work. What a wait should do depends on who
// moves the bytes: over shared memory the receiver copies (single copy), so
// a receiver's test is work and it yields between tests (a sleeping vCPU
// takes tens of microseconds to wake); a sender whose chunks are posted
// ahead has nothing to do until the receiver is done with them, so it
// sleeps. Either way, after `yield_us` the sleep backs off to `max_sleep_us`
// (a round's start, a client's training).
struct WaitStyle {
  int yield_us;
  int max_sleep_us;
};
constexpr WaitStyle kIdle{100, 1000};      // waiting for a round, a client's training, an ack
constexpr WaitStyle kReceiver{2000, 200};  // a chunk stream's receiving side: this rank copies
constexpr WaitStyle kSender{0, 200};       // a chunk stream's sending side: chunks are posted ahead

// MPI_Waitall of `n` requests, waiting as `style` says.
void quiet_waitall(int n, MPI_Request* reqs, MPI_Status* statuses, WaitStyle style);

// As quiet_waitall, giving up at `deadline`: false then, with the requests
// left as they were (some may have completed: MPI_Test them).
bool quiet_waitall_until(int n, MPI_Request* reqs, MPI_Status* statuses, WaitStyle style, Clock::time_point deadline);

// Ends requests that a stalled peer will not complete: a receive is
// cancelled (its buffer is free again), a send let go (MPI_Request_free:
// its buffer must outlive it). Completed requests are simply finished.
void cancel_receive(MPI_Request* r);
void abandon_send(MPI_Request* r);

// Waits quietly for a message with `tag` from any of `sources`; returns the
// first of them (in their order) that has one — the first source itself if it
// has one within `grace` of a later one being ready — or -1 at `deadline`.
int quiet_probe_first(const std::vector<int>& sources, int tag, std::chrono::microseconds grace,
                      Clock::time_point deadline = Clock::time_point::max());

// The same for the threads of the server: yield a while before blocking, so
// a hand-over between the MPI thread and the fold worker (one per chunk)
// does not wait for a halted vCPU to wake.
template <typename Ready>
void yield_until_ready(const Ready& ready, int yield_us) {
  const auto until = Clock::now() + std::chrono::microseconds(yield_us);
  while (!ready() && Clock::now() < until) std::this_thread::yield();
}

// How long a thread yields for a hand-over before it blocks.
constexpr int kHandOverYieldUs = 500;

// Chunks in flight per stream: enough to keep the single-copy engine busy
// while the other side checks the previous ones, bounded so the ring costs
// at most ≈ 8 MiB (and two chunks when chunks are larger).
size_t chunks_in_flight(size_t chunk);

// The largest chunk a slot of the shared-memory ring holds: above it, chunks
// go point to point.
constexpr size_t kMaxSharedSlot = size_t{8} << 20;

// A thread that runs tasks in the order they are queued, beside the MPI
// thread. The server verifies (xxh3) and folds chunks on it while the MPI
// thread receives the next ones, and a client checks the chunks it has while
// the next ones arrive: over shared memory the receiver does the copy, so
// the copy and the check each get a core. Order is kept, so clients still
// fold in selection order (bit-for-bit the in-process result). Only the main
// thread calls MPI (MPI_THREAD_FUNNELED); the first failure is kept for it,
// and it aborts the job.
class OrderedWorker {
 public:
  OrderedWorker() : thread_([this] { loop(); }) {}
  ~OrderedWorker() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<Status()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
      pending_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }
  // Waits until every queued task ran; the first failure, if any.
  Status drain() {
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return tasks_.empty() && !busy_; });
    return error_;
  }
  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  void loop() {
    std::unique_lock lock(mu_);
    while (true) {
      if (tasks_.empty() && !stop_) {
        lock.unlock();
        yield_until_ready([&] { return pending_.load(std::memory_order_acquire) > 0; }, kHandOverYieldUs);
        lock.lock();
      }
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      pending_.fetch_sub(1, std::memory_order_relaxed);
      busy_ = true;
      lock.unlock();
      Status s = task();  // tasks run even after a failure: they hand their buffers back
      lock.lock();
      if (!s.ok() && error_.ok()) error_ = s;
      busy_ = false;
      if (tasks_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> tasks_;
  Status error_;
  std::atomic<size_t> pending_{0};  // tasks_.size(), readable without the lock
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

// Buffers of the server's receive ring, handed back by the fold worker.
class BufferRing {
 public:
  BufferRing(size_t count, size_t bytes) : buffers_(count, std::vector<std::byte>(bytes)) {
    for (size_t i = 0; i < count; ++i) free_.push_back(i);
    free_count_ = count;
  }
  size_t acquire() {
    yield_until_ready([&] { return free_count_.load(std::memory_order_acquire) > 0; }, kHandOverYieldUs);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    const size_t i = free_.front();
    free_.pop_front();
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return i;
  }
  std::optional<size_t> try_acquire() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return std::nullopt;
    const size_t i = free_.front();
    free_.pop_front();
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return i;
  }
  void release(size_t i) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(i);
      free_count_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }
  std::byte* data(size_t i) { return buffers_[i].data(); }
  size_t size() const { return buffers_.size(); }

 private:
  std::vector<std::vector<std::byte>> buffers_;
  std::deque<size_t> free_;
  std::atomic<size_t> free_count_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace memfl::mpi_detail
