// The gRPC wire: frames are raw gRPC messages (grpc::ByteBuffer) that we
// encode and decode ourselves, so that a chunk's bytes go from an arena into
// gRPC as a slice that points at the arena (no serialised copy), and come out
// of gRPC as the slices they arrived in (read in place by the receiver).
// Control messages are ordinary protobuf (proto/memfl.proto).
//
//   Frame f = encode_chunk_frame(kClientChunkField, header, arena.bytes(off, len), &inflight);
//   stream->Write(f);
//   ...
//   DecodedFrame d;
//   MEMFL_RETURN_IF_ERROR(decode_frame(frame, kServerChunkField, peer, &d, &server_message));
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/serialization_traits.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

#include "comm/chunk.h"
#include "common/status.h"
#include "proto/memfl.pb.h"

namespace memfl {

struct Frame {
  grpc::ByteBuffer buffer;
};

// Field numbers of Chunk in ClientMessage and ServerMessage.
inline constexpr int kClientChunkField = 6;
inline constexpr int kServerChunkField = 4;
// Largest control message we accept (configs are a few KiB).
inline constexpr size_t kMaxControlMessageBytes = 4u << 20;
inline constexpr const char* kSessionMethod = "/memfl.wire.FL/Session";

// Encodes a protobuf control message.
Frame encode_message(const google::protobuf::MessageLite& msg);

// Encodes a Chunk as field `field` of the outer message, with `data` handed
// to gRPC by reference. `inflight` (may be null) counts the arena slices gRPC
// still holds: it is incremented now and decremented when gRPC lets go, so
// the owner knows when it may overwrite the bytes.
Frame encode_chunk_frame(int field, const ChunkHeader& header, std::span<const std::byte> data,
                         std::atomic<int64_t>* inflight);

// A decoded frame: either a chunk (header + payload pieces that point into
// `slices`, valid while the DecodedFrame lives) or a control message.
struct DecodedFrame {
  bool is_chunk = false;
  ChunkHeader header;
  std::vector<grpc::Slice> slices;
  std::vector<std::span<const std::byte>> pieces;
  Payload payload() const { return Payload(pieces.data(), pieces.size()); }
};

// Decodes `frame`. Chunk frames (field `chunk_field`) are parsed by hand with
// every length checked against what arrived; other frames are parsed into
// `control` (ClientMessage or ServerMessage). Errors name `peer`.
Status decode_frame(Frame& frame, int chunk_field, std::string_view peer, DecodedFrame* out,
                    google::protobuf::MessageLite* control);

// The same decoder over plain bytes (for the fuzz target and tests).
Status decode_bytes(std::span<const uint8_t> bytes, int chunk_field, std::string_view peer, DecodedFrame* out,
                    google::protobuf::MessageLite* control);

// Reads a run of chunk frames and the control message that ends it (the
// model's ModelEnd, an update's UpdateEnd). A second thread reads and decodes
// up to `read_ahead` frames ahead of `on_chunk`, so that gRPC's receive work
// (the socket read, HTTP/2 parsing) overlaps the checking and folding of the
// chunk before; with the synchronous API alone the two take turns on one
// thread. `read` is the stream's Read; `cancel` its context's TryCancel.
//
// Returns OK with `control` parsed when a control message ended the run (the
// caller checks which). A frame that does not decode, or a chunk `on_chunk`
// refuses, ends the run with that status: the rest of the run is then read
// and dropped, so that the peer still hears the reply, for `drain` at most
// before the stream is cancelled. A stream that breaks sets *broke and
// returns kUnavailable.
//
// `budget` (may be null), shared by the runs of one process, bounds the
// frames read ahead by all of them together: a frame read while this run's
// consumer is busy takes a token, given back when the frame is taken; with
// none left a run reads only when its consumer waits (as the synchronous API
// would), so a server's read-ahead memory does not grow with its clients.
struct ChunkRunOptions {
  size_t read_ahead = 2;
  std::chrono::milliseconds drain{5000};
  std::atomic<int>* budget = nullptr;
};
Status read_chunk_run(const std::function<bool(Frame*)>& read, const std::function<void()>& cancel, int chunk_field,
                      std::string_view peer, const ChunkRunOptions& options,
                      const std::function<Status(const DecodedFrame&)>& on_chunk,
                      google::protobuf::MessageLite* control, bool* broke);

// gRPC message limits both sides set from the chunk size (see server.cpp).
int max_message_bytes(int64_t chunk_size, int64_t configured);
// The HTTP/2 stream window a side asks for: `chunks` chunks in flight, at
// least 1 MiB, so a stream keeps the pipe full without buffering a model.
// Clients ask for two; the server for one, as its uploads also read ahead
// (read_chunk_run's shared budget) — per client, one chunk less to hold.
int stream_window_bytes(int64_t chunk_size, int chunks = 2);

}  // namespace memfl

namespace grpc {
// Frames pass through gRPC untouched: "serialising" one hands over its slices.
template <>
class SerializationTraits<memfl::Frame, void> {
 public:
  static Status Serialize(const memfl::Frame& msg, ByteBuffer* bb, bool* own_buffer) {
    *bb = msg.buffer;  // shares the slices (reference counts), copies no bytes
    *own_buffer = true;
    return Status::OK;
  }
  static Status Deserialize(ByteBuffer* bb, memfl::Frame* msg) {
    msg->buffer.Swap(bb);
    bb->Clear();
    return Status::OK;
  }
};
}  // namespace grpc
