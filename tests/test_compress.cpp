// Compressed updates (src/compress/): the lossless stages round-trip; each
// lossy codec keeps every element within its bound (checked here against
// the original, element by element); frames cut anywhere — inside
// elements, inside tensors — rebuild what the sender meant; error feedback
// keeps what was lost; and bad frames are refused naming client and chunk.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include "cli_util.h"
#include "client/client_work.h"
#include "client/prefetching_place.h"
#include "comm/chunk.h"
#include "compress/broadcast_delta.h"
#include "compress/decoding_opener.h"
#include "compress/frame.h"
#include "compress/lossless.h"
#include "compress/lossy.h"
#include "compress/settings.h"
#include "compress/update_encoder.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

std::vector<std::byte> as_bytes(const std::vector<float>& v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// --- lossless stages --------------------------------------------------------

class LosslessCodecs : public ::testing::TestWithParam<Lossless> {};

TEST_P(LosslessCodecs, RoundTripEveryByteAtEverySize) {
  const Lossless codec = GetParam();
  if (!lossless_available(codec)) {
    GTEST_SKIP() << lossless_name(codec) << " not built";
  }
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n(0, 0.01f);
  for (size_t size : {size_t{1}, size_t{7}, size_t{4096}, size_t{1} << 20}) {
    std::vector<float> v(size / 4 + 1);
    for (auto& x : v) x = n(rng);
    std::vector<std::byte> in = as_bytes(v);
    in.resize(size);
    std::vector<std::byte> packed;
    ASSERT_TRUE(lossless_compress(codec, in, packed).ok());
    std::vector<std::byte> back(size);
    ASSERT_TRUE(lossless_decompress(codec, packed, back).ok()) << size;
    EXPECT_EQ(back, in) << lossless_name(codec) << " at " << size << " bytes";
    // A stream is held to the size its frame promises: one byte more or
    // less is refused, never written past.
    std::vector<std::byte> longer(size + 1), shorter(size - 1 + (size == 1 ? 1 : 0));
    EXPECT_FALSE(lossless_decompress(codec, packed, longer).ok()) << lossless_name(codec);
    if (size > 1) {
      EXPECT_FALSE(lossless_decompress(codec, packed, shorter).ok()) << lossless_name(codec);
    }
  }
  // Small codes compress: what the quantiser hands this stage.
  std::vector<std::byte> codes(1 << 16);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::byte>(rng() % 3);
  std::vector<std::byte> packed;
  ASSERT_TRUE(lossless_compress(codec, codes, packed).ok());
  if (codec != Lossless::kNone) {
    EXPECT_LT(packed.size(), codes.size() / 2) << lossless_name(codec);
  }
}

// The codecs that decode something (`none` copies its bytes as they are).
class LosslessDecoders : public ::testing::TestWithParam<Lossless> {};

TEST_P(LosslessDecoders, GarbageIsRefused) {
  const Lossless codec = GetParam();
  if (!lossless_available(codec)) GTEST_SKIP() << lossless_name(codec) << " is not in this build";
  std::vector<std::byte> garbage(300);
  std::mt19937_64 rng(3);
  for (auto& b : garbage) b = static_cast<std::byte>(rng());
  std::vector<std::byte> out(1000);
  EXPECT_FALSE(lossless_decompress(codec, garbage, out).ok()) << lossless_name(codec);
}

INSTANTIATE_TEST_SUITE_P(Compress, LosslessCodecs,
                         ::testing::Values(Lossless::kNone, Lossless::kZstd, Lossless::kGzip, Lossless::kZlib,
                                           Lossless::kLzma, Lossless::kBlosc),
                         [](const auto& p) { return std::string(lossless_name(p.param)); });
INSTANTIATE_TEST_SUITE_P(Compress, LosslessDecoders,
                         ::testing::Values(Lossless::kZstd, Lossless::kGzip, Lossless::kZlib, Lossless::kLzma,
                                           Lossless::kBlosc),
                         [](const auto& p) { return std::string(lossless_name(p.param)); });

TEST(CompressNames, AppflNamesMapToCodecs) {
  for (const char* name : {"zstd", "gzip", "zlib", "lzma", "blosc", "none"}) {
    ASSERT_TRUE(lossless_from_name(name).has_value()) << name;
    EXPECT_EQ(lossless_name(*lossless_from_name(name)), name);
  }
  EXPECT_FALSE(lossless_from_name("brotli").has_value());
}

// --- lossy codecs -------------------------------------------------------------

struct LossyCase {
  Lossy codec;
  double tolerance;
};

void PrintTo(const LossyCase& c, std::ostream* os) { *os << lossy_codec_name(c.codec) << " at " << c.tolerance; }

class LossyCodecs : public ::testing::TestWithParam<LossyCase> {};

// Values of very different ranges: small deltas, unit noise, large values,
// a smooth ramp, and spikes inside blocks of small values (where ZFP's
// shared block exponent can overshoot).
std::vector<std::vector<float>> test_arrays() {
  std::mt19937_64 rng(11);
  std::vector<std::vector<float>> out;
  for (float scale : {1e-5f, 1e-2f, 1.0f, 3e4f}) {
    std::normal_distribution<float> n(0, scale);
    std::vector<float> v(10007);
    for (auto& x : v) x = n(rng);
    out.push_back(v);
  }
  std::vector<float> ramp(5000);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = std::sin(static_cast<float>(i) * 0.01f) * 5;
  out.push_back(ramp);
  std::vector<float> spikes(4096);
  std::normal_distribution<float> small(0, 1e-4f);
  for (size_t i = 0; i < spikes.size(); ++i) spikes[i] = i % 97 == 0 ? 1e6f : small(rng);
  out.push_back(spikes);
  out.push_back({0.5f});  // one value: a partial ZFP block
  return out;
}

TEST_P(LossyCodecs, EveryElementStaysWithinTheBoundAndTheDecoderAgrees) {
  const auto [codec, tolerance] = GetParam();
  if (!lossy_available(codec)) {
    GTEST_SKIP() << "zfp not built";
  }
  LossyScratch scratch;
  double worst = 0;
  for (const auto& values : test_arrays()) {
    std::vector<std::byte> payload;
    std::vector<float> decoded(values.size()), again(values.size());
    ASSERT_TRUE(lossy_encode(codec, values, tolerance, payload, decoded).ok());
    ASSERT_TRUE(lossy_decode(codec, payload, tolerance, again, scratch).ok());
    for (size_t i = 0; i < values.size(); ++i) {
      const double err = std::fabs(static_cast<double>(values[i]) - static_cast<double>(again[i]));
      ASSERT_LE(err, tolerance) << lossy_codec_name(codec) << " element " << i << " of " << values.size() << ": "
                                << values[i] << " came back as " << again[i];
      worst = std::max(worst, err);
      ASSERT_EQ(std::memcmp(&decoded[i], &again[i], 4), 0) << "the encoder's rebuild differs from the decoder's";
    }
  }
  EXPECT_GT(worst, 0) << "nothing was lost: the codec did not quantise";
}

TEST_P(LossyCodecs, NoisyDeltasShrinkAtUsefulBounds) {
  const auto [codec, tolerance] = GetParam();
  if (!lossy_available(codec)) {
    GTEST_SKIP();
  }
  // A tensor's change after local training: noise of about 1e-3. At a bound
  // of a few percent of its range the code is far below 4 bytes a value.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n(0, 1e-3f);
  std::vector<float> v(1 << 16);
  for (auto& x : v) x = n(rng);
  std::vector<std::byte> payload, packed;
  std::vector<float> decoded(v.size());
  const double bound = 1e-2 * 8e-3;  // REL 1e-2 of a range of about 8 sigma
  ASSERT_TRUE(lossy_encode(codec, v, bound, payload, decoded).ok());
  ASSERT_TRUE(lossless_compress(Lossless::kZlib, payload, packed).ok());
  EXPECT_LT(packed.size(), v.size() * 4 / 2) << lossy_codec_name(codec) << ": " << packed.size() << " bytes";
  (void)tolerance;
}

TEST(LossyCodecs, NonFiniteValuesComeBackExact) {
  std::vector<float> v = {1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -2.0f,
                          0.25f};
  for (Lossy codec : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(codec)) continue;
    std::vector<std::byte> payload;
    std::vector<float> decoded(v.size()), again(v.size());
    ASSERT_TRUE(lossy_encode(codec, v, 1e-3, payload, decoded).ok());
    LossyScratch scratch;
    ASSERT_TRUE(lossy_decode(codec, payload, 1e-3, again, scratch).ok());
    EXPECT_TRUE(std::isnan(again[1])) << lossy_codec_name(codec);
    EXPECT_EQ(again[2], std::numeric_limits<float>::infinity()) << lossy_codec_name(codec);
    EXPECT_NEAR(again[3], -2.0, 1e-3);
  }
}

TEST(LossyCodecs, MalformedPayloadsAreRefused) {
  std::vector<float> v(1000, 0.125f), out(1000);
  for (Lossy codec : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(codec)) continue;
    std::vector<std::byte> payload;
    std::vector<float> decoded(v.size());
    ASSERT_TRUE(lossy_encode(codec, v, 1e-3, payload, decoded).ok());
    LossyScratch scratch;
    // Cut short, one byte too long, and the wrong element count.
    auto cut = payload;
    cut.resize(payload.size() - 1);
    EXPECT_FALSE(lossy_decode(codec, cut, 1e-3, out, scratch).ok()) << lossy_codec_name(codec);
    auto longer = payload;
    longer.push_back(std::byte{0});
    EXPECT_FALSE(lossy_decode(codec, longer, 1e-3, out, scratch).ok()) << lossy_codec_name(codec);
    std::vector<float> more(5000);
    if (codec == Lossy::kQuantizer) {
      EXPECT_FALSE(lossy_decode(codec, payload, 1e-3, more, scratch).ok());
    }
    EXPECT_FALSE(lossy_decode(codec, payload, 0.0, out, scratch).ok()) << "a zero tolerance";
  }
  // A ZFP stream of random bits decodes from a padded buffer without
  // reading past it (ASan watches), or is refused.
  if (lossy_available(Lossy::kZfp)) {
    std::mt19937_64 rng(9);
    std::vector<std::byte> junk(8 + 64 + 4);
    const uint64_t zbytes = 64;
    std::memcpy(junk.data(), &zbytes, 8);
    for (size_t i = 8; i < 8 + 64; ++i) junk[i] = static_cast<std::byte>(rng());
    std::memset(junk.data() + 72, 0, 4);
    std::vector<float> big(100000);
    LossyScratch scratch;
    (void)lossy_decode(Lossy::kZfp, junk, 1e-30, big, scratch);
  }
}

INSTANTIATE_TEST_SUITE_P(Compress, LossyCodecs,
                         ::testing::Values(LossyCase{Lossy::kZfp, 1e-3}, LossyCase{Lossy::kZfp, 1e-6},
                                           LossyCase{Lossy::kZfp, 0.5}, LossyCase{Lossy::kQuantizer, 1e-3},
                                           LossyCase{Lossy::kQuantizer, 1e-6}, LossyCase{Lossy::kQuantizer, 0.5}),
                         [](const auto& p) {
                           return std::string(p.param.codec == Lossy::kZfp ? "zfp" : "quantizer") + "_" +
                                  std::to_string(static_cast<int>(-std::log10(p.param.tolerance) * 10));
                         });

// --- frames over a layout -------------------------------------------------------

Layout model_layout() {
  LayoutBuilder b;
  b.add("conv1.weight", DType::kF32, {40, 30})  // lossy
      .add("conv1.bias", DType::kF32, {40})     // lossless: not a weight
      .add("bn.num_batches_tracked", DType::kI64, {1})
      .add("emb.weight", DType::kBF16, {33, 50})  // lossy, 16-bit
      .add("small.weight", DType::kF32, {10})     // lossless: under param_cutoff
      .add("head.weight", DType::kF16, {1100})    // lossy, f16
      .add("fc.weight", DType::kF32, {2001});     // lossy
  return std::move(b).build().value();
}

// The base (x) and a trained model y = x + noise of `scale` per tensor.
void make_models(const Layout& layout, Arena& x, Arena& y, uint64_t seed) {
  testing::fill_random(layout, x, seed);
  std::memcpy(y.data(), x.data(), layout.total_bytes());
  std::mt19937_64 rng(seed + 1);
  double scale = 1e-3;
  for (const auto& e : layout.entries()) {
    if (!dtype_is_float(e.dtype)) continue;
    std::normal_distribution<float> n(0, static_cast<float>(scale));
    scale *= 3;  // each tensor its own range
    std::byte* p = y.data() + e.offset;
    for (size_t i = 0; i < e.numel(); ++i) {
      const float v = load_float(e.dtype, p, i) + n(rng);
      if (e.dtype == DType::kF32) std::memcpy(p + 4 * i, &v, 4);
      if (e.dtype == DType::kBF16) {
        const uint16_t b = f32_to_bf16(v);
        std::memcpy(p + 2 * i, &b, 2);
      }
      if (e.dtype == DType::kF16) {
        const uint16_t b = f32_to_f16(v);
        std::memcpy(p + 2 * i, &b, 2);
      }
    }
  }
}

CompressionSettings settings(Lossy lossy, bool rel, double bound, bool ef = false) {
  CompressionSettings s;
  s.enabled = true;
  s.lossy = lossy;
  s.lossy_name = lossy == Lossy::kZfp ? "ZFPCompressor" : "SZ3Compressor";
  s.lossless = lossless_available(Lossless::kZstd) ? Lossless::kZstd : Lossless::kZlib;
  s.relative = rel;
  s.error_bound = bound;
  s.param_cutoff = 64;
  s.error_feedback = ef;
  return s;
}

// Half a unit in the last place of `dtype` at magnitude |v|: what rounding
// the rebuilt value to its dtype may add to the bound.
double half_ulp(DType dtype, float v) {
  const int bits = dtype == DType::kF32 ? 24 : dtype == DType::kBF16 ? 8 : 11;
  const double a = std::max(std::fabs(static_cast<double>(v)), dtype == DType::kF16 ? 6.1e-5 : 1.2e-38);
  return std::ldexp(1.0, std::ilogb(a) - bits);
}

// APPFL's rule at the tests' param_cutoff of 64, written out here rather
// than taken from CompressionSettings::lossy_tensor.
bool goes_lossy(const LayoutEntry& e) {
  return dtype_is_float(e.dtype) && e.numel() > 64 && e.name.find("weight") != std::string::npos;
}

// max − min of tensor `e`'s change from x to y over the whole tensor: what
// REL's tolerance is a proportion of.
double change_range(const LayoutEntry& e, const Arena& x, const Arena& y) {
  double lo = INFINITY, hi = -INFINITY;
  for (size_t i = 0; i < e.numel(); ++i) {
    const double d = load_float(e.dtype, y.data() + e.offset, i) - load_float(e.dtype, x.data() + e.offset, i);
    lo = std::min(lo, d);
    hi = std::max(hi, d);
  }
  return hi - lo;
}

// Every lossy tensor of `rebuilt` within its tolerance of `y` on every
// element — ABS: the bound; REL: the bound × the range of that tensor's
// change from `x`, worked out here over the whole tensor whatever the chunk —
// and every other tensor exact.
void expect_within_bound(const Layout& layout, const Arena& x, const Arena& y, const Arena& rebuilt,
                         const std::vector<double>& tol, Lossy lossy, bool rel, double bound, size_t chunk) {
  for (size_t ei = 0; ei < layout.size(); ++ei) {
    const LayoutEntry& e = layout.entries()[ei];
    if (!goes_lossy(e)) {
      EXPECT_EQ(std::memcmp(rebuilt.data() + e.offset, y.data() + e.offset, e.nbytes()), 0) << e.name;
      continue;
    }
    const double want = rel ? bound * change_range(e, x, y) : bound;
    EXPECT_NEAR(tol[ei], want, want * 1e-5) << e.name;
    for (size_t i = 0; i < e.numel(); ++i) {
      const float yv = load_float(e.dtype, y.data() + e.offset, i);
      const float got = load_float(e.dtype, rebuilt.data() + e.offset, i);
      const double allowed = want + half_ulp(e.dtype, yv) + half_ulp(e.dtype, got) + half_ulp(DType::kF32, yv);
      ASSERT_LE(std::fabs(static_cast<double>(got) - yv), allowed)
          << lossy_codec_name(lossy) << (rel ? " REL " : " ABS ") << e.name << " element " << i << " chunk " << chunk;
    }
  }
}

// Sends `y` (against `x`) through the encoder in chunks of `chunk` bytes and
// decodes each frame as a server would, into `rebuilt`.
EncodedStats round_trip(const Layout& layout, const CompressionSettings& s, Arena& y, const Arena& x, Arena* residual,
                        size_t chunk, Arena& rebuilt, std::vector<double>* tolerances = nullptr) {
  UpdateEncoder enc(layout, s);
  ArenaPlace place(y);
  EXPECT_TRUE(enc.begin(place, &x, residual).ok());
  if (tolerances != nullptr) *tolerances = enc.tolerances();
  ArenaBaseModel base(x);
  FrameDecoder dec(layout, &base, "client_4");
  for (uint64_t off = 0; off < layout.total_bytes(); off += chunk) {
    const size_t len = std::min<uint64_t>(chunk, layout.total_bytes() - off);
    auto frame = enc.encode(off, len);
    EXPECT_TRUE(frame.ok()) << frame.status().message();
    if (!frame.ok()) break;
    EXPECT_LE(frame->size(), len + kMaxFrameOverhead);
    std::span<const std::byte> one = *frame;
    auto raw = dec.decode(off, Payload(&one, 1));
    EXPECT_TRUE(raw.ok()) << raw.status().message();
    if (!raw.ok()) break;
    EXPECT_EQ(raw->size(), len);
    EXPECT_EQ(dec.raw_checksum(), chunk_checksum(*raw));
    std::memcpy(rebuilt.data() + off, raw->data(), len);
  }
  return enc.stats();
}

class FrameChunks : public ::testing::TestWithParam<size_t> {};

TEST_P(FrameChunks, LossyTensorsStayWithinTheirBoundAndTheRestComesBackExact) {
  const size_t chunk = GetParam();
  const Layout layout = model_layout();
  for (Lossy lossy : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(lossy)) continue;
    for (bool rel : {false, true}) {
      Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
          rebuilt(layout.total_bytes(), MemoryCategory::kModel);
      make_models(layout, x, y, 21);
      const double bound = rel ? 1e-2 : 1e-4;
      const CompressionSettings s = settings(lossy, rel, bound);
      std::vector<double> tol;
      const EncodedStats st = round_trip(layout, s, y, x, nullptr, chunk, rebuilt, &tol);
      // 7-byte chunks hold at most one whole element: a lossy code of one
      // value costs more than the value, so everything goes exact.
      if (chunk == 7) {
        EXPECT_EQ(st.lossy_elements, 0u);
      } else {
        EXPECT_GT(st.lossy_elements, 0u);
      }
      expect_within_bound(layout, x, y, rebuilt, tol, lossy, rel, bound, chunk);
      const LayoutEntry& fc = *layout.find("fc.weight");
      if (chunk != 7) {
        EXPECT_NE(std::memcmp(rebuilt.data() + fc.offset, y.data() + fc.offset, fc.nbytes()), 0)
            << "a lossy tensor came back exact: nothing was compressed";
      }
    }
  }
}

// An ABS bound larger than every change sends every lossy-coded change as
// zero; the encoder counts those (checked here against the rebuilt model:
// changed elements of lossy tensors that came back unchanged) and its
// warning says so. A bound below the changes keeps them and stays quiet.
TEST(LossyZeroedChanges, AnAbsBoundAboveTheChangesIsCountedAndWarnedAbout) {
  const Layout layout = model_layout();
  for (Lossy lossy : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(lossy)) continue;
    for (double bound : {1e3, 1e-4}) {
      Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
          rebuilt(layout.total_bytes(), MemoryCategory::kModel);
      make_models(layout, x, y, 5);
      const EncodedStats st = round_trip(layout, settings(lossy, false, bound), y, x, nullptr, 4096, rebuilt);
      uint64_t zeroed = 0, changed = 0;
      for (const LayoutEntry& e : layout.entries()) {
        if (!goes_lossy(e)) continue;
        for (size_t i = 0; i < e.numel(); ++i) {
          const float xv = load_float(e.dtype, x.data() + e.offset, i),
                      yv = load_float(e.dtype, y.data() + e.offset, i);
          if (yv == xv) continue;
          ++changed;
          zeroed += load_float(e.dtype, rebuilt.data() + e.offset, i) == xv ? 1 : 0;
        }
      }
      ASSERT_GT(st.lossy_elements, 0u);
      EXPECT_EQ(st.zeroed_elements, zeroed) << lossy_codec_name(lossy) << " ABS " << bound;
      const std::string w = zeroed_changes_warning(st, "client_2");
      if (bound > 1) {
        EXPECT_GT(zeroed, changed / 2) << "the test's premise: a bound of 1e3 is larger than the changes";
        EXPECT_NE(w.find("client_2: "), std::string::npos) << w;
        EXPECT_NE(w.find("arrive as zero"), std::string::npos) << w;
      } else {
        EXPECT_LT(zeroed, changed / 10) << lossy_codec_name(lossy);
        EXPECT_EQ(w, "") << w;
      }
    }
  }
}

#ifdef MEMFL_TEST_TORCH
// A real update: the Fashion-MNIST CNN's change after one client's local
// epoch (round 2's checkpoint − round 1's, FedAvg over that one client), coded
// with each lossy codec at ABS and REL bounds in chunks whose edges fall
// inside elements and tensors. Trained changes are heavy-tailed and mostly
// near zero, unlike the Gaussian above.
TEST(RealUpdate, EveryElementOfATrainedChangeStaysWithinItsBound) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  const auto r = memfl_cli(
      "run -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2"
      " --set server_configs.clients_per_round=1 --set server_configs.checkpoint_keep=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1200"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=100"
      " --set client_configs.train_configs.num_threads=1 --set memory_configs.profile=false --out " +
      run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto before = SafetensorsFile::open(run + "/state/round-000001.safetensors");
  auto after = SafetensorsFile::open(run + "/state/round-000002.safetensors");
  ASSERT_TRUE(before.ok() && after.ok());
  const Layout layout = (*before)->layout().value();
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
      rebuilt(layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE((*before)->load_into(layout, x).ok());
  ASSERT_TRUE((*after)->load_into(layout, y).ok());
  ASSERT_NE(std::memcmp(x.data(), y.data(), layout.total_bytes()), 0) << "no training happened";
  for (Lossy lossy : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(lossy)) continue;
    for (bool rel : {false, true}) {
      for (size_t chunk : {size_t{4093}, size_t{1} << 18}) {
        const double bound = rel ? 1e-3 : 1e-4;
        std::vector<double> tol;
        const EncodedStats st = round_trip(layout, settings(lossy, rel, bound), y, x, nullptr, chunk, rebuilt, &tol);
        EXPECT_GT(st.lossy_elements, 0u);
        expect_within_bound(layout, x, y, rebuilt, tol, lossy, rel, bound, chunk);
      }
    }
  }
}
#endif  // MEMFL_TEST_TORCH: it trains, with the libtorch plugin

TEST_P(FrameChunks, LosslessOnlyRebuildsTheModelBitForBit) {
  const Layout layout = model_layout();
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
      rebuilt(layout.total_bytes(), MemoryCategory::kModel);
  make_models(layout, x, y, 4);
  CompressionSettings s = settings(Lossy::kNone, false, 1);
  for (Lossless codec : {Lossless::kZstd, Lossless::kGzip, Lossless::kZlib, Lossless::kLzma, Lossless::kBlosc}) {
    if (!lossless_available(codec)) continue;
    s.lossless = codec;
    const EncodedStats st = round_trip(layout, s, y, x, nullptr, GetParam(), rebuilt);
    EXPECT_EQ(st.lossy_elements, 0u);
    EXPECT_EQ(std::memcmp(rebuilt.data(), y.data(), layout.total_bytes()), 0) << lossless_name(codec);
  }
}

// 7 bytes cuts every element; 1000 cuts tensors mid-way; 4 MiB is one frame.
INSTANTIATE_TEST_SUITE_P(Compress, FrameChunks, ::testing::Values(7, 1000, 4096, 4 << 20));

// --- DummyTrainer's noisy change (the compression benchmarks' update) ------------

// The noise of DummyTrainer's change to `layout`'s one f32 tensor: the change
// less its pattern, scale·(client + 1)·(1 + (i + round) mod 5), worked here.
static std::vector<double> dummy_noise(const ExperimentConfig& cfg, const Layout& layout, int round, int client) {
  Arena a(layout.total_bytes(), MemoryCategory::kModel);
  EXPECT_TRUE(dummy_update(cfg, layout, a, round, client).ok());
  std::vector<double> noise(layout.total_bytes() / 4);
  for (size_t i = 0; i < noise.size(); ++i) {
    const double pattern = cfg.train.dummy_update_scale * (client + 1) * (1 + (i + static_cast<size_t>(round)) % 5);
    noise[i] = static_cast<double>(load_float(DType::kF32, a.data(), i)) - pattern;
  }
  return noise;
}

TEST(DummyNoise, IsASeededGaussianOfTheConfiguredSigmaOnTopOfThePattern) {
  LayoutBuilder b;
  b.add("a.weight", DType::kF32, {200000});
  const Layout layout = std::move(b).build().value();
  ExperimentConfig cfg;
  cfg.train.dummy_update_scale = 0.001;
  cfg.train.dummy_update_noise = 2;
  const double sigma = 0.002;
  auto draw = [&](int round, int client) { return dummy_noise(cfg, layout, round, client); };
  const std::vector<double> z = draw(3, 1);
  double sum = 0, sq = 0, beyond3 = 0;
  for (double v : z) {
    sum += v;
    sq += v * v;
    beyond3 += std::fabs(v) > 3 * sigma;
  }
  const double n = static_cast<double>(z.size());
  const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  EXPECT_LT(std::fabs(mean), 5 * sigma / std::sqrt(n));  // five standard errors
  EXPECT_NEAR(sd, sigma, 0.02 * sigma);
  EXPECT_NEAR(beyond3 / n, 0.0027, 0.001);  // a normal's tails, not a uniform's (0) or a pattern's
  EXPECT_EQ(draw(3, 1), z) << "the noise is seeded: every run and transport draws the same";
  EXPECT_NE(draw(3, 2), z);
  EXPECT_NE(draw(4, 1), z);
}

// With dummy_update_noise_values the noise is one of the file's values,
// standardised and scaled to σ: values worked by hand, each drawn about as
// often as the others, the same draw on every run.
TEST(DummyNoise, DrawsFromTheGivenValuesStandardisedToTheConfiguredSigma) {
  LayoutBuilder b;
  b.add("a.weight", DType::kF32, {60000});
  const Layout layout = std::move(b).build().value();
  testing::TempDir tmp;
  // Mean 0; σ = sqrt((9 + 1 + 4) / 6): the standardised values are v / σ.
  const std::vector<float> file_values{-3, 0, 0, 0, 1, 2};
  const std::string path = tmp.file("values.f32");
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(file_values.data()), 4 * file_values.size());
  }
  ExperimentConfig cfg;
  cfg.train.dummy_update_scale = 0.001;
  cfg.train.dummy_update_noise = 2;
  cfg.train.dummy_update_noise_values = path;
  const double sigma = 0.002, file_sd = std::sqrt(14.0 / 6.0);
  auto draw = [&](int round, int client) { return dummy_noise(cfg, layout, round, client); };
  const std::vector<double> z = draw(2, 0);
  std::map<int, int> seen;  // value of the file (×1) → draws
  for (double v : z) {
    const double raw = v / sigma * file_sd;
    const long k = std::lround(raw);
    ASSERT_NEAR(raw, static_cast<double>(k), 1e-3) << "noise " << v << " is no value of the file";
    seen[static_cast<int>(k)]++;
  }
  // -3, 1 and 2 each 1/6 of the draws, 0 three times as often.
  const double n = static_cast<double>(z.size()), sixth = n / 6, se = std::sqrt(n * (1.0 / 6) * (5.0 / 6));
  EXPECT_NEAR(seen[-3], sixth, 5 * se);
  EXPECT_NEAR(seen[1], sixth, 5 * se);
  EXPECT_NEAR(seen[2], sixth, 5 * se);
  EXPECT_NEAR(seen[0], 3 * sixth, 5 * std::sqrt(n * 0.25));
  EXPECT_EQ(draw(2, 0), z);
  EXPECT_NE(draw(2, 1), z);

  // A file that cannot serve is an error naming the key and the file.
  Arena a(layout.total_bytes(), MemoryCategory::kModel);
  cfg.train.dummy_update_noise_values = tmp.file("missing.f32");
  Status st = dummy_update(cfg, layout, a, 1, 0);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("dummy_update_noise_values"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("missing.f32"), std::string::npos) << st.message();
  {
    std::ofstream out(tmp.file("odd.f32"), std::ios::binary);
    out.write("abcde", 5);
  }
  cfg.train.dummy_update_noise_values = tmp.file("odd.f32");
  st = dummy_update(cfg, layout, a, 1, 0);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("multiple of 4"), std::string::npos) << st.message();
}

// --- coding the next frame while this one is sent ----------------------------

// A framed place whose frame k is k's offset and length written out, from one
// buffer it reuses (as the encoder does); it notes the order it was asked in.
class CountingFrames final : public ModelPlace {
 public:
  std::unique_ptr<ModelWriter> writer(const Layout&, std::string) override { return nullptr; }
  Status read(uint64_t, std::span<std::byte>) override { return Status::Ok(); }
  bool framed() const override { return true; }
  StatusOr<std::span<const std::byte>> frame(uint64_t offset, size_t length) override {
    std::lock_guard lock(mu);
    asked.emplace_back(offset, length);
    cv.notify_all();
    if (offset == fail_at) return data_loss("frame at {} failed", offset);
    buffer = text_of(offset, length);
    return std::span<const std::byte>(reinterpret_cast<const std::byte*>(buffer.data()), buffer.size());
  }
  static std::string text_of(uint64_t offset, size_t length) {
    return "frame " + std::to_string(offset) + "+" + std::to_string(length);
  }
  // Waits until `n` frames have been asked for (false after 30 s).
  bool wait_asked(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return asked.size() >= n; });
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<uint64_t, size_t>> asked;
  std::string buffer;
  uint64_t fail_at = UINT64_MAX;
};

std::string text(std::span<const std::byte> s) { return {reinterpret_cast<const char*>(s.data()), s.size()}; }

TEST(PrefetchingPlace, CodesTheNextFrameAheadAndHandsEachOverIntact) {
  auto inner = std::make_unique<CountingFrames>();
  CountingFrames* frames = inner.get();
  // 25 bytes in chunks of 10: frames at 0, 10 and 20 (the last 5 long).
  PrefetchingPlace place(std::move(inner), 25);
  auto f0 = place.frame(0, 10);
  ASSERT_TRUE(f0.ok());
  EXPECT_EQ(text(*f0), CountingFrames::text_of(0, 10));
  // Frame 1 is coded before it is asked for, and frame 0 stays as it was.
  ASSERT_TRUE(frames->wait_asked(2));
  {
    std::lock_guard lock(frames->mu);
    EXPECT_EQ(frames->asked[1], std::make_pair(uint64_t{10}, size_t{10}));
  }
  EXPECT_EQ(text(*f0), CountingFrames::text_of(0, 10));
  auto f1 = place.frame(10, 10);
  ASSERT_TRUE(f1.ok());
  EXPECT_EQ(text(*f1), CountingFrames::text_of(10, 10));
  ASSERT_TRUE(frames->wait_asked(3));
  {
    std::lock_guard lock(frames->mu);
    EXPECT_EQ(frames->asked[2], std::make_pair(uint64_t{20}, size_t{5}));  // the grid's short last chunk
  }
  auto f2 = place.frame(20, 5);
  ASSERT_TRUE(f2.ok());
  EXPECT_EQ(text(*f2), CountingFrames::text_of(20, 5));
  // Nothing is coded past the end: each frame exactly once.
  {
    std::lock_guard lock(frames->mu);
    EXPECT_EQ(frames->asked.size(), 3u);
  }

  // A request off the grid gets what the inner place gives for it.
  auto again = std::make_unique<CountingFrames>();
  CountingFrames* a = again.get();
  PrefetchingPlace off_grid(std::move(again), 25);
  ASSERT_TRUE(off_grid.frame(0, 10).ok());
  auto restart = off_grid.frame(0, 10);
  ASSERT_TRUE(restart.ok());
  EXPECT_EQ(text(*restart), CountingFrames::text_of(0, 10));
  // Asked in order: 0, 10 (ahead, dropped), then 0 again.
  ASSERT_TRUE(a->wait_asked(3));
  {
    std::lock_guard lock(a->mu);
    EXPECT_EQ(a->asked[2], std::make_pair(uint64_t{0}, size_t{10}));
  }

  // A frame that fails while coded ahead fails when it is asked for.
  auto failing = std::make_unique<CountingFrames>();
  failing->fail_at = 10;
  PrefetchingPlace bad(std::move(failing), 25);
  ASSERT_TRUE(bad.frame(0, 10).ok());
  auto broken = bad.frame(10, 10);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("frame at 10 failed"), std::string::npos);
}

// --- the broadcast as its change ---------------------------------------------

// The server codes round 4's model y as its change from round 3's x, which
// its clients hold. Afterwards its own model is, bit for bit, what a client
// holding x rebuilds from the frames (checked as any chunk, rebuilt in
// place), each lossy element within the bound of y and the rest exactly y.
TEST(BroadcastDelta, TheServerKeepsWhatItsClientsRebuildWithinTheBound) {
  const Layout layout = model_layout();
  const size_t total = layout.total_bytes();
  const size_t chunk = 1007;  // edges inside elements and inside tensors
  testing::TempDir tmp;
  for (Lossy lossy : {Lossy::kZfp, Lossy::kQuantizer}) {
    if (!lossy_available(lossy)) continue;
    const std::string codec(lossy_codec_name(lossy));
    Arena x(total, MemoryCategory::kModel), y(total, MemoryCategory::kModel), global(total, MemoryCategory::kModel),
        client(total, MemoryCategory::kModel);
    make_models(layout, x, y, 33);
    const double bound = 1e-2;
    BroadcastDelta delta(layout, settings(lossy, /*rel=*/true, bound, /*ef=*/true), tmp.path.string(), chunk);

    // Round 3: nothing held yet — the model goes as its bytes, unchanged.
    std::memcpy(global.data(), x.data(), total);
    ASSERT_TRUE(delta.prepare(3, global).ok()) << codec;
    EXPECT_EQ(delta.from_round(), -1);
    EXPECT_EQ(std::memcmp(global.data(), x.data(), total), 0) << codec;
    std::memcpy(client.data(), x.data(), total);  // what the client received

    // Round 4: the aggregate y, coded against x.
    std::memcpy(global.data(), y.data(), total);
    const Status prepared = delta.prepare(4, global);
    ASSERT_TRUE(prepared.ok()) << codec << ": " << prepared.message();
    EXPECT_EQ(delta.from_round(), 3);
    EXPECT_EQ(delta.to_round(), 4);
    EXPECT_EQ(delta.stats().raw_bytes, total);
    // Smaller than the model, though its random lossless tensors stay whole.
    EXPECT_LT(delta.stats().frame_bytes, total) << codec;

    ArenaBaseModel held(client);
    ArenaWriter writer(layout, client, "server");
    auto decoded = decoding_stream(std::make_unique<WriterStream>(writer), layout, &held, "server", chunk);
    std::vector<std::byte> buffer;
    uint64_t frame_bytes = 0;
    for (uint64_t off = 0; off < total; off += chunk) {
      auto frame = delta.frame(off, &buffer);
      ASSERT_TRUE(frame.ok()) << frame.status().message();
      frame_bytes += frame->size();
      const ChunkHeader h{layout.hash(), off, frame->size(), chunk_checksum(*frame)};
      const Status st = decoded->accept(h, *frame);
      ASSERT_TRUE(st.ok()) << codec << " at " << off << ": " << st.message();
    }
    ASSERT_TRUE(decoded->commit().ok());
    EXPECT_EQ(frame_bytes, delta.stats().frame_bytes);
    EXPECT_EQ(std::memcmp(client.data(), global.data(), total), 0) << codec << ": the client rebuilt other bits";

    for (const auto& e : layout.entries()) {
      if (!goes_lossy(e)) {
        EXPECT_EQ(std::memcmp(global.data() + e.offset, y.data() + e.offset, e.nbytes()), 0) << codec << " " << e.name;
        continue;
      }
      const double tol = bound * change_range(e, x, y);
      for (size_t i = 0; i < e.numel(); ++i) {
        const float want = load_float(e.dtype, y.data() + e.offset, i);
        const float got = load_float(e.dtype, global.data() + e.offset, i);
        const double allowed = tol + half_ulp(e.dtype, want) + half_ulp(e.dtype, got) + half_ulp(DType::kF32, want);
        ASSERT_LE(std::fabs(static_cast<double>(got) - want), allowed) << codec << " " << e.name << " element " << i;
      }
    }
    const LayoutEntry& fc = *layout.find("fc.weight");
    EXPECT_NE(std::memcmp(global.data() + fc.offset, y.data() + fc.offset, fc.nbytes()), 0)
        << codec << ": a lossy tensor came back exact";

    // A frame damaged on the way is refused, naming the chunk.
    {
      std::memcpy(client.data(), x.data(), total);
      ArenaBaseModel again(client);
      ArenaWriter w2(layout, client, "server");
      auto d2 = decoding_stream(std::make_unique<WriterStream>(w2), layout, &again, "server 127.0.0.1:1", chunk);
      auto frame = delta.frame(0, &buffer);
      ASSERT_TRUE(frame.ok());
      buffer[buffer.size() / 2] ^= std::byte{0x40};
      const ChunkHeader h{layout.hash(), 0, buffer.size(), chunk_checksum(std::span<const std::byte>(buffer))};
      const Status bad = d2->accept(h, std::span<const std::byte>(buffer));
      EXPECT_FALSE(bad.ok()) << codec;
      EXPECT_NE(bad.message().find("server 127.0.0.1:1"), std::string::npos) << bad.message();
    }

    // A round that does not follow the one held (a resumed run, a skipped
    // prepare): its bytes again, and no frames to send.
    ASSERT_TRUE(delta.prepare(6, global).ok());
    EXPECT_EQ(delta.from_round(), -1);
    EXPECT_FALSE(delta.frame(0, &buffer).ok());
  }
}

TEST(ErrorFeedback, TheResidualIsWhatTheServerDidNotGetAndReturnsNextRound) {
  const Layout layout = model_layout();
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
      rebuilt(layout.total_bytes(), MemoryCategory::kModel), r(layout.total_bytes(), MemoryCategory::kModel);
  make_models(layout, x, y, 8);
  const CompressionSettings s = settings(Lossy::kQuantizer, true, 5e-2, /*ef=*/true);
  round_trip(layout, s, y, x, &r, 1000, rebuilt);
  const LayoutEntry& fc = *layout.find("fc.weight");
  double lost = 0;
  for (size_t i = 0; i < fc.numel(); ++i) {
    const float yv = load_float(fc.dtype, y.data() + fc.offset, i);
    const float got = load_float(fc.dtype, rebuilt.data() + fc.offset, i);
    const float rv = load_float(fc.dtype, r.data() + fc.offset, i);
    // r = (x + (y − x)) − ỹ in f32: y − ỹ up to the rounding of y − x.
    ASSERT_NEAR(rv, yv - got, 2 * half_ulp(DType::kF32, yv)) << i;
    lost += std::fabs(rv);
  }
  EXPECT_GT(lost, 0) << "a lossy round leaves a residual";
  // Tensors that go lossless leave none.
  const LayoutEntry& bias = *layout.find("conv1.bias");
  for (size_t i = 0; i < bias.numel(); ++i) EXPECT_EQ(load_float(bias.dtype, r.data() + bias.offset, i), 0.0f);

  // Next round, from the rebuilt model, with no training at all: the update
  // is the residual alone, and what the server then gets brings it to y
  // (within this round's bound, now of the residual's own range).
  Arena x2(layout.total_bytes(), MemoryCategory::kModel), rebuilt2(layout.total_bytes(), MemoryCategory::kModel);
  std::memcpy(x2.data(), rebuilt.data(), layout.total_bytes());
  Arena y2(layout.total_bytes(), MemoryCategory::kModel);
  std::memcpy(y2.data(), rebuilt.data(), layout.total_bytes());
  std::vector<double> tol;
  round_trip(layout, s, y2, x2, &r, 1000, rebuilt2, &tol);
  const size_t fc_index = static_cast<size_t>(&fc - layout.entries().data());
  double before = 0, after = 0;
  for (size_t i = 0; i < fc.numel(); ++i) {
    const float yv = load_float(fc.dtype, y.data() + fc.offset, i);
    before += std::fabs(load_float(fc.dtype, rebuilt.data() + fc.offset, i) - yv);
    const float now = load_float(fc.dtype, rebuilt2.data() + fc.offset, i);
    after += std::fabs(now - yv);
    ASSERT_LE(std::fabs(now - yv), tol[fc_index] + 4 * half_ulp(DType::kF32, yv)) << i;
  }
  EXPECT_LT(after, before / 5) << "error feedback should deliver most of what the first round lost";
}

// --- bad frames ---------------------------------------------------------------

// One encoded frame of the test model, and what decoding it needs.
struct OneFrame {
  Layout layout = model_layout();
  Arena x{layout.total_bytes(), MemoryCategory::kModel};
  Arena y{layout.total_bytes(), MemoryCategory::kModel};
  std::vector<std::byte> frame;
  uint64_t offset = 4096;
  OneFrame() {
    make_models(layout, x, y, 2);
    UpdateEncoder enc(layout, settings(Lossy::kQuantizer, true, 1e-2));
    ArenaPlace place(y);
    EXPECT_TRUE(enc.begin(place, &x, nullptr).ok());
    for (uint64_t off = 0; off <= offset; off += 4096) {
      auto f = enc.encode(off, 4096);
      EXPECT_TRUE(f.ok());
      if (off == offset) frame.assign(f->begin(), f->end());
    }
  }
  Status decode(std::vector<std::byte> bytes) {
    ArenaBaseModel base(x);
    FrameDecoder dec(layout, &base, "client_7");
    std::span<const std::byte> one = bytes;
    return dec.decode(offset, Payload(&one, 1)).status();
  }
};

void expect_refused(const Status& s, const std::string& why) {
  EXPECT_FALSE(s.ok()) << why;
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
  EXPECT_NE(s.message().find("client_7"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset 4096"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
}

TEST(BadFrames, AreRefusedNamingTheClientAndTheChunk) {
  OneFrame f;
  ASSERT_TRUE(f.decode(f.frame).ok());
  {
    auto b = f.frame;  // a flipped byte in the body
    b[kFrameHeaderBytes + 40] ^= std::byte{0x5a};
    const Status s = f.decode(b);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("client_7"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("offset 4096"), std::string::npos) << s.message();
  }
  {
    auto b = f.frame;  // a decompression bomb: 1 GiB promised from a few KiB
    const uint64_t huge = uint64_t{1} << 30;
    std::memcpy(b.data() + 16, &huge, 8);
    expect_refused(f.decode(b), "a chunk holds 1 to");
  }
  {
    auto b = f.frame;  // past the model's end
    const uint64_t past = f.layout.total_bytes();
    std::memcpy(b.data() + 16, &past, 8);
    expect_refused(f.decode(b), "a chunk holds 1 to");
  }
  {
    auto b = f.frame;  // an unknown lossless codec
    b[5] = std::byte{9};
    expect_refused(f.decode(b), "unknown lossless codec id 9");
  }
  {
    auto b = f.frame;  // cut short: the body is not what the header says
    b.resize(b.size() - 3);
    expect_refused(f.decode(b), "body is");
  }
  {
    auto b = f.frame;  // the rebuilt bytes' checksum
    b[40] ^= std::byte{1};
    expect_refused(f.decode(b), "checksum");
  }
  {
    auto b = f.frame;  // not a frame at all
    b[0] = std::byte{'X'};
    expect_refused(f.decode(b), "not a compressed frame");
  }
  {
    auto b = f.frame;  // segments that promise more than the raw bound
    const uint64_t inner = uint64_t{1} << 40;
    std::memcpy(b.data() + 32, &inner, 8);
    expect_refused(f.decode(b), "segments say");
  }
}

TEST(BadFrames, ALossySegmentMayNotLeaveItsTensor) {
  // Hand-made: one stored frame whose only segment claims to be a lossy
  // delta over the i64 counter.
  const Layout layout = model_layout();
  const LayoutEntry& counter = *layout.find("bn.num_batches_tracked");
  std::vector<std::byte> inner(kSegmentHeaderBytes + 8);
  write_segment_header({.kind = SegmentKind::kLossyDelta,
                        .codec = Lossy::kQuantizer,
                        .dtype = DType::kI64,
                        .raw_bytes = 8,
                        .payload_bytes = 8,
                        .tolerance = 1},
                       inner.data());
  std::vector<std::byte> frame(kFrameHeaderBytes + inner.size());
  write_frame_header({.codec = Lossless::kNone,
                      .segments = 1,
                      .raw_length = 8,
                      .body_length = inner.size(),
                      .inner_length = inner.size(),
                      .raw_checksum = 0},
                     frame.data());
  std::memcpy(frame.data() + kFrameHeaderBytes, inner.data(), inner.size());
  FrameDecoder dec(layout, nullptr, "client_2");
  std::span<const std::byte> one = frame;
  const Status s = dec.decode(counter.offset, Payload(&one, 1)).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not whole elements of one float tensor"), std::string::npos) << s.message();
}

// A stream that keeps what the decoder hands on.
class KeepStream final : public UpdateStream {
 public:
  KeepStream(const Layout& layout, Arena& into) : layout_(layout), into_(into) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload p) override {
    MEMFL_RETURN_IF_ERROR(verify_chunk(h, p, layout_, next_, "kept"));
    std::memcpy(into_.data() + h.offset, p.front().data(), h.length);
    next_ += h.length;
    return Status::Ok();
  }
  Status commit() override { return next_ == layout_.total_bytes() ? Status::Ok() : data_loss("short"); }

 private:
  const Layout& layout_;
  Arena& into_;
  uint64_t next_ = 0;
};

class KeepOpener final : public UpdateOpener {
 public:
  KeepOpener(const Layout& layout, Arena& into) : layout_(layout), into_(into) {}
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string&, double) override {
    return std::unique_ptr<UpdateStream>(std::make_unique<KeepStream>(layout_, into_));
  }

 private:
  const Layout& layout_;
  Arena& into_;
};

TEST(DecodingUpdateOpener, HandsTheFoldCheckedRawChunksAndRefusesABadFrameByClientAndOffset) {
  testing::TempDir dir;
  const Layout layout = model_layout();
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel),
      kept(layout.total_bytes(), MemoryCategory::kModel), expect(layout.total_bytes(), MemoryCategory::kModel);
  make_models(layout, x, y, 12);
  // The base from the checkpoint file, as an in-place server reads it.
  ASSERT_TRUE(write_safetensors(dir.file("global.safetensors"), layout, x).ok());
  auto base = FileBaseModel::open(dir.file("global.safetensors"), layout);
  ASSERT_TRUE(base.ok()) << base.status().message();
  // What the encoder means the server to rebuild, from the arena base.
  const CompressionSettings s = settings(Lossy::kQuantizer, true, 1e-2);
  round_trip(layout, s, y, x, nullptr, 1000, expect);

  KeepOpener keep(layout, kept);
  DecodingUpdateOpener opener(keep, layout, base->get());
  UpdateEncoder enc(layout, s);
  ArenaPlace place(y);
  ASSERT_TRUE(enc.begin(place, &x, nullptr).ok());
  auto stream = opener.open_update("client_5", 10);
  ASSERT_TRUE(stream.ok());
  for (uint64_t off = 0; off < layout.total_bytes(); off += 1000) {
    const size_t len = std::min<uint64_t>(1000, layout.total_bytes() - off);
    auto f = enc.encode(off, len);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*stream)->accept({layout.hash(), off, f->size(), chunk_checksum(*f)}, *f).ok());
  }
  ASSERT_TRUE((*stream)->commit().ok());
  EXPECT_EQ(std::memcmp(kept.data(), expect.data(), layout.total_bytes()), 0);

  // A frame damaged on the way: the wire checksum names client and chunk.
  auto again = opener.open_update("client_5", 10);
  ASSERT_TRUE(enc.begin(place, &x, nullptr).ok());
  auto f = enc.encode(0, 1000);
  std::vector<std::byte> bytes(f->begin(), f->end());
  const uint64_t sum = chunk_checksum(std::span<const std::byte>(bytes));
  bytes[60] ^= std::byte{1};
  const Status bad = (*again)->accept({layout.hash(), 0, bytes.size(), sum}, std::span<const std::byte>(bytes));
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.message().find("client_5"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("model offset 0"), std::string::npos) << bad.message();
  // A bomb: a frame far above the transport's chunk is refused before it is read.
  std::vector<std::byte> bomb(kMaxTransferChunk + kMaxFrameOverhead + 1);
  auto third = opener.open_update("client_6", 10);
  const Status b = (*third)->accept({layout.hash(), 0, bomb.size(), 0}, std::span<const std::byte>(bomb));
  EXPECT_NE(b.message().find("client_6"), std::string::npos) << b.message();
  EXPECT_NE(b.message().find("at most"), std::string::npos) << b.message();
}

TEST(FileBaseModel, ReadsTheArenaBytesAcrossPadding) {
  testing::TempDir dir;
  const Layout layout = model_layout();
  Arena a(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, a, 99);
  ASSERT_TRUE(write_safetensors(dir.file("m.safetensors"), layout, a).ok());
  auto base = FileBaseModel::open(dir.file("m.safetensors"), layout);
  ASSERT_TRUE(base.ok()) << base.status().message();
  std::vector<std::byte> got(layout.total_bytes());
  for (uint64_t off = 0; off < layout.total_bytes(); off += 333) {
    const size_t len = std::min<uint64_t>(333, layout.total_bytes() - off);
    ASSERT_TRUE((*base)->read(off, std::span<std::byte>(got.data() + off, len)).ok());
  }
  for (const auto& e : layout.entries()) {
    EXPECT_EQ(std::memcmp(got.data() + e.offset, a.data() + e.offset, e.nbytes()), 0) << e.name;
  }
}

}  // namespace
}  // namespace memfl
