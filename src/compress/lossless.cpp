#include "compress/lossless.h"

#include <zlib.h>

#include <climits>
#include <cstring>
#include <memory>

#if defined(MEMFL_HAVE_ZSTD)
#include <zstd.h>
#endif
#if defined(MEMFL_HAVE_LZMA)
#include <lzma.h>
#endif
#if defined(MEMFL_HAVE_BLOSC)
#include <blosc.h>
#endif

namespace memfl {

namespace {

// Levels: the fastest of each library's usual settings. An update is
// compressed on the client's critical path at link speed; the ratio of
// float deltas gains little from slower levels (docs/BENCHMARKS.md,
// "Compression").
constexpr int kZstdLevel = 1;
constexpr int kDeflateLevel = 1;
constexpr uint32_t kLzmaPreset = 1;
// blosc: byte shuffle over 4-byte items (f32 deltas and quantisation codes
// are what it sees), with zstd inside where the library has it. blosclz,
// python-blosc's default, has no entropy stage: it left a stream of small
// codes larger than it came (measured: 40.8 KB from 32 KB of 3-valued
// bytes), where blosc's zstd shrinks it as zstd does.
constexpr int kBloscLevel = 5;
// What an lzma decoder may allocate for its dictionary: preset 1 needs
// about 1 MiB; a stream that asks for more is refused, not obeyed.
constexpr uint64_t kLzmaMemLimit = 16u << 20;

const unsigned char* u8(std::span<const std::byte> s) { return reinterpret_cast<const unsigned char*>(s.data()); }
unsigned char* u8(std::span<std::byte> s) { return reinterpret_cast<unsigned char*>(s.data()); }

[[maybe_unused]] Status not_built(Lossless codec) {
  return failed_precondition("lossless codec {} is not built into this memfl (its library was not found by CMake)",
                             lossless_name(codec));
}

// zlib and gzip are the same deflate stream in two wrappers (window bits
// 15: zlib's header and adler32; 31: gzip's header and crc32).
int deflate_window_bits(Lossless codec) { return codec == Lossless::kGzip ? 31 : 15; }

Status deflate_compress(Lossless codec, std::span<const std::byte> in, std::vector<std::byte>& out) {
  if (in.size() > UINT_MAX) return invalid_argument("deflate: {} bytes is more than one call takes", in.size());
  z_stream z{};
  if (deflateInit2(&z, kDeflateLevel, Z_DEFLATED, deflate_window_bits(codec), 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    return internal_error("deflateInit2 failed");
  }
  out.resize(deflateBound(&z, static_cast<uLong>(in.size())) + 32);  // + gzip's larger header
  z.next_in = const_cast<unsigned char*>(u8(in));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<unsigned char*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  const size_t produced = z.total_out;
  deflateEnd(&z);
  if (rc != Z_STREAM_END) return internal_error("deflate failed ({})", rc);
  out.resize(produced);
  return Status::Ok();
}

Status deflate_decompress(Lossless codec, std::span<const std::byte> in, std::span<std::byte> out) {
  if (in.size() > UINT_MAX || out.size() > UINT_MAX) return data_loss("{}: stream too long", lossless_name(codec));
  z_stream z{};
  if (inflateInit2(&z, deflate_window_bits(codec)) != Z_OK) return internal_error("inflateInit2 failed");
  z.next_in = const_cast<unsigned char*>(u8(in));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = u8(out);
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = inflate(&z, Z_FINISH);
  const size_t produced = z.total_out, left = z.avail_in;
  inflateEnd(&z);
  if (rc != Z_STREAM_END || produced != out.size() || left != 0) {
    return data_loss("{}: the stream does not decompress to the {} bytes its frame promises (zlib {}, {} bytes out)",
                     lossless_name(codec), out.size(), rc, produced);
  }
  return Status::Ok();
}

}  // namespace

std::optional<Lossless> lossless_from_name(std::string_view name) {
  for (uint8_t i = 0; i < kLosslessCount; ++i) {
    if (lossless_name(static_cast<Lossless>(i)) == name) return static_cast<Lossless>(i);
  }
  return std::nullopt;
}

std::string_view lossless_name(Lossless codec) {
  switch (codec) {
    case Lossless::kNone:
      return "none";
    case Lossless::kZstd:
      return "zstd";
    case Lossless::kGzip:
      return "gzip";
    case Lossless::kZlib:
      return "zlib";
    case Lossless::kLzma:
      return "lzma";
    case Lossless::kBlosc:
      return "blosc";
  }
  return "?";
}

bool lossless_available(Lossless codec) {
  switch (codec) {
    case Lossless::kNone:
    case Lossless::kGzip:
    case Lossless::kZlib:
      return true;
    case Lossless::kZstd:
#if defined(MEMFL_HAVE_ZSTD)
      return true;
#else
      return false;
#endif
    case Lossless::kLzma:
#if defined(MEMFL_HAVE_LZMA)
      return true;
#else
      return false;
#endif
    case Lossless::kBlosc:
#if defined(MEMFL_HAVE_BLOSC)
      return true;
#else
      return false;
#endif
  }
  return false;
}

Status lossless_compress(Lossless codec, std::span<const std::byte> in, std::vector<std::byte>& out) {
  switch (codec) {
    case Lossless::kNone:
      out.assign(in.begin(), in.end());
      return Status::Ok();
    case Lossless::kGzip:
    case Lossless::kZlib:
      return deflate_compress(codec, in, out);
    case Lossless::kZstd: {
#if defined(MEMFL_HAVE_ZSTD)
      out.resize(ZSTD_compressBound(in.size()));
      // One context per thread, kept: ZSTD_compress makes and zeroes a fresh
      // one (about a megabyte, fresh pages) for every frame.
      thread_local std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> context(ZSTD_createCCtx(), ZSTD_freeCCtx);
      if (context == nullptr) return resource_exhausted("zstd: no memory for a compression context");
      const size_t n = ZSTD_compressCCtx(context.get(), out.data(), out.size(), in.data(), in.size(), kZstdLevel);
      if (ZSTD_isError(n)) return internal_error("zstd: {}", ZSTD_getErrorName(n));
      out.resize(n);
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
    case Lossless::kLzma: {
#if defined(MEMFL_HAVE_LZMA)
      out.resize(lzma_stream_buffer_bound(in.size()));
      size_t pos = 0;
      const lzma_ret rc = lzma_easy_buffer_encode(kLzmaPreset, LZMA_CHECK_NONE, nullptr, u8(in), in.size(),
                                                  reinterpret_cast<uint8_t*>(out.data()), &pos, out.size());
      if (rc != LZMA_OK) return internal_error("lzma: encoder failed ({})", static_cast<int>(rc));
      out.resize(pos);
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
    case Lossless::kBlosc: {
#if defined(MEMFL_HAVE_BLOSC)
      if (in.size() > static_cast<size_t>(BLOSC_MAX_BUFFERSIZE)) {
        return invalid_argument("blosc: {} bytes is more than one buffer takes", in.size());
      }
      out.resize(in.size() + BLOSC_MAX_OVERHEAD);
      static const char* const compressor = blosc_compname_to_compcode("zstd") >= 0 ? "zstd" : "blosclz";
      const int n = blosc_compress_ctx(kBloscLevel, BLOSC_SHUFFLE, 4, in.size(), in.data(), out.data(), out.size(),
                                       compressor, 0, 1);
      if (n <= 0) return internal_error("blosc: compression failed ({})", n);
      out.resize(static_cast<size_t>(n));
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
  }
  return invalid_argument("unknown lossless codec {}", static_cast<int>(codec));
}

Status lossless_decompress(Lossless codec, std::span<const std::byte> in, std::span<std::byte> out) {
  switch (codec) {
    case Lossless::kNone:
      if (in.size() != out.size()) {
        return data_loss("a stored body of {} bytes where {} were promised", in.size(), out.size());
      }
      if (!in.empty()) std::memcpy(out.data(), in.data(), in.size());
      return Status::Ok();
    case Lossless::kGzip:
    case Lossless::kZlib:
      return deflate_decompress(codec, in, out);
    case Lossless::kZstd: {
#if defined(MEMFL_HAVE_ZSTD)
      // The frame's own size field first: a stream that says it holds more
      // than promised is refused before it is run.
      const unsigned long long said = ZSTD_getFrameContentSize(in.data(), in.size());
      if (said != out.size()) {
        return data_loss("zstd: the stream says {} bytes where its frame promises {}",
                         said == ZSTD_CONTENTSIZE_UNKNOWN ? "an unknown number of"
                         : said == ZSTD_CONTENTSIZE_ERROR ? "no valid header and"
                                                          : std::to_string(said),
                         out.size());
      }
      thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> context(ZSTD_createDCtx(), ZSTD_freeDCtx);
      if (context == nullptr) return resource_exhausted("zstd: no memory for a decompression context");
      const size_t n = ZSTD_decompressDCtx(context.get(), out.data(), out.size(), in.data(), in.size());
      if (ZSTD_isError(n) || n != out.size()) {
        return data_loss("zstd: {}", ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short stream");
      }
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
    case Lossless::kLzma: {
#if defined(MEMFL_HAVE_LZMA)
      uint64_t memlimit = kLzmaMemLimit;
      size_t in_pos = 0, out_pos = 0;
      const lzma_ret rc =
          lzma_stream_buffer_decode(&memlimit, 0, nullptr, u8(in), &in_pos, in.size(), u8(out), &out_pos, out.size());
      if (rc != LZMA_OK || out_pos != out.size() || in_pos != in.size()) {
        return data_loss("lzma: the stream does not decompress to the {} bytes its frame promises (lzma {})",
                         out.size(), static_cast<int>(rc));
      }
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
    case Lossless::kBlosc: {
#if defined(MEMFL_HAVE_BLOSC)
      // blosc reads its sizes from its own header: validate them against the
      // bytes that arrived before the decoder trusts them.
      size_t said = 0;
      if (blosc_cbuffer_validate(in.data(), in.size(), &said) != 0) return data_loss("blosc: not a valid buffer");
      size_t nbytes = 0, cbytes = 0, block = 0;
      blosc_cbuffer_sizes(in.data(), &nbytes, &cbytes, &block);
      if (said != out.size() || cbytes != in.size()) {
        return data_loss("blosc: the buffer says {} bytes ({} compressed) where its frame promises {} ({})", said,
                         cbytes, out.size(), in.size());
      }
      const int n = blosc_decompress_ctx(in.data(), out.data(), out.size(), 1);
      if (n < 0 || static_cast<size_t>(n) != out.size()) return data_loss("blosc: decompression failed ({})", n);
      return Status::Ok();
#else
      return not_built(codec);
#endif
    }
  }
  return data_loss("unknown lossless codec {}", static_cast<int>(codec));
}

}  // namespace memfl
