// Chunks: how every transport moves a model. A chunk is a byte range of an
// arena, named by (layout hash, offset, length) and carrying an xxh3-64
// checksum of its bytes. A receiver checks all four against what it expects
// before it writes a byte anywhere.
//
//   ArenaWriter into(layout, client_arena, "server");
//   MEMFL_RETURN_IF_ERROR(stream_arena(layout, global_arena, chunk_size, into));
//   MEMFL_RETURN_IF_ERROR(into.finish());
#pragma once

#include <cstdint>
#include <atomic>
#include <climits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "tensor/sharded_model_io.h"

namespace memfl {

struct ChunkHeader {
  uint64_t layout_hash = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;  // xxh3-64 of the payload
};

// A chunk's payload as it arrived: one span when it came from an arena,
// several when a transport received it in pieces (gRPC slices). Receivers
// read the pieces in place; nobody glues them into one buffer.
using Payload = std::span<const std::span<const std::byte>>;

// The most bytes one chunk carries on any transport, whatever
// model_chunk_size says: what a stream buffers (two chunks in flight) stays a
// few MiB when APPFL users configure 256 MiB–1 GiB chunks. Measured: 1–4 MiB
// chunks are also the fastest here over gRPC and MPI (docs/BENCHMARKS.md).
inline constexpr uint64_t kMaxTransferChunk = 4 << 20;
// The chunk a transport uses: model_chunk_size (the whole model when
// use_model_chunking is off), at most kMaxTransferChunk.
inline uint64_t transfer_chunk_bytes(bool use_model_chunking, int64_t model_chunk_size, uint64_t model_bytes) {
  const uint64_t want =
      use_model_chunking && model_chunk_size > 0 ? static_cast<uint64_t>(model_chunk_size) : model_bytes;
  return want < kMaxTransferChunk ? (want == 0 ? 1 : want) : kMaxTransferChunk;
}

// gRPC's chunk: at most 1 MiB, whatever model_chunk_size says (a smaller
// one is kept). Measured with bench/grpc_vs_tcp.sh on the 2-core VM, 1 GiB:
// 1 MiB frames moved 1.88 GB/s down with 1 client and 2.71 with 4, where
// 4 MiB frames moved 1.68 and 2.07. Raw TCP shows the same step (about 2.9
// against 2.0 GB/s): a 4 MiB chunk no longer stays in the 2 MiB L2 between
// the kernel's copy and the hash.
inline constexpr uint64_t kMaxGrpcChunk = 1 << 20;
inline uint64_t grpc_chunk_bytes(bool use_model_chunking, int64_t model_chunk_size, uint64_t model_bytes) {
  const uint64_t c = transfer_chunk_bytes(use_model_chunking, model_chunk_size, model_bytes);
  return c < kMaxGrpcChunk ? c : kMaxGrpcChunk;
}

// What a compressed frame (compress/frame.h) may hold beyond the model bytes
// it carries: its header and, for a chunk that does not compress, one raw
// segment's header. Transports that size a buffer or a message from the
// chunk add this much when updates are compressed; the encoder never exceeds it.
inline constexpr uint64_t kMaxFrameOverhead = 256;

uint64_t chunk_checksum(std::span<const std::byte> payload);
uint64_t chunk_checksum(Payload payload);
size_t payload_size(Payload payload);

// Copies n bytes from src to dst and returns chunk_checksum of the side
// named: the one only this process can write, so that the bytes checked
// are the bytes kept (a shared-memory peer may change the other side).
// One pass: the hash reads each block right after the copy moved it.
enum class ChecksumSide { kSource, kDestination };
uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side);
namespace chunk_detail {
// The same, calling after_copy(ctx, offset, length) between a block's copy
// and its hash: the moment a shared-memory peer could change the other side
// (tests play that peer).
uint64_t copy_with_checksum(std::byte* dst, const std::byte* src, size_t n, ChecksumSide side,
                            void (*after_copy)(void*, size_t, size_t), void* ctx);
}  // namespace chunk_detail

// Copies a payload that arrived in pieces to dst (payload_size bytes) and
// returns the checksum of dst: one pass, the hash reads each block right
// after the copy wrote it (what a receiver that owns dst may do instead of
// hashing the pieces, then copying them).
uint64_t copy_with_checksum(std::byte* dst, Payload src);

// Checks a chunk from `peer` against the layout it must belong to and the
// offset the stream is at (chunks of one stream arrive in order; a gap, an
// overlap or a repeat is an error). Messages name the peer.
Status verify_chunk(const ChunkHeader& header, Payload payload, const Layout& layout, uint64_t expected_offset,
                    std::string_view peer);
// The same checks but the checksum, for a payload of `size` bytes: what a
// receiver must know before it puts a byte anywhere.
Status verify_chunk_header(const ChunkHeader& header, size_t size, const Layout& layout, uint64_t expected_offset,
                           std::string_view peer);
// The error for a chunk whose bytes do not match its header's checksum.
Status checksum_mismatch(const ChunkHeader& header, std::string_view peer);

// The checksums of one model's chunks, computed once by whichever sender
// needs one first and shared by the others: a broadcast to N clients hashes
// the model once, not N times, and still hashes each chunk just before the
// first send of it (the sender's hash overlaps the receiver's work).
// Senders call get() concurrently; reset() (a new model) only while none is
// inside get().
class ChunkChecksums {
 public:
  // For the model identified by `key` (its round or version): keeps what was
  // computed if the key is the same, else forgets it.
  void reset(int64_t key, size_t total_bytes, size_t chunk_bytes);
  // The checksum of chunk `offset / chunk_bytes`, whose bytes are `bytes`.
  uint64_t get(uint64_t offset, std::span<const std::byte> bytes);

 private:
  int64_t key_ = INT64_MIN;
  size_t chunk_ = 0, count_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> sums_;
  std::unique_ptr<std::atomic<bool>[]> ready_;
};

// Where chunks go: an arena, the aggregator's running sum, a socket.
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual Status accept(const ChunkHeader& header, Payload payload) = 0;
  Status accept(const ChunkHeader& header, std::span<const std::byte> payload) {
    return accept(header, Payload(&payload, 1));
  }
};

// One client's upload into whatever combines it (an aggregator). Destroying
// it without commit() aborts it.
class UpdateStream : public ChunkSink {
 public:
  // Succeeds only when every byte of the model arrived; then the update counts.
  virtual Status commit() = 0;
};

// A client's update, whole and checked, read back block by block (an
// asynchronous server applies it from where it waits: a spool slot).
class UpdateSource {
 public:
  virtual ~UpdateSource() = default;
  virtual Status read(size_t offset, std::span<std::byte> into) const = 0;
};

class ArenaUpdateSource final : public UpdateSource {
 public:
  explicit ArenaUpdateSource(const Arena& arena) : arena_(arena) {}
  Status read(size_t offset, std::span<std::byte> into) const override;

 private:
  const Arena& arena_;
};

// Sends `arena` (the whole of `layout.total_bytes()`) to `sink` in chunks of
// at most `chunk_size` bytes, straight from the arena: no staging copy.
// `hashed` false: the chunks carry checksum 0, for a sink opened with
// UpdateOpener::open_local_update (bytes that never leave the process).
// Returns the number of bytes sent.
StatusOr<uint64_t> stream_arena(const Layout& layout, const Arena& arena, size_t chunk_size, ChunkSink& sink,
                                bool hashed = true);

// Receives one model stream: every chunk's header is checked (layout hash,
// offset in order, length, bounds) before store() sees a byte, and store()
// checks the checksum.
class ModelWriter : public ChunkSink {
 public:
  using ChunkSink::accept;
  Status accept(const ChunkHeader& header, Payload payload) final;
  // Fails unless the whole model arrived.
  Status finish() const;
  uint64_t received() const { return next_offset_; }

 protected:
  ModelWriter(const Layout& layout, std::string peer) : layout_(layout), peer_(std::move(peer)) {}
  // Puts a chunk whose header was checked where the model lives, and checks
  // its checksum (checksum_mismatch) before or while it copies: a writer
  // that copies first hashes its own copy, so the bytes checked are the
  // bytes kept. After a mismatch the stream is over (finish() fails).
  virtual Status store(const ChunkHeader& header, Payload payload) = 0;
  const std::string& peer() const { return peer_; }

 private:
  const Layout& layout_;
  std::string peer_;
  uint64_t next_offset_ = 0;
};

// Into an arena: each chunk is copied and hashed in one pass. A chunk that
// fails its checksum has been copied already; the arena is then not the
// model, and finish() says so (the arena is being replaced anyway: the
// receiver's previous model is not kept on a failed download).
class ArenaWriter final : public ModelWriter {
 public:
  ArenaWriter(const Layout& layout, Arena& arena, std::string peer)
      : ModelWriter(layout, std::move(peer)), arena_(arena) {}

 private:
  Status store(const ChunkHeader& header, Payload payload) override;
  Arena& arena_;
};

// Into a model sharded over ranks (a client with num_gpus > 1): a chunk that
// came in pieces is put together in one chunk-sized buffer, then handed to
// the ranks that own its bytes. No buffer larger than a chunk exists here.
class ShardedWriter final : public ModelWriter {
 public:
  ShardedWriter(const Layout& layout, ShardedModelIo& io, std::string peer)
      : ModelWriter(layout, std::move(peer)), io_(io) {}

 private:
  Status store(const ChunkHeader& header, Payload payload) override;
  ShardedModelIo& io_;
  std::vector<std::byte> buffer_;
};

}  // namespace memfl
