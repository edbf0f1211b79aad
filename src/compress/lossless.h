// Lossless stages of a compressed frame (compress/frame.h): the libraries
// APPFL names in `lossless_compressor` — zstd, gzip, zlib, lzma, blosc — each
// from its Debian package. A stage compresses one buffer at a time and
// decompresses into a buffer whose exact size the caller already knows (the
// frame says it, and the frame was checked against the chunk limit first), so
// a stream that would produce more bytes than promised is an error, never an
// allocation.
//
//   std::vector<std::byte> packed;
//   MEMFL_RETURN_IF_ERROR(lossless_compress(Lossless::kZstd, bytes, packed));
//   std::vector<std::byte> back(bytes.size());
//   MEMFL_RETURN_IF_ERROR(lossless_decompress(Lossless::kZstd, packed, back));
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memfl {

// The codec id a frame carries (one byte on the wire: values never change).
enum class Lossless : uint8_t { kNone = 0, kZstd = 1, kGzip = 2, kZlib = 3, kLzma = 4, kBlosc = 5 };
inline constexpr uint8_t kLosslessCount = 6;

// APPFL's names ("zstd", "gzip", "zlib", "lzma", "blosc") and "none".
std::optional<Lossless> lossless_from_name(std::string_view name);
std::string_view lossless_name(Lossless codec);
// Whether this build links the codec's library (each is optional in CMake so
// that a machine without one still builds; a config naming a missing one is
// refused before any work).
bool lossless_available(Lossless codec);

// Replaces `out` with the compressed form of `in`.
Status lossless_compress(Lossless codec, std::span<const std::byte> in, std::vector<std::byte>& out);
// Decompresses `in` into exactly `out.size()` bytes: a stream that holds
// more, fewer or malformed bytes is an error (kDataLoss).
Status lossless_decompress(Lossless codec, std::span<const std::byte> in, std::span<std::byte> out);

}  // namespace memfl
