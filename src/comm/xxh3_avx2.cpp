// xxh3-64 built for AVX2, chosen at run time by comm/chunk.cpp. Debian's
// libxxhash is built for SSE2 (20 GB/s on a 1 MiB chunk in cache here);
// this build of the same function runs at 42 GB/s, and every byte a
// transport moves is hashed on both sides. The result is the same 64-bit value: xxh3
// is defined independently of the vector width.
//
// This file alone is compiled with -mavx2. It exposes two plain C functions
// and instantiates nothing from headers other than xxhash's own static
// inline functions, so no AVX2 code can leak into a shared inline symbol.
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef XXH_INLINE_ALL  // the GPU machine's build defines it for every file
#define XXH_INLINE_ALL
#endif
#ifndef XXH_STATIC_LINKING_ONLY
#define XXH_STATIC_LINKING_ONLY
#endif
#include <xxhash.h>

extern "C" uint64_t memfl_xxh3_avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

extern "C" uint64_t memfl_xxh3_avx2_pieces(const void* const* data, const size_t* sizes, size_t count) {
  XXH3_state_t state;  // on the stack: no allocation per chunk
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (size_t i = 0; i < count; ++i) XXH3_64bits_update(&state, data[i], sizes[i]);
  return XXH3_64bits_digest(&state);
}

// Copies n bytes and returns the xxh3 of one side of the copy, 32 KiB at a
// time so that the hash reads what the copy just brought into L1.
extern "C" uint64_t memfl_copy_xxh3_avx2(void* dst, const void* src, size_t n, int hash_dst) {
  constexpr size_t kBlock = 32 * 1024;
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = n - off < kBlock ? n - off : kBlock;
    std::memcpy(d + off, s + off, len);
    XXH3_64bits_update(&state, hash_dst ? d + off : s + off, len);
  }
  return XXH3_64bits_digest(&state);
}
