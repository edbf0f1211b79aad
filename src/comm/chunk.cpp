#include "comm/chunk.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#if defined(MEMFL_HAVE_XXH3_AVX2)
extern "C" uint64_t memfl_xxh3_avx2(const void* data, size_t size);
extern "C" uint64_t memfl_xxh3_avx2_pieces(const void* const* data, const size_t* sizes, size_t count);
extern "C" uint64_t memfl_copy_xxh3_avx2(void* dst, const void* src, size_t n, int hash_dst);
#endif

namespace memfl {

namespace {
#if defined(MEMFL_HAVE_XXH3_AVX2)
const bool kAvx2 = __builtin_cpu_supports("avx2");
#endif
}  // namespace

uint64_t chunk_checksum(std::span<const std::byte> payload) {
#if defined(MEMFL_HAVE_XXH3_AVX2)
  if (kAvx2) return memfl_xxh3_avx2(payload.data(), payload.size());
#endif
  return XXH3_64bits(payload.data(), payload.size());
}

uint64_t chunk_checksum(Payload payload) {
  if (payload.size() == 1) return chunk_checksum(payload[0]);
#if defined(MEMFL_HAVE_XXH3_AVX2)
  if (kAvx2 && payload.size() <= 64) {
    const void* data[64];
    size_t sizes[64];
    for (size_t i = 0; i < payload.size(); ++i) {
      data[i] = payload[i].data();
      sizes[i] = payload[i].size();
    }
    return memfl_xxh3_avx2_pieces(data, sizes, payload.size());
  }
#endif
  XXH3_state_t state;  // on the stack: no allocation per chunk
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (auto part : payload) XXH3_64bits_update(&state, part.data(), part.size());
  return XXH3_64bits_digest(&state);
}

uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side) {
#if defined(MEMFL_HAVE_XXH3_AVX2)
  if (kAvx2) return memfl_copy_xxh3_avx2(dst, src, n, side == ChecksumSide::kDestination ? 1 : 0);
#endif
  constexpr size_t kBlock = 32 * 1024;  // the hash reads what the copy just brought into L1
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = std::min(kBlock, n - off);
    std::memcpy(dst + off, src + off, len);
    XXH3_64bits_update(&state, (side == ChecksumSide::kDestination ? dst : src) + off, len);
  }
  return XXH3_64bits_digest(&state);
}

size_t payload_size(Payload payload) {
  size_t n = 0;
  for (auto part : payload) n += part.size();
  return n;
}

Status verify_chunk(const ChunkHeader& h, Payload payload, const Layout& layout, uint64_t expected_offset,
                    std::string_view peer) {
  const size_t size = payload_size(payload);
  if (h.layout_hash != layout.hash()) {
    return data_loss("chunk from {}: layout hash {:016x} does not match the model's {:016x}", peer, h.layout_hash,
                     layout.hash());
  }
  if (h.length != size) {
    return data_loss("chunk from {}: header says {} bytes but {} arrived", peer, h.length, size);
  }
  if (h.length == 0) return data_loss("chunk from {}: empty chunk at offset {}", peer, h.offset);
  if (h.offset > layout.total_bytes() || h.length > layout.total_bytes() - h.offset) {
    return data_loss("chunk from {}: bytes [{}, {}) lie outside the {}-byte model", peer, h.offset, h.offset + h.length,
                     layout.total_bytes());
  }
  if (h.offset != expected_offset) {
    return data_loss("chunk from {}: offset {} where {} was expected (gap, overlap or repeat)", peer, h.offset,
                     expected_offset);
  }
  if (chunk_checksum(payload) != h.checksum) {
    return data_loss("chunk from {}: checksum mismatch for bytes [{}, {})", peer, h.offset, h.offset + h.length);
  }
  return Status::Ok();
}

StatusOr<uint64_t> stream_arena(const Layout& layout, const Arena& arena, size_t chunk_size, ChunkSink& sink) {
  if (chunk_size == 0) return invalid_argument("model_chunk_size must be at least 1 byte");
  const size_t total = layout.total_bytes();
  if (arena.size() < total) {
    return failed_precondition("arena of {} bytes is smaller than the layout's {}", arena.size(), total);
  }
  uint64_t sent = 0;
  for (size_t off = 0; off < total; off += chunk_size) {
    const size_t len = std::min(chunk_size, total - off);
    auto payload = arena.bytes(off, len);
    ChunkHeader h{layout.hash(), off, len, chunk_checksum(payload)};
    MEMFL_RETURN_IF_ERROR(sink.accept(h, payload));
    sent += len;
  }
  return sent;
}

Status ArenaWriter::accept(const ChunkHeader& h, Payload payload) {
  MEMFL_RETURN_IF_ERROR(verify_chunk(h, payload, layout_, next_offset_, peer_));
  size_t at = h.offset;
  for (auto part : payload) {
    std::memcpy(arena_.data() + at, part.data(), part.size());
    at += part.size();
  }
  next_offset_ += h.length;
  return Status::Ok();
}

Status ArenaWriter::finish() const {
  if (next_offset_ != layout_.total_bytes()) {
    return data_loss("model from {} ended after {} of {} bytes", peer_, next_offset_, layout_.total_bytes());
  }
  return Status::Ok();
}

}  // namespace memfl
