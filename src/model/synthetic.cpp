#include "model/synthetic.h"

#include <algorithm>

namespace memfl {

StatusOr<Layout> synthetic_layout(int64_t num_params, DType dtype) {
  if (num_params < 1) return invalid_argument("synthetic model: num_params must be at least 1, got {}", num_params);
  if (!dtype_is_float(dtype)) return invalid_argument("synthetic model: dtype must be f32, bf16 or f16");
  constexpr int64_t kMaxTensor = int64_t{16} << 20;
  LayoutBuilder b;
  int64_t left = num_params;
  for (int i = 0; left > 0; ++i) {
    const int64_t n = std::min(left, kMaxTensor);
    b.add("layers." + std::to_string(i) + ".weight", dtype, {n});
    left -= n;
  }
  return std::move(b).build();
}

void fill_synthetic(const Layout& layout, Arena& arena, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (const auto& e : layout.entries()) {
    std::byte* p = arena.data() + e.offset;
    for (size_t i = 0; i < e.numel(); ++i) {
      x ^= x << 13;  // xorshift64: a few cycles per element
      x ^= x >> 7;
      x ^= x << 17;
      const float v = static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
      switch (e.dtype) {
        case DType::kF32:
          reinterpret_cast<float*>(p)[i] = v;
          break;
        case DType::kBF16:
          reinterpret_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
          break;
        case DType::kF16:
          reinterpret_cast<uint16_t*>(p)[i] = f32_to_f16(v);
          break;
        default:
          break;
      }
    }
  }
}

}  // namespace memfl
