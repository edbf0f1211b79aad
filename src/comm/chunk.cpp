#include "comm/chunk.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#if defined(MEMFL_HAVE_XXH3_AVX2)
extern "C" uint64_t memfl_xxh3_avx2(const void* data, size_t size);
extern "C" void memfl_xxh3_avx2_reset(void* state);
extern "C" void memfl_xxh3_avx2_update(void* state, const void* data, size_t size);
extern "C" uint64_t memfl_xxh3_avx2_digest(const void* state);
#endif

namespace memfl {

namespace {
#if defined(MEMFL_HAVE_XXH3_AVX2)
const bool kAvx2 = __builtin_cpu_supports("avx2");
#endif

// xxh3-64 fed in pieces, by the AVX2 build (comm/xxh3_avx2.cpp) where the
// CPU has it, else by libxxhash; the state lives on the stack.
class Xxh3Stream {
 public:
  Xxh3Stream() {
    XXH3_INITSTATE(&state_);
#if defined(MEMFL_HAVE_XXH3_AVX2)
    if (kAvx2) {
      memfl_xxh3_avx2_reset(&state_);
      return;
    }
#endif
    XXH3_64bits_reset(&state_);
  }
  void update(const void* data, size_t size) {
#if defined(MEMFL_HAVE_XXH3_AVX2)
    if (kAvx2) {
      memfl_xxh3_avx2_update(&state_, data, size);
      return;
    }
#endif
    XXH3_64bits_update(&state_, data, size);
  }
  uint64_t digest() const {
#if defined(MEMFL_HAVE_XXH3_AVX2)
    if (kAvx2) return memfl_xxh3_avx2_digest(&state_);
#endif
    return XXH3_64bits_digest(&state_);
  }

 private:
  XXH3_state_t state_;
};
}  // namespace

uint64_t chunk_checksum(std::span<const std::byte> payload) {
#if defined(MEMFL_HAVE_XXH3_AVX2)
  if (kAvx2) return memfl_xxh3_avx2(payload.data(), payload.size());
#endif
  return XXH3_64bits(payload.data(), payload.size());
}

uint64_t chunk_checksum(Payload payload) {
  if (payload.size() == 1) return chunk_checksum(payload[0]);
  Xxh3Stream hash;
  for (auto part : payload) hash.update(part.data(), part.size());
  return hash.digest();
}

namespace chunk_detail {
uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side,
                            void (*after_copy)(void*, size_t, size_t), void* ctx) {
  constexpr size_t kBlock = 32 * 1024;  // the hash reads what the copy just brought into L1
  const std::byte* hashed = side == ChecksumSide::kDestination ? dst : src;
  Xxh3Stream hash;
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = std::min(kBlock, n - off);
    std::memcpy(dst + off, src + off, len);
    if (after_copy != nullptr) after_copy(ctx, off, len);
    hash.update(hashed + off, len);
  }
  return hash.digest();
}
}  // namespace chunk_detail

uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side) {
  return chunk_detail::copy_with_checksum(dst, src, n, side, nullptr, nullptr);
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

Status ModelWriter::accept(const ChunkHeader& h, Payload payload) {
  MEMFL_RETURN_IF_ERROR(verify_chunk(h, payload, layout_, next_offset_, peer_));
  MEMFL_RETURN_IF_ERROR(store(h, payload));
  next_offset_ += h.length;
  return Status::Ok();
}

Status ModelWriter::finish() const {
  if (next_offset_ != layout_.total_bytes()) {
    return data_loss("model from {} ended after {} of {} bytes", peer_, next_offset_, layout_.total_bytes());
  }
  return Status::Ok();
}

Status ArenaWriter::store(const ChunkHeader& h, Payload payload) {
  size_t at = h.offset;
  for (auto part : payload) {
    std::memcpy(arena_.data() + at, part.data(), part.size());
    at += part.size();
  }
  return Status::Ok();
}

Status ShardedWriter::store(const ChunkHeader& h, Payload payload) {
  if (payload.size() == 1) return io_.write(h.offset, payload.front());
  buffer_.resize(h.length);
  size_t at = 0;
  for (auto part : payload) {
    std::memcpy(buffer_.data() + at, part.data(), part.size());
    at += part.size();
  }
  return io_.write(h.offset, buffer_);
}

Status ArenaUpdateSource::read(size_t offset, std::span<std::byte> into) const {
  if (offset + into.size() > arena_.size())
    return invalid_argument("update read of {} bytes at {} runs past its {} bytes", into.size(), offset, arena_.size());
  std::memcpy(into.data(), arena_.data() + offset, into.size());
  return Status::Ok();
}

}  // namespace memfl
