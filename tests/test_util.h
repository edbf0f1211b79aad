// Helpers shared by the tests.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl::testing {

// A fresh directory under /tmp, removed when the object dies.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/memfl_test_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// A whole file's text ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Fills every entry of `arena` with seeded values of its dtype.
inline void fill_random(const Layout& layout, Arena& arena, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  for (const auto& e : layout.entries()) {
    for (size_t i = 0; i < e.numel(); ++i) {
      std::byte* p = arena.data() + e.offset + i * dtype_size(e.dtype);
      switch (e.dtype) {
        case DType::kF32:
          *reinterpret_cast<float*>(p) = n(rng);
          break;
        case DType::kBF16:
          *reinterpret_cast<uint16_t*>(p) = f32_to_bf16(n(rng));
          break;
        case DType::kF16:
          *reinterpret_cast<uint16_t*>(p) = f32_to_f16(n(rng));
          break;
        case DType::kI64:
          *reinterpret_cast<int64_t*>(p) = static_cast<int64_t>(rng() % 1000);
          break;
        case DType::kI32:
          *reinterpret_cast<int32_t*>(p) = static_cast<int32_t>(rng() % 1000);
          break;
        case DType::kU8:
          *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(rng());
          break;
      }
    }
  }
}

inline double element_as_double(const Arena& arena, const LayoutEntry& e, size_t i) {
  const std::byte* p = arena.data() + e.offset + i * dtype_size(e.dtype);
  switch (e.dtype) {
    case DType::kF32:
      return *reinterpret_cast<const float*>(p);
    case DType::kBF16:
      return bf16_to_f32(*reinterpret_cast<const uint16_t*>(p));
    case DType::kF16:
      return f16_to_f32(*reinterpret_cast<const uint16_t*>(p));
    case DType::kI64:
      return static_cast<double>(*reinterpret_cast<const int64_t*>(p));
    case DType::kI32:
      return *reinterpret_cast<const int32_t*>(p);
    case DType::kU8:
      return *reinterpret_cast<const uint8_t*>(p);
  }
  return 0;
}

}  // namespace memfl::testing
