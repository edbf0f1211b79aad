#include "model/synthetic.h"

#include <algorithm>

#include "common/parallel.h"

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

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

namespace {

// Elements [first, last) of one tensor. Each block of kBlock elements has
// its own xorshift state, seeded from (seed, tensor, block): any split of the
// range over threads gives the same values.
constexpr size_t kBlock = 4096;

template <typename Store>
void fill_range(uint64_t tensor_seed, size_t first, size_t last, Store store) {
  for (size_t b = first / kBlock; b * kBlock < last; ++b) {
    uint64_t x = splitmix64(tensor_seed + b) | 1;  // xorshift's state must not be 0
    const size_t lo = std::max(first, b * kBlock);
    const size_t hi = std::min(last, (b + 1) * kBlock);
    for (size_t i = b * kBlock; i < hi; ++i) {
      x ^= x << 13;  // xorshift64: a few cycles per element
      x ^= x >> 7;
      x ^= x << 17;
      if (i < lo) continue;
      store(i, static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / static_cast<float>(1 << 23));
    }
  }
}

}  // namespace

void fill_synthetic(const Layout& layout, Arena& arena, uint64_t seed) {
  const auto& entries = layout.entries();
  for (size_t t = 0; t < entries.size(); ++t) {
    const LayoutEntry& e = entries[t];
    std::byte* p = arena.data() + e.offset;
    const uint64_t tensor_seed = splitmix64(seed * 0x9e3779b97f4a7c15ULL + t) << 20;
    // Pieces of whole blocks, so that no block is stepped through twice.
    const size_t blocks = (e.numel() + kBlock - 1) / kBlock;
    parallel_for(blocks, 256, [&](size_t b0, size_t b1) {
      const size_t first = b0 * kBlock;
      const size_t last = std::min(e.numel(), b1 * kBlock);
      switch (e.dtype) {
        case DType::kF32:
          fill_range(tensor_seed, first, last, [p](size_t i, float v) { reinterpret_cast<float*>(p)[i] = v; });
          break;
        case DType::kBF16:
          fill_range(tensor_seed, first, last,
                     [p](size_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = f32_to_bf16(v); });
          break;
        case DType::kF16:
          fill_range(tensor_seed, first, last,
                     [p](size_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = f32_to_f16(v); });
          break;
        default:
          break;
      }
    });
  }
}

}  // namespace memfl
