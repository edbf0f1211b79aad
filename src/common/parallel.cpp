#include "common/parallel.h"

#include <cstring>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace memfl {

namespace {

int threads_from_env() {
  if (const char* v = std::getenv("MEMFL_THREADS"); v != nullptr && *v != '\0') {
    const int n = std::atoi(v);
    if (n >= 1) return n;
  }
  cpu_set_t set;
  int cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Beyond this, memory bandwidth, not cores, bounds these loops.
  return std::min(cores, 32);
}

// One batch of pieces; its caller waits on `left`.
struct Batch {
  const std::function<void(size_t, size_t)>* fn;
  std::atomic<size_t> left;
  std::mutex mu;
  std::condition_variable done;
};

struct Task {
  Batch* batch;
  size_t begin, end;
};

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void push(std::vector<Task>& tasks) {
    {
      std::lock_guard lock(mu_);
      for (auto& t : tasks) queue_.push_back(t);
    }
    cv_.notify_all();
  }

  // Runs queued pieces of `batch` on the calling thread, then waits for
  // those the workers took.
  void help_and_wait(Batch& batch) {
    for (;;) {
      Task t{};
      {
        std::lock_guard lock(mu_);
        auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Task& q) { return q.batch == &batch; });
        if (it == queue_.end()) break;
        t = *it;
        queue_.erase(it);
      }
      run(t);
    }
    std::unique_lock lock(batch.mu);
    batch.done.wait(lock, [&] { return batch.left.load() == 0; });
  }

 private:
  static void run(const Task& t) {
    (*t.batch->fn)(t.begin, t.end);
    // The count drops under the batch's lock: the caller sees it at zero
    // only after this thread has let go of the lock, and then returns and
    // ends the batch (on its stack). Dropping it before taking the lock let
    // the caller return first, and this thread then locked a mutex that no
    // longer existed (a glibc assertion in a client masking 1 GiB chunks).
    std::lock_guard lock(t.batch->mu);
    if (t.batch->left.fetch_sub(1) == 1) t.batch->done.notify_all();
  }

  void work() {
    for (;;) {
      Task t{};
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        t = queue_.front();
        queue_.pop_front();
      }
      run(t);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

Pool& pool() {
  // Leaked on purpose: pieces may still run from static destructors' callers
  // at exit, and joining threads after main returns is a hazard.
  static Pool* p = new Pool(parallel_threads() - 1);
  return *p;
}

}  // namespace

int parallel_threads() {
  static const int n = threads_from_env();
  return n;
}

void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  grain = std::max<size_t>(grain, 1);
  const size_t threads = static_cast<size_t>(parallel_threads());
  if (n < 2 * grain || threads < 2) {
    fn(0, n);
    return;
  }
  const size_t pieces = std::min(threads, n / grain);
  Batch batch;
  batch.fn = &fn;
  batch.left = pieces;
  std::vector<Task> tasks;
  tasks.reserve(pieces);
  for (size_t i = 0; i < pieces; ++i) tasks.push_back({&batch, n * i / pieces, n * (i + 1) / pieces});
  pool().push(tasks);
  pool().help_and_wait(batch);
}

void parallel_copy(void* dst, const void* src, size_t n) {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  parallel_for(n, size_t{8} << 20, [&](size_t lo, size_t hi) { std::memcpy(d + lo, s + lo, hi - lo); });
}

}  // namespace memfl
