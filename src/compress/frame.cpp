#include "compress/frame.h"

#include <cmath>
#include <cstring>

namespace memfl {

namespace {

template <typename T>
void put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
T get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

void write_frame_header(const FrameHeader& h, std::byte* out) {
  std::memset(out, 0, kFrameHeaderBytes);
  put<uint32_t>(out, kFrameMagic);
  out[4] = std::byte{kFrameVersion};
  out[5] = static_cast<std::byte>(h.codec);
  put<uint32_t>(out + 8, h.segments);
  put<uint64_t>(out + 16, h.raw_length);
  put<uint64_t>(out + 24, h.body_length);
  put<uint64_t>(out + 32, h.inner_length);
  put<uint64_t>(out + 40, h.raw_checksum);
}

void write_segment_header(const SegmentHeader& h, std::byte* out) {
  std::memset(out, 0, kSegmentHeaderBytes);
  out[0] = static_cast<std::byte>(h.kind);
  out[1] = static_cast<std::byte>(h.codec);
  out[2] = static_cast<std::byte>(h.dtype);
  put<uint64_t>(out + 8, h.raw_bytes);
  put<uint64_t>(out + 16, h.payload_bytes);
  put<double>(out + 24, h.tolerance);
}

StatusOr<FrameHeader> read_frame_header(std::span<const std::byte> frame, uint64_t max_raw) {
  if (frame.size() < kFrameHeaderBytes) {
    return data_loss("{} bytes is shorter than a frame header ({} bytes)", frame.size(), kFrameHeaderBytes);
  }
  const std::byte* p = frame.data();
  if (get<uint32_t>(p) != kFrameMagic) return data_loss("not a compressed frame (magic {:08x})", get<uint32_t>(p));
  if (static_cast<uint8_t>(p[4]) != kFrameVersion) {
    return data_loss("frame version {} (this memfl reads version {})", static_cast<int>(p[4]), kFrameVersion);
  }
  const uint8_t codec = static_cast<uint8_t>(p[5]);
  if (codec >= kLosslessCount) return data_loss("unknown lossless codec id {}", codec);
  FrameHeader h;
  h.codec = static_cast<Lossless>(codec);
  h.segments = get<uint32_t>(p + 8);
  h.raw_length = get<uint64_t>(p + 16);
  h.body_length = get<uint64_t>(p + 24);
  h.inner_length = get<uint64_t>(p + 32);
  h.raw_checksum = get<uint64_t>(p + 40);
  if (h.raw_length == 0 || h.raw_length > max_raw) {
    return data_loss("the frame says it rebuilds {} bytes; a chunk holds 1 to {}", h.raw_length, max_raw);
  }
  if (h.body_length != frame.size() - kFrameHeaderBytes) {
    return data_loss("the frame says its body is {} bytes but {} arrived", h.body_length,
                     frame.size() - kFrameHeaderBytes);
  }
  if (h.inner_length > h.raw_length + kMaxFrameOverhead || h.inner_length < kSegmentHeaderBytes) {
    return data_loss("the frame's segments say {} bytes for {} bytes of model (at most {} more)", h.inner_length,
                     h.raw_length, kMaxFrameOverhead);
  }
  if (h.segments == 0 || h.segments > h.inner_length / kSegmentHeaderBytes) {
    return data_loss("the frame says {} segments in {} bytes", h.segments, h.inner_length);
  }
  if (!lossless_available(h.codec)) {
    return failed_precondition("the frame is compressed with {}, which this memfl was built without",
                               lossless_name(h.codec));
  }
  return h;
}

void rebuild_delta(DType dtype, const std::byte* base, const float* delta, size_t n, std::byte* out) {
  for (size_t i = 0; i < n; ++i) {
    const float v = base != nullptr ? load_float(dtype, base, i) + delta[i] : delta[i];
    switch (dtype) {
      case DType::kF32:
        put<float>(out + 4 * i, v);
        break;
      case DType::kBF16:
        put<uint16_t>(out + 2 * i, f32_to_bf16(v));
        break;
      case DType::kF16:
        put<uint16_t>(out + 2 * i, f32_to_f16(v));
        break;
      default:
        break;
    }
  }
}

Status FrameDecoder::bad(uint64_t offset, const std::string& why) const {
  return data_loss("compressed frame from {} for the chunk at model offset {}: {}", peer_, offset, why);
}

StatusOr<std::span<const std::byte>> FrameDecoder::decode(uint64_t offset, Payload frame) {
  std::span<const std::byte> bytes;
  if (frame.size() == 1) {
    bytes = frame.front();
  } else {
    // A frame that arrived in pieces (gRPC slices) is put together once: the
    // lossless stages take one buffer. Bounded: the transport refused a
    // chunk above the limit before it read it.
    gathered_.resize(payload_size(frame));
    size_t at = 0;
    for (auto part : frame) {
      if (!part.empty()) std::memcpy(gathered_.data() + at, part.data(), part.size());
      at += part.size();
    }
    bytes = gathered_;
  }
  const uint64_t left = offset < layout_.total_bytes() ? layout_.total_bytes() - offset : 0;
  auto header = read_frame_header(bytes, std::min(max_raw_, left));
  if (!header.ok()) return bad(offset, header.status().message());
  const FrameHeader& h = *header;
  inner_.resize(h.inner_length);
  if (Status s = lossless_decompress(h.codec, bytes.subspan(kFrameHeaderBytes), inner_); !s.ok()) {
    return bad(offset, s.message());
  }
  raw_.resize(h.raw_length);
  MEMFL_RETURN_IF_ERROR(decode_segments(offset, h));
  if (chunk_checksum(std::span<const std::byte>(raw_)) != h.raw_checksum) {
    return bad(offset, "the rebuilt bytes do not match the frame's checksum");
  }
  raw_checksum_ = h.raw_checksum;
  return std::span<const std::byte>(raw_);
}

Status FrameDecoder::decode_segments(uint64_t offset, const FrameHeader& h) {
  size_t in = 0;   // position in inner_
  size_t out = 0;  // position in raw_
  for (uint32_t s = 0; s < h.segments; ++s) {
    if (inner_.size() - in < kSegmentHeaderBytes) return bad(offset, fmt::format("segment {} is cut short", s));
    const std::byte* p = inner_.data() + in;
    const uint8_t kind = static_cast<uint8_t>(p[0]), codec = static_cast<uint8_t>(p[1]),
                  dtype = static_cast<uint8_t>(p[2]);
    const uint64_t raw_bytes = get<uint64_t>(p + 8), payload_bytes = get<uint64_t>(p + 16);
    const double tolerance = get<double>(p + 24);
    in += kSegmentHeaderBytes;
    if (raw_bytes == 0 || raw_bytes > raw_.size() - out || payload_bytes > inner_.size() - in) {
      return bad(offset, fmt::format("segment {} says {} model bytes from {} bytes, past the frame's end", s, raw_bytes,
                                     payload_bytes));
    }
    const std::span<const std::byte> payload(inner_.data() + in, payload_bytes);
    const uint64_t at = offset + out;
    if (kind == static_cast<uint8_t>(SegmentKind::kRaw)) {
      if (payload_bytes != raw_bytes) {
        return bad(offset, fmt::format("raw segment {} holds {} bytes for {}", s, payload_bytes, raw_bytes));
      }
      std::memcpy(raw_.data() + out, payload.data(), raw_bytes);
    } else if (kind == static_cast<uint8_t>(SegmentKind::kLossyDelta)) {
      // A lossy segment holds whole elements of one float tensor, of its dtype.
      const size_t e = layout_.entry_at_or_after(static_cast<size_t>(at));
      const LayoutEntry* entry = e < layout_.size() ? &layout_.entries()[e] : nullptr;
      if (entry == nullptr || !dtype_is_float(entry->dtype) || static_cast<uint8_t>(entry->dtype) != dtype ||
          at < entry->offset || at + raw_bytes > entry->end() || (at - entry->offset) % dtype_size(entry->dtype) != 0 ||
          raw_bytes % dtype_size(entry->dtype) != 0) {
        return bad(offset, fmt::format("lossy segment {} ([{}, {}), dtype id {}) is not whole elements of one float "
                                       "tensor of that dtype",
                                       s, at, at + raw_bytes, dtype));
      }
      if (codec != static_cast<uint8_t>(Lossy::kZfp) && codec != static_cast<uint8_t>(Lossy::kQuantizer)) {
        return bad(offset, fmt::format("lossy segment {}: unknown lossy codec id {}", s, codec));
      }
      const size_t n = raw_bytes / dtype_size(entry->dtype);
      delta_.resize(n);
      if (Status st = lossy_decode(static_cast<Lossy>(codec), payload, tolerance, delta_, scratch_); !st.ok()) {
        return bad(offset, fmt::format("segment {} ({}): {}", s, entry->name, st.message()));
      }
      const std::byte* base = nullptr;
      if (base_ != nullptr) {
        base_bytes_.resize(raw_bytes);
        MEMFL_RETURN_IF_ERROR(base_->read(at, base_bytes_));
        base = base_bytes_.data();
      }
      rebuild_delta(entry->dtype, base, delta_.data(), n, raw_.data() + out);
    } else {
      return bad(offset, fmt::format("segment {} is of unknown kind {}", s, kind));
    }
    in += payload_bytes;
    out += raw_bytes;
  }
  if (in != inner_.size() || out != raw_.size()) {
    return bad(offset, fmt::format("its segments cover {} of {} model bytes and {} of {} bytes", out, raw_.size(), in,
                                   inner_.size()));
  }
  return Status::Ok();
}

}  // namespace memfl
