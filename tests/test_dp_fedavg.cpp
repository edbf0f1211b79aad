// Client-level DP-FedAvg's two pieces: the client clips its update, the
// server adds calibrated noise to the mean.
#include <gtest/gtest.h>

#include <cmath>

#include "aggregate/dp_fedavg.h"
#include "test_util.h"

namespace memfl {
namespace {

Layout small_layout() {
  LayoutBuilder b;
  b.add("w", DType::kF32, {50, 40}).add("b", DType::kF32, {40}).add("steps", DType::kI64, {});
  return std::move(b).build().value();
}

double update_norm(const Layout& l, const Arena& g, const Arena& x) {
  double sq = 0;
  for (const auto& e : l.entries()) {
    if (!dtype_is_float(e.dtype)) continue;
    for (size_t i = 0; i < e.numel(); ++i) {
      const double d = testing::element_as_double(x, e, i) - testing::element_as_double(g, e, i);
      sq += d * d;
    }
  }
  return std::sqrt(sq);
}

TEST(DpFedAvg, ClipUpdateBoundsTheNormAndKeepsTheDirection) {
  Layout l = small_layout();
  Arena global(l.total_bytes(), MemoryCategory::kModel), local(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, global, 1);
  testing::fill_random(l, local, 2);
  Arena before(l.total_bytes(), MemoryCategory::kModel);
  std::memcpy(before.data(), local.data(), l.total_bytes());
  const double norm = clip_update(l, global, local, 0.5);
  EXPECT_NEAR(norm, update_norm(l, global, before), 1e-6 * norm);
  ASSERT_GT(norm, 0.5);
  EXPECT_NEAR(update_norm(l, global, local), 0.5, 1e-4);
  // Same direction: every coordinate of the update scaled by 0.5 / norm.
  const auto& w = l.entries()[0];
  for (size_t i = 0; i < 20; ++i) {
    const double d0 = testing::element_as_double(before, w, i) - testing::element_as_double(global, w, i);
    const double d1 = testing::element_as_double(local, w, i) - testing::element_as_double(global, w, i);
    EXPECT_NEAR(d1, d0 * 0.5 / norm, 1e-5);
  }
  // An update already inside the bound is left alone.
  Arena copy(l.total_bytes(), MemoryCategory::kModel);
  std::memcpy(copy.data(), local.data(), l.total_bytes());
  clip_update(l, global, local, 10.0);
  EXPECT_EQ(std::memcmp(copy.data(), local.data(), l.total_bytes()), 0);
}

TEST(DpFedAvg, NoiseHasTheRequestedSpreadAndSparesIntegers) {
  Layout l = small_layout();
  Arena m(l.total_bytes(), MemoryCategory::kModel);
  add_gaussian_noise(l, m, 0.3, 7);
  double sum = 0, sq = 0;
  size_t n = 0;
  for (const auto& e : l.entries()) {
    for (size_t i = 0; i < e.numel(); ++i) {
      const double v = testing::element_as_double(m, e, i);
      if (!dtype_is_float(e.dtype)) {
        EXPECT_EQ(v, 0.0) << e.name;
        continue;
      }
      sum += v;
      sq += v * v;
      ++n;
    }
  }
  const double mean = sum / static_cast<double>(n);
  const double sd = std::sqrt(sq / static_cast<double>(n) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.03);
  EXPECT_NEAR(sd, 0.3, 0.02);
}

}  // namespace
}  // namespace memfl
