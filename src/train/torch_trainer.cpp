// VanillaTrainer on libtorch: the plugin's TrainerBackend and ModelReplica.
#include <algorithm>
#include <optional>
#include <numeric>
#include <random>

#include "memory/ledger.h"

// The CUDA caching allocator's statistics exist only in CUDA builds of
// libtorch (the GPU machine's); Debian's is CPU-only.
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define MEMFL_HAVE_CUDA_STATS 1
#endif
#include "train/dp_bench.h"
#include "train/dp_sgd.h"
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

// Language-model batches: each sample is seq_length + 1 token ids (stored as
// the data set's uint8 "pixels"); the input is the first seq_length, the
// target the last seq_length (next-token prediction).
void fill_token_batch(const ImageDataset& data, std::span<const uint32_t> idx, torch::Tensor& x, torch::Tensor& y) {
  const int64_t b = static_cast<int64_t>(idx.size());
  const int64_t len = static_cast<int64_t>(data.sample_bytes());
  auto all = torch::empty({b, len}, torch::kInt64);
  int64_t* p = all.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const uint8_t* s = data.sample(idx[static_cast<size_t>(i)]);
    for (int64_t j = 0; j < len; ++j) p[i * len + j] = s[j];
  }
  x = all.narrow(1, 0, len - 1).contiguous();
  y = all.narrow(1, 1, len - 1).contiguous();
}

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

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

class TorchReplica final : public ModelReplica {
 public:
  TorchReplica(std::shared_ptr<Net> net, BoundModel bound, torch::Device device)
      : net_(std::move(net)), bound_(std::move(bound)), device_(device) {
    if (device_.is_cuda()) net_->to(device_);  // the arena stays the host copy
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
  std::vector<torch::Tensor> all_tensors() {
    std::vector<torch::Tensor> ts;
    for (auto& p : net_->parameters(true)) ts.push_back(p);
    for (auto& b : net_->buffers(true)) ts.push_back(b);
    return ts;
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
    for (size_t i = 0; i < ts.size(); ++i) ts[i].copy_(host_view(i, ts[i]));
  }
  void sync_to_host() {
    if (!device_.is_cuda()) return;
    torch::NoGradGuard g;
    auto ts = all_tensors();
    for (size_t i = 0; i < ts.size(); ++i) host_view(i, ts[i]).copy_(ts[i]);
  }

  TrainResult train_impl(const ImageDataset& data, std::span<const uint32_t> train_idx,
                         std::span<const uint32_t> val_idx, const TrainConfig& cfg, uint64_t seed) {
    sync_to_device();
    torch::manual_seed(seed);
    net_->train();
    std::unique_ptr<torch::optim::Optimizer> opt;
    const auto& o = cfg.optim;
    if (o.optim == "Adam") {
      opt = std::make_unique<torch::optim::Adam>(
          net_->parameters(),
          torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
    } else {
      opt = std::make_unique<torch::optim::SGD>(
          net_->parameters(),
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay).nesterov(o.nesterov));
    }
    if (cfg.dp.enabled) return train_dp(data, train_idx, val_idx, cfg, seed, *opt);
    // FedProx: the received global model's parameters, the anchor of the
    // proximal term. A copy is needed (the arena is trained in place): one
    // model's parameters more on the client, buffers excluded.
    std::vector<torch::Tensor> params, anchor;
    if (cfg.mu > 0) {
      torch::NoGradGuard g;
      params = net_->parameters();
      for (const auto& p : params) anchor.push_back(p.detach().clone());
    }
    std::vector<uint32_t> order(train_idx.begin(), train_idx.end());
    std::mt19937_64 rng(seed);
    const size_t bs = static_cast<size_t>(cfg.train_batch_size);
    const int64_t max_steps = cfg.mode == "step" ? cfg.num_local_steps : INT64_MAX;
    const int epochs = cfg.mode == "step" ? INT32_MAX : cfg.num_local_epochs;
    TrainResult r;
    double loss_sum = 0;
    double correct = 0;
    torch::Tensor x, y;
    const bool lm = net_->is_language_model();
    for (int ep = 0; ep < epochs && r.num_steps < max_steps; ++ep) {
      if (cfg.train_data_shuffle) std::shuffle(order.begin(), order.end(), rng);
      for (size_t b = 0; b < order.size() && r.num_steps < max_steps; b += bs) {
        const size_t n = std::min(bs, order.size() - b);
        if (lm) {
          fill_token_batch(data, std::span<const uint32_t>(order).subspan(b, n), x, y);
        } else {
          fill_batch(data, std::span<const uint32_t>(order).subspan(b, n), x, y);
        }
        x = x.to(device_);
        y = y.to(device_);
        opt->zero_grad();
        auto logits = net_->forward(x);
        auto loss = batch_loss(logits, y);
        loss.backward();
        if (cfg.mu > 0) {
          // ∇ μ/2·‖w − w_g‖² = μ·(w − w_g), added to each gradient.
          torch::NoGradGuard g;
          for (size_t i = 0; i < params.size(); ++i) {
            if (params[i].grad().defined()) params[i].grad().add_(params[i].detach() - anchor[i], cfg.mu);
          }
        }
        opt->step();
        loss_sum += loss.item<double>() * static_cast<double>(n);
        // Accuracy per predicted element (per token for a language model).
        correct += static_cast<double>(batch_correct(logits, y)) * static_cast<double>(n) /
                   static_cast<double>(std::max<int64_t>(1, y.numel()));
        r.num_samples += static_cast<int64_t>(n);
        r.num_steps++;
      }
    }
    if (r.num_samples > 0) {
      r.train_loss = loss_sum / static_cast<double>(r.num_samples);
      r.train_accuracy = correct / static_cast<double>(r.num_samples);
    }
    // What training cost on top of the model, for the ledger and reports.
    for (auto& p : net_->parameters()) r.gradient_bytes += tensor_bytes(p.grad());
    r.optimizer_bytes = optimizer_state_bytes(*opt, o.optim);
    auto& ledger = Ledger::instance();
    ledger.set(MemoryCategory::kGradients, r.gradient_bytes);
    ledger.set(MemoryCategory::kOptimizer, r.optimizer_bytes);
    // Nothing of this client survives its turn: drop gradients and the optimizer.
    for (auto& p : net_->parameters()) p.mutable_grad() = torch::Tensor();
    opt.reset();
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
    dp::DpOptions o;
    o.mode = dp::parse_clip_mode(cfg.dp.clipping).value_or(dp::ClipMode::kFused);
    o.max_grad_norm = cfg.dp.max_grad_norm;
    o.noise_multiplier = cfg.dp.noise_multiplier;
    auto created = dp::DpSgd::create(net_, o);
    if (!created.ok()) throw std::runtime_error(created.status().message());
    std::unique_ptr<dp::DpSgd> dpsgd = std::move(*created);
    const auto n = static_cast<int64_t>(train_idx.size());
    const int64_t bs = cfg.train_batch_size;
    const double q = n > 0 ? std::min(1.0, static_cast<double>(bs) / static_cast<double>(n)) : 1.0;
    const int64_t steps =
        cfg.mode == "step" ? cfg.num_local_steps : static_cast<int64_t>(cfg.num_local_epochs) * ((n + bs - 1) / bs);
    std::vector<uint32_t> pool(train_idx.begin(), train_idx.end());
    dp::PoissonSampler sampler(pool, q, seed);
    std::vector<uint32_t> batch;
    TrainResult r;
    double loss_sum = 0, correct = 0;
    torch::Tensor x, y;
    for (int64_t k = 0; k < steps; ++k) {
      sampler.next(batch);
      // DpSgd::step writes every gradient afresh: dropping the last ones is
      // all zeroing them would achieve, without touching their memory.
      for (auto& p : net_->parameters()) p.mutable_grad() = torch::Tensor();
      if (!batch.empty()) {
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
    if (r.num_samples > 0) {
      r.train_loss = loss_sum / static_cast<double>(r.num_samples);
      r.train_accuracy = correct / static_cast<double>(r.num_samples);
    }
    r.dp_steps = r.num_steps;
    r.dp_sample_rate = q;
    for (auto& p : net_->parameters()) p.mutable_grad() = torch::Tensor();
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
      r.has_validation = true;
    }
    return r;
  }

  static int64_t optimizer_state_bytes(torch::optim::Optimizer& opt, const std::string& kind) {
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
      auto logits = net_->forward(x);
      // Per sample: a language model's summed token loss is divided by its
      // tokens per sample, so loss and accuracy are per token.
      const double per = static_cast<double>(std::max<int64_t>(1, y.numel() / std::max<int64_t>(1, y.size(0))));
      loss_sum += batch_loss(logits, y, /*sum=*/true).item<double>() / per;
      correct += batch_correct(logits, y);
      r.num_samples += static_cast<int64_t>(n);
      predicted += y.numel();
    }
    if (r.num_samples > 0) {
      r.loss = loss_sum / static_cast<double>(r.num_samples);
      r.accuracy = static_cast<double>(correct) / static_cast<double>(predicted);
    }
    return r;
  }

  std::shared_ptr<Net> net_;
  BoundModel bound_;
  torch::Device device_;
#ifdef MEMFL_HAVE_CUDA_STATS
  std::optional<c10::cuda::CUDAStream> stream_;
#endif
};

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
      MEMFL_ASSIGN_OR_RETURN(auto net, make_model(model, input));
      MEMFL_ASSIGN_OR_RETURN(auto bound, bind_to_arena(*net));
      return std::unique_ptr<ModelReplica>(std::make_unique<TorchReplica>(std::move(net), std::move(bound), dev));
    } catch (const std::exception& e) {
      return internal_error("building model {} failed in libtorch: {}", model.model_name, e.what());
    }
  }

  StatusOr<std::vector<std::string>> bench_dp(const DpBenchOptions& options) override {
    try {
      return run_dp_bench(options);
    } catch (const std::exception& e) {
      return internal_error("bench dp failed in libtorch: {}", e.what());
    }
  }

  void set_num_threads(int threads) override { torch::set_num_threads(threads); }

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
