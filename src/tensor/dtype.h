// Element types a model arena can hold, with the conversions the aggregator
// needs. bf16 and f16 are stored as raw 16-bit patterns; aggregation widens
// them to f32 and narrows back with round-to-nearest-even.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace memfl {

enum class DType : uint8_t { kF32 = 0, kBF16, kF16, kI64, kI32, kU8 };

// Bytes per element.
size_t dtype_size(DType dtype);
// Our short name ("f32", "bf16", ...), used in configs and reports.
std::string_view dtype_name(DType dtype);
// The safetensors header name ("F32", "BF16", "F16", "I64", "I32", "U8").
std::string_view dtype_safetensors_name(DType dtype);
std::optional<DType> dtype_from_name(std::string_view name);              // "f32", "bf16", ...
std::optional<DType> dtype_from_safetensors_name(std::string_view name);  // "F32", ...
inline bool dtype_is_float(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float f);

}  // namespace memfl
