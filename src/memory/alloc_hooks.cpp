// The allocation hooks (see alloc_tracker.h). Linked into executables only:
// definitions of malloc & co. in the executable interpose on every library's
// calls, libtorch's included. glibc 2.36 exports __libc_malloc, __libc_free,
// __libc_calloc, __libc_realloc and __libc_memalign, which we forward to.
//
// Rules inside a hook: no allocation, no exceptions, no locks that an
// allocation could need. A thread-local guard passes nested calls (from
// libunwind, or from our own flush thread) straight to glibc.
#include <dlfcn.h>
#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define UNW_LOCAL_ONLY
#include <libunwind.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <cxxabi.h>
#include <thread>

#include "memory/alloc_tracker.h"
#include "memory/profile.h"

extern "C" {
void* __libc_malloc(size_t);
void __libc_free(void*);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
}

namespace memfl::profile_internal {
namespace {

constexpr size_t kLiveCapacity = size_t{1} << 20;   // live tracked allocations
constexpr size_t kStackCapacity = size_t{1} << 16;  // distinct stacks
constexpr size_t kBufferBytes = size_t{4} << 20;    // write buffer
constexpr int kMaxFrames = 48;
constexpr int kSkipFrames = 2;  // the hook and record_alloc

struct LiveEntry {
  uint64_t ptr;  // 0 = empty, 1 = tombstone
  uint64_t size;
};
struct StackEntry {
  uint64_t hash;  // 0 = empty
  uint32_t id;
};

std::atomic<bool> g_on{false};
size_t g_threshold = 64 << 10;
int g_fd = -1;
LiveEntry* g_live = nullptr;
StackEntry* g_stacks = nullptr;
uint32_t g_next_stack = 1;
uint8_t* g_buf = nullptr;
size_t g_len = 0;
std::atomic_flag g_lock = ATOMIC_FLAG_INIT;  // guards the tables and the buffer
std::atomic<int64_t> g_small_current{0};
std::atomic<uint64_t> g_small_total{0};
uint64_t g_t0 = 0;
// Stacks seen but not yet symbolized (ids), handled by the flush thread.
uint64_t* g_pending_frames = nullptr;  // frames of new stacks, appended
size_t g_pending_len = 0;
constexpr size_t kPendingCapacity = size_t{1} << 20;
std::thread* g_flusher = nullptr;
std::atomic<bool> g_stop{false};

thread_local bool t_in_hook = false;

uint64_t now_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u - g_t0;
}

void lock() {
  while (g_lock.test_and_set(std::memory_order_acquire)) {
  }
}
void unlock() { g_lock.clear(std::memory_order_release); }

void flush_locked() {
  size_t off = 0;
  while (off < g_len) {
    ssize_t n = ::write(g_fd, g_buf + off, g_len - off);
    if (n <= 0) {
      if (errno == EINTR) continue;
      break;  // disk full: drop what we cannot write rather than block the program
    }
    off += static_cast<size_t>(n);
  }
  g_len = 0;
}

void put(const void* p, size_t n) {
  if (g_len + n > kBufferBytes) flush_locked();
  std::memcpy(g_buf + g_len, p, n);
  g_len += n;
}
template <typename T>
void put_v(T v) {
  put(&v, sizeof v);
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

uint32_t intern_stack_locked(void** frames, int n) {
  uint64_t h = 0x1234567;
  for (int i = 0; i < n; ++i) h = mix(h, reinterpret_cast<uint64_t>(frames[i]));
  if (h == 0) h = 1;
  size_t slot = h & (kStackCapacity - 1);
  for (size_t probe = 0; probe < kStackCapacity; ++probe, slot = (slot + 1) & (kStackCapacity - 1)) {
    if (g_stacks[slot].hash == h) return g_stacks[slot].id;
    if (g_stacks[slot].hash == 0) {
      const uint32_t id = g_next_stack++;
      g_stacks[slot] = {h, id};
      put_v<uint8_t>(kRecStack);
      put_v<uint32_t>(id);
      put_v<uint16_t>(static_cast<uint16_t>(n));
      for (int i = 0; i < n; ++i) put_v<uint64_t>(reinterpret_cast<uint64_t>(frames[i]));
      for (int i = 0; i < n && g_pending_len < kPendingCapacity; ++i) {
        g_pending_frames[g_pending_len++] = reinterpret_cast<uint64_t>(frames[i]);
      }
      return id;
    }
  }
  return 0;  // table full: the allocation is recorded under stack 0 ("unknown")
}

void live_insert_locked(uint64_t ptr, uint64_t size) {
  size_t slot = (ptr >> 4) * 0x9e3779b97f4a7c15ULL >> 44 & (kLiveCapacity - 1);
  for (size_t probe = 0; probe < kLiveCapacity; ++probe, slot = (slot + 1) & (kLiveCapacity - 1)) {
    if (g_live[slot].ptr <= 1) {
      g_live[slot] = {ptr, size};
      return;
    }
  }
}

bool live_erase_locked(uint64_t ptr) {
  size_t slot = (ptr >> 4) * 0x9e3779b97f4a7c15ULL >> 44 & (kLiveCapacity - 1);
  for (size_t probe = 0; probe < kLiveCapacity; ++probe, slot = (slot + 1) & (kLiveCapacity - 1)) {
    if (g_live[slot].ptr == ptr) {
      g_live[slot].ptr = 1;
      return true;
    }
    if (g_live[slot].ptr == 0) return false;
  }
  return false;
}

void record_alloc(void* p, size_t size) {
  if (p == nullptr) return;
  if (size < g_threshold) {
    g_small_current.fetch_add(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
    g_small_total.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  void* frames[kMaxFrames + kSkipFrames];
  int n = unw_backtrace(frames, kMaxFrames + kSkipFrames);
  const int skip = n > kSkipFrames ? kSkipFrames : 0;
  lock();
  const uint32_t id = intern_stack_locked(frames + skip, n - skip);
  live_insert_locked(reinterpret_cast<uint64_t>(p), size);
  put_v<uint8_t>(kRecAlloc);
  put_v<uint64_t>(now_us());
  put_v<uint64_t>(reinterpret_cast<uint64_t>(p));
  put_v<uint64_t>(size);
  put_v<uint32_t>(id);
  unlock();
}

void record_free(void* p) {
  if (p == nullptr) return;
  const size_t usable = malloc_usable_size(p);
  if (usable < g_threshold) {
    g_small_current.fetch_sub(static_cast<int64_t>(usable), std::memory_order_relaxed);
    return;
  }
  lock();
  if (live_erase_locked(reinterpret_cast<uint64_t>(p))) {
    put_v<uint8_t>(kRecFree);
    put_v<uint64_t>(now_us());
    put_v<uint64_t>(reinterpret_cast<uint64_t>(p));
  } else {
    // Allocated below the threshold (usable size rounds up) or before start.
    g_small_current.fetch_sub(static_cast<int64_t>(usable), std::memory_order_relaxed);
  }
  unlock();
}

struct Guard {
  bool active;
  Guard() : active(g_on.load(std::memory_order_relaxed) && !t_in_hook) {
    if (active) t_in_hook = true;
  }
  ~Guard() {
    if (active) t_in_hook = false;
  }
};

// Symbols for the frames of new stacks, outside any hook.
void symbolize_pending() {
  static uint64_t done[kPendingCapacity];
  size_t count = 0;
  lock();
  count = g_pending_len;
  std::memcpy(done, g_pending_frames, count * sizeof(uint64_t));
  g_pending_len = 0;
  unlock();
  for (size_t i = 0; i < count; ++i) {
    Dl_info info{};
    const void* addr = reinterpret_cast<const void*>(done[i] - 1);  // inside the call instruction
    char name[512];
    if (dladdr(addr, &info) != 0 && info.dli_sname != nullptr) {
      int status = 0;
      char* dem = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
      const char* module = info.dli_fname ? std::strrchr(info.dli_fname, '/') : nullptr;
      std::snprintf(name, sizeof name, "%s [%s]", status == 0 && dem ? dem : info.dli_sname, module ? module + 1 : "?");
      std::free(dem);
    } else if (info.dli_fname != nullptr) {
      const char* module = std::strrchr(info.dli_fname, '/');
      std::snprintf(name, sizeof name, "%s+0x%lx", module ? module + 1 : info.dli_fname,
                    static_cast<unsigned long>(done[i] - reinterpret_cast<uint64_t>(info.dli_fbase)));
    } else {
      std::snprintf(name, sizeof name, "0x%lx", static_cast<unsigned long>(done[i]));
    }
    const size_t len = std::min<size_t>(std::strlen(name), 1000);
    lock();
    put_v<uint8_t>(kRecSymbol);
    put_v<uint64_t>(done[i]);
    put_v<uint16_t>(static_cast<uint16_t>(len));
    put(name, len);
    unlock();
  }
}

// Resident bytes of the tracker's own tables and buffer (mincore), so a
// report can tell the profiler's footprint from the program's.
int64_t own_resident_bytes() {
  static unsigned char vec[(kLiveCapacity * sizeof(LiveEntry) >> 12) + 1];
  const size_t page = 4096;
  int64_t total = 0;
  auto count = [&](void* base, size_t bytes) {
    if (base == nullptr) return;
    const size_t pages = (bytes + page - 1) / page;
    if (mincore(base, bytes, vec) != 0) return;
    for (size_t i = 0; i < pages; ++i) total += (vec[i] & 1) ? static_cast<int64_t>(page) : 0;
  };
  count(g_live, kLiveCapacity * sizeof(LiveEntry));
  count(g_stacks, kStackCapacity * sizeof(StackEntry));
  count(g_buf, kBufferBytes);
  count(g_pending_frames, kPendingCapacity * sizeof(uint64_t));
  return total;
}

void flush_all() {
  symbolize_pending();
  const int64_t own = own_resident_bytes();
  // What malloc holds beyond live allocations (freed, not returned): the gap
  // between tracked bytes and anonymous RSS. Read here, outside any hook.
  const struct mallinfo2 mi = mallinfo2();
  lock();
  put_v<uint8_t>(kRecSmall);
  put_v<uint64_t>(now_us());
  put_v<int64_t>(g_small_current.load());
  put_v<uint64_t>(g_small_total.load());
  put_v<uint8_t>(kRecHeap);
  put_v<uint64_t>(now_us());
  put_v<int64_t>(static_cast<int64_t>(mi.fordblks));
  put_v<int64_t>(static_cast<int64_t>(mi.arena));
  put_v<int64_t>(static_cast<int64_t>(mi.hblkhd));
  put_v<int64_t>(own);
  flush_locked();
  unlock();
}

void* map_fixed(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

bool start(const char* path, const char* role, size_t threshold) {
  if (g_on.load()) return false;
  t_in_hook = true;  // our own set-up allocations are not the program's
  g_fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (g_fd < 0) {
    t_in_hook = false;
    return false;
  }
  if (g_live == nullptr) {
    g_live = static_cast<LiveEntry*>(map_fixed(kLiveCapacity * sizeof(LiveEntry)));
    g_stacks = static_cast<StackEntry*>(map_fixed(kStackCapacity * sizeof(StackEntry)));
    g_buf = static_cast<uint8_t*>(map_fixed(kBufferBytes));
    g_pending_frames = static_cast<uint64_t*>(map_fixed(kPendingCapacity * sizeof(uint64_t)));
  }
  g_threshold = threshold;
  // Without a cache libunwind re-parses .eh_frame for every frame (≈2 ms a
  // stack with libtorch's libraries mapped); with it, a stack is microseconds.
  unw_set_caching_policy(unw_local_addr_space, UNW_CACHE_PER_THREAD);
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  g_t0 = 0;
  g_t0 = now_us();
  // Header: magic, version, pid, threshold, role.
  put(kProfileMagic, 8);
  put_v<uint32_t>(kProfileVersion);
  put_v<uint32_t>(static_cast<uint32_t>(getpid()));
  put_v<uint64_t>(threshold);
  const uint16_t rl = static_cast<uint16_t>(std::min<size_t>(std::strlen(role), 200));
  put_v<uint16_t>(rl);
  put(role, rl);
  flush_locked();
  g_stop.store(false);
  g_on.store(true);
  g_flusher = new std::thread([] {
    t_in_hook = true;  // the flush thread's own allocations are not recorded
    while (!g_stop.load()) {
      for (int i = 0; i < 10 && !g_stop.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      flush_all();
    }
  });
  t_in_hook = false;
  return true;
}

void stop() {
  if (!g_on.load()) return;
  t_in_hook = true;
  g_stop.store(true);
  g_flusher->join();
  delete g_flusher;
  g_flusher = nullptr;
  g_on.store(false);
  flush_all();
  ::close(g_fd);
  g_fd = -1;
  t_in_hook = false;
}

void mark(int round, const char* phase) {
  Guard g;
  if (!g.active) return;
  const size_t len = std::min<size_t>(std::strlen(phase), 200);
  lock();
  put_v<uint8_t>(kRecMark);
  put_v<uint64_t>(now_us());
  put_v<int32_t>(round);
  put_v<uint16_t>(static_cast<uint16_t>(len));
  put(phase, len);
  unlock();
}

void map(const void* p, size_t bytes) {
  Guard g;
  if (!g.active) return;
  void* frames[kMaxFrames + kSkipFrames];
  int n = unw_backtrace(frames, kMaxFrames + kSkipFrames);
  lock();
  const uint32_t id = intern_stack_locked(frames + 1, n - 1);
  live_insert_locked(reinterpret_cast<uint64_t>(p), bytes);
  put_v<uint8_t>(kRecAlloc);
  put_v<uint64_t>(now_us());
  put_v<uint64_t>(reinterpret_cast<uint64_t>(p));
  put_v<uint64_t>(bytes);
  put_v<uint32_t>(id);
  unlock();
}

void unmap(const void* p) {
  Guard g;
  if (!g.active) return;
  lock();
  if (live_erase_locked(reinterpret_cast<uint64_t>(p))) {
    put_v<uint8_t>(kRecFree);
    put_v<uint64_t>(now_us());
    put_v<uint64_t>(reinterpret_cast<uint64_t>(p));
  }
  unlock();
}

void flush_hook() {
  Guard g;
  if (!g.active) return;
  flush_all();
}

const AllocTrackerHooks kHooks = {&start, &stop, &mark, &map, &unmap, &flush_hook};

// Registers the hooks before main, so any role can start the tracker.
struct Registrar {
  Registrar() { set_alloc_tracker_hooks(&kHooks); }
} g_registrar;

}  // namespace
}  // namespace memfl::profile_internal

using memfl::profile_internal::Guard;
using memfl::profile_internal::record_alloc;
using memfl::profile_internal::record_free;

extern "C" {

void* malloc(size_t size) {
  void* p = __libc_malloc(size);
  Guard g;
  if (g.active) record_alloc(p, size);
  return p;
}

void free(void* p) {
  {
    Guard g;
    if (g.active) record_free(p);
  }
  __libc_free(p);
}

void* calloc(size_t n, size_t size) {
  void* p = __libc_calloc(n, size);
  Guard g;
  if (g.active) record_alloc(p, n * size);
  return p;
}

void* realloc(void* old, size_t size) {
  {
    Guard g;
    if (g.active) record_free(old);
  }
  void* p = __libc_realloc(old, size);
  Guard g;
  if (g.active) record_alloc(p, size);
  return p;
}

void* memalign(size_t alignment, size_t size) {
  void* p = __libc_memalign(alignment, size);
  Guard g;
  if (g.active) record_alloc(p, size);
  return p;
}

int posix_memalign(void** out, size_t alignment, size_t size) {
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr && size != 0) return ENOMEM;
  *out = p;
  Guard g;
  if (g.active) record_alloc(p, size);
  return 0;
}

void* aligned_alloc(size_t alignment, size_t size) { return memalign(alignment, size); }

void* valloc(size_t size) { return memalign(static_cast<size_t>(sysconf(_SC_PAGESIZE)), size); }

}  // extern "C"
