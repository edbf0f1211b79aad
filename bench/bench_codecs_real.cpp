// Codecs on a real update: the change between two checkpoints of a model
// (BASE: the global model a client started from; MODEL: what it sent, e.g. the
// next global model of a run with one client a round), encoded and decoded in
// 1 MiB chunks on one thread for each codec and bound. One JSON line per case:
// ratio (model bytes ÷ frame bytes), compress and decompress MB/s per CPU
// second (model bytes), and the largest reconstruction error of a lossy tensor
// over its tolerance plus one rounding of the weight's dtype, computed here
// from the decoded bytes (≤ 1 when the bound holds on every element).
//
//   memfl_bench_codecs BASE.safetensors MODEL.safetensors LABEL [REPS]
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "compress/decoding_opener.h"
#include "compress/update_encoder.h"
#include "tensor/dtype.h"
#include "tensor/safetensors.h"

namespace memfl {
namespace {

constexpr size_t kChunk = 1u << 20;

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Case {
  Lossy lossy;
  bool relative;
  double bound;
};

// One element widened to f32 (tensor/dtype.h's conversions); NaN for
// integer tensors, which never go lossy.
float element(const std::byte* p, DType dt) {
  uint16_t h;
  float f;
  switch (dt) {
    case DType::kF32:
      std::memcpy(&f, p, 4);
      return f;
    case DType::kBF16:
      std::memcpy(&h, p, 2);
      return bf16_to_f32(h);
    case DType::kF16:
      std::memcpy(&h, p, 2);
      return f16_to_f32(h);
    default:
      return NAN;
  }
}

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s BASE.safetensors MODEL.safetensors LABEL [REPS]\n", argv[0]);
    return 2;
  }
  const std::string label = argv[3];
  const int reps = argc > 4 ? std::max(1, std::atoi(argv[4])) : 3;
  auto base_file = SafetensorsFile::open(argv[1]);
  auto model_file = SafetensorsFile::open(argv[2]);
  if (!base_file.ok() || !model_file.ok()) {
    std::fprintf(stderr, "%s\n", (!base_file.ok() ? base_file.status() : model_file.status()).to_string().c_str());
    return 1;
  }
  auto layout = (*base_file)->layout();
  if (!layout.ok()) {
    std::fprintf(stderr, "%s\n", layout.status().to_string().c_str());
    return 1;
  }
  const uint64_t total = layout->total_bytes();
  uint64_t elements = 0;
  for (const LayoutEntry& en : layout->entries()) elements += en.numel();
  Arena base(total, MemoryCategory::kModel), model(total, MemoryCategory::kModel);
  for (auto [file, arena] : {std::pair{base_file->get(), &base}, std::pair{model_file->get(), &model}}) {
    if (Status s = file->load_into(*layout, *arena); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.to_string().c_str());
      return 1;
    }
  }
  const Case cases[] = {{Lossy::kNone, true, 0},          {Lossy::kZfp, false, 1e-3},
                        {Lossy::kZfp, true, 1e-2},        {Lossy::kZfp, true, 1e-3},
                        {Lossy::kQuantizer, false, 1e-3}, {Lossy::kQuantizer, true, 1e-2},
                        {Lossy::kQuantizer, true, 1e-3}};
  ArenaBaseModel base_model(base);
  for (const Case& c : cases) {
    if (!lossy_available(c.lossy)) continue;
    CompressionSettings s;
    s.enabled = true;
    s.lossy = c.lossy;
    s.lossy_name = c.lossy == Lossy::kZfp ? "ZFPCompressor" : "SZ2Compressor";
    s.lossless = Lossless::kZstd;
    s.relative = c.relative;
    s.error_bound = c.lossy == Lossy::kNone ? 1e-3 : c.bound;
    double enc_cpu = 1e30, dec_cpu = 1e30;
    uint64_t frame_bytes = 0, lossy_elements = 0;
    double worst = 0;
    for (int rep = 0; rep < reps; ++rep) {
      std::vector<std::vector<std::byte>> frames;
      EncodingPlace place(std::make_unique<ArenaPlace>(model), *layout, s);
      double t0 = cpu_seconds();
      if (Status st = place.begin(&base, nullptr); !st.ok()) {
        std::fprintf(stderr, "%s\n", st.to_string().c_str());
        return 1;
      }
      for (uint64_t off = 0; off < total; off += kChunk) {
        auto f = place.frame(off, std::min<uint64_t>(kChunk, total - off));
        if (!f.ok()) {
          std::fprintf(stderr, "%s\n", f.status().to_string().c_str());
          return 1;
        }
        frames.emplace_back(f->begin(), f->end());
      }
      enc_cpu = std::min(enc_cpu, cpu_seconds() - t0);
      frame_bytes = place.stats().frame_bytes;
      lossy_elements = place.stats().lossy_elements;
      // Each tensor's tolerance, worked out here from the two checkpoints:
      // ABS = the bound; REL = bound × (max − min) of the tensor's change.
      std::vector<double> tol(layout->entries().size(), 0);
      for (size_t e = 0; e < layout->entries().size(); ++e) {
        const LayoutEntry& en = layout->entries()[e];
        if (c.lossy == Lossy::kNone || !s.lossy_tensor(en)) continue;
        const size_t es = dtype_size(en.dtype);
        double lo = INFINITY, hi = -INFINITY;
        for (uint64_t k = 0; k < en.numel(); ++k) {
          const double d = static_cast<double>(element(model.data() + en.offset + k * es, en.dtype)) -
                           static_cast<double>(element(base.data() + en.offset + k * es, en.dtype));
          lo = std::min(lo, d);
          hi = std::max(hi, d);
        }
        tol[e] = c.relative ? c.bound * (hi - lo) : c.bound;
      }
      FrameDecoder dec(*layout, &base_model, label);
      std::vector<std::byte> rebuilt(total);
      t0 = cpu_seconds();
      uint64_t off = 0;
      for (const auto& f : frames) {
        std::span<const std::byte> one = f;
        auto raw = dec.decode(off, Payload(&one, 1));
        if (!raw.ok()) {
          std::fprintf(stderr, "%s\n", raw.status().to_string().c_str());
          return 1;
        }
        std::memcpy(rebuilt.data() + off, raw->data(), raw->size());
        off += raw->size();
      }
      dec_cpu = std::min(dec_cpu, cpu_seconds() - t0);
      worst = 0;
      for (size_t e = 0; e < layout->entries().size(); ++e) {
        const LayoutEntry& en = layout->entries()[e];
        const size_t es = dtype_size(en.dtype);
        for (uint64_t k = 0; k < en.numel(); ++k) {
          const std::byte* a = rebuilt.data() + en.offset + k * es;
          const std::byte* b = model.data() + en.offset + k * es;
          if (tol[e] == 0) {
            if (std::memcmp(a, b, es) != 0) worst = INFINITY;  // lossless must be exact
            continue;
          }
          // The bound holds on the change; the weight rebuilt as base + change
          // takes the rounding of its dtype on top: one unit in the last place
          // (2^-23 of the larger of the base and the weight in f32, 2^-7 in bf16, 2^-10 in f16) covers the subtraction
          // on the client and the addition on the server.
          const double err = std::fabs(static_cast<double>(element(a, en.dtype)) - element(b, en.dtype));
          const double mag =
              std::max(std::fabs(element(b, en.dtype)), std::fabs(element(base.data() + en.offset + k * es, en.dtype)));
          const double ulp = mag * (en.dtype == DType::kBF16 ? 0x1p-7 : en.dtype == DType::kF16 ? 0x1p-10 : 0x1p-23);
          worst = std::max(worst, err / (tol[e] + ulp));
        }
      }
    }
    std::string bound = c.lossy == Lossy::kNone ? "" : fmt::format("{} {}", c.relative ? "REL" : "ABS", c.bound);
    std::printf(
        "{\"update\": \"%s\", \"model_bytes\": %llu, \"codec\": \"%s\", \"bound\": \"%s\", \"lossless\": \"zstd\", "
        "\"lossy_fraction\": %.4f, \"ratio\": %.3f, \"compress_mb_per_cpu_s\": %.1f, "
        "\"decompress_mb_per_cpu_s\": %.1f, \"max_error_over_tolerance\": %.7f}\n",
        label.c_str(), static_cast<unsigned long long>(total), std::string(lossy_codec_name(c.lossy)).c_str(),
        bound.c_str(), static_cast<double>(lossy_elements) / static_cast<double>(elements),
        static_cast<double>(total) / static_cast<double>(frame_bytes), total / enc_cpu / 1e6, total / dec_cpu / 1e6,
        worst);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace memfl

int main(int argc, char** argv) { return memfl::run(argc, argv); }
