// Micro-benchmarks of compressed updates (`make bench`, JSON in
// build/bench.json): one update of 4 Mi f32 parameters whose change from
// its base is noise of 1e-3 (what a local epoch leaves on a weight tensor),
// encoded and decoded in 1 MiB chunks on one core, per codec and bound. The
// counters give the ratio (model bytes ÷ frame bytes); bytes_per_second is
// model bytes per second.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "compress/decoding_opener.h"
#include "compress/update_encoder.h"

namespace memfl {
namespace {

constexpr size_t kParams = 4u << 20;
constexpr size_t kChunk = 1u << 20;

struct Update {
  Layout layout;
  Arena base, model;
  Update() {
    LayoutBuilder b;
    for (int i = 0; i < 4; ++i) b.add("layer" + std::to_string(i) + ".weight", DType::kF32, {kParams / 4});
    layout = std::move(b).build().value();
    base = Arena(layout.total_bytes(), MemoryCategory::kModel);
    model = Arena(layout.total_bytes(), MemoryCategory::kModel);
    std::mt19937_64 rng(1);
    std::normal_distribution<float> w(0, 0.05f), d(0, 1e-3f);
    auto* x = reinterpret_cast<float*>(base.data());
    auto* y = reinterpret_cast<float*>(model.data());
    for (size_t i = 0; i < kParams; ++i) {
      x[i] = w(rng);
      y[i] = x[i] + d(rng);
    }
  }
};

const Update& update() {
  static const Update u;
  return u;
}

// Codec cases: lossy codec, REL bound (0: ABS 1e-4), lossless stage.
struct Case {
  Lossy lossy;
  double rel;
  Lossless lossless;
};
const Case kCases[] = {
    {Lossy::kNone, 0, Lossless::kZstd},          {Lossy::kNone, 0, Lossless::kGzip},
    {Lossy::kNone, 0, Lossless::kLzma},          {Lossy::kNone, 0, Lossless::kBlosc},
    {Lossy::kZfp, 1e-2, Lossless::kZstd},        {Lossy::kZfp, 1e-3, Lossless::kZstd},
    {Lossy::kZfp, 0, Lossless::kZstd},           {Lossy::kQuantizer, 1e-2, Lossless::kZstd},
    {Lossy::kQuantizer, 1e-3, Lossless::kZstd},  {Lossy::kQuantizer, 0, Lossless::kZstd},
    {Lossy::kQuantizer, 1e-3, Lossless::kBlosc},
};

CompressionSettings settings(const Case& c) {
  CompressionSettings s;
  s.enabled = true;
  s.lossy = c.lossy;
  s.lossy_name = c.lossy == Lossy::kZfp ? "ZFPCompressor" : "SZ3Compressor";
  s.lossless = c.lossless;
  s.relative = c.rel > 0;
  s.error_bound = c.rel > 0 ? c.rel : 1e-4;
  return s;
}

std::string label(const Case& c) {
  std::string l = c.lossy == Lossy::kNone ? "lossless" : std::string(lossy_codec_name(c.lossy));
  if (c.lossy != Lossy::kNone) l += c.rel > 0 ? " REL " + fmt::format("{}", c.rel) : " ABS 1e-4";
  return l + " + " + std::string(lossless_name(c.lossless));
}

void BM_CompressUpdate(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Update& u = update();
  if (!lossless_available(c.lossless) || !lossy_available(c.lossy)) {
    state.SkipWithError("codec not built");
    return;
  }
  uint64_t frames = 0;
  for (auto _ : state) {
    EncodingPlace place(std::make_unique<ArenaPlace>(const_cast<Arena&>(u.model)), u.layout, settings(c));
    (void)place.begin(&u.base, nullptr);
    for (uint64_t off = 0; off < u.layout.total_bytes(); off += kChunk) {
      auto f = place.frame(off, std::min<uint64_t>(kChunk, u.layout.total_bytes() - off));
      benchmark::DoNotOptimize(f);
    }
    frames = place.stats().frame_bytes;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(u.layout.total_bytes()));
  state.counters["ratio"] = static_cast<double>(u.layout.total_bytes()) / static_cast<double>(frames);
  state.SetLabel(label(c));
}
BENCHMARK(BM_CompressUpdate)->DenseRange(0, std::size(kCases) - 1)->Unit(benchmark::kMillisecond);

void BM_DecompressUpdate(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Update& u = update();
  if (!lossless_available(c.lossless) || !lossy_available(c.lossy)) {
    state.SkipWithError("codec not built");
    return;
  }
  std::vector<std::vector<std::byte>> frames;
  EncodingPlace place(std::make_unique<ArenaPlace>(const_cast<Arena&>(u.model)), u.layout, settings(c));
  (void)place.begin(&u.base, nullptr);
  for (uint64_t off = 0; off < u.layout.total_bytes(); off += kChunk) {
    auto f = place.frame(off, std::min<uint64_t>(kChunk, u.layout.total_bytes() - off));
    frames.emplace_back(f->begin(), f->end());
  }
  ArenaBaseModel base(u.base);
  for (auto _ : state) {
    FrameDecoder dec(u.layout, &base, "bench");
    uint64_t off = 0;
    for (const auto& f : frames) {
      std::span<const std::byte> one = f;
      auto raw = dec.decode(off, Payload(&one, 1));
      benchmark::DoNotOptimize(raw);
      off += raw->size();
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(u.layout.total_bytes()));
  state.SetLabel(label(c));
}
BENCHMARK(BM_DecompressUpdate)->DenseRange(0, std::size(kCases) - 1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace memfl
