#include "compress/update_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace memfl {

std::string zeroed_changes_warning(const EncodedStats& stats, std::string_view what) {
  if (stats.lossy_elements == 0 || stats.zeroed_share() < 0.5) return "";
  return fmt::format(
      "{}: {:.1f}% of the {} lossy-coded changes that were not zero arrive as zero; the error bound is larger than "
      "the changes (an ABS error_bound is in the values' units: lower it, or use REL)",
      what, 100.0 * stats.zeroed_share(), stats.lossy_elements);
}

namespace {

void store_float(DType dtype, std::byte* p, float v) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(p, &v, 4);
      break;
    case DType::kBF16: {
      const uint16_t b = f32_to_bf16(v);
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kF16: {
      const uint16_t b = f32_to_f16(v);
      std::memcpy(p, &b, 2);
      break;
    }
    default:
      break;
  }
}

}  // namespace

UpdateEncoder::UpdateEncoder(const Layout& layout, CompressionSettings settings)
    : layout_(layout), s_(std::move(settings)) {
  lossy_.resize(layout.size());
  tolerance_.assign(layout.size(), 0.0);
  for (size_t e = 0; e < layout.size(); ++e) lossy_[e] = s_.lossy_tensor(layout.entries()[e]);
}

const std::byte* UpdateEncoder::model_at(uint64_t offset) const {
  return y_ != nullptr ? y_ + offset : ybuf_.data() + (offset - window_);
}

void UpdateEncoder::deltas(size_t e, size_t k0, size_t k1, float* out) const {
  const LayoutEntry& en = layout_.entries()[e];
  const std::byte* y = y_ + en.offset;
  const std::byte* x = x_ != nullptr ? x_ + en.offset : nullptr;
  const std::byte* r = r_ != nullptr ? r_ + en.offset : nullptr;
  if (en.dtype == DType::kF32 && x != nullptr) {
    // The common case, in a loop the compiler vectorises.
    const size_t n = k1 - k0;
    std::memcpy(out, y + 4 * k0, 4 * n);
    for (size_t i = 0; i < n; ++i) {
      float xv;
      std::memcpy(&xv, x + 4 * (k0 + i), 4);
      out[i] -= xv;
    }
    if (r != nullptr) {
      for (size_t i = 0; i < n; ++i) {
        float rv;
        std::memcpy(&rv, r + 4 * (k0 + i), 4);
        out[i] += rv;
      }
    }
    return;
  }
  for (size_t k = k0; k < k1; ++k) {
    float d = load_float(en.dtype, y, k) - (x != nullptr ? load_float(en.dtype, x, k) : 0.0f);
    if (r != nullptr) d += load_float(en.dtype, r, k);
    out[k - k0] = d;
  }
}

Status UpdateEncoder::attach(ModelPlace& model, const Arena* base, Arena* residual) {
  model_ = &model;
  y_ = model.arena() != nullptr ? model.arena()->data() : nullptr;
  x_ = base != nullptr ? base->data() : nullptr;
  r_ = s_.error_feedback && residual != nullptr ? residual->data() : nullptr;
  stats_ = {};
  const bool any_lossy = std::any_of(lossy_.begin(), lossy_.end(), [](bool b) { return b; });
  if (any_lossy && y_ == nullptr) {
    return failed_precondition("lossy compression reads the update from an arena; this one has none");
  }
  return Status::Ok();
}

Status UpdateEncoder::begin(ModelPlace& model, const Arena* base, Arena* residual, std::span<const double> tolerances) {
  if (tolerances.size() != tolerance_.size()) {
    return internal_error("UpdateEncoder::begin: {} tolerances for {} tensors", tolerances.size(), tolerance_.size());
  }
  MEMFL_RETURN_IF_ERROR(attach(model, base, residual));
  std::copy(tolerances.begin(), tolerances.end(), tolerance_.begin());
  return Status::Ok();
}

Status UpdateEncoder::begin(ModelPlace& model, const Arena* base, Arena* residual) {
  MEMFL_RETURN_IF_ERROR(attach(model, base, residual));
  // Each lossy tensor's tolerance for this update: REL needs its whole
  // range, which no chunk alone has.
  std::vector<float> block(64 * 1024);
  for (size_t e = 0; e < layout_.size(); ++e) {
    tolerance_[e] = 0;
    if (!lossy_[e]) continue;
    if (!s_.relative) {
      tolerance_[e] = s_.error_bound;
      continue;
    }
    const size_t n = layout_.entries()[e].numel();
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (size_t k = 0; k < n; k += block.size()) {
      const size_t m = std::min(block.size(), n - k);
      deltas(e, k, k + m, block.data());
      if (base_done_) {
        const size_t es = dtype_size(layout_.entries()[e].dtype);
        base_done_(layout_.entries()[e].offset + k * es, m * es);
      }
      for (size_t i = 0; i < m; ++i) {
        if (!std::isfinite(block[i])) continue;
        lo = std::min(lo, block[i]);
        hi = std::max(hi, block[i]);
      }
    }
    const double range = static_cast<double>(hi) - static_cast<double>(lo);
    const double tol = s_.error_bound * range;
    tolerance_[e] = std::isfinite(tol) && tol > 0 ? tol : 0;  // a constant change: nothing to gain, sent exact
  }
  return Status::Ok();
}

void UpdateEncoder::write_target(uint64_t from, uint64_t to, std::byte* out) {
  const auto& entries = layout_.entries();
  uint64_t pos = from;
  while (pos < to) {
    const size_t e = layout_.entry_at_or_after(static_cast<size_t>(pos));
    if (e == entries.size() || entries[e].offset >= to) {
      std::memcpy(out + (pos - from), model_at(pos), to - pos);
      return;
    }
    const LayoutEntry& en = entries[e];
    if (en.offset > pos) {
      std::memcpy(out + (pos - from), model_at(pos), en.offset - pos);
      pos = en.offset;
    }
    const uint64_t stop = std::min<uint64_t>(to, en.end());
    if (r_ == nullptr || !lossy_[e]) {
      std::memcpy(out + (pos - from), model_at(pos), stop - pos);
    } else {
      // dtype(base + d), whole elements, of which the bytes asked for.
      const size_t es = dtype_size(en.dtype);
      const size_t k0 = (pos - en.offset) / es, k1 = (stop - en.offset + es - 1) / es;
      target_delta_.resize(k1 - k0);
      target_.resize((k1 - k0) * es);
      deltas(e, k0, k1, target_delta_.data());
      rebuild_delta(en.dtype, x_ != nullptr ? x_ + en.offset + k0 * es : nullptr, target_delta_.data(), k1 - k0,
                    target_.data());
      std::memcpy(out + (pos - from), target_.data() + (pos - (en.offset + k0 * es)), stop - pos);
    }
    pos = stop;
  }
}

void UpdateEncoder::add_raw(uint64_t from, uint64_t to, uint64_t chunk_offset) {
  if (from == to) return;
  const size_t n = to - from;
  if (open_raw_ == SIZE_MAX) {
    open_raw_ = inner_.size();
    inner_.resize(inner_.size() + kSegmentHeaderBytes);
    write_segment_header({}, inner_.data() + open_raw_);
    ++segments_;
  }
  const size_t at = inner_.size();
  inner_.resize(at + n);
  write_target(from, to, inner_.data() + at);
  std::memcpy(recon_.data() + (from - chunk_offset), inner_.data() + at, n);
  uint64_t bytes;
  std::memcpy(&bytes, inner_.data() + open_raw_ + 8, 8);
  bytes += n;
  std::memcpy(inner_.data() + open_raw_ + 8, &bytes, 8);   // raw bytes
  std::memcpy(inner_.data() + open_raw_ + 16, &bytes, 8);  // payload bytes
}

StatusOr<std::span<const std::byte>> UpdateEncoder::encode(uint64_t offset, size_t length) {
  if (model_ == nullptr) return failed_precondition("UpdateEncoder::encode before begin");
  if (length == 0 || offset + length > layout_.total_bytes()) {
    return invalid_argument("frame for bytes [{}, {}) of a {}-byte model", offset, offset + length,
                            layout_.total_bytes());
  }
  if (y_ == nullptr) {
    ybuf_.resize(length);
    window_ = offset;
    MEMFL_RETURN_IF_ERROR(model_->read(offset, ybuf_));
  }
  const uint64_t end = offset + length;
  inner_.clear();
  recon_.resize(length);
  open_raw_ = SIZE_MAX;
  segments_ = 0;
  const auto& entries = layout_.entries();
  uint64_t pos = offset;
  while (pos < end) {
    const size_t e = layout_.entry_at_or_after(static_cast<size_t>(pos));
    if (e == entries.size() || entries[e].offset >= end) {
      add_raw(pos, end, offset);
      break;
    }
    const LayoutEntry& en = entries[e];
    if (en.offset > pos) {
      add_raw(pos, en.offset, offset);
      pos = en.offset;
    }
    const uint64_t stop = std::min<uint64_t>(end, en.end());
    if (!lossy_[e] || tolerance_[e] <= 0) {
      add_raw(pos, stop, offset);
      pos = stop;
      continue;
    }
    // Whole elements go lossy; an element the chunk's edge cuts goes raw.
    const size_t es = dtype_size(en.dtype);
    const uint64_t a = en.offset + (pos - en.offset + es - 1) / es * es;
    const uint64_t b = en.offset + (stop - en.offset) / es * es;
    if (a >= b) {
      add_raw(pos, stop, offset);
      pos = stop;
      continue;
    }
    add_raw(pos, a, offset);
    const size_t k0 = (a - en.offset) / es, k1 = (b - en.offset) / es, n = k1 - k0;
    delta_.resize(n);
    decoded_.resize(n);
    deltas(e, k0, k1, delta_.data());
    payload_.clear();
    MEMFL_RETURN_IF_ERROR(lossy_encode(s_.lossy, delta_, tolerance_[e], payload_, decoded_));
    if (payload_.size() + kSegmentHeaderBytes >= b - a) {
      add_raw(a, b, offset);  // did not pay: exact bytes instead
    } else {
      open_raw_ = SIZE_MAX;
      const size_t at = inner_.size();
      inner_.resize(at + kSegmentHeaderBytes + payload_.size());
      write_segment_header({.kind = SegmentKind::kLossyDelta,
                            .codec = s_.lossy,
                            .dtype = en.dtype,
                            .raw_bytes = b - a,
                            .payload_bytes = payload_.size(),
                            .tolerance = tolerance_[e]},
                           inner_.data() + at);
      std::memcpy(inner_.data() + at + kSegmentHeaderBytes, payload_.data(), payload_.size());
      ++segments_;
      rebuild_delta(en.dtype, x_ != nullptr ? x_ + a : nullptr, decoded_.data(), n, recon_.data() + (a - offset));
      stats_.lossy_elements += n;
      for (size_t i = 0; i < n; ++i) stats_.zeroed_elements += (decoded_[i] == 0.0f && delta_[i] != 0.0f) ? 1 : 0;
    }
    add_raw(b, stop, offset);
    pos = stop;
  }
  MEMFL_RETURN_IF_ERROR(lossless_compress(s_.lossless, inner_, body_));
  Lossless codec = s_.lossless;
  if (body_.size() >= inner_.size()) codec = Lossless::kNone;  // incompressible: the segments as they are
  const std::vector<std::byte>& body = codec == Lossless::kNone ? inner_ : body_;
  if (kFrameHeaderBytes + body.size() > length + kMaxFrameOverhead || inner_.size() > length + kMaxFrameOverhead) {
    // Many small segments cost more than they saved: one raw segment of the
    // target bytes, which always fits the frame's bound.
    inner_.assign(kSegmentHeaderBytes + length, std::byte{0});
    write_segment_header({.raw_bytes = length, .payload_bytes = length}, inner_.data());
    write_target(offset, end, inner_.data() + kSegmentHeaderBytes);
    std::memcpy(recon_.data(), inner_.data() + kSegmentHeaderBytes, length);
    segments_ = 1;
    MEMFL_RETURN_IF_ERROR(lossless_compress(s_.lossless, inner_, body_));
    codec = body_.size() < inner_.size() ? s_.lossless : Lossless::kNone;
  }
  const std::vector<std::byte>& out = codec == Lossless::kNone ? inner_ : body_;
  frame_.resize(kFrameHeaderBytes + out.size());
  write_frame_header({.codec = codec,
                      .segments = segments_,
                      .raw_length = length,
                      .body_length = out.size(),
                      .inner_length = inner_.size(),
                      .raw_checksum = chunk_checksum(std::span<const std::byte>(recon_))},
                     frame_.data());
  std::memcpy(frame_.data() + kFrameHeaderBytes, out.data(), out.size());
  if (r_ != nullptr) update_residual(offset, length);
  if (base_done_) base_done_(offset, length);
  stats_.raw_bytes += length;
  stats_.frame_bytes += frame_.size();
  return std::span<const std::byte>(frame_);
}

void UpdateEncoder::update_residual(uint64_t offset, size_t length) {
  // Each element's residual changes once, in the chunk that holds its last
  // byte: an element the chunk's start cuts was sent as target bytes in two
  // frames, both computed from the residual before this update.
  const uint64_t end = offset + length;
  const auto& entries = layout_.entries();
  for (size_t e = layout_.entry_at_or_after(static_cast<size_t>(offset)); e < entries.size(); ++e) {
    const LayoutEntry& en = entries[e];
    if (en.offset >= end) break;
    if (!lossy_[e]) continue;
    const size_t es = dtype_size(en.dtype);
    const uint64_t from = std::max<uint64_t>(offset, en.offset), to = std::min<uint64_t>(end, en.end());
    // Elements whose last byte is in [from, to).
    const size_t k0 = (from - en.offset) / es, k1 = (to - en.offset) / es;
    std::byte* r = r_ + en.offset;
    const std::byte* x = x_ != nullptr ? x_ + en.offset : nullptr;
    std::byte cut[8];
    for (size_t k = k0; k < k1; ++k) {
      float d;
      deltas(e, k, k + 1, &d);
      const uint64_t start = en.offset + k * es;
      const std::byte* rebuilt = start >= offset ? recon_.data() + (start - offset) : nullptr;
      if (rebuilt == nullptr) {
        write_target(start, start + es, cut);
        rebuilt = cut;
      }
      const float xv = x != nullptr ? load_float(en.dtype, x, k) : 0.0f;
      store_float(en.dtype, r + k * es, (xv + d) - load_float(en.dtype, rebuilt, 0));
    }
  }
}

StatusOr<std::span<const std::byte>> EncodingPlace::frame(uint64_t offset, size_t length) {
  auto f = encoder_.encode(offset, length);
  if (f.ok() && offset + length >= total_bytes_) {
    if (const std::string w = zeroed_changes_warning(encoder_.stats(), sender_); !w.empty()) spdlog::warn("{}", w);
  }
  return f;
}

}  // namespace memfl
