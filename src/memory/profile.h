// The profile file (`profile.bin`, one per process) and its reader.
//
// Format, version 1, little-endian:
//   header: "MEMFLPRF" u32 version u32 pid u64 threshold u16 role_len role
//   records, each a u8 type and then:
//     STACK  (1): u32 id, u16 n, u64 frames[n]          (return addresses, innermost first)
//     ALLOC  (2): u64 t_us, u64 ptr, u64 size, u32 stack  (size ≥ threshold, or an arena mapping)
//     FREE   (3): u64 t_us, u64 ptr
//     MARK   (4): u64 t_us, i32 round, u16 n, char phase[n]
//     SMALL  (5): u64 t_us, i64 current_small_bytes, u64 small_allocations
//     SYMBOL (6): u64 address, u16 n, char name[n]
//     HEAP   (7): u64 t_us, i64 free_retained, i64 heap_total, i64 mmapped, i64 profiler_own
//                 (glibc mallinfo2: bytes malloc holds free, its heap, its mmaps;
//                 then the tracker's own resident tables)
// The writer streams records; a file cut anywhere (a killed process) reads
// up to its last whole record, and the reader says it was truncated.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace memfl {

inline constexpr char kProfileMagic[8] = {'M', 'E', 'M', 'F', 'L', 'P', 'R', 'F'};
inline constexpr uint32_t kProfileVersion = 1;
enum : uint8_t {
  kRecStack = 1,
  kRecAlloc = 2,
  kRecFree = 3,
  kRecMark = 4,
  kRecSmall = 5,
  kRecSymbol = 6,
  kRecHeap = 7
};

struct ProfileEvent {
  uint64_t t_us;
  int64_t delta;  // + allocation, - free
  uint32_t stack;
};

struct Profile {
  uint32_t version = 0, pid = 0;
  uint64_t threshold = 0;
  std::string role;
  bool truncated = false;  // the file ended inside a record (the process died)
  uint64_t bytes_read = 0;
  std::unordered_map<uint32_t, std::vector<uint64_t>> stacks;
  std::unordered_map<uint64_t, std::string> symbols;
  std::vector<ProfileEvent> events;  // tracked allocations and frees, in order
  struct Mark {
    uint64_t t_us;
    int round;
    std::string phase;
  };
  std::vector<Mark> marks;
  struct Small {
    uint64_t t_us;
    int64_t current;
    uint64_t count;
  };
  std::vector<Small> small;
  struct Heap {
    uint64_t t_us;
    int64_t free_retained, heap_total, mmapped, profiler_own;
  };
  std::vector<Heap> heap;
  uint64_t unmatched_frees = 0;

  // Frame names of a stack, outermost first (as flamegraphs want them).
  std::vector<std::string> frames_of(uint32_t stack) const;
};

StatusOr<Profile> read_profile(const std::string& path);

struct SiteBytes {
  uint32_t stack;
  int64_t bytes;
  int64_t count;
};

struct ProfileAnalysis {
  int64_t peak_tracked_bytes = 0;  // large allocations live at once, at most
  uint64_t peak_t_us = 0;
  std::string peak_phase;
  int peak_round = 0;
  int64_t small_at_peak = 0;
  int64_t malloc_free_retained_at_peak = 0;            // freed bytes malloc had not returned, near the peak
  std::vector<SiteBytes> live_at_peak;                 // by stack, largest first: the high-water-mark flamegraph
  std::vector<SiteBytes> total_allocated;              // by stack over the run, largest first
  std::vector<std::pair<uint64_t, int64_t>> timeline;  // (t_us, tracked bytes) after each event
};

ProfileAnalysis analyse_profile(const Profile& p);

// What the profile accounts for at time `t_us` (profile clock): tracked
// large allocations, net small ones, and freed bytes malloc kept.
struct Accounting {
  int64_t tracked = 0, small = 0, malloc_kept = 0, profiler_own = 0;
  int64_t total() const { return tracked + small + malloc_kept + profiler_own; }
};
Accounting accounting_at(const Profile& p, const ProfileAnalysis& a, uint64_t t_us);

// Folded stacks ("outer;inner bytes" per line) for flamegraph.pl, inferno
// and speedscope.
std::string folded_stacks(const Profile& p, const std::vector<SiteBytes>& sites);

// A human-readable dump (the golden-file tests diff this).
std::string describe_profile(const Profile& p, const ProfileAnalysis& a);

}  // namespace memfl
