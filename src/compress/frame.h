// Compressed frames: how a compressed update travels. Each chunk of the
// model's bytes becomes one self-describing frame, sent where the raw chunk
// would have gone (same transport, same chunk grid, same ChunkHeader offset;
// the header's length and xxh3 are the frame's, so every transport's
// checksum check still covers the bytes on the wire). The receiver turns
// the frame back into the chunk's model bytes before anything folds them,
// holding one frame and one chunk at a time: no whole model, compressed or
// not, exists on either side.
//
// Frame, little-endian:
//
//   header (kFrameHeaderBytes = 48)
//     u32 magic "MFZF"  u8 version (1)  u8 lossless codec (compress/lossless.h)  u16 0
//     u32 segments  u32 0
//     u64 raw length    bytes of the model the frame rebuilds (≤ the chunk limit)
//     u64 body length   bytes after the header (the compressed length)
//     u64 inner length  the body after its lossless stage (≤ raw length + kMaxFrameOverhead)
//     u64 xxh3          of the rebuilt model bytes
//   body: the lossless stage applied to the segments, in model order:
//     segment header (kSegmentHeaderBytes = 32)
//       u8 kind (0 raw, 1 lossy delta)  u8 lossy codec  u8 dtype  u8 0  u32 0
//       u64 raw bytes   model bytes it rebuilds
//       u64 payload bytes
//       f64 tolerance   (lossy: the absolute bound this segment honours)
//     payload: raw — the bytes themselves; lossy delta — compress/lossy.h's
//       encoding of d, the tensor's change from the base model, as f32;
//       the receiver rebuilds dtype(f32(base) + d̃) element by element
//       (rebuild_delta), the same arithmetic as the sender.
//
// Every field is checked before it is used and before any buffer is sized
// from it: an unknown codec or version, a raw length above the chunk limit
// (a decompression bomb) or past the model's end, a body that is not the
// rest of the frame, an inner length above raw + overhead, segments that do
// not add up or leave their tensor, and rebuilt bytes whose xxh3 is not the
// frame's are all refused, naming the peer and the chunk's offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "comm/chunk.h"
#include "common/status.h"
#include "compress/lossless.h"
#include "compress/lossy.h"
#include "tensor/layout.h"

namespace memfl {

inline constexpr uint32_t kFrameMagic = 0x465a464d;  // "MFZF"
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 48;
inline constexpr size_t kSegmentHeaderBytes = 32;
static_assert(kFrameHeaderBytes + kSegmentHeaderBytes <= kMaxFrameOverhead);

enum class SegmentKind : uint8_t { kRaw = 0, kLossyDelta = 1 };

struct FrameHeader {
  Lossless codec = Lossless::kNone;
  uint32_t segments = 0;
  uint64_t raw_length = 0, body_length = 0, inner_length = 0, raw_checksum = 0;
};

struct SegmentHeader {
  SegmentKind kind = SegmentKind::kRaw;
  Lossy codec = Lossy::kNone;
  DType dtype = DType::kU8;
  uint64_t raw_bytes = 0, payload_bytes = 0;
  double tolerance = 0;
};

void write_frame_header(const FrameHeader& h, std::byte* out);
void write_segment_header(const SegmentHeader& h, std::byte* out);
// Reads and checks a frame's header: magic, version, codec, raw length in
// (0, max_raw], body length = frame size − header, inner length bounded.
StatusOr<FrameHeader> read_frame_header(std::span<const std::byte> frame, uint64_t max_raw);

// out[i] = dtype(f32(base[i]) + delta[i]) for n elements of `dtype` (a float
// type); no base means a zero one (an update that is a change already). The
// sender and the receiver call this one function, so both rebuild the same
// bytes and the frame's xxh3 can check them.
void rebuild_delta(DType dtype, const std::byte* base, const float* delta, size_t n, std::byte* out);
// f32 value of element i of a float dtype at p (inline: the encoder's and
// the decoder's per-element loops call it).
inline float load_float(DType dtype, const std::byte* p, size_t i) {
  switch (dtype) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return dtype == DType::kBF16 ? bf16_to_f32(b) : f16_to_f32(b);
    }
    default:
      return 0;
  }
}

// Where a receiver reads the model an update's deltas are against (the
// round's global model: the server's arena or its checkpoint file).
class BaseModel {
 public:
  virtual ~BaseModel() = default;
  virtual Status read(uint64_t offset, std::span<std::byte> into) const = 0;
};

// Turns one stream's frames back into model bytes, chunk by chunk. Holds a
// frame-sized and a chunk-sized buffer (plus, for lossy segments, the
// chunk's base bytes and its f32 deltas): what a stream in flight costs.
class FrameDecoder {
 public:
  // `base`: null when the update's deltas are against zero (an asynchronous
  // gradient_based update is a change already). `max_raw`: the most model
  // bytes one frame may rebuild (the transports' largest chunk).
  FrameDecoder(const Layout& layout, const BaseModel* base, std::string peer, uint64_t max_raw = kMaxTransferChunk)
      : layout_(layout), base_(base), peer_(std::move(peer)), max_raw_(max_raw) {}
  // Decodes `frame`, which carries the model's bytes from `offset`: returns
  // them (valid until the next call) after checking them against the
  // frame's xxh3, which raw_checksum() then returns.
  StatusOr<std::span<const std::byte>> decode(uint64_t offset, Payload frame);
  uint64_t raw_checksum() const { return raw_checksum_; }

 private:
  Status bad(uint64_t offset, const std::string& why) const;
  Status decode_segments(uint64_t offset, const FrameHeader& h);
  const Layout& layout_;
  const BaseModel* base_;
  std::string peer_;
  uint64_t max_raw_;
  uint64_t raw_checksum_ = 0;
  std::vector<std::byte> gathered_, inner_, raw_, base_bytes_;
  std::vector<float> delta_;
  LossyScratch scratch_;
};

}  // namespace memfl
