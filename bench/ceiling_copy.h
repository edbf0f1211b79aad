// The copy with its checksum as memfl's chunk code does it (comm/chunk's
// copy_with_checksum), for the programs that measure this machine's ceiling
// (transfer_ceiling, transfer_work): 32 KiB at a time, each block hashed
// while it is still in L1. Include after defining XXH_INLINE_ALL.
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

inline uint64_t copy_with_xxh3(char* dst, const char* src, size_t n) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  constexpr size_t kBlock = 32 << 10;
  for (size_t o = 0; o < n; o += kBlock) {
    const size_t len = std::min(kBlock, n - o);
    std::memcpy(dst + o, src + o, len);
    XXH3_64bits_update(&st, dst + o, len);
  }
  return XXH3_64bits_digest(&st);
}
