#include "tensor/dtype.h"

#include <cmath>

namespace memfl {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kI64:
      return 8;
    case DType::kI32:
      return 4;
    case DType::kU8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI64:
      return "i64";
    case DType::kI32:
      return "i32";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI64:
      return "I64";
    case DType::kI32:
      return "I32";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI64, DType::kI32, DType::kU8}) {
    if (dtype_name(d) == name) return d;
  }
  return std::nullopt;
}

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI64, DType::kI32, DType::kU8}) {
    if (dtype_safetensors_name(d) == name) return d;
  }
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);  // subnormal
  } else if (exp == 31) {
    magnitude = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    uint32_t u = ((exp + 112u) << 23) | (mant << 13);
    std::memcpy(&magnitude, &u, 4);
  }
  return sign ? -magnitude : magnitude;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. inf) after rounding
  if (abs < 0x38800000u) {                        // subnormal or zero in f16
    // Scale so that the f16 subnormal unit (2^-24) becomes 1, round to nearest even.
    float a;
    std::memcpy(&a, &abs, 4);
    float scaled = a * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

}  // namespace memfl
