// The server's side of a compressed broadcast
// (compressor_configs.broadcast_compression: lossy). After each round's
// aggregation, the new global model G is coded as its change from R, the
// model the clients received the round before, chunk by chunk with the
// update codec (lossy tensors within error_bound, the rest lossless):
//
//   G̃ = R + decode(encode(G − R))
//
// G̃ replaces G in the server's arena before the round is committed, so the
// checkpoint, the evaluation and every client hold the same bits; what the
// codec lost is left out of the model (at most the bound per element per
// round), as a client's lossy update loses it. The frames go to a file
// (page cache, not the server's memory) and a transport that carries them
// (gRPC) sends each client that holds R the frames instead of the model's
// bytes; other transports send G̃ as it is, so every transport trains from
// the same model.
//
// R itself lives in an unnamed file-backed arena whose pages are dropped as
// soon as each range has been read or written: during prepare() the server
// holds the model plus a few chunk-sized buffers per coding thread, as
// without compression. The chunks are split between up to 4 threads (one a
// core): the clients wait for this, so it uses the cores they leave idle.
//
//   BroadcastDelta delta(layout, settings, run_dir, chunk_bytes);
//   transport.set_broadcast_frames(&delta);
//   … after each round's aggregation, before the commit:
//   MEMFL_RETURN_IF_ERROR(delta.prepare(round + 1, global.arena()));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "compress/settings.h"
#include "compress/update_encoder.h"
#include "io/spool_file.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

class BroadcastDelta final : public BroadcastFrames {
 public:
  BroadcastDelta(const Layout& layout, CompressionSettings settings, std::string dir, size_t chunk_bytes);
  BroadcastDelta(const BroadcastDelta&) = delete;
  BroadcastDelta& operator=(const BroadcastDelta&) = delete;

  // `global` is the model clients will receive for round `round`. The first
  // time (or when `round` does not follow the model kept), it is only kept
  // as the reference: clients get its bytes. Otherwise it is replaced by
  // its rebuilt form and the frames from the reference's round are written.
  Status prepare(int round, Arena& global);

  int from_round() const override { return from_round_; }
  int to_round() const override { return to_round_; }
  size_t chunk_bytes() const override { return chunk_; }
  StatusOr<std::span<const std::byte>> frame(uint64_t offset, std::vector<std::byte>* buffer) const override;

  // The last prepare()'s bytes: the model's and its frames'.
  const EncodedStats& stats() const { return stats_; }

 private:
  const Layout& layout_;
  CompressionSettings settings_;
  std::string dir_;
  size_t chunk_;
  Arena reference_;  // R: the model clients hold (file-backed, unnamed)
  int reference_round_ = -1;
  // The frames: chunk i's at i × (chunk + kMaxFrameOverhead), the most a
  // frame can take, so threads coding different chunks write without
  // waiting for each other (the file is sparse: only frames take blocks).
  SpoolFile frames_{"broadcast frames"};
  std::vector<uint64_t> frame_size_;  // each chunk's frame's bytes
  int from_round_ = -1, to_round_ = -1;
  EncodedStats stats_;
};

}  // namespace memfl
