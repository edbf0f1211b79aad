// xxh3-64 built for AVX2, chosen at run time by comm/chunk.cpp. Debian's
// libxxhash is built for SSE2 (20 GB/s on a 1 MiB chunk in cache here);
// this build of the same function runs about twice as fast
// (`memfl_bench --benchmark_filter=ChunkChecksum`), and every byte a transport
// moves is hashed on both sides. The result is the same 64-bit value: xxh3 is
// defined independently of the vector width.
//
// This file alone is compiled with -mavx2. It exposes plain C functions and
// instantiates nothing from headers other than xxhash's own static
// inline functions, so no AVX2 code can leak into a shared inline symbol.
#include <cstddef>
#include <cstdint>

#ifndef XXH_INLINE_ALL  // the GPU machine's build defines it for every file
#define XXH_INLINE_ALL
#endif
#ifndef XXH_STATIC_LINKING_ONLY
#define XXH_STATIC_LINKING_ONLY
#endif
#include <xxhash.h>

extern "C" uint64_t memfl_xxh3_avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

// The streaming form, on a state the caller owns (XXH3_state_t, the same
// struct in every build of xxhash.h; passed as void* because the inline
// build renames the type).
extern "C" void memfl_xxh3_avx2_reset(void* state) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state)); }
extern "C" void memfl_xxh3_avx2_update(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
extern "C" uint64_t memfl_xxh3_avx2_digest(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}
