// Adam with float32 moments (train/adam_float32_state.h): against torch's
// own Adam where both hold float32, and against Adam's formula worked in
// double where the weights are bf16 and only the moments are float32.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "train/adam_float32_state.h"

namespace memfl::torch_internal {
namespace {

double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(1e-30, b.abs().max().item<double>());
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

// Gradients of different scales per step, so a wrong beta or bias
// correction weighs them wrongly.
std::vector<torch::Tensor> gradients(torch::IntArrayRef shape, int steps) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> gs;
  for (int t = 0; t < steps; ++t) gs.push_back(torch::randn(shape, torch::kFloat64) * (0.5 + 0.7 * t));
  return gs;
}

TEST(Float32StateAdam, MatchesTorchsAdamOnFloat32Weights) {
  const AdamHyper h{0.03, 0.8, 0.95, 1e-6, 0.1};
  torch::manual_seed(3);
  const auto init = torch::randn({37, 19});
  auto mine = init.clone().requires_grad_(true);
  auto theirs = init.clone().requires_grad_(true);
  Float32StateAdam a({mine}, h);
  torch::optim::Adam b({theirs},
                      torch::optim::AdamOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
  for (const auto& g : gradients(init.sizes(), 5)) {
    mine.mutable_grad() = g.to(torch::kFloat32);
    theirs.mutable_grad() = g.to(torch::kFloat32);
    a.step();
    b.step();
  }
  // Both update float32 with the same operations in a different order:
  // a few float32 roundings apart after 5 steps.
  EXPECT_LT(max_rel(mine, theirs), 1e-6);
  const auto& s = static_cast<torch::optim::AdamParamState&>(*b.state().begin()->second);
  EXPECT_LT(max_rel(a.exp_avg(0), s.exp_avg()), 1e-6);
  EXPECT_LT(max_rel(a.exp_avg_sq(0), s.exp_avg_sq()), 1e-6);
  EXPECT_EQ(a.state_bytes(), 2 * 37 * 19 * 4);
}

TEST(Float32StateAdam, Bf16WeightsFollowAdamsFormulaWithFloat32Moments) {
  const double lr = 0.01, b1 = 0.8, b2 = 0.95, eps = 1e-8;
  const int steps = 6;
  torch::manual_seed(5);
  const auto init = torch::randn({257, 33}).to(torch::kBFloat16);
  const auto gs = gradients(init.sizes(), steps);

  // Adam's formula in double, the weights rounded to bf16 after each step
  // (they are stored in bf16), the moments kept exact.
  auto p = init.to(torch::kFloat64), m = torch::zeros_like(p), v = torch::zeros_like(p);
  for (int t = 1; t <= steps; ++t) {
    const auto g = gs[t - 1].to(torch::kBFloat16).to(torch::kFloat64);  // the gradient a bf16 model has
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const auto mhat = m / (1 - std::pow(b1, t));
    const auto vhat = v / (1 - std::pow(b2, t));
    p = (p - lr * mhat / (vhat.sqrt() + eps)).to(torch::kBFloat16).to(torch::kFloat64);
  }

  // The optimizer, and the free step in slices that do not divide the
  // tensor (8,481 elements in slices of 1,000).
  auto whole = init.clone().requires_grad_(true);
  auto sliced = init.clone();
  auto sm = torch::zeros(init.sizes(), torch::kFloat32), sv = torch::zeros(init.sizes(), torch::kFloat32);
  Float32StateAdam opt({whole}, {lr, b1, b2, eps, 0});
  // torch's Adam on the same bf16 weights keeps bf16 moments: the contrast.
  auto bf16_state = init.clone().requires_grad_(true);
  torch::optim::Adam torch_adam({bf16_state}, torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps));
  for (int t = 1; t <= steps; ++t) {
    const auto g = gs[t - 1].to(torch::kBFloat16);
    whole.mutable_grad() = g;
    bf16_state.mutable_grad() = g;
    opt.step();
    torch_adam.step();
    adam_step_float32_state(sliced, g, sm, sv, t, {lr, b1, b2, eps, 0}, /*slice=*/1000);
  }
  EXPECT_EQ(whole.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(opt.exp_avg(0).scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(whole.detach(), sliced)) << "slices change the arithmetic";
  EXPECT_TRUE(torch::equal(opt.exp_avg_sq(0), sv));
  // The moments: float32 against double, six steps of a few roundings each.
  EXPECT_LT(max_rel(opt.exp_avg(0), m), 1e-6);
  EXPECT_LT(max_rel(opt.exp_avg_sq(0), v), 1e-6);
  // The weights: the same bf16 value as the formula's, or the neighbour
  // where the float32 and double updates straddle a rounding boundary
  // (bf16 keeps 8 significant bits: neighbours lie ≤ 2^-7 × |w| apart).
  const auto diff = (whole.detach().to(torch::kFloat64) - p).abs();
  EXPECT_TRUE((diff <= p.abs() * std::ldexp(1.0, -7) + 1e-30).all().item<bool>())
      << "max difference " << diff.max().item<double>();
  const double moved = (p - init.to(torch::kFloat64)).abs().mean().item<double>();
  EXPECT_GT(moved, 0.5 * lr) << "the reference must move the weights for the comparison to mean anything";
  // bf16 moments lose the second moment's low bits: far outside the float32 bound.
  const auto& s = static_cast<torch::optim::AdamParamState&>(*torch_adam.state().begin()->second);
  EXPECT_EQ(s.exp_avg_sq().scalar_type(), torch::kBFloat16);
  EXPECT_GT(max_rel(s.exp_avg_sq(), v), 1e-4);
}

}  // namespace
}  // namespace memfl::torch_internal
