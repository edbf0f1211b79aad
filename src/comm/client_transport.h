// ClientTransport: what a client needs of a transport (gRPC, MPI) — the
// mirror of ServerTransport (comm/transport.h). The client's steps are
// written once, in ClientDriver (client/client_driver.h), against this
// interface; a transport knows how to be told a round began, how to move a
// model's checked chunks into a ModelPlace, and how to send an update's
// chunks out of one — nothing of training, privacy or encoding.
//
//   while (true) {
//     MEMFL_ASSIGN_OR_RETURN(RoundOffer offer, transport.next_round());
//     if (offer.finished()) break;
//     MEMFL_RETURN_IF_ERROR(transport.receive(place));          // every chunk checked
//     … train each of offer.clients …
//     MEMFL_RETURN_IF_ERROR(transport.send(meta, update_place));
//   }
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/chunk.h"
#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "tensor/sharded_model_io.h"

namespace memfl {

// Where a model is received into and an update sent from. A place with an
// arena is read and written in place (no staging copy); any other place
// (a model sharded over ranks, the Python client's own tensors) through a
// checked writer and a copying read, one chunk at a time.
class ModelPlace {
 public:
  virtual ~ModelPlace() = default;
  virtual Arena* arena() { return nullptr; }
  virtual ShardedModelIo* shards() { return nullptr; }
  // Checks every chunk's header and checksum before its bytes count.
  virtual std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) = 0;
  // Bytes [offset, offset + into.size()) of the model.
  virtual Status read(uint64_t offset, std::span<std::byte> into) = 0;
  // Whether the model leaves as compressed frames (compress/frame.h): then a
  // transport sends, for each chunk of its grid in order, frame(offset,
  // length) in place of the chunk's bytes — at most length +
  // kMaxFrameOverhead bytes, in a buffer the place reuses at the next call
  // (so a transport lets go of one frame before it asks for the next).
  virtual bool framed() const { return false; }
  virtual StatusOr<std::span<const std::byte>> frame(uint64_t offset, size_t length) {
    return failed_precondition("this place sends its model's bytes as they are, not as frames");
  }
  // Whether what the place receives stays in its arena, untouched, until
  // the next broadcast: then a transport may ask for that broadcast as the
  // change from it (compressor_configs.broadcast_compression) and rebuild
  // the new model in place.
  virtual bool keeps_received_model() const { return false; }
};

class ArenaPlace final : public ModelPlace {
 public:
  explicit ArenaPlace(Arena& arena, bool keeps_received_model = false) : arena_(arena), keeps_(keeps_received_model) {}
  Arena* arena() override { return &arena_; }
  bool keeps_received_model() const override { return keeps_; }
  std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) override {
    return std::make_unique<ArenaWriter>(layout, arena_, std::move(peer));
  }
  Status read(uint64_t offset, std::span<std::byte> into) override {
    return ArenaUpdateSource(arena_).read(offset, into);
  }

 private:
  Arena& arena_;
  bool keeps_;
};

class ShardsPlace final : public ModelPlace {
 public:
  explicit ShardsPlace(ShardedModelIo& io) : io_(io) {}
  ShardedModelIo* shards() override { return &io_; }
  std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) override {
    return std::make_unique<ShardedWriter>(layout, io_, std::move(peer));
  }
  Status read(uint64_t offset, std::span<std::byte> into) override { return io_.read(offset, into); }

 private:
  ShardedModelIo& io_;
};

// Sends the model in `from` to `sink` in chunks of at most `chunk` bytes:
// from its arena in place, through one staging buffer, or — a framed place —
// as its frames. Returns the bytes handed to the sink (the wire's bytes).
inline StatusOr<uint64_t> stream_place(const Layout& layout, ModelPlace& from, size_t chunk, ChunkSink& sink) {
  if (chunk == 0) return invalid_argument("model_chunk_size must be at least 1 byte");
  if (!from.framed() && from.arena() != nullptr) return stream_arena(layout, *from.arena(), chunk, sink);
  std::vector<std::byte> staging;
  uint64_t sent = 0;
  for (uint64_t off = 0; off < layout.total_bytes(); off += chunk) {
    const size_t len = std::min<uint64_t>(chunk, layout.total_bytes() - off);
    std::span<const std::byte> bytes;
    if (from.framed()) {
      MEMFL_ASSIGN_OR_RETURN(bytes, from.frame(off, len));
    } else {
      staging.resize(len);
      MEMFL_RETURN_IF_ERROR(from.read(off, staging));
      bytes = staging;
    }
    MEMFL_RETURN_IF_ERROR(sink.accept(ChunkHeader{layout.hash(), off, bytes.size(), chunk_checksum(bytes)}, bytes));
    sent += bytes.size();
  }
  return sent;
}

// The largest secure-aggregation message a transport carries (a share is
// ≈ 150 bytes; 2^16 clients' worth of them fit): a larger one is refused
// before it is read.
inline constexpr size_t kMaxSecAggMessage = size_t{64} << 20;

// The server has begun a round for this process: which of its clients train
// (one for a gRPC client; an MPI rank may run several virtual clients), on
// the model about to be received.
struct RoundOffer {
  int round = -1;       // -1: the run is over
  int local_steps = 0;  // FedCompass: this trip's steps; 0: the config's
  std::vector<int> clients;
  bool finished() const { return round < 0; }
};

// What is sent ahead of an update's chunks.
struct UpdateMeta {
  int round = 0;
  int client = 0;
  double sample_count = 0;                // FedAvg's weight
  std::map<std::string, double> metrics;  // train_loss, val_accuracy, local_steps, epsilon, …
};

// Where a misbehaving peer is played, for the fault tests: a transport calls
// these at its fault points, and production runs pass none (the transports
// hold a do-nothing TransferFaults). The env-configured plan the tests use
// lives in comm/fault_plan.h; nothing else in the loops knows of faults.
class TransferFaults {
 public:
  virtual ~TransferFaults() = default;
  // The token and data ticket the client presents when it registers.
  virtual std::string token(std::string token) { return token; }
  virtual uint64_t data_ticket(uint64_t ticket) { return ticket; }
  // A chunk of the model arrived (MPI: the round's model is about to).
  virtual void in_broadcast() {}
  // Chunk `index` of an update is about to go (`last`: the update's last
  // chunk; MPI passes null before its first chunk): it may alter the
  // header, or return an error that the transport acts out as a dropped
  // connection.
  virtual Status before_upload_chunk(size_t /*index*/, bool /*last*/, ChunkHeader* /*header*/) { return Status::Ok(); }
  // An update's metadata is about to go: it may alter what it reports.
  virtual void before_update_meta(UpdateMeta* /*meta*/) {}
  // The process's part of `round` is over.
  virtual void after_round(int /*round*/) {}
};

class ClientTransport {
 public:
  virtual ~ClientTransport() = default;
  virtual std::string_view name() const = 0;
  // Waits for the server's next round (a round this process takes part in).
  virtual StatusOr<RoundOffer> next_round() = 0;
  // The round's model into `into`; returns once every chunk passed its
  // checks and the server knows it arrived.
  virtual Status receive(ModelPlace& into) = 0;
  // One client's update: `meta`, then the model's bytes read from `from`.
  // Returns once the server accepted it.
  virtual Status send(const UpdateMeta& meta, ModelPlace& from) = 0;
  // Secure aggregation's stages ride on the transport as opaque bytes
  // (secagg/wire.h gives them meaning): the server's next request for the
  // clients this process plays (empty: the round's stages are over), and
  // the reply to it. Neither is larger than kMaxSecAggMessage.
  virtual StatusOr<std::string> next_secagg_request() {
    return failed_precondition("the {} transport does not carry secure aggregation's key exchange", name());
  }
  virtual Status send_secagg_reply(std::string /*reply*/) {
    return failed_precondition("the {} transport does not carry secure aggregation's key exchange", name());
  }
  // A round failed with `why`: OK when the transport has a new session and
  // the client may go on with the next round (a server that restarted);
  // otherwise the error that ends the client.
  virtual Status recover(const Status& why) { return why; }
  // Tells the server this client is done (also after a failure).
  virtual Status close() = 0;
};

}  // namespace memfl
