// The library side of the tracker: forwards to the hooks when an executable
// that links them has registered them.
#include <atomic>

#include "memory/alloc_tracker.h"

namespace memfl {

namespace {
std::atomic<const AllocTrackerHooks*> g_hooks{nullptr};
std::atomic<bool> g_active{false};
}  // namespace

void set_alloc_tracker_hooks(const AllocTrackerHooks* hooks) { g_hooks.store(hooks); }

bool alloc_tracker_start(const std::string& path, const std::string& role, size_t threshold) {
  const AllocTrackerHooks* h = g_hooks.load();
  if (h == nullptr || !h->start(path.c_str(), role.c_str(), threshold)) return false;
  g_active.store(true);
  return true;
}

void alloc_tracker_stop() {
  const AllocTrackerHooks* h = g_hooks.load();
  if (h != nullptr && g_active.exchange(false)) h->stop();
}

bool alloc_tracker_active() { return g_active.load(std::memory_order_relaxed); }

void alloc_tracker_mark(int round, const char* phase) {
  if (!alloc_tracker_active()) return;
  g_hooks.load()->mark(round, phase);
}

void track_mapping(const void* p, size_t bytes) {
  if (!alloc_tracker_active()) return;
  g_hooks.load()->map(p, bytes);
}

void untrack_mapping(const void* p) {
  if (!alloc_tracker_active()) return;
  g_hooks.load()->unmap(p);
}

void alloc_tracker_flush() {
  if (!alloc_tracker_active()) return;
  g_hooks.load()->flush();
}

}  // namespace memfl
