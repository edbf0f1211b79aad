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

namespace {
// Copies n bytes in blocks and feeds each block to `hash` right after the
// copy, while it is in L1: from the side named (see ChecksumSide).
void copy_and_hash(Xxh3Stream& hash, std::byte* dst, const std::byte* src, size_t n, ChecksumSide side,
                   void (*after_copy)(void*, size_t, size_t), void* ctx) {
  constexpr size_t kBlock = 32 * 1024;
  const std::byte* hashed = side == ChecksumSide::kDestination ? dst : src;
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = std::min(kBlock, n - off);
    std::memcpy(dst + off, src + off, len);
    if (after_copy != nullptr) after_copy(ctx, off, len);
    hash.update(hashed + off, len);
  }
}
}  // namespace

namespace chunk_detail {
uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side,
                            void (*after_copy)(void*, size_t, size_t), void* ctx) {
  Xxh3Stream hash;
  copy_and_hash(hash, dst, src, n, side, after_copy, ctx);
  return hash.digest();
}
}  // namespace chunk_detail

uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side) {
  return chunk_detail::copy_with_checksum(dst, src, n, side, nullptr, nullptr);
}

uint64_t copy_with_checksum(std::byte* dst, Payload src) {
  Xxh3Stream hash;
  for (auto part : src) {
    copy_and_hash(hash, dst, part.data(), part.size(), ChecksumSide::kDestination, nullptr, nullptr);
    dst += part.size();
  }
  return hash.digest();
}

size_t payload_size(Payload payload) {
  size_t n = 0;
  for (auto part : payload) n += part.size();
  return n;
}

Status verify_chunk(const ChunkHeader& h, Payload payload, const Layout& layout, uint64_t expected_offset,
                    std::string_view peer) {
  MEMFL_RETURN_IF_ERROR(verify_chunk_header(h, payload_size(payload), layout, expected_offset, peer));
  if (chunk_checksum(payload) != h.checksum) return checksum_mismatch(h, peer);
  return Status::Ok();
}

Status checksum_mismatch(const ChunkHeader& h, std::string_view peer) {
  return data_loss("chunk from {}: checksum mismatch for bytes [{}, {})", peer, h.offset, h.offset + h.length);
}

Status verify_chunk_header(const ChunkHeader& h, size_t size, const Layout& layout, uint64_t expected_offset,
                           std::string_view peer) {
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
  return Status::Ok();
}

void ChunkChecksums::reset(int64_t key, size_t total_bytes, size_t chunk_bytes) {
  const size_t count = chunk_bytes == 0 ? 0 : (total_bytes + chunk_bytes - 1) / chunk_bytes;
  if (key == key_ && chunk_bytes == chunk_ && count == count_) return;
  key_ = key;
  chunk_ = chunk_bytes;
  if (count != count_) {
    sums_ = std::make_unique<std::atomic<uint64_t>[]>(count);
    ready_ = std::make_unique<std::atomic<bool>[]>(count);
    count_ = count;
  }
  for (size_t i = 0; i < count_; ++i) ready_[i].store(false, std::memory_order_relaxed);
}

uint64_t ChunkChecksums::get(uint64_t offset, std::span<const std::byte> bytes) {
  const size_t i = chunk_ == 0 ? count_ : offset / chunk_;
  if (i >= count_ || offset % chunk_ != 0) return chunk_checksum(bytes);  // not a chunk of this model: no cache
  if (ready_[i].load(std::memory_order_acquire)) return sums_[i].load(std::memory_order_relaxed);
  // Two senders may both get here for one chunk: both compute the same value.
  const uint64_t sum = chunk_checksum(bytes);
  sums_[i].store(sum, std::memory_order_relaxed);
  ready_[i].store(true, std::memory_order_release);
  return sum;
}

StatusOr<uint64_t> stream_arena(const Layout& layout, const Arena& arena, size_t chunk_size, ChunkSink& sink,
                                bool hashed) {
  if (chunk_size == 0) return invalid_argument("model_chunk_size must be at least 1 byte");
  const size_t total = layout.total_bytes();
  if (arena.size() < total) {
    return failed_precondition("arena of {} bytes is smaller than the layout's {}", arena.size(), total);
  }
  uint64_t sent = 0;
  for (size_t off = 0; off < total; off += chunk_size) {
    const size_t len = std::min(chunk_size, total - off);
    auto payload = arena.bytes(off, len);
    ChunkHeader h{layout.hash(), off, len, hashed ? chunk_checksum(payload) : 0};
    MEMFL_RETURN_IF_ERROR(sink.accept(h, payload));
    sent += len;
  }
  return sent;
}

Status ModelWriter::accept(const ChunkHeader& h, Payload payload) {
  MEMFL_RETURN_IF_ERROR(verify_chunk_header(h, payload_size(payload), layout_, next_offset_, peer_));
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
  if (copy_with_checksum(arena_.data() + h.offset, payload) != h.checksum) return checksum_mismatch(h, peer());
  return Status::Ok();
}

Status ShardedWriter::store(const ChunkHeader& h, Payload payload) {
  // The shards are written only with checked bytes: a chunk in one piece is
  // hashed where it is; one in pieces is hashed as it is put together.
  if (payload.size() == 1) {
    if (chunk_checksum(payload) != h.checksum) return checksum_mismatch(h, peer());
    return io_.write(h.offset, payload.front());
  }
  buffer_.resize(h.length);
  if (copy_with_checksum(buffer_.data(), payload) != h.checksum) return checksum_mismatch(h, peer());
  return io_.write(h.offset, buffer_);
}

Status ArenaUpdateSource::read(size_t offset, std::span<std::byte> into) const {
  if (offset + into.size() > arena_.size())
    return invalid_argument("update read of {} bytes at {} runs past its {} bytes", into.size(), offset, arena_.size());
  std::memcpy(into.data(), arena_.data() + offset, into.size());
  return Status::Ok();
}

}  // namespace memfl
