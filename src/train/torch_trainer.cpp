// VanillaTrainer on libtorch: the plugin's TrainerBackend and ModelReplica.
#include <algorithm>
#include <map>
#include <thread>
#include <optional>
#include <numeric>
#include <random>
#include <chrono>

#include "memory/ledger.h"

// The CUDA caching allocator's statistics exist only in CUDA builds of
// libtorch (the GPU machine's); Debian's is CPU-only.
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define MEMFL_HAVE_CUDA_STATS 1
#endif
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "data/experiment_data.h"
#include "io/process.h"
#include "model/llama.h"
#include "model/lora.h"
#include "tensor/safetensors.h"
#include "train/adam_float32_state.h"
#include "train/dp_bench.h"
#include "train/llama_module.h"
#include "train/dp_sgd.h"
#include "train/sharded_dp.h"
#include "train/torch_models.h"

namespace memfl::torch_internal {

namespace {

// Fills `x` (B×C×H×W float) and `y` (B int64) from uint8 samples, normalised
// with the data set's mean and std; batches are built on the fly so the data
// set stays uint8 once per process.
void fill_batch(const ImageDataset& data, std::span<const uint32_t> idx, torch::Tensor& x, torch::Tensor& y) {
  const size_t sb = data.sample_bytes();
  const int64_t b = static_cast<int64_t>(idx.size());
  x = torch::empty({b, data.channels, data.height, data.width}, torch::kFloat32);
  y = torch::empty({b}, torch::kInt64);
  float* xp = x.data_ptr<float>();
  int64_t* yp = y.data_ptr<int64_t>();
  const float scale = 1.0f / (255.0f * data.std);
  const float shift = data.mean / data.std;
  for (int64_t i = 0; i < b; ++i) {
    const uint8_t* s = data.sample(idx[static_cast<size_t>(i)]);
    float* dst = xp + static_cast<size_t>(i) * sb;
    for (size_t j = 0; j < sb; ++j) dst[j] = static_cast<float>(s[j]) * scale - shift;
    yp[i] = data.labels[idx[static_cast<size_t>(i)]];
  }
}

// Language-model batches: each sample is seq_length + 1 token ids (the data
// set's int32 `tokens`, or its uint8 "pixels" for byte tokens; dataset.h);
// the input is the first seq_length, the target the last seq_length
// (next-token prediction). A target the data set's loss_mask leaves out
// (padding, a prompt) is -100, torch's ignore_index, which every loss here
// skips.
constexpr int64_t kIgnoredTarget = -100;
void fill_token_batch(const ImageDataset& data, std::span<const uint32_t> idx, torch::Tensor& x, torch::Tensor& y) {
  const int64_t b = static_cast<int64_t>(idx.size());
  const int64_t len = data.width;
  const bool ids = !data.tokens.empty();
  const bool masked = !data.loss_mask.empty();
  auto all = torch::empty({b, len}, torch::kInt64);
  int64_t* p = all.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const size_t at = static_cast<size_t>(idx[static_cast<size_t>(i)]) * static_cast<size_t>(len);
    for (int64_t j = 0; j < len; ++j) {
      p[i * len + j] = ids ? data.tokens[at + static_cast<size_t>(j)] : data.pixels[at + static_cast<size_t>(j)];
    }
  }
  x = all.narrow(1, 0, len - 1).contiguous();
  y = all.narrow(1, 1, len - 1).contiguous();
  if (masked) {
    int64_t* t = y.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i) {
      const uint8_t* m = data.loss_mask.data() + static_cast<size_t>(idx[static_cast<size_t>(i)]) * len;
      for (int64_t j = 1; j < len; ++j) {
        if (m[j] == 0) t[i * (len - 1) + j - 1] = kIgnoredTarget;
      }
    }
  }
}

// The targets that count in a batch (a classifier's: all of them).
torch::Tensor counted_targets(const torch::Tensor& y) { return y.ge(0).sum(); }

// Loss and correct predictions of a batch, for classifiers and language models alike.
torch::Tensor batch_loss(const torch::Tensor& logits, const torch::Tensor& y, bool sum = false) {
  auto opts = torch::nn::functional::CrossEntropyFuncOptions();
  if (sum) opts = opts.reduction(torch::kSum);
  if (logits.dim() == 3) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32),
                                                y.reshape({-1}), opts);
  }
  return torch::nn::functional::cross_entropy(logits, y, opts);
}
int64_t batch_correct(const torch::Tensor& logits, const torch::Tensor& y) {
  return logits.argmax(-1).eq(y).sum().item<int64_t>();
}

// DP-SGD's Poisson rate q = batch / n and its steps: num_local_steps, or
// epochs × ceil(n / batch) (the expected number of batches an epoch has).
std::pair<double, int64_t> dp_schedule(const TrainConfig& cfg, int64_t n) {
  const int64_t bs = cfg.train_batch_size;
  const double q = n > 0 ? std::min(1.0, static_cast<double>(bs) / static_cast<double>(n)) : 1.0;
  const int64_t steps =
      cfg.mode == "step" ? cfg.num_local_steps : static_cast<int64_t>(cfg.num_local_epochs) * ((n + bs - 1) / bs);
  return {q, steps};
}

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// Adam on CUDA through libtorch 2.x's fused kernel (as
// torch.optim.Adam(fused=True)): the same update as torch::optim::Adam (L2
// weight decay added to the gradient), moments in the parameters' dtype as
// torch's, or in float32 (optimizer_state_dtype). Where libtorch has post-accumulate-grad hooks (2.1+), each
// parameter is stepped as soon as its gradient is complete and the gradient
// is dropped there (the optimizer step in the backward): no moment exists
// with every gradient of the model at once, which saves a model's worth of
// GPU memory. Elsewhere the trainer uses torch::optim.
#if defined(MEMFL_HAVE_CUDA_STATS) && defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
#define MEMFL_HAVE_FUSED_ADAM 1
#if (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 1) && !defined(MEMFL_NO_STEP_IN_BACKWARD)
#define MEMFL_HAVE_STEP_IN_BACKWARD 1
#endif
class FusedAdam {
 public:
  FusedAdam(std::vector<torch::Tensor> params, const OptimConfig& o, bool in_backward) : o_(o) {
    torch::NoGradGuard g;
    const bool float32_state = o.state_dtype == "float32";
    for (auto& p : params) {
      params_.push_back(p);
      // float32 moments for a parameter of another dtype: the fused kernel
      // takes one dtype for all four lists, so these step through
      // adam_step_float32_state (train/adam_float32_state.h) instead.
      const bool own = float32_state && p.scalar_type() != torch::kFloat32;
      own_step_.push_back(own);
      const auto state = own ? p.options().dtype(torch::kFloat32) : p.options();
      exp_avg_.push_back(torch::zeros(p.sizes(), state));
      exp_avg_sq_.push_back(torch::zeros(p.sizes(), state));
      steps_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat32)));
    }
    host_steps_.assign(params_.size(), 0);
#ifdef MEMFL_HAVE_STEP_IN_BACKWARD
    if (in_backward) {
      for (size_t i = 0; i < params_.size(); ++i) {
        torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::make_unique<StepHook>(this, i));
      }
      in_backward_ = true;
    }
#else
    (void)in_backward;
#endif
  }
  ~FusedAdam() {
#ifdef MEMFL_HAVE_STEP_IN_BACKWARD
    if (in_backward_) {
      for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    }
#endif
  }
  FusedAdam(const FusedAdam&) = delete;
  FusedAdam& operator=(const FusedAdam&) = delete;
  // Whether step() is done by the backward itself.
  bool in_backward() const { return in_backward_; }
  // Before a backward that steps: every step count + 1 in one launch (the
  // hooks then launch only the update, one per parameter).
  void begin_backward() {
    if (!in_backward_) return;
    torch::NoGradGuard g;
    at::_foreach_add_(steps_, 1);
    for (auto& n : host_steps_) ++n;
  }
  void step() {
    if (in_backward_) return;
    torch::NoGradGuard g;
    std::map<torch::ScalarType, std::vector<size_t>> by_dtype;  // one launch per dtype
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].grad().defined()) by_dtype[params_[i].scalar_type()].push_back(i);
    }
    for (const auto& [dtype, idx] : by_dtype) update(idx);
  }
  int64_t state_bytes() const {
    int64_t b = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      b += static_cast<int64_t>(exp_avg_[i].nbytes() + exp_avg_sq_[i].nbytes());
    }
    return b;
  }

 private:
  void update(const std::vector<size_t>& idx) {
    std::vector<torch::Tensor> ps, gs, ms, vs, ss;
    for (size_t i : idx) {
      if (!in_backward_) ++host_steps_[i];  // in the backward: begin_backward() did
      if (own_step_[i]) {
        adam_step_float32_state(params_[i], params_[i].grad(), exp_avg_[i], exp_avg_sq_[i], host_steps_[i],
                                {o_.lr, o_.beta1, o_.beta2, o_.eps, o_.weight_decay});
        continue;
      }
      ps.push_back(params_[i]);
      gs.push_back(params_[i].grad());
      ms.push_back(exp_avg_[i]);
      vs.push_back(exp_avg_sq_[i]);
      ss.push_back(steps_[i]);
    }
    if (ps.empty()) return;
    if (!in_backward_) at::_foreach_add_(ss, 1);  // in the backward: begin_backward() did
    at::_fused_adam_(ps, gs, ms, vs, {}, ss, o_.lr, o_.beta1, o_.beta2, o_.weight_decay, o_.eps,
                     /*amsgrad=*/false, /*maximize=*/false, {}, {});
  }
#ifdef MEMFL_HAVE_STEP_IN_BACKWARD
  struct StepHook final : torch::autograd::PostAccumulateGradHook {
    StepHook(FusedAdam* o, size_t i) : opt(o), index(i) {}
    void operator()(const torch::autograd::Variable& /*param*/) override {
      torch::NoGradGuard g;
      opt->update({index});
      opt->params_[index].mutable_grad() = torch::Tensor();
    }
    FusedAdam* opt;
    size_t index;
  };
#endif
  OptimConfig o_;
  std::vector<torch::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  std::vector<bool> own_step_;       // float32 moments of a parameter of another dtype
  std::vector<int64_t> host_steps_;  // their step counts, without reading the device's
  bool in_backward_ = false;
};
#endif

class TorchReplica final : public ModelReplica {
 public:
  TorchReplica(std::shared_ptr<Net> net, BoundModel bound, torch::Device device)
      : net_(std::move(net)), bound_(std::move(bound)), device_(device) {
    if (device_.is_cuda()) net_->to(device_);  // the arena stays the host copy
#ifdef MEMFL_HAVE_CUDA_COPY
    // The model crosses the link twice a turn: page-locked, it goes at the
    // link's speed instead of through staging buffers.
    if (device_.is_cuda()) pinned_ = std::make_unique<PinnedArena>(bound_.arena);
#endif
#ifdef MEMFL_HAVE_CUDA_STATS
    // Each replica (a simulator worker) gets its own stream, so K workers'
    // kernels can overlap instead of queueing on the default stream.
    if (device_.is_cuda())
      stream_.emplace(c10::cuda::getStreamFromPool(false, device_.has_index() ? device_.index() : 0));
#endif
  }
  const Layout& layout() const override { return bound_.layout; }
  Arena& arena() override { return bound_.arena; }

  StatusOr<TrainResult> train(const ImageDataset& data, std::span<const uint32_t> train_idx,
                              std::span<const uint32_t> val_idx, const TrainConfig& cfg, uint64_t seed) override {
    try {
#ifdef MEMFL_HAVE_CUDA_STATS
      std::optional<c10::cuda::CUDAStreamGuard> on_stream;
      if (stream_) on_stream.emplace(*stream_);
#endif
      return train_impl(data, train_idx, val_idx, cfg, seed);
    } catch (const std::exception& e) {
      return internal_error("training failed in libtorch: {}", e.what());
    }
  }

  StatusOr<EvalResult> evaluate(const ImageDataset& data, std::span<const uint32_t> idx, int batch_size) override {
    try {
#ifdef MEMFL_HAVE_CUDA_STATS
      std::optional<c10::cuda::CUDAStreamGuard> on_stream;
      if (stream_) on_stream.emplace(*stream_);
#endif
      sync_to_device();
      return evaluate_impl(data, idx, batch_size);
    } catch (const std::exception& e) {
      return internal_error("evaluation failed in libtorch: {}", e.what());
    }
  }

 private:
  // On CUDA the module's tensors live on the GPU and the arena is their host
  // copy: copy in before use, out after training. On CPU both are no-ops,
  // since the module's tensors are views of the arena.
  // The tensors of the layout, in its order (under LoRA: the adapters).
  std::vector<torch::Tensor> all_tensors() {
    std::vector<torch::Tensor> ts;
    for (auto& [name, t] : net_->named_tensors()) ts.push_back(t);
    return ts;
  }
  // What the optimizer steps: every parameter, or LoRA's adapters over a
  // frozen base (no gradient and no optimizer state for the base).
  std::vector<torch::Tensor> trainable_parameters() {
    std::vector<torch::Tensor> ps;
    for (auto& p : net_->parameters()) {
      if (p.requires_grad()) ps.push_back(p);
    }
    return ps;
  }
  static bool all_contiguous(const std::vector<torch::Tensor>& ts) {
    return std::all_of(ts.begin(), ts.end(), [](const torch::Tensor& t) { return t.is_cuda() && t.is_contiguous(); });
  }
  torch::Tensor host_view(size_t i, const torch::Tensor& like) {
    const auto& e = bound_.layout.entries()[i];
    return torch::from_blob(bound_.arena.data() + e.offset, like.sizes(),
                            torch::TensorOptions().dtype(like.scalar_type()));
  }
  void sync_to_device() {
    if (!device_.is_cuda()) return;
    torch::NoGradGuard g;
    auto ts = all_tensors();
#ifdef MEMFL_HAVE_CUDA_COPY
    if (all_contiguous(ts))
      return copy_cuda_arena(ts, bound_.layout, bound_.arena, /*to_device=*/true, pinned_ && pinned_->ready());
#endif
    for (size_t i = 0; i < ts.size(); ++i) ts[i].copy_(host_view(i, ts[i]));
  }
  void sync_to_host() {
    if (!device_.is_cuda()) return;
    torch::NoGradGuard g;
    auto ts = all_tensors();
#ifdef MEMFL_HAVE_CUDA_COPY
    if (all_contiguous(ts))
      return copy_cuda_arena(ts, bound_.layout, bound_.arena, /*to_device=*/false, pinned_ && pinned_->ready());
#endif
    for (size_t i = 0; i < ts.size(); ++i) host_view(i, ts[i]).copy_(ts[i]);
  }

  TrainResult train_impl(const ImageDataset& data, std::span<const uint32_t> train_idx,
                         std::span<const uint32_t> val_idx, const TrainConfig& cfg, uint64_t seed) {
    sync_to_device();
    torch::manual_seed(seed);
    net_->train();
    std::unique_ptr<torch::optim::Optimizer> opt;
    const auto& o = cfg.optim;
    if (o.optim == "Adam" && o.state_dtype == "float32" && !all_float32(trainable_parameters())) {
      opt = std::make_unique<Float32StateAdam>(trainable_parameters(),
                                               AdamHyper{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay});
    } else if (o.optim == "Adam") {
      opt = std::make_unique<torch::optim::Adam>(
          trainable_parameters(),
          torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
    } else {
      opt = std::make_unique<torch::optim::SGD>(
          trainable_parameters(),
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay).nesterov(o.nesterov));
    }
    if (cfg.dp.enabled) return train_dp(data, train_idx, val_idx, cfg, seed, *opt);
    net_->set_gradient_checkpointing(cfg.gradient_checkpointing);
#ifdef MEMFL_HAVE_FUSED_ADAM
    std::unique_ptr<FusedAdam> fused;
    if (device_.is_cuda() && o.optim == "Adam") {
      opt.reset();  // no state was made yet: torch::optim allocates it at the first step
      // FedProx adds its term to the whole gradient after the backward.
      fused = std::make_unique<FusedAdam>(trainable_parameters(), o, /*in_backward=*/cfg.mu == 0);
    }
#endif
    // FedProx: the received global model's parameters, the anchor of the
    // proximal term. A copy is needed (the arena is trained in place): one
    // model's parameters more on the client, buffers excluded.
    std::vector<torch::Tensor> params, anchor;
    if (cfg.mu > 0) {
      torch::NoGradGuard g;
      params = trainable_parameters();
      for (const auto& p : params) anchor.push_back(p.detach().clone());
    }
    std::vector<uint32_t> order(train_idx.begin(), train_idx.end());
    std::mt19937_64 rng(seed);
    const size_t bs = static_cast<size_t>(cfg.train_batch_size);
    const int64_t max_steps = cfg.mode == "step" ? cfg.num_local_steps : INT64_MAX;
    const int epochs = cfg.mode == "step" ? INT32_MAX : cfg.num_local_epochs;
    TrainResult r;
    // Summed on the device and read once at the end: a read per step would
    // wait for the GPU every step.
    torch::Tensor loss_sum, correct;
    torch::Tensor x, y;
    const bool lm = net_->is_language_model();
    const auto loop_start = std::chrono::steady_clock::now();
#ifdef MEMFL_HAVE_FUSED_ADAM
    const FusedAdam* fused_ptr = fused.get();
#else
    const void* fused_ptr = nullptr;
#endif
    for (int ep = 0; ep < epochs && r.num_steps < max_steps; ++ep) {
      if (cfg.train_data_shuffle) std::shuffle(order.begin(), order.end(), rng);
      for (size_t b = 0; b < order.size() && r.num_steps < max_steps; b += bs) {
        const size_t n = std::min(bs, order.size() - b);
        if (lm) {
          fill_token_batch(data, std::span<const uint32_t>(order).subspan(b, n), x, y);
        } else {
          fill_batch(data, std::span<const uint32_t>(order).subspan(b, n), x, y);
        }
        x = x.to(device_, /*non_blocking=*/true);
        y = y.to(device_, /*non_blocking=*/true);
        if (!device_.is_cuda()) opt->zero_grad();
        auto [loss, right] = net_->loss_and_correct(x, y);
#ifdef MEMFL_HAVE_FUSED_ADAM
        if (fused) fused->begin_backward();
#endif
        loss.backward();
        if (cfg.mu > 0) {
          // ∇ μ/2·‖w − w_g‖² = μ·(w − w_g), added to each gradient.
          torch::NoGradGuard g;
          for (size_t i = 0; i < params.size(); ++i) {
            if (params[i].grad().defined()) params[i].grad().add_(params[i].detach() - anchor[i], cfg.mu);
          }
        }
#ifdef MEMFL_HAVE_FUSED_ADAM
        if (fused) {
          fused->step();
        } else {
          opt->step();
        }
#else
        opt->step();
#endif
        if (r.num_steps == 0) {
          // Gradients and the optimizer's moments exist from the first step
          // to the end of the turn: the ledger holds them for all of it, so
          // an RSS peak inside training sees them (not only after the last step).
          int64_t grads = 0;
          for (auto& p : trainable_parameters()) grads += tensor_bytes(p.grad());
#ifdef MEMFL_HAVE_FUSED_ADAM
          // Stepped in the backward: a parameter's gradient lives only until its step.
          if (fused && fused->in_backward()) grads = largest_param_bytes();
#endif
          Ledger::instance().set(MemoryCategory::kGradients, grads);
          Ledger::instance().set(MemoryCategory::kOptimizer, state_bytes(opt.get(), fused_ptr, o.optim));
        }
        // On the GPU the gradients go to None before the next backward
        // (torch's set_to_none): the backward writes them instead of adding
        // to zeros, and the caching allocator hands back the same blocks.
        if (device_.is_cuda()) {
          for (auto& p : trainable_parameters()) p.mutable_grad() = torch::Tensor();
        }
        {
          torch::NoGradGuard g;
          auto weighted = loss.detach() * static_cast<double>(n);
          // Accuracy per predicted element (per counted token for a language model).
          auto acc =
              right.to(torch::kFloat64) * static_cast<double>(n) / counted_targets(y).clamp_min(1).to(torch::kFloat64);
          loss_sum = loss_sum.defined() ? loss_sum + weighted : weighted;
          correct = correct.defined() ? correct + acc : acc;
        }
        r.num_samples += static_cast<int64_t>(n);
        r.num_steps++;
      }
    }
    if (r.num_samples > 0) {
      r.train_loss = loss_sum.item<double>() / static_cast<double>(r.num_samples);
      r.train_accuracy = correct.item<double>() / static_cast<double>(r.num_samples);
    }
    r.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count();
    // What training cost on top of the model, for the ledger and reports:
    // a gradient per parameter and the optimizer's state.
    if (r.num_steps > 0) {
      for (auto& p : trainable_parameters()) r.gradient_bytes += tensor_bytes(p);
#ifdef MEMFL_HAVE_FUSED_ADAM
      if (fused && fused->in_backward()) r.gradient_bytes = largest_param_bytes();
#endif
    }
    r.optimizer_bytes = state_bytes(opt.get(), fused_ptr, o.optim);
    auto& ledger = Ledger::instance();
    ledger.set(MemoryCategory::kGradients, r.gradient_bytes);
    ledger.set(MemoryCategory::kOptimizer, r.optimizer_bytes);
    // Nothing of this client survives its turn: drop gradients and the optimizer.
    for (auto& p : trainable_parameters()) p.mutable_grad() = torch::Tensor();
    opt.reset();
#ifdef MEMFL_HAVE_FUSED_ADAM
    fused.reset();
#endif
    ledger.set(MemoryCategory::kGradients, 0);
    ledger.set(MemoryCategory::kOptimizer, 0);
    return finish_turn(std::move(r), data, val_idx, cfg);
  }

  // DP-SGD (train_configs.dp): Poisson batches of rate q = batch / n, the
  // summed loss, per-sample clipping and noise by DpSgd, then the optimizer.
  // Steps: num_local_steps, or epochs × ceil(n / batch) — the expected number
  // of batches an epoch would have. The accountant composes (σ, q, steps).
  TrainResult train_dp(const ImageDataset& data, std::span<const uint32_t> train_idx, std::span<const uint32_t> val_idx,
                       const TrainConfig& cfg, uint64_t seed, torch::optim::Optimizer& opt) {
    if (net_->is_torchscript()) return train_dp_per_sample(data, train_idx, val_idx, cfg, seed, opt);
    dp::DpOptions o;
    o.mode = dp::parse_clip_mode(cfg.dp.clipping).value_or(dp::ClipMode::kFused);
    o.max_grad_norm = cfg.dp.max_grad_norm;
    o.noise_multiplier = cfg.dp.noise_multiplier;
    auto created = dp::DpSgd::create(net_, o);
    if (!created.ok()) throw std::runtime_error(created.status().message());
    std::unique_ptr<dp::DpSgd> dpsgd = std::move(*created);
    const auto [q, steps] = dp_schedule(cfg, static_cast<int64_t>(train_idx.size()));
    std::vector<uint32_t> pool(train_idx.begin(), train_idx.end());
    dp::PoissonSampler sampler(pool, q, seed);
    std::vector<uint32_t> batch;
    TrainResult r;
    double loss_sum = 0, correct = 0;
    torch::Tensor x, y;
    const bool lm = net_->is_language_model();
    net_->set_gradient_checkpointing(cfg.gradient_checkpointing);
    for (int64_t k = 0; k < steps; ++k) {
      sampler.next(batch);
      // DpSgd::step writes every gradient afresh: dropping the last ones is
      // all zeroing them would achieve, without touching their memory.
      for (auto& p : trainable_parameters()) p.mutable_grad() = torch::Tensor();
      if (!batch.empty() && lm) {
        fill_token_batch(data, batch, x, y);
        x = x.to(device_);
        y = y.to(device_);
        // A sequence's loss is its counted tokens' summed cross-entropy ÷ T:
        // each sample's term depends on its own sequence alone, so clipping
        // it bounds that sample's influence, and a full sequence's term is
        // its mean token loss. The chunked loss is the mean over the batch's
        // counted tokens, hence × counted ÷ T.
        auto [mean, right] = net_->loss_and_correct(x, y);
        const double counted = static_cast<double>(counted_targets(y).item<int64_t>());
        (mean * (counted / static_cast<double>(y.size(1)))).backward();
        const double n = static_cast<double>(batch.size());
        loss_sum += mean.item<double>() * n;  // train_loss: the mean token loss, as without DP
        correct += right.item<double>() * n / std::max(1.0, counted);
        r.num_samples += static_cast<int64_t>(batch.size());
      } else if (!batch.empty()) {
        fill_batch(data, batch, x, y);
        x = x.to(device_);
        y = y.to(device_);
        auto logits = net_->forward(x);
        auto loss = batch_loss(logits, y, /*sum=*/true);
        loss.backward();
        loss_sum += loss.item<double>();
        correct += static_cast<double>(batch_correct(logits, y));
        r.num_samples += static_cast<int64_t>(batch.size());
      }
      auto st = dpsgd->step(sampler.expected_batch_size());
      if (!st.ok()) throw std::runtime_error(st.status().message());
      opt.step();
      r.num_steps++;
    }
    dpsgd.reset();  // the layers run as plain layers again (evaluation)
    return finish_dp_turn(std::move(r), loss_sum, correct, q, data, val_idx, cfg);
  }

  // DP-SGD on a model without DP layers (a user's TorchScript module): the
  // naive route, one forward and backward per sample, each sample's gradient
  // clipped to C and added up; then noise N(0, σ²C²) per coordinate and the
  // division by the expected batch, as DpSgd does. Poisson batches and the
  // accountant's (σ, q, steps) are the same. A module with BatchNorm is
  // refused: its statistics mix samples, so no per-sample bound holds.
  TrainResult train_dp_per_sample(const ImageDataset& data, std::span<const uint32_t> train_idx,
                                  std::span<const uint32_t> val_idx, const TrainConfig& cfg, uint64_t seed,
                                  torch::optim::Optimizer& opt) {
    for (const auto& [name, t] : net_->named_tensors()) {
      if (name.find("running_mean") != std::string::npos) {
        throw std::runtime_error(fmt::format(
            "client_configs.train_configs.dp: the TorchScript model has BatchNorm ('{}'), whose batch statistics "
            "mix samples: DP-SGD cannot bound one sample's influence (use GroupNorm)",
            name));
      }
    }
    std::vector<torch::Tensor> params;
    for (auto& p : trainable_parameters()) {
      if (p.requires_grad()) params.push_back(p);
    }
    const auto [q, steps] = dp_schedule(cfg, static_cast<int64_t>(train_idx.size()));
    std::vector<uint32_t> pool(train_idx.begin(), train_idx.end());
    dp::PoissonSampler sampler(pool, q, seed);
    std::vector<uint32_t> batch;
    TrainResult r;
    double loss_sum = 0, correct = 0;
    torch::Tensor x, y;
    const double c_max = cfg.dp.max_grad_norm, noise_std = cfg.dp.noise_multiplier * cfg.dp.max_grad_norm;
    for (int64_t k = 0; k < steps; ++k) {
      sampler.next(batch);
      std::vector<torch::Tensor> sum;
      for (auto& p : params) sum.push_back(torch::zeros_like(p));
      if (!batch.empty()) {
        fill_batch(data, batch, x, y);
        x = x.to(device_);
        y = y.to(device_);
        for (int64_t i = 0; i < x.size(0); ++i) {
          for (auto& p : params) p.mutable_grad() = torch::Tensor();
          auto logits = net_->forward(x.narrow(0, i, 1));
          auto loss = batch_loss(logits, y.narrow(0, i, 1), /*sum=*/true);
          loss.backward();
          loss_sum += loss.item<double>();
          correct += static_cast<double>(batch_correct(logits, y.narrow(0, i, 1)));
          torch::NoGradGuard g;
          torch::Tensor sq = torch::zeros({}, torch::kFloat64);
          for (auto& p : params) {
            if (p.grad().defined()) sq += p.grad().to(torch::kFloat64).pow(2).sum().cpu();
          }
          const double clip = std::min(1.0, c_max / (std::sqrt(sq.item<double>()) + 1e-6));
          for (size_t j = 0; j < params.size(); ++j) {
            if (params[j].grad().defined()) sum[j].add_(params[j].grad(), clip);
          }
        }
        r.num_samples += static_cast<int64_t>(batch.size());
      }
      {
        torch::NoGradGuard g;
        for (size_t j = 0; j < params.size(); ++j) {
          if (noise_std > 0) sum[j].add_(torch::randn_like(sum[j]), noise_std);
          sum[j].div_(sampler.expected_batch_size());
          params[j].mutable_grad() = sum[j];
        }
      }
      opt.step();
      r.num_steps++;
    }
    return finish_dp_turn(std::move(r), loss_sum, correct, q, data, val_idx, cfg);
  }

  // The end of a DP turn, either route: the means, the accountant's (q,
  // steps), no gradient left behind, then finish_turn.
  TrainResult finish_dp_turn(TrainResult r, double loss_sum, double correct, double q, const ImageDataset& data,
                             std::span<const uint32_t> val_idx, const TrainConfig& cfg) {
    if (r.num_samples > 0) {
      r.train_loss = loss_sum / static_cast<double>(r.num_samples);
      r.train_accuracy = correct / static_cast<double>(r.num_samples);
    }
    r.dp_steps = r.num_steps;
    r.dp_sample_rate = q;
    for (auto& p : trainable_parameters()) p.mutable_grad() = torch::Tensor();
    return finish_turn(std::move(r), data, val_idx, cfg);
  }

  // The end of a client's turn, with or without DP: the weights go back to
  // the host arena and the validation split is scored.
  TrainResult finish_turn(TrainResult r, const ImageDataset& data, std::span<const uint32_t> val_idx,
                          const TrainConfig& cfg) {
    sync_to_host();
    if (cfg.do_validation && !val_idx.empty()) {
      EvalResult v = evaluate_impl(data, val_idx, cfg.val_batch_size);
      r.val_loss = v.loss;
      r.val_accuracy = v.accuracy;
      r.val_samples = v.num_samples;
      r.has_validation = true;
    }
    return r;
  }

#ifdef MEMFL_HAVE_FUSED_ADAM
  static int64_t state_bytes(torch::optim::Optimizer* opt, const FusedAdam* fused, const std::string& kind) {
    return fused != nullptr ? fused->state_bytes() : optimizer_state_bytes(*opt, kind);
  }
#else
  static int64_t state_bytes(torch::optim::Optimizer* opt, const void*, const std::string& kind) {
    return optimizer_state_bytes(*opt, kind);
  }
#endif
  int64_t largest_param_bytes() {
    int64_t b = 0;
    for (auto& p : trainable_parameters()) b = std::max(b, tensor_bytes(p));
    return b;
  }
  static bool all_float32(const std::vector<torch::Tensor>& ps) {
    return std::all_of(ps.begin(), ps.end(), [](const torch::Tensor& p) { return p.scalar_type() == torch::kFloat32; });
  }
  static int64_t optimizer_state_bytes(torch::optim::Optimizer& opt, const std::string& kind) {
    if (const auto* own = dynamic_cast<const Float32StateAdam*>(&opt)) return own->state_bytes();
    int64_t bytes = 0;
    for (auto& kv : opt.state()) {
      if (kind == "Adam") {
        auto& s = static_cast<torch::optim::AdamParamState&>(*kv.second);
        bytes += tensor_bytes(s.exp_avg()) + tensor_bytes(s.exp_avg_sq()) + tensor_bytes(s.max_exp_avg_sq());
      } else {
        auto& s = static_cast<torch::optim::SGDParamState&>(*kv.second);
        bytes += tensor_bytes(s.momentum_buffer());
      }
    }
    return bytes;
  }

  EvalResult evaluate_impl(const ImageDataset& data, std::span<const uint32_t> idx, int batch_size) {
    torch::NoGradGuard no_grad;
    net_->eval();
    EvalResult r;
    double loss_sum = 0;
    int64_t correct = 0, predicted = 0;
    torch::Tensor x, y;
    const size_t bs = static_cast<size_t>(batch_size);
    for (size_t b = 0; b < idx.size(); b += bs) {
      const size_t n = std::min(bs, idx.size() - b);
      if (net_->is_language_model()) {
        fill_token_batch(data, idx.subspan(b, n), x, y);
      } else {
        fill_batch(data, idx.subspan(b, n), x, y);
      }
      x = x.to(device_);
      y = y.to(device_);
      // Summed over the targets that count (a language model's: the tokens
      // its loss mask keeps; -100 is skipped by the loss and never equals an
      // arg-max), and divided by them at the end: loss and accuracy per
      // counted token, per sample for a classifier.
      const int64_t counted = counted_targets(y).item<int64_t>();
      if (net_->is_language_model()) {
        // The loss a chunk of rows at a time, as in training: the full
        // [batch, seq, vocab] logits (and their f32 copy) never exist, so an
        // evaluation costs a chunk's logits at any vocabulary and batch.
        auto [mean, right] = net_->loss_and_correct(x, y);
        loss_sum += mean.item<double>() * static_cast<double>(counted);
        correct += right.item<int64_t>();
      } else {
        auto logits = net_->forward(x);
        loss_sum += batch_loss(logits, y, /*sum=*/true).item<double>();
        correct += batch_correct(logits, y);
      }
      r.num_samples += static_cast<int64_t>(n);
      predicted += counted;
    }
    if (predicted > 0) {
      r.loss = loss_sum / static_cast<double>(predicted);
      r.accuracy = static_cast<double>(correct) / static_cast<double>(predicted);
    }
    return r;
  }

  std::shared_ptr<Net> net_;
  BoundModel bound_;
  torch::Device device_;
#ifdef MEMFL_HAVE_CUDA_COPY
  std::unique_ptr<PinnedArena> pinned_;  // after bound_: unpinned before the arena goes
#endif
#ifdef MEMFL_HAVE_CUDA_STATS
  std::optional<c10::cuda::CUDAStream> stream_;
#endif
};

// ------------------------------------------------------ sharded client
//
// A client with train_configs.num_gpus = N: this process (rank 0) holds the
// FL arena (the model as the transports see it) and starts N − 1
// `memfl shard-rank` processes; all N hold one shard each of the CNN_GN cut
// into units (train/sharded_dp.h). A turn: rank 0 posts a command (seed,
// steps, sample indices) in the rendezvous store; every rank loads the arena
// into its shard (one unit broadcast at a time), then all take the same
// steps — each its slice of every batch; Poisson batches and shuffles come
// from the same seed on every rank, so no batch travels — and rank 0 writes
// the trained units back into the arena one at a time.

using json = nlohmann::json;

sharded::Options sharded_options(const ExperimentConfig& cfg, uint64_t seed) {
  sharded::Options o;
  o.mode = cfg.train.dp.enabled ? cfg.train.dp.clipping : "no_dp";
  o.max_grad_norm = cfg.train.dp.max_grad_norm;
  o.noise_multiplier = cfg.train.dp.noise_multiplier;
  o.noise_seed = seed;
  o.lr = cfg.train.optim.lr;
  return o;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimConfig& o, std::vector<torch::Tensor> params) {
  if (o.optim == "Adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay).nesterov(o.nesterov));
}

// This rank's contiguous slice of a batch.
std::span<const uint32_t> rank_slice(std::span<const uint32_t> batch, int rank, int world) {
  const size_t n = batch.size(), lo = n * static_cast<size_t>(rank) / static_cast<size_t>(world),
               hi = n * static_cast<size_t>(rank + 1) / static_cast<size_t>(world);
  return batch.subspan(lo, hi - lo);
}

struct ShardedCommand {
  std::string op;  // train | eval | exit
  uint64_t seed = 0;
  std::string mode;
  int64_t steps = 0, epochs = 0;
  std::vector<uint32_t> train_idx, val_idx;
  int batch_size = 0;
  int64_t dataset_size = 0;  // which split the indices refer to (train or test), by its size
  // train/eval: rank 0 holds the model in an arena (the simulator): load it
  // into the shards first, store it back after training.
  bool staged = false;
  // write/read: a chunk of the layout, as pieces of parameters.
  std::vector<sharded::ShardedModel::BytePiece> pieces;
  int64_t chunk_len = 0;
};

std::string to_text(const ShardedCommand& c) {
  json pieces = json::array();
  for (const auto& p : c.pieces) pieces.push_back(json::array({p.name, p.param_byte, p.chunk_byte, p.length}));
  return json{{"op", c.op},         {"seed", c.seed},        {"mode", c.mode},
              {"steps", c.steps},   {"epochs", c.epochs},    {"train", c.train_idx},
              {"val", c.val_idx},   {"batch", c.batch_size}, {"dataset_size", c.dataset_size},
              {"staged", c.staged}, {"pieces", pieces},      {"chunk_len", c.chunk_len}}
      .dump();
}
ShardedCommand from_text(const std::string& t) {
  const json j = json::parse(t);
  ShardedCommand c;
  c.op = j.at("op").get<std::string>();
  c.seed = j.at("seed").get<uint64_t>();
  c.mode = j.at("mode").get<std::string>();
  c.steps = j.at("steps").get<int64_t>();
  c.epochs = j.at("epochs").get<int64_t>();
  c.train_idx = j.at("train").get<std::vector<uint32_t>>();
  c.val_idx = j.at("val").get<std::vector<uint32_t>>();
  c.batch_size = j.at("batch").get<int>();
  c.dataset_size = j.at("dataset_size").get<int64_t>();
  c.staged = j.at("staged").get<bool>();
  for (const auto& p : j.at("pieces")) {
    c.pieces.push_back(
        {p.at(0).get<std::string>(), p.at(1).get<int64_t>(), p.at(2).get<int64_t>(), p.at(3).get<int64_t>()});
  }
  c.chunk_len = j.at("chunk_len").get<int64_t>();
  return c;
}

// One turn of training, run by every rank in lockstep. TrainResult's sums
// are over all ranks (rank 0 reports them).
TrainResult sharded_train(sharded::ShardedModel& model, sharded::ShardGroup& group, const ImageDataset& data,
                          const ShardedCommand& c, const TrainConfig& cfg, const torch::Device& dev) {
  model.reset_optimizer([&](std::vector<torch::Tensor> ps) { return make_optimizer(cfg.optim, std::move(ps)); });
  const int rank = group.rank(), world = group.world_size();
  TrainResult r;
  double loss_sum = 0, correct = 0;
  torch::Tensor x, y;
  auto run = [&](std::span<const uint32_t> batch, double divisor) {
    fill_batch(data, rank_slice(batch, rank, world), x, y);
    auto st = model.step(x.to(dev), y.to(dev), divisor);
    if (!st.ok()) throw std::runtime_error(st.status().message());
    loss_sum += st->loss;
    correct += static_cast<double>(st->correct);
    r.num_samples += static_cast<int64_t>(batch.size());
    r.num_steps++;
  };
  const auto n = static_cast<int64_t>(c.train_idx.size());
  const int64_t bs = c.batch_size;
  if (cfg.dp.enabled) {
    // cfg carries the command's mode, steps and batch on every rank.
    const auto [q, steps] = dp_schedule(cfg, n);
    dp::PoissonSampler sampler(c.train_idx, q, c.seed);
    std::vector<uint32_t> batch;
    for (int64_t k = 0; k < steps; ++k) {
      sampler.next(batch);
      run(batch, sampler.expected_batch_size());
    }
    r.dp_steps = r.num_steps;
    r.dp_sample_rate = q;
  } else {
    std::vector<uint32_t> order = c.train_idx;
    std::mt19937_64 rng(c.seed);
    const int64_t max_steps = c.mode == "step" ? c.steps : INT64_MAX;
    const int64_t epochs = c.mode == "step" ? INT64_MAX : c.epochs;
    for (int64_t ep = 0; ep < epochs && r.num_steps < max_steps && n > 0; ++ep) {
      if (cfg.train_data_shuffle) std::shuffle(order.begin(), order.end(), rng);
      for (int64_t b = 0; b < n && r.num_steps < max_steps; b += bs) {
        const auto len = static_cast<size_t>(std::min(bs, n - b));
        run(std::span<const uint32_t>(order).subspan(static_cast<size_t>(b), len), static_cast<double>(len));
      }
    }
  }
  torch::Tensor sums = torch::tensor({loss_sum, correct}, torch::kFloat64);
  if (dev.is_cuda()) sums = sums.to(dev);
  group.all_reduce_sum(sums);
  sums = sums.to(torch::kCPU);
  if (r.num_samples > 0) {
    r.train_loss = sums[0].item<double>() / static_cast<double>(r.num_samples);
    r.train_accuracy = sums[1].item<double>() / static_cast<double>(r.num_samples);
  }
  return r;
}

EvalResult sharded_eval(sharded::ShardedModel& model, sharded::ShardGroup& group, const ImageDataset& data,
                        std::span<const uint32_t> idx, int batch_size, const torch::Device& dev) {
  double loss = 0, correct = 0;
  torch::Tensor x, y;
  const size_t bs = static_cast<size_t>(std::max(1, batch_size));
  for (size_t b = 0; b < idx.size(); b += bs) {
    const auto batch = idx.subspan(b, std::min(bs, idx.size() - b));
    fill_batch(data, rank_slice(batch, group.rank(), group.world_size()), x, y);
    auto [l, k] = model.evaluate_sums(x.to(dev), y.to(dev));
    loss += l;
    correct += static_cast<double>(k);
  }
  torch::Tensor sums = torch::tensor({loss, correct}, torch::kFloat64);
  if (dev.is_cuda()) sums = sums.to(dev);
  group.all_reduce_sum(sums);
  sums = sums.to(torch::kCPU);
  EvalResult r;
  r.num_samples = static_cast<int64_t>(idx.size());
  if (r.num_samples > 0) {
    r.loss = sums[0].item<double>() / static_cast<double>(r.num_samples);
    r.accuracy = sums[1].item<double>() / static_cast<double>(r.num_samples);
  }
  return r;
}

StatusOr<std::unique_ptr<sharded::ShardedModel>> build_sharded_cnn(sharded::ShardGroup* group,
                                                                   const ExperimentConfig& cfg, const InputSpec& input,
                                                                   uint64_t seed, const torch::Device& dev) {
  torch::manual_seed(seed);  // values are overwritten from rank 0's arena before every turn
  return sharded::ShardedModel::create(
      group, sharded::kGroupNormCnnUnits,
      [&](int i) { return sharded::make_groupnorm_cnn_unit(input.channels, input.height, input.num_classes, i); },
      sharded_options(cfg, seed), dev);
}

torch::Device rank_device(const std::string& device, int local_rank) {
  return device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank))
                          : torch::Device(torch::kCPU);
}

// OpenBLAS's entry point `name`, or nullptr. libblas.so.3 came in with
// libtorch_cpu (Debian's OpenBLAS one depends on libopenblas.so.0, which
// dlsym searches too); RTLD_NOLOAD only finds what is loaded already, and the
// handle's reference is dropped at once since libtorch keeps it loaded.
void* openblas_symbol(const char* name) {
  void* blas = dlopen("libblas.so.3", RTLD_LAZY | RTLD_NOLOAD);
  if (blas == nullptr) return nullptr;
  void* sym = dlsym(blas, name);
  dlclose(blas);
  return sym;
}

// libtorch's intra-op threads, with each BLAS call single-threaded inside
// them. Debian's libtorch calls the system BLAS; OpenBLAS's pthread build
// starts a pool of its own, one thread per core, so with libtorch's pool
// (whose OpenMP threads spin between regions) or several simulator workers
// four threads contend for two cores. Measured on a 2-core VM
// (bench/blas_threads_ab.sh; docs/BENCHMARKS.md, "Training speed"): at 2
// intra-op threads the CNN trained 1.9–2.1× faster with one BLAS thread per
// call, and llama-tiny 2.9–3.3×. OPENBLAS_NUM_THREADS, when the user sets it,
// wins. With another BLAS (the reference one; MKL inside PyTorch's bundled
// libtorch, which follows torch's setting) there is no such symbol and
// nothing to do.
void set_intra_op_threads(int threads) {
  torch::set_num_threads(threads);
  if (std::getenv("OPENBLAS_NUM_THREADS") != nullptr) return;
  if (auto set = reinterpret_cast<void (*)(int)>(openblas_symbol("openblas_set_num_threads")); set != nullptr) set(1);
}

int openblas_threads() {
  auto get = reinterpret_cast<int (*)()>(openblas_symbol("openblas_get_num_threads"));
  return get != nullptr ? get() : 0;
}

int threads_per_rank(const ExperimentConfig& cfg) {
  if (cfg.train.num_threads > 0) return cfg.train.num_threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / cfg.train.num_gpus);
}

// A client whose model is sharded over num_gpus ranks. The model lives only
// in the shards: the transport's chunks go straight to the ranks that own
// their bytes (sharded_io), and no rank holds the whole model. Only when
// something asks for arena() — the simulator, which combines models
// in-process — is the model gathered into an arena here, once; from then on
// the arena is the model, loaded into the shards before each turn and stored
// back after (one unit at a time).
class ShardedReplica final : public ModelReplica, public ShardedModelIo {
 public:
  static StatusOr<std::unique_ptr<ModelReplica>> create(const ExperimentConfig& cfg, const InputSpec& input,
                                                        uint64_t seed) {
    const int world = cfg.train.num_gpus;
    std::unique_ptr<ShardedReplica> r(new ShardedReplica());
    r->dev_ = rank_device(cfg.train.device, 0);
    // The other ranks: this executable again, told its rank through the environment.
    sharded::Rendezvous where;
    where.world_size = world;
    MEMFL_ASSIGN_OR_RETURN(where.port, free_loopback_port());
    const std::string logs =
        (std::filesystem::temp_directory_path() / fmt::format("memfl-shard-{}-{}-rank", ::getpid(), where.port))
            .string();
    for (int rank = 1; rank < world; ++rank) {
      SpawnOptions o;
      o.log_path = logs + std::to_string(rank) + ".log";
      o.env = rank_env(rank, world, where.port);
      o.env.emplace_back("MEMFL_SHARD_DEVICE", cfg.train.device);
      MEMFL_ASSIGN_OR_RETURN(pid_t pid, spawn_process({self_executable(), "shard-rank"}, o));
      r->workers_.push_back(pid);
      r->logs_.push_back(o.log_path);
    }
    set_intra_op_threads(threads_per_rank(cfg));
    auto group = sharded::ShardGroup::create(where, r->dev_);
    if (!group.ok()) {
      return Status(group.status().code(),
                    fmt::format("{} (the other ranks' logs: {}*.log)", group.status().message(), logs));
    }
    r->group_ = std::move(*group);
    r->group_->store_set("memfl/config", cfg.resolved_yaml);
    r->group_->store_set("memfl/seed", std::to_string(seed));
    MEMFL_ASSIGN_OR_RETURN(r->model_, build_sharded_cnn(r->group_.get(), cfg, input, seed, r->dev_));
    // The arena layout of the unsharded network (the same names, shapes and
    // order), from the shards' shapes: nothing here holds the model to get it.
    if (r->model_->dtype() != torch::kFloat32) return invalid_argument("a sharded client's parameters must be f32");
    LayoutBuilder b;
    for (auto& [name, shape] : r->model_->parameter_shapes()) b.add(name, DType::kF32, shape);
    MEMFL_ASSIGN_OR_RETURN(r->layout_, std::move(b).build());
    return std::unique_ptr<ModelReplica>(std::move(r));
  }

  ~ShardedReplica() override {
    if (group_) {
      ShardedCommand c;
      c.op = "exit";
      post(c);
    }
    // Ranks that never met rank 0 have nothing to wait for.
    if (!group_) {
      for (pid_t p : workers_) ::kill(p, SIGTERM);
    }
    // A rank's log is kept only when it did not end cleanly.
    for (size_t i = 0; i < workers_.size(); ++i) {
      int status = 0;
      ::waitpid(workers_[i], &status, 0);
      std::error_code ec;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) std::filesystem::remove(logs_[i], ec);
    }
  }

  const Layout& layout() const override { return layout_; }
  Arena& arena() override {
    if (!staged_) {
      staged_ = std::make_unique<Arena>(layout_.total_bytes(), MemoryCategory::kModel);
      ShardedCommand c;
      c.op = "gather";
      post(c);
      store();
    }
    return *staged_;
  }
  ShardedModelIo* sharded_io() override { return staged_ ? nullptr : this; }

  Status write(uint64_t offset, std::span<const std::byte> bytes) override {
    return move_bytes("write", offset, bytes.size(),
                      [&](const auto& pieces, int64_t len) { model_->write_bytes(pieces, bytes, len); });
  }
  Status read(uint64_t offset, std::span<std::byte> into) override {
    return move_bytes("read", offset, into.size(),
                      [&](const auto& pieces, int64_t len) { model_->read_bytes(pieces, into, len); });
  }

  StatusOr<TrainResult> train(const ImageDataset& data, std::span<const uint32_t> train_idx,
                              std::span<const uint32_t> val_idx, const TrainConfig& cfg, uint64_t seed) override {
    if (cfg.mu > 0) return invalid_argument("client_configs.train_configs.num_gpus > 1 does not run FedProx (mu)");
    ShardedCommand c;
    c.op = "train";
    c.seed = seed;
    c.mode = cfg.mode;
    c.steps = cfg.num_local_steps;
    c.epochs = cfg.num_local_epochs;
    c.train_idx.assign(train_idx.begin(), train_idx.end());
    c.batch_size = cfg.train_batch_size;
    c.dataset_size = static_cast<int64_t>(data.labels.size());
    c.staged = staged_ != nullptr;
    post(c);
    try {
      if (c.staged) load();
      TrainResult r = sharded_train(*model_, *group_, data, c, cfg, dev_);
      if (c.staged) store();
      if (cfg.do_validation && !val_idx.empty()) {
        MEMFL_ASSIGN_OR_RETURN(EvalResult v, evaluate(data, val_idx, cfg.val_batch_size));
        r.val_loss = v.loss;
        r.val_accuracy = v.accuracy;
      r.val_samples = v.num_samples;
        r.has_validation = true;
      }
      return r;
    } catch (const std::exception& e) {
      return internal_error("sharded training failed: {}", e.what());
    }
  }

  StatusOr<EvalResult> evaluate(const ImageDataset& data, std::span<const uint32_t> idx, int batch_size) override {
    ShardedCommand c;
    c.op = "eval";
    c.val_idx.assign(idx.begin(), idx.end());
    c.batch_size = batch_size;
    c.dataset_size = static_cast<int64_t>(data.labels.size());
    c.staged = staged_ != nullptr;
    post(c);
    try {
      if (c.staged) load();
      return sharded_eval(*model_, *group_, data, idx, batch_size, dev_);
    } catch (const std::exception& e) {
      return internal_error("sharded evaluation failed: {}", e.what());
    }
  }

 private:
  ShardedReplica() = default;
  void post(const ShardedCommand& c) { group_->store_set(fmt::format("memfl/cmd/{}", commands_++), to_text(c)); }
  // [offset, offset + len) of the layout as pieces of parameters (alignment
  // padding between tensors belongs to none: it is dropped on write and
  // reads as 0), posted to the ranks with `op`; then `move` on this rank.
  template <typename F>
  Status move_bytes(const char* op, uint64_t offset, uint64_t len, F&& move) {
    if (offset > layout_.total_bytes() || len > layout_.total_bytes() - offset) {
      return invalid_argument("sharded model: {} of {} bytes at {} runs past its {} bytes", op, len, offset,
                              layout_.total_bytes());
    }
    ShardedCommand c;
    c.op = op;
    c.chunk_len = static_cast<int64_t>(len);
    for (size_t i = layout_.entry_at_or_after(offset); i < layout_.size(); ++i) {
      const LayoutEntry& e = layout_.entries()[i];
      if (e.offset >= offset + len) break;
      const uint64_t lo = std::max<uint64_t>(offset, e.offset), hi = std::min<uint64_t>(offset + len, e.end());
      if (lo < hi) {
        c.pieces.push_back({e.name, static_cast<int64_t>(lo - e.offset), static_cast<int64_t>(lo - offset),
                            static_cast<int64_t>(hi - lo)});
      }
    }
    post(c);
    try {
      move(c.pieces, c.chunk_len);
    } catch (const std::exception& e) {
      return internal_error("sharded model: {} of [{}, {}) failed: {}", op, offset, offset + len, e.what());
    }
    return Status::Ok();
  }
  torch::Tensor host_view(const std::string& name) {
    const LayoutEntry& e = *layout_.find(name);
    return torch::from_blob(staged_->data() + e.offset, e.shape, torch::kFloat32);
  }
  void load() {
    model_->load_from_rank0([&](const std::string& name, torch::Tensor dst) { dst.copy_(host_view(name)); });
  }
  void store() {
    model_->store_to_rank0([&](const std::string& name, const torch::Tensor& src) { host_view(name).copy_(src); });
  }

  Layout layout_;
  std::unique_ptr<Arena> staged_;  // the model gathered here, once arena() was asked for
  torch::Device dev_{torch::kCPU};
  std::vector<pid_t> workers_;
  std::vector<std::string> logs_;
  std::unique_ptr<sharded::ShardGroup> group_;
  std::unique_ptr<sharded::ShardedModel> model_;
  int64_t commands_ = 0;
};

Status shard_rank_main() {
  MEMFL_ASSIGN_OR_RETURN(auto where, sharded::rendezvous_from_env());
  if (!where) return failed_precondition("shard-rank: no MEMFL_RANK in the environment (rank 0 starts this command)");
  const char* device = std::getenv("MEMFL_SHARD_DEVICE");
  const torch::Device dev = rank_device(device != nullptr ? device : "cpu", where->local_rank);
  MEMFL_ASSIGN_OR_RETURN(auto group, sharded::ShardGroup::create(*where, dev));
  const auto wait = std::chrono::milliseconds(std::chrono::hours(24 * 7));
  MEMFL_ASSIGN_OR_RETURN(std::string yaml, group->store_get("memfl/config", wait));
  MEMFL_ASSIGN_OR_RETURN(std::string seed_text, group->store_get("memfl/seed", wait));
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg, load_config_text(yaml, "rank 0's resolved config"));
  set_intra_op_threads(threads_per_rank(cfg));
  MEMFL_ASSIGN_OR_RETURN(DatasetSplits data, load_data(cfg));
  MEMFL_ASSIGN_OR_RETURN(InputSpec input, input_spec(cfg, data.train));
  const uint64_t seed = std::stoull(seed_text);
  MEMFL_ASSIGN_OR_RETURN(auto model, build_sharded_cnn(group.get(), cfg, input, seed, dev));
  for (int64_t k = 0;; ++k) {
    MEMFL_ASSIGN_OR_RETURN(std::string text, group->store_get(fmt::format("memfl/cmd/{}", k), wait));
    const ShardedCommand c = from_text(text);
    if (c.op == "exit") return Status();
    // Chunks of the model as the transport moves them, and rank 0 gathering
    // the model into its arena (the simulator): no data set involved.
    if (c.op == "write") {
      model->write_bytes(c.pieces, {}, c.chunk_len);
      continue;
    }
    if (c.op == "read") {
      model->read_bytes(c.pieces, {}, c.chunk_len);
      continue;
    }
    if (c.op == "gather") {
      model->store_to_rank0([](const std::string&, const torch::Tensor&) {});
      continue;
    }
    const ImageDataset* split = nullptr;
    for (const ImageDataset* d : {&data.train, &data.test}) {
      if (static_cast<int64_t>(d->labels.size()) == c.dataset_size) split = d;
    }
    if (split == nullptr) {
      return failed_precondition("shard-rank {}: rank 0 trains on a data set of {} samples; here train has {}, test {}",
                                 where->rank, c.dataset_size, data.train.labels.size(), data.test.labels.size());
    }
    if (c.staged) model->load_from_rank0([](const std::string&, torch::Tensor) {});
    if (c.op == "train") {
      TrainConfig tc = cfg.train;
      tc.mode = c.mode;
      tc.num_local_steps = static_cast<int>(c.steps);
      tc.num_local_epochs = static_cast<int>(c.epochs);
      tc.train_batch_size = c.batch_size;
      sharded_train(*model, *group, *split, c, tc, dev);
      if (c.staged) model->store_to_rank0([](const std::string&, const torch::Tensor&) {});
      // (rank 0 validates through evaluate(), which posts its own command)
    } else if (c.op == "eval") {
      sharded_eval(*model, *group, *split, c.val_idx, c.batch_size, dev);
    }
  }
}

// `memfl bench llm` (LlmBenchOptions): the oracle's logits, or the trainer timed.
int64_t cuda_peak_allocated(bool reset) {
#ifdef MEMFL_HAVE_CUDA_STATS
  if (!torch::cuda::is_available()) return 0;
  if (reset) {
    torch::cuda::synchronize();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    return 0;
  }
  torch::cuda::synchronize();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)].peak;
#else
  (void)reset;
  return 0;
#endif
}

StatusOr<std::string> llm_logits(const LlmBenchOptions& o, torch::Device dev) {
  // With LoRA the layout, and so --weights, is the adapters (PEFT's
  // adapter_model.safetensors) over the base of --hf-checkpoint.
  MEMFL_ASSIGN_OR_RETURN(auto net, make_model(o.model, InputSpec{1, 1, 1, 0}, dev, o.seed));
  MEMFL_ASSIGN_OR_RETURN(auto bound, bind_to_arena(*net));
  if (o.model.lora.enabled && std::filesystem::is_directory(o.weights)) {
    // A PEFT adapter folder, read as train_configs.lora.init_adapters reads it.
    LoraConfig lora = o.model.lora;
    lora.init_adapters = o.weights;
    MEMFL_RETURN_IF_ERROR(load_peft_adapter(lora, bound.layout, bound.arena));
  } else {
    MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(o.weights));
    MEMFL_RETURN_IF_ERROR(file->load_into(bound.layout, bound.arena).with_context(o.weights));
  }
  torch::NoGradGuard g;
  auto named = net->named_tensors();
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& e = bound.layout.entries()[i];
    auto& t = named[i].second;
    if (t.is_cuda()) {
      t.copy_(torch::from_blob(bound.arena.data() + e.offset, t.sizes(), t.options().device(torch::kCPU)));
    }
  }
  const int64_t b = o.batch_size, len = o.seq_length + 1;
  auto all = torch::empty({b, len}, torch::kInt64);
  FILE* f = std::fopen(o.tokens.c_str(), "rb");
  if (f == nullptr) return not_found("bench llm: --tokens {}: cannot open", o.tokens);
  const size_t got = std::fread(all.data_ptr<int64_t>(), sizeof(int64_t), static_cast<size_t>(b * len), f);
  std::fclose(f);
  if (got != static_cast<size_t>(b * len)) {
    return invalid_argument("bench llm: --tokens {} holds {} int64 tokens, not batch × (seq + 1) = {}", o.tokens, got,
                            b * len);
  }
  auto x = all.narrow(1, 0, len - 1).contiguous().to(dev), y = all.narrow(1, 1, len - 1).contiguous().to(dev);
  net->eval();
  auto logits = net->forward(x).to(torch::kFloat32).cpu().contiguous();
  auto [loss, correct] = net->loss_and_correct(x, y);
  FILE* out = std::fopen(o.logits_out.c_str(), "wb");
  if (out == nullptr) return internal_error("bench llm: cannot write {}", o.logits_out);
  std::fwrite(logits.data_ptr<float>(), sizeof(float), static_cast<size_t>(logits.numel()), out);
  std::fclose(out);
  nlohmann::ordered_json j;
  j["mode"] = "logits";
  j["loss"] = loss.item<double>();
  j["correct"] = correct.item<int64_t>();
  j["logits"] = o.logits_out;
  j["shape"] = logits.sizes().vec();
  j["device"] = dev.str();
  j["attention"] = fused_attention_available() ? "scaled_dot_product_attention" : "math";
  return j.dump();
}

StatusOr<std::string> llm_train_bench(TrainerBackend& backend, const LlmBenchOptions& o, torch::Device dev) {
  using clock = std::chrono::steady_clock;
  auto since_start = [&] { return static_cast<double>(clock::now().time_since_epoch().count() - o.started_ns) * 1e-9; };
  MEMFL_ASSIGN_OR_RETURN(LlamaSpec spec, llama_spec_from_config(o.model));
  const auto t0 = clock::now();
  MEMFL_ASSIGN_OR_RETURN(auto replica, backend.create_replica(o.model, InputSpec{1, 1, 1, 0}, o.device, o.seed));
  const double setup_s = std::chrono::duration<double>(clock::now() - t0).count();
  // Random tokens below min(vocab, 256): the data set's samples are bytes.
  ImageDataset data;
  data.name = "random-tokens";
  data.channels = data.height = 1;
  data.width = o.seq_length + 1;
  const int64_t n = static_cast<int64_t>(o.batch_size) * (o.steps + o.warmup + 1);
  data.labels.assign(static_cast<size_t>(n), 0);
  data.pixels.resize(static_cast<size_t>(n * data.width));
  std::mt19937_64 rng(o.seed);
  const int64_t top = std::min<int64_t>(256, spec.vocab_size);
  for (auto& p : data.pixels) p = static_cast<uint8_t>(rng() % static_cast<uint64_t>(top));
  std::vector<uint32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0u);
  TrainConfig cfg;
  cfg.mode = "step";
  cfg.train_batch_size = o.batch_size;
  cfg.train_data_shuffle = false;
  cfg.do_validation = false;
  cfg.device = o.device;
  cfg.gradient_checkpointing = o.gradient_checkpointing;
  cfg.optim.optim = o.optimizer;
  cfg.optim.state_dtype = o.state_dtype;
  cfg.optim.lr = o.lr;
  // The first step, as a client's first round takes it.
  cfg.num_local_steps = 1;
  MEMFL_ASSIGN_OR_RETURN(TrainResult first, replica->train(data, idx, {}, cfg, o.seed));
  const double first_step_s = since_start();
  cfg.num_local_steps = o.warmup;
  if (o.warmup > 0) MEMFL_RETURN_IF_ERROR(replica->train(data, idx, {}, cfg, o.seed).status());
  cuda_peak_allocated(/*reset=*/true);
  cfg.num_local_steps = o.steps;
  const auto t1 = clock::now();
  MEMFL_ASSIGN_OR_RETURN(TrainResult r, replica->train(data, idx, {}, cfg, o.seed));
  const double turn_s = std::chrono::duration<double>(clock::now() - t1).count();
  const int64_t peak = cuda_peak_allocated(false);
  const double tokens = static_cast<double>(o.steps) * o.batch_size * o.seq_length;
  nlohmann::ordered_json j;
  j["impl"] = "memfl";
  j["model"] = o.model.model_name;
  j["num_params"] = llama_num_params(spec);
  j["dtype"] = o.model.dtype;
  j["batch_size"] = o.batch_size;
  j["seq_length"] = o.seq_length;
  j["steps"] = o.steps;
  j["optimizer"] = o.optimizer;
  j["optimizer_state_dtype"] = o.state_dtype;
  j["gradient_checkpointing"] = o.gradient_checkpointing;
  j["attention"] = fused_attention_available() ? "scaled_dot_product_attention" : "math";
  j["device"] = dev.str();
  j["tokens_per_s"] = r.step_seconds > 0 ? tokens / r.step_seconds : 0.0;
  j["step_seconds"] = r.step_seconds;
  j["turn_seconds"] = turn_s;  // the steps plus the model's copies in and out of the arena
  j["peak_allocated_bytes"] = peak;
  j["setup_seconds"] = setup_s;
  j["first_step_seconds_since_start"] = first_step_s;
  j["first_loss"] = first.train_loss;
  j["loss"] = r.train_loss;
  j["gradient_bytes"] = r.gradient_bytes;
  j["optimizer_bytes"] = r.optimizer_bytes;
  j["model_bytes"] = static_cast<int64_t>(replica->layout().total_bytes());
  // Model FLOPs per token: 6 N + 12 L H T (forward 2 N, backward 4 N; N the
  // parameters outside the input embedding, T the sequence), and with LoRA's
  // frozen base two thirds of it (no weight-gradient matmuls: NeMo's count).
  const double non_embedding =
      static_cast<double>(llama_num_params(spec) - spec.vocab_size * spec.hidden_size);
  const double attention = 12.0 * static_cast<double>(spec.num_layers * spec.hidden_size) * o.seq_length;
  const bool lora = o.model.lora.enabled;
  const double flops_per_token = (lora ? 2.0 / 3.0 : 1.0) * (6.0 * non_embedding + attention);
  j["flops_per_token"] = flops_per_token;
  j["mfu_989_tflops"] = r.step_seconds > 0 ? tokens / r.step_seconds * flops_per_token / 989e12 : 0.0;
  if (lora) {
    j["lora_r"] = o.model.lora.r;
    j["lora_alpha"] = o.model.lora.lora_alpha;
    j["target_modules"] = o.model.lora.target_modules;
    j["adapter_params"] = static_cast<int64_t>(replica->layout().num_params());
    j["base_from"] = o.model.hf_checkpoint.empty() ? std::string("seed") : o.model.hf_checkpoint;
  }
  return j.dump();
}

class TorchBackend final : public TrainerBackend {
 public:
  std::vector<std::string> model_names() const override {
    return {"CNN",      "MLP",      "ResNet18",  "CNN_GN", "llama-tiny",
            "llama-1b", "llama-8b", "llama-70b", "llama",  "TorchScript"};
  }

  StatusOr<std::unique_ptr<ModelReplica>> create_replica(const ModelConfig& model, const InputSpec& input,
                                                         const std::string& device, uint64_t seed) override {
    try {
      torch::Device dev(torch::kCPU);
      if (device == "cuda") {
        if (!torch::cuda::is_available()) {
          return failed_precondition("device: cuda was asked for but libtorch sees no CUDA device");
        }
        dev = torch::Device(torch::kCUDA);
      }
      torch::manual_seed(seed);  // same seed, same initial global model
      // A Llama is made on its device (weights drawn there, in its dtype);
      // the arena gets their host copy.
      MEMFL_ASSIGN_OR_RETURN(auto net, make_model(model, input, dev, seed));
      MEMFL_ASSIGN_OR_RETURN(auto bound, bind_to_arena(*net));
      return std::unique_ptr<ModelReplica>(std::make_unique<TorchReplica>(std::move(net), std::move(bound), dev));
    } catch (const std::exception& e) {
      return internal_error("building model {} failed in libtorch: {}", model.model_name, e.what());
    }
  }

  StatusOr<std::unique_ptr<ModelReplica>> create_sharded_replica(const ExperimentConfig& cfg, const InputSpec& input,
                                                                 uint64_t seed) override {
    if (cfg.model.model_name != "CNN_GN") {
      return invalid_argument(
          "{}: client_configs.train_configs.num_gpus is {}: sharding a client's model needs model_name CNN_GN (the "
          "model cut into units), not {}",
          cfg.source, cfg.train.num_gpus, cfg.model.model_name);
    }
    if (cfg.train.device == "cuda" && static_cast<int>(torch::cuda::device_count()) < cfg.train.num_gpus) {
      return failed_precondition("{}: client_configs.train_configs.num_gpus is {} but libtorch sees {} GPU(s)",
                                 cfg.source, cfg.train.num_gpus, torch::cuda::device_count());
    }
    try {
      return ShardedReplica::create(cfg, input, seed);
    } catch (const std::exception& e) {
      return internal_error("sharded client failed in libtorch: {}", e.what());
    }
  }

  Status run_shard_rank() override {
    try {
      return shard_rank_main();
    } catch (const std::exception& e) {
      return internal_error("shard-rank failed: {}", e.what());
    }
  }

  StatusOr<std::vector<std::string>> bench_dp(const DpBenchOptions& options) override {
    try {
      return run_dp_bench(options);
    } catch (const std::exception& e) {
      return internal_error("bench dp failed in libtorch: {}", e.what());
    }
  }

  StatusOr<std::string> bench_llm(const LlmBenchOptions& options) override {
    try {
      torch::Device dev(torch::kCPU);
      if (options.device == "cuda") {
        if (!torch::cuda::is_available()) return failed_precondition("bench llm: --device cuda but no CUDA device");
        dev = torch::Device(torch::kCUDA);
      }
      if (!options.weights.empty()) return llm_logits(options, dev);
      return llm_train_bench(*this, options, dev);
    } catch (const std::exception& e) {
      return internal_error("bench llm failed in libtorch: {}", e.what());
    }
  }

  void set_num_threads(int threads) override { set_intra_op_threads(threads); }
  int blas_threads_per_call() const override { return openblas_threads(); }

  bool gpu_memory(int64_t* allocated, int64_t* reserved, int64_t* peak_allocated) override {
#ifdef MEMFL_HAVE_CUDA_STATS
    if (!torch::cuda::is_available()) return false;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    constexpr auto kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[kAll].current;
    *reserved = stats.reserved_bytes[kAll].current;
    *peak_allocated = stats.allocated_bytes[kAll].peak;
    return true;
#else
    (void)allocated, (void)reserved, (void)peak_allocated;
    return false;
#endif
  }

  std::string version() const override {
    return fmt::format("libtorch {}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  }
};

}  // namespace

}  // namespace memfl::torch_internal

extern "C" memfl::TrainerBackend* memfl_trainer_backend() {
  // Leaked on purpose: libtorch's own static teardown order is not ours to race.
  static auto* backend = new memfl::torch_internal::TorchBackend();
  return backend;
}
