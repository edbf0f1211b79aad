// Error-bounded lossy codecs for arrays of f32: every decoded element lies
// within `tolerance` (absolute) of its input, checked element by element by
// the encoder, which also returns what the decoder will rebuild (error
// feedback needs it, and it costs nothing extra: the check decodes anyway).
//
// - ZFP (libzfp, fixed-accuracy mode) — APPFL's ZFPCompressor. ZFP's
//   accuracy mode bounds the error in all but rare cases (large dynamic range
//   inside one block of 4 values can overshoot); the encoder decodes,
//   compares, and patches each element that overshot with its exact value.
// - the quantiser — memfl's own codec for APPFL's SZ family (SZ2, SZ3, SZx,
//   which Debian does not package): SZ's scheme, prediction (none, or the
//   previous decoded value, whichever leaves the smaller residuals for this
//   array) plus linear quantisation in bins of 2·tolerance; an element whose
//   code would not fit 16 bits or whose decoded f32 misses the bound is kept
//   exact. The codes go to the frame's lossless stage (zstd, …), which does
//   the entropy coding SZ does with Huffman + zstd.
//
// Both decoders check every length and index against the array before a
// byte is read: the payload comes from a peer.
//
//   std::vector<std::byte> payload;
//   std::vector<float> decoded(values.size());
//   MEMFL_RETURN_IF_ERROR(lossy_encode(Lossy::kZfp, values, 1e-3, payload, decoded));
//   LossyScratch scratch;
//   MEMFL_RETURN_IF_ERROR(lossy_decode(Lossy::kZfp, payload, 1e-3, out, scratch));   // out == decoded
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memfl {

// The codec id a frame's segment carries (one byte on the wire).
enum class Lossy : uint8_t { kNone = 0, kZfp = 1, kQuantizer = 2 };

std::string_view lossy_codec_name(Lossy codec);  // "zfp", "memfl-quantizer"
bool lossy_available(Lossy codec);               // kZfp: built with libzfp

// Buffers a decoder reuses from one segment to the next (one per stream).
struct LossyScratch {
  std::vector<std::byte> padded;  // ZFP's input, padded to what its decoder may read
};

// Appends the encoded `values` to `out` and writes the values the decoder
// will rebuild to `decoded` (same size). `tolerance` > 0 and finite.
Status lossy_encode(Lossy codec, std::span<const float> values, double tolerance, std::vector<std::byte>& out,
                    std::span<float> decoded);
// Decodes `payload` (exactly one encoded array) into `out`, whose size is the
// number of values the segment says it holds.
Status lossy_decode(Lossy codec, std::span<const std::byte> payload, double tolerance, std::span<float> out,
                    LossyScratch& scratch);

}  // namespace memfl
