// A program with known allocation sites, for the tracker tests:
//   alloc_site_program sites PROFILE   — allocates known sizes at known sites
//   alloc_site_program killed PROFILE  — allocates, flushes, then SIGKILLs itself
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "memory/alloc_tracker.h"

extern "C" {
__attribute__((noinline)) void* memfl_test_site_a() {
  void* p = std::malloc(100000);
  std::memset(p, 1, 100000);
  return p;
}
__attribute__((noinline)) char* memfl_test_site_b() {
  char* p = new char[200000];
  std::memset(p, 2, 200000);
  return p;
}
__attribute__((noinline)) void* memfl_test_site_c() {
  void* p = nullptr;
  if (posix_memalign(&p, 64, 131072) != 0) std::abort();
  std::memset(p, 3, 131072);
  return p;
}
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const std::string mode = argv[1];
  if (!memfl::alloc_tracker_start(argv[2], "test", 64 << 10)) return 3;
  memfl::alloc_tracker_mark(1, "train");
  void* a = memfl_test_site_a();
  char* b[3];
  for (auto& x : b) x = memfl_test_site_b();
  void* c = memfl_test_site_c();
  for (int i = 0; i < 1000; ++i) {
    volatile char* small = static_cast<char*>(std::malloc(100));
    small[0] = 1;
    std::free(const_cast<char*>(small));
  }
  if (mode == "killed") {
    memfl::alloc_tracker_flush();
    raise(SIGKILL);
  }
  memfl::alloc_tracker_mark(1, "aggregate");
  delete[] b[2];  // the peak was before this free
  memfl::alloc_tracker_stop();
  std::free(a);
  delete[] b[0];
  delete[] b[1];
  std::free(c);
  return 0;
}
