// Shamir secret sharing (Shamir 1979) of 32-byte secrets over the prime
// field GF(2^61 − 1), for secure aggregation's seeds and secret keys.
//
// A 32-byte secret is cut into five pieces of at most 7 bytes (56 bits,
// below the prime), and each piece is the constant term of its own random
// polynomial of degree t − 1; a share is the five polynomials' values at the
// share's x (1 … 65535, never 0, which would be the secret itself). Any t
// shares give the secret back by Lagrange interpolation at 0; t − 1 reveal
// nothing about it.
//
//   auto shares = shamir_split(secret, /*t=*/3, /*xs=*/{1, 2, 3, 4, 5});
//   std::array<uint8_t, 32> back;
//   MEMFL_RETURN_IF_ERROR(shamir_reconstruct({shares[0], shares[2], shares[4]}, 3, &back));
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace memfl {

inline constexpr uint64_t kShamirPrime = (uint64_t{1} << 61) - 1;
inline constexpr size_t kShamirPieces = 5;  // 7-byte pieces of a 32-byte secret
using Secret32 = std::array<uint8_t, 32>;

struct ShamirShare {
  uint32_t x = 0;                           // where the polynomials were evaluated (1 … 65535)
  std::array<uint64_t, kShamirPieces> y{};  // each piece's polynomial at x, each < kShamirPrime
};

// Field arithmetic (exposed for the tests' hand-worked vectors).
uint64_t gf_add(uint64_t a, uint64_t b);
uint64_t gf_sub(uint64_t a, uint64_t b);
uint64_t gf_mul(uint64_t a, uint64_t b);
uint64_t gf_inv(uint64_t a);  // a ≠ 0

// One share per x in `xs` (distinct, non-zero, ≤ 65535), of which any
// `threshold` reconstruct `secret`. Coefficients come from libsodium's CSPRNG.
StatusOr<std::vector<ShamirShare>> shamir_split(const Secret32& secret, size_t threshold, std::span<const uint32_t> xs);

// The secret from the first `threshold` of `shares` (their xs distinct).
Status shamir_reconstruct(std::span<const ShamirShare> shares, size_t threshold, Secret32* secret);

namespace shamir_detail {
// One field element's polynomial (coefficients[0] = the secret) at x.
uint64_t evaluate(std::span<const uint64_t> coefficients, uint64_t x);
// The value at 0 of the polynomial through the points (x_i, y_i).
StatusOr<uint64_t> interpolate_at_zero(std::span<const uint64_t> xs, std::span<const uint64_t> ys);
}  // namespace shamir_detail

}  // namespace memfl
