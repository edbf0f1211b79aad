#include "secagg/shamir.h"

#include <sodium.h>

#include <cstring>
#include <set>

namespace memfl {

uint64_t gf_add(uint64_t a, uint64_t b) {
  uint64_t s = a + b;  // < 2^62: no overflow
  return s >= kShamirPrime ? s - kShamirPrime : s;
}

uint64_t gf_sub(uint64_t a, uint64_t b) { return a >= b ? a - b : a + kShamirPrime - b; }

namespace {
__extension__ typedef unsigned __int128 Wide;  // GCC/Clang's 128-bit product, pedantic-clean
}  // namespace

uint64_t gf_mul(uint64_t a, uint64_t b) {
  // 2^61 ≡ 1 (mod 2^61 − 1): fold the high bits of the 122-bit product down.
  const Wide p = static_cast<Wide>(a) * b;
  const uint64_t lo = static_cast<uint64_t>(p) & kShamirPrime;
  const uint64_t hi = static_cast<uint64_t>(p >> 61);
  return gf_add(lo, hi % kShamirPrime);
}

uint64_t gf_inv(uint64_t a) {
  // Fermat: a^(p−2).
  uint64_t result = 1, base = a % kShamirPrime, e = kShamirPrime - 2;
  while (e != 0) {
    if ((e & 1) != 0) result = gf_mul(result, base);
    base = gf_mul(base, base);
    e >>= 1;
  }
  return result;
}

namespace shamir_detail {

uint64_t evaluate(std::span<const uint64_t> coefficients, uint64_t x) {
  uint64_t y = 0;
  for (size_t i = coefficients.size(); i-- > 0;) y = gf_add(gf_mul(y, x), coefficients[i]);
  return y;
}

StatusOr<uint64_t> interpolate_at_zero(std::span<const uint64_t> xs, std::span<const uint64_t> ys) {
  if (xs.size() != ys.size() || xs.empty()) return invalid_argument("interpolation needs as many ys as xs");
  uint64_t secret = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    // Lagrange basis at 0: Π_{j≠i} x_j / (x_j − x_i).
    uint64_t num = 1, den = 1;
    for (size_t j = 0; j < xs.size(); ++j) {
      if (j == i) continue;
      if (xs[j] == xs[i]) return invalid_argument("two shares at the same x ({})", xs[i]);
      num = gf_mul(num, xs[j]);
      den = gf_mul(den, gf_sub(xs[j], xs[i]));
    }
    secret = gf_add(secret, gf_mul(ys[i], gf_mul(num, gf_inv(den))));
  }
  return secret;
}

}  // namespace shamir_detail

namespace {

uint64_t piece(const Secret32& s, size_t k) {
  uint64_t v = 0;
  const size_t from = k * 7, n = std::min<size_t>(7, s.size() - from);
  for (size_t b = 0; b < n; ++b) v |= uint64_t{s[from + b]} << (8 * b);
  return v;
}

uint64_t random_element() {
  // Rejection sampling keeps the coefficients uniform over the field.
  while (true) {
    uint64_t v = 0;
    randombytes_buf(&v, sizeof v);
    v &= kShamirPrime;
    if (v < kShamirPrime) return v;
  }
}

}  // namespace

StatusOr<std::vector<ShamirShare>> shamir_split(const Secret32& secret, size_t threshold,
                                                std::span<const uint32_t> xs) {
  if (threshold < 1 || threshold > xs.size()) {
    return invalid_argument("Shamir threshold {} with {} shares: need 1 ≤ t ≤ shares", threshold, xs.size());
  }
  std::set<uint32_t> seen;
  for (uint32_t x : xs) {
    if (x == 0 || x > 65535 || !seen.insert(x).second) {
      return invalid_argument("Shamir share x {} is zero, above 65535 or repeated", x);
    }
  }
  std::vector<ShamirShare> shares(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) shares[i].x = xs[i];
  std::vector<uint64_t> coefficients(threshold);
  for (size_t k = 0; k < kShamirPieces; ++k) {
    coefficients[0] = piece(secret, k);
    for (size_t c = 1; c < threshold; ++c) coefficients[c] = random_element();
    for (auto& s : shares) s.y[k] = shamir_detail::evaluate(coefficients, s.x);
  }
  sodium_memzero(coefficients.data(), coefficients.size() * sizeof(uint64_t));
  return shares;
}

Status shamir_reconstruct(std::span<const ShamirShare> shares, size_t threshold, Secret32* secret) {
  if (threshold < 1 || shares.size() < threshold) {
    return failed_precondition("Shamir reconstruction needs {} shares, has {}", threshold, shares.size());
  }
  std::vector<uint64_t> xs(threshold), ys(threshold);
  for (size_t i = 0; i < threshold; ++i) xs[i] = shares[i].x;
  Secret32 out{};
  for (size_t k = 0; k < kShamirPieces; ++k) {
    for (size_t i = 0; i < threshold; ++i) {
      if (shares[i].y[k] >= kShamirPrime) return invalid_argument("Shamir share value outside the field");
      ys[i] = shares[i].y[k];
    }
    MEMFL_ASSIGN_OR_RETURN(uint64_t v, shamir_detail::interpolate_at_zero(xs, ys));
    const size_t from = k * 7, n = std::min<size_t>(7, out.size() - from);
    // A piece of n bytes is below 2^(8n); anything above came from shares
    // that do not belong together.
    if (n < 8 && (v >> (8 * n)) != 0) return data_loss("Shamir shares do not belong to one secret");
    for (size_t b = 0; b < n; ++b) out[from + b] = static_cast<uint8_t>(v >> (8 * b));
  }
  *secret = out;
  return Status::Ok();
}

}  // namespace memfl
