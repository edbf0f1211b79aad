#include "aggregate/dp_fedavg.h"

#include <cmath>
#include <random>

namespace memfl {

namespace {
float get(const LayoutEntry& e, const std::byte* base, size_t i) {
  switch (e.dtype) {
    case DType::kF32:
      return reinterpret_cast<const float*>(base + e.offset)[i];
    case DType::kBF16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(base + e.offset)[i]);
    case DType::kF16:
      return f16_to_f32(reinterpret_cast<const uint16_t*>(base + e.offset)[i]);
    default:
      return 0;
  }
}
void put(const LayoutEntry& e, std::byte* base, size_t i, float v) {
  switch (e.dtype) {
    case DType::kF32:
      reinterpret_cast<float*>(base + e.offset)[i] = v;
      break;
    case DType::kBF16:
      reinterpret_cast<uint16_t*>(base + e.offset)[i] = f32_to_bf16(v);
      break;
    case DType::kF16:
      reinterpret_cast<uint16_t*>(base + e.offset)[i] = f32_to_f16(v);
      break;
    default:
      break;
  }
}
}  // namespace

double clip_update(const Layout& layout, const Arena& global, Arena& local, double clip_norm) {
  double sq = 0;
  for (const auto& e : layout.entries()) {
    if (!dtype_is_float(e.dtype)) continue;
    for (size_t i = 0; i < e.numel(); ++i) {
      const double d = static_cast<double>(get(e, local.data(), i)) - get(e, global.data(), i);
      sq += d * d;
    }
  }
  const double norm = std::sqrt(sq);
  if (norm <= clip_norm || norm == 0) return norm;
  const double s = clip_norm / norm;
  for (const auto& e : layout.entries()) {
    if (!dtype_is_float(e.dtype)) continue;
    for (size_t i = 0; i < e.numel(); ++i) {
      const double g = get(e, global.data(), i);
      put(e, local.data(), i, static_cast<float>(g + s * (get(e, local.data(), i) - g)));
    }
  }
  return norm;
}

void add_gaussian_noise(const Layout& layout, Arena& model, double stddev, uint64_t seed) {
  if (stddev <= 0) return;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, stddev);
  for (const auto& e : layout.entries()) {
    if (!dtype_is_float(e.dtype)) continue;
    for (size_t i = 0; i < e.numel(); ++i)
      put(e, model.data(), i, static_cast<float>(get(e, model.data(), i) + n(rng)));
  }
}

}  // namespace memfl
