// Adam with its moments in float32 whatever the parameters' dtype
// (train_configs.optimizer_state_dtype: float32). torch.optim keeps the
// moments in the parameters' dtype; with bf16 weights the second moment
// then holds g² to 8 bits of mantissa, and updates smaller than a bf16
// step of the moment vanish. Mixed-precision trainers keep them in float32
// instead, at 8 bytes a parameter rather than 4.
//
// The update is torch::optim::Adam's (L2 weight decay added to the
// gradient, bias-corrected moments, eps outside the square root), computed
// in float32 and rounded once into the parameter. Large parameters go in
// slices, so the float32 temporaries are bounded by the slice, not by the
// largest tensor (a 128k-entry embedding is 2 GB in float32).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

namespace memfl::torch_internal {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
};

// Elements a slice of the update covers: 64 MiB of float32 temporaries each.
inline constexpr int64_t kAdamSliceElements = int64_t{1} << 24;

// One step (`step` counts from 1) of `param` with `grad`; `exp_avg` and
// `exp_avg_sq` are float32 tensors of param's shape, updated in place.
inline void adam_step_float32_state(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                                    const torch::Tensor& exp_avg_sq, int64_t step, const AdamHyper& h,
                                    int64_t slice = kAdamSliceElements) {
  torch::NoGradGuard no_grad;
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const bool same = param.scalar_type() == torch::kFloat32;
  // Slices are views of contiguous storage; a strided parameter goes whole.
  const bool sliced = param.is_contiguous() && grad.is_contiguous();
  const int64_t n = param.numel();
  const int64_t len = sliced ? std::max<int64_t>(1, slice) : std::max<int64_t>(1, n);
  const auto p_all = sliced ? param.view(-1) : param;
  const auto g_all = sliced ? grad.view(-1) : grad;
  const auto m_all = sliced ? exp_avg.view(-1) : exp_avg;
  const auto v_all = sliced ? exp_avg_sq.view(-1) : exp_avg_sq;
  for (int64_t off = 0; off < n; off += len) {
    const int64_t k = std::min(len, n - off);
    auto p = sliced ? p_all.narrow(0, off, k) : p_all;
    auto m = sliced ? m_all.narrow(0, off, k) : m_all;
    auto v = sliced ? v_all.narrow(0, off, k) : v_all;
    auto g = (sliced ? g_all.narrow(0, off, k) : g_all).to(torch::kFloat32);
    // A float32 parameter is updated in place; another dtype through a
    // float32 copy, rounded once at the end.
    auto p32 = same ? p : p.to(torch::kFloat32);
    if (h.weight_decay != 0) g = g.add(p32, h.weight_decay);
    m.mul_(h.beta1).add_(g, 1.0 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
    auto denom = v.sqrt().div_(std::sqrt(bc2)).add_(h.eps);
    p32.addcdiv_(m, denom, -h.lr / bc1);
    if (!same) p.copy_(p32);
  }
}

// The same as a torch::optim::Optimizer, for the trainer's host path and
// DP-SGD (which step through torch::optim): moments made at a parameter's
// first gradient, as torch's.
class Float32StateAdam final : public torch::optim::Optimizer {
 public:
  Float32StateAdam(std::vector<torch::Tensor> params, const AdamHyper& h)
      : torch::optim::Optimizer(std::move(params), std::make_unique<torch::optim::AdamOptions>(h.lr)), h_(h) {
    const auto& ps = param_groups().front().params();
    exp_avg_.resize(ps.size());
    exp_avg_sq_.resize(ps.size());
    steps_.assign(ps.size(), 0);
  }
  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::Tensor loss;
    if (closure) {
      torch::AutoGradMode enable(true);
      loss = closure();
    }
    const auto& ps = param_groups().front().params();
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto& g = ps[i].grad();
      if (!g.defined()) continue;
      if (!exp_avg_[i].defined()) {
        const auto opts = ps[i].options().dtype(torch::kFloat32);
        exp_avg_[i] = torch::zeros(ps[i].sizes(), opts);
        exp_avg_sq_[i] = torch::zeros(ps[i].sizes(), opts);
      }
      adam_step_float32_state(ps[i], g, exp_avg_[i], exp_avg_sq_[i], ++steps_[i], h_);
    }
    return loss;
  }
  int64_t state_bytes() const {
    int64_t b = 0;
    for (size_t i = 0; i < exp_avg_.size(); ++i) {
      if (exp_avg_[i].defined()) b += static_cast<int64_t>(exp_avg_[i].nbytes() + exp_avg_sq_[i].nbytes());
    }
    return b;
  }
  const torch::Tensor& exp_avg(size_t i) const { return exp_avg_[i]; }
  const torch::Tensor& exp_avg_sq(size_t i) const { return exp_avg_sq_[i]; }

 private:
  AdamHyper h_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_;
  std::vector<int64_t> steps_;
};

}  // namespace memfl::torch_internal
