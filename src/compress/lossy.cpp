#include "compress/lossy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(MEMFL_HAVE_ZFP)
#include <zfp.h>
#endif

namespace memfl {

namespace {

[[maybe_unused]] void put_u32(std::vector<std::byte>& out, uint32_t v) {  // ZFP frames only
  const size_t at = out.size();
  out.resize(at + 4);
  std::memcpy(out.data() + at, &v, 4);
}

[[maybe_unused]] void put_u64(std::vector<std::byte>& out, uint64_t v) {
  const size_t at = out.size();
  out.resize(at + 8);
  std::memcpy(out.data() + at, &v, 8);
}

template <typename T>
T get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Whether `decoded` is within `tolerance` of `value`; a NaN on either side
// is not (an input NaN is kept exact instead).
bool within(float value, float decoded, double tolerance) {
  return std::fabs(static_cast<double>(value) - static_cast<double>(decoded)) <= tolerance;
}

// --- ZFP ------------------------------------------------------------------

#if defined(MEMFL_HAVE_ZFP)

// The most bits ZFP's decoder reads for one block of 4 floats, whatever the
// stream holds: a nonzero flag, 8 exponent bits, 32 bit planes of 4 value
// bits plus one terminating group-test bit each, and at most 4 + 3 more
// group-test bits (each makes a coefficient significant once). ZFP's own
// zfp_stream_maximum_size counts well-formed streams only; a peer's stream
// is decoded from a buffer padded to this bound, so a crafted one cannot
// make the decoder read past it (libzfp checks no bounds).
constexpr size_t kZfpMaxBitsPerBlock = 1 + 8 + 32 * (4 + 1) + 7;

size_t zfp_read_bound_bytes(size_t n) {
  const size_t blocks = (n + 3) / 4;
  return (blocks * kZfpMaxBitsPerBlock + 7) / 8 + 2 * sizeof(uint64_t);
}

struct ZfpStream {
  zfp_stream* zfp = zfp_stream_open(nullptr);
  zfp_field* field = nullptr;
  bitstream* bits = nullptr;
  ~ZfpStream() {
    if (bits != nullptr) stream_close(bits);
    if (field != nullptr) zfp_field_free(field);
    zfp_stream_close(zfp);
  }
};

Status zfp_encode(std::span<const float> values, double tolerance, std::vector<std::byte>& out,
                  std::span<float> decoded) {
  ZfpStream z;
  z.field = zfp_field_1d(const_cast<float*>(values.data()), zfp_type_float, values.size());
  zfp_stream_set_accuracy(z.zfp, tolerance);
  // ZFP reads and writes whole 64-bit words: its buffer is word-aligned.
  std::vector<uint64_t> words((zfp_stream_maximum_size(z.zfp, z.field) + 7) / 8 + 1);
  z.bits = stream_open(words.data(), words.size() * sizeof(uint64_t));
  zfp_stream_set_bit_stream(z.zfp, z.bits);
  zfp_stream_rewind(z.zfp);
  const size_t bytes = zfp_compress(z.zfp, z.field);
  if (bytes == 0) return internal_error("zfp: compression failed ({} values)", values.size());
  // Decode what was written, as the receiver will, to check every element.
  zfp_field_set_pointer(z.field, decoded.data());
  zfp_stream_rewind(z.zfp);
  if (zfp_decompress(z.zfp, z.field) == 0) return internal_error("zfp: cannot decode its own stream");
  std::vector<uint32_t> patch;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!within(values[i], decoded[i], tolerance)) {
      patch.push_back(static_cast<uint32_t>(i));
      decoded[i] = values[i];
    }
  }
  // [u64 zfp bytes][zfp stream][u32 patches][u32 index…][f32 exact value…]
  put_u64(out, bytes);
  const size_t at = out.size();
  out.resize(at + bytes);
  std::memcpy(out.data() + at, words.data(), bytes);
  put_u32(out, static_cast<uint32_t>(patch.size()));
  for (uint32_t i : patch) put_u32(out, i);
  for (uint32_t i : patch) {
    uint32_t b;
    std::memcpy(&b, &values[i], 4);
    put_u32(out, b);
  }
  return Status::Ok();
}

Status zfp_decode(std::span<const std::byte> payload, double tolerance, std::span<float> out, LossyScratch& scratch) {
  const size_t n = out.size();
  if (payload.size() < 12) return data_loss("zfp segment of {} bytes is shorter than its fields", payload.size());
  const uint64_t zbytes = get<uint64_t>(payload.data());
  if (zbytes > payload.size() - 12) {
    return data_loss("zfp segment says {} stream bytes but holds {}", zbytes, payload.size() - 12);
  }
  const uint32_t patches = get<uint32_t>(payload.data() + 8 + zbytes);
  const size_t tail = payload.size() - 12 - zbytes;
  if (patches > n || tail != static_cast<size_t>(patches) * 8) {
    return data_loss("zfp segment: {} patches of {} values do not fill its last {} bytes", patches, n, tail);
  }
  // The stream, padded with zeros to the most its decoder can read.
  const size_t bound = std::max<size_t>(zbytes, zfp_read_bound_bytes(n));
  auto& padded = scratch.padded;
  padded.assign((bound + 7) / 8 * 8 + sizeof(uint64_t), std::byte{0});
  if (zbytes > 0) std::memcpy(padded.data(), payload.data() + 8, zbytes);
  // Word alignment: std::vector<std::byte> from operator new is 16-aligned.
  ZfpStream z;
  z.field = zfp_field_1d(out.data(), zfp_type_float, n);
  zfp_stream_set_accuracy(z.zfp, tolerance);
  z.bits = stream_open(padded.data(), padded.size());
  zfp_stream_set_bit_stream(z.zfp, z.bits);
  zfp_stream_rewind(z.zfp);
  const size_t used = zfp_decompress(z.zfp, z.field);
  if (used == 0 || used > (zbytes + 7) / 8 * 8) {
    return data_loss("zfp segment: the stream of {} bytes does not decode {} values", zbytes, n);
  }
  const std::byte* idx = payload.data() + 12 + zbytes;
  const std::byte* val = idx + 4 * static_cast<size_t>(patches);
  int64_t last = -1;
  for (uint32_t k = 0; k < patches; ++k) {
    const uint32_t i = get<uint32_t>(idx + 4 * k);
    if (i >= n || static_cast<int64_t>(i) <= last) {
      return data_loss("zfp segment: patch index {} is out of order or past its {} values", i, n);
    }
    last = i;
    std::memcpy(&out[i], val + 4 * k, 4);
  }
  return Status::Ok();
}

#endif  // MEMFL_HAVE_ZFP

// --- the quantiser ----------------------------------------------------------

constexpr uint8_t kPredictNone = 0, kPredictPrevious = 1;
constexpr int32_t kMaxCode = 32767;

float dequantize(float predicted, int32_t code, double bin) {
  return static_cast<float>(static_cast<double>(predicted) + static_cast<double>(code) * bin);
}

Status quantizer_encode(std::span<const float> values, double tolerance, std::vector<std::byte>& out,
                        std::span<float> decoded) {
  const size_t n = values.size();
  const double bin = 2 * tolerance;
  // The predictor that leaves the smaller residuals: none for noise-like
  // deltas (predicting from a neighbour doubles their variance), the
  // previous value for smooth data.
  double plain = 0, from_previous = 0;
  for (size_t i = 0; i < n; ++i) {
    const double v = values[i], d = v - (i > 0 ? static_cast<double>(values[i - 1]) : 0.0);
    if (std::isfinite(v)) plain += std::fabs(v);
    if (std::isfinite(d)) from_previous += std::fabs(d);
  }
  const uint8_t predictor = from_previous < plain ? kPredictPrevious : kPredictNone;
  // Reused from one segment to the next (no zero fill, no fresh pages):
  // every element below is written before it is read.
  thread_local std::vector<int32_t> codes;
  if (codes.size() < n) codes.resize(n);
  std::vector<float> exact;
  int32_t largest = 0;
  float previous = 0;
  if (predictor == kPredictNone) {
    // Each element on its own: a loop without a carried value or a divide,
    // which the compiler vectorises. The code is the nearest integer to
    // v / bin — rounded by adding and taking away 1.5 × 2^52 (exact below
    // 2^51, and |steps| < kMaxCode here) — and the decoded value is what the
    // decoder computes from it; the bound is checked on that, so a code one
    // off in a tie can only cost an exact value, never the bound.
    const double inverse = 1.0 / bin, magic = 0x1.8p52;
    int32_t* out_codes = codes.data();
    for (size_t i = 0; i < n; ++i) {
      const float v = values[i];
      const double steps = static_cast<double>(v) * inverse;
      const bool in_range = std::fabs(steps) < kMaxCode;  // false for NaN and infinities too
      const double rounded = in_range ? (steps + magic) - magic : 0.0;
      const int32_t q = static_cast<int32_t>(rounded);
      const float r = dequantize(0.0f, q, bin);
      const bool ok = in_range && within(v, r, tolerance);
      out_codes[i] = ok ? q : INT32_MIN;
      decoded[i] = ok ? r : v;
    }
    for (size_t i = 0; i < n; ++i) {
      if (out_codes[i] == INT32_MIN) {
        exact.push_back(values[i]);
      } else {
        largest = std::max(largest, std::abs(out_codes[i]));
      }
    }
  }
  for (size_t i = 0; predictor == kPredictPrevious && i < n; ++i) {
    const float v = values[i];
    const float p = predictor == kPredictPrevious ? previous : 0.0f;
    const double steps = (static_cast<double>(v) - static_cast<double>(p)) / bin;
    bool ok = std::fabs(steps) < kMaxCode;  // false for NaN and infinities too
    int32_t q = 0;
    float r = v;
    if (ok) {
      q = static_cast<int32_t>(std::nearbyint(steps));
      r = dequantize(p, q, bin);
      // The f32 rounding of the decoded value can leave the bound: then exact.
      ok = within(v, r, tolerance);
    }
    if (!ok) {
      codes[i] = INT32_MIN;
      exact.push_back(v);
      r = v;
    } else {
      codes[i] = q;
      largest = std::max(largest, std::abs(q));
    }
    decoded[i] = r;
    previous = r;
  }
  const uint8_t width = largest <= 127 ? 1 : 2;
  // [u8 predictor][u8 code width][u16 0][u32 exact count][codes][f32 exact…]
  // Codes of 2 bytes go as two planes (all low bytes, then all high bytes):
  // the high plane is mostly one value, which the lossless stage removes.
  const size_t at = out.size();
  out.resize(at + 8 + n * width + exact.size() * 4);
  std::byte* p = out.data() + at;
  p[0] = std::byte{predictor};
  p[1] = std::byte{width};
  p[2] = p[3] = std::byte{0};
  const uint32_t count = static_cast<uint32_t>(exact.size());
  std::memcpy(p + 4, &count, 4);
  std::byte* c = p + 8;
  for (size_t i = 0; i < n; ++i) {
    if (width == 1) {
      const int8_t b = codes[i] == INT32_MIN ? INT8_MIN : static_cast<int8_t>(codes[i]);
      c[i] = static_cast<std::byte>(b);
    } else {
      const int16_t h = codes[i] == INT32_MIN ? INT16_MIN : static_cast<int16_t>(codes[i]);
      const uint16_t u = static_cast<uint16_t>(h);
      c[i] = static_cast<std::byte>(u & 0xff);
      c[n + i] = static_cast<std::byte>(u >> 8);
    }
  }
  if (!exact.empty()) std::memcpy(c + n * width, exact.data(), exact.size() * 4);
  return Status::Ok();
}

Status quantizer_decode(std::span<const std::byte> payload, double tolerance, std::span<float> out) {
  const size_t n = out.size();
  if (payload.size() < 8) return data_loss("quantiser segment of {} bytes is shorter than its fields", payload.size());
  const uint8_t predictor = static_cast<uint8_t>(payload[0]);
  const uint8_t width = static_cast<uint8_t>(payload[1]);
  const uint32_t count = get<uint32_t>(payload.data() + 4);
  if (predictor > kPredictPrevious || (width != 1 && width != 2) || count > n) {
    return data_loss("quantiser segment: predictor {}, code width {}, {} exact values of {}: not a valid segment",
                     predictor, width, count, n);
  }
  if (payload.size() != 8 + n * width + static_cast<size_t>(count) * 4) {
    return data_loss("quantiser segment of {} bytes does not hold {} codes of {} bytes and {} exact values",
                     payload.size(), n, width, count);
  }
  const std::byte* c = payload.data() + 8;
  const std::byte* exact = c + n * width;
  const double bin = 2 * tolerance;
  uint32_t used = 0;
  float previous = 0;
  for (size_t i = 0; i < n; ++i) {
    int32_t q;
    bool is_exact;
    if (width == 1) {
      const int8_t b = static_cast<int8_t>(c[i]);
      is_exact = b == INT8_MIN;
      q = b;
    } else {
      const uint16_t u = static_cast<uint16_t>(static_cast<uint8_t>(c[i]) | (static_cast<uint8_t>(c[n + i]) << 8));
      const int16_t h = static_cast<int16_t>(u);
      is_exact = h == INT16_MIN;
      q = h;
    }
    float r;
    if (is_exact) {
      if (used == count) return data_loss("quantiser segment: more exact markers than its {} exact values", count);
      std::memcpy(&r, exact + 4 * static_cast<size_t>(used++), 4);
    } else {
      r = dequantize(predictor == kPredictPrevious ? previous : 0.0f, q, bin);
    }
    out[i] = r;
    previous = r;
  }
  if (used != count) return data_loss("quantiser segment: {} exact markers for {} exact values", used, count);
  return Status::Ok();
}

}  // namespace

std::string_view lossy_codec_name(Lossy codec) {
  switch (codec) {
    case Lossy::kNone:
      return "none";
    case Lossy::kZfp:
      return "zfp";
    case Lossy::kQuantizer:
      return "memfl-quantizer";
  }
  return "?";
}

bool lossy_available(Lossy codec) {
#if defined(MEMFL_HAVE_ZFP)
  return true;
#else
  return codec != Lossy::kZfp;
#endif
}

Status lossy_encode(Lossy codec, std::span<const float> values, double tolerance, std::vector<std::byte>& out,
                    std::span<float> decoded) {
  if (!(tolerance > 0) || !std::isfinite(tolerance)) {
    return invalid_argument("lossy codec: tolerance {} is not a finite number above 0", tolerance);
  }
  if (decoded.size() != values.size()) return invalid_argument("lossy codec: decoded size differs from the input's");
  if (values.empty()) return Status::Ok();
  switch (codec) {
    case Lossy::kZfp:
#if defined(MEMFL_HAVE_ZFP)
      return zfp_encode(values, tolerance, out, decoded);
#else
      return failed_precondition("ZFPCompressor: this memfl was built without libzfp (libzfp-dev)");
#endif
    case Lossy::kQuantizer:
      return quantizer_encode(values, tolerance, out, decoded);
    case Lossy::kNone:
      break;
  }
  return invalid_argument("lossy codec {} cannot encode", static_cast<int>(codec));
}

Status lossy_decode(Lossy codec, std::span<const std::byte> payload, double tolerance, std::span<float> out,
                    LossyScratch& scratch) {
  if (!(tolerance > 0) || !std::isfinite(tolerance)) {
    return data_loss("lossy segment: tolerance {} is not a finite number above 0", tolerance);
  }
  if (out.empty()) return data_loss("lossy segment of no values");
  switch (codec) {
    case Lossy::kZfp:
#if defined(MEMFL_HAVE_ZFP)
      return zfp_decode(payload, tolerance, out, scratch);
#else
      return failed_precondition("a ZFP segment arrived, and this memfl was built without libzfp (libzfp-dev)");
#endif
    case Lossy::kQuantizer:
      return quantizer_decode(payload, tolerance, out);
    case Lossy::kNone:
      break;
  }
  return data_loss("unknown lossy codec {}", static_cast<int>(codec));
}

}  // namespace memfl
