// The oracle for DummyTrainer runs: what FedAvg of its known updates gives,
// computed here in double from the formula of the config key
// train_configs.dummy_update_scale — client c in round r sends
// g + s·(c+1)·(1 + (i + r) mod 5) with weight 5·(c+1) — independently of the
// server code under test.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "model/synthetic.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl::testing {

// The global model after the rounds of `in` (in[r - 1]: the clients whose
// update counted in round r), from the seeded synthetic f32 model of
// `params` parameters (server_configs.seed's default, 42).
inline std::vector<double> dummy_fedavg_model(int64_t params, double scale, const std::vector<std::vector<int>>& in) {
  Layout layout = synthetic_layout(params, DType::kF32).value();
  Arena init(layout.total_bytes(), MemoryCategory::kModel);
  fill_synthetic(layout, init, 42);
  std::vector<double> g;
  for (const auto& e : layout.entries()) {
    for (size_t i = 0; i < e.numel(); ++i) g.push_back(element_as_double(init, e, i));
  }
  for (int r = 1; r <= static_cast<int>(in.size()); ++r) {
    size_t k = 0;
    for (const auto& e : layout.entries()) {
      for (size_t i = 0; i < e.numel(); ++i, ++k) {
        double sum = 0, w = 0;
        for (int c : in[static_cast<size_t>(r - 1)]) {
          const double wc = 5.0 * (c + 1);
          sum += wc * (g[k] + scale * (c + 1) * (1 + (i + static_cast<size_t>(r)) % 5));
          w += wc;
        }
        g[k] = sum / w;
      }
    }
  }
  return g;
}

// Whether the f32 model in `path` is `want`, element by element, to f32 rounding.
inline ::testing::AssertionResult model_equals(const std::string& path, const std::vector<double>& want) {
  auto f = SafetensorsFile::open(path);
  if (!f.ok()) return ::testing::AssertionFailure() << f.status().to_string();
  size_t k = 0;
  for (const auto& t : (*f)->tensors()) {
    const size_t n = t.data.size() / 4;
    for (size_t i = 0; i < n; ++i, ++k) {
      float v;
      std::memcpy(&v, t.data.data() + 4 * i, 4);
      if (k >= want.size() || std::abs(v - want[k]) > 4e-6 * (1 + std::abs(want[k]))) {
        return ::testing::AssertionFailure()
               << t.name << "[" << i << "] = " << v << ", expected " << (k < want.size() ? want[k] : NAN);
      }
    }
  }
  if (k != want.size()) return ::testing::AssertionFailure() << k << " elements, expected " << want.size();
  return ::testing::AssertionSuccess();
}

}  // namespace memfl::testing
