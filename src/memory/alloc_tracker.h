// Allocation tracker: `--profile` on any role. The memfl executable defines
// malloc, calloc, realloc, free, posix_memalign, aligned_alloc, memalign and
// valloc (so it sees libtorch's tensors, which come from posix_memalign), and
// arenas report their mmaps through track_mapping(). Allocations at or above
// a threshold (default 64 KiB) are recorded with their native stack
// (libunwind); smaller ones are counted by total. The hook never allocates or
// throws: a recursion guard, fixed mmap'd tables and a fixed write buffer.
//
// The profile file (format in src/memory/profile.h) is streamed: a flush
// thread writes it every 50 ms, so a process the OOM killer ends still leaves
// a readable file up to its last flush. Symbols are resolved in that thread
// (dladdr), outside the hook.
//
//   alloc_tracker_start("run/server/profile.bin", "server", 64 << 10);
//   ...
//   alloc_tracker_stop();
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace memfl {

// Starts recording into `path`. Fails (returns false) when the tracker is
// not linked into this executable or the file cannot be opened.
bool alloc_tracker_start(const std::string& path, const std::string& role, size_t threshold_bytes);
void alloc_tracker_stop();
bool alloc_tracker_active();
// A phase mark (the sampler calls this for every mark).
void alloc_tracker_mark(int round, const char* phase);
// Memory that does not come from malloc (arenas are anonymous mmaps).
void track_mapping(const void* p, size_t bytes);
void untrack_mapping(const void* p);
// Writes everything buffered now (tests; the flush thread does it otherwise).
void alloc_tracker_flush();

// Implemented by the hooks when they are linked in (the memfl executable and
// the tracker test program); weak no-ops otherwise, so libmemfl_core works in
// any executable.
struct AllocTrackerHooks {
  bool (*start)(const char* path, const char* role, size_t threshold);
  void (*stop)();
  void (*mark)(int round, const char* phase);
  void (*map)(const void* p, size_t bytes);
  void (*unmap)(const void* p);
  void (*flush)();
};
void set_alloc_tracker_hooks(const AllocTrackerHooks* hooks);

}  // namespace memfl
