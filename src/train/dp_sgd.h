// DP-SGD with memory-efficient per-sample clipping.
//
// DP-SGD (Abadi et al. 2016) replaces the batch gradient by
//
//   g̃ = ( Σ_i c_i g_i  +  N(0, σ²C²·I) ) / E[B],   c_i = min(1, C / (‖g_i‖ + 1e-6))
//
// where g_i is sample i's gradient over *all* parameters, C the clipping bound
// (max_grad_norm), σ the noise multiplier and E[B] the expected batch size.
// The layers below compute per-sample norms without a second backward:
//
//   * In the forward each layer keeps what autograd keeps anyway (its input A;
//     for the norm layers the normalised input x̂), and its custom autograd
//     Function hands its layer, in the backward, the output gradient G next to
//     it. For Linear, ∇W = Σ_i G_iᵀA_i (A_i: T×d_in, G_i: T×d_out; T = 1 for
//     2-D inputs, T = tokens for sequences, T = output positions for Conv2d,
//     whose A is the unfolded input, im2col(x)). The layer keeps A and G, or,
//     where that is smaller, the per-sample gradients G_iᵀA_i themselves.
//   * DpSgd::step() then gets ‖g_i‖² = Σ_layers ‖G_iᵀA_i‖² + ‖Σ_t G_i,t‖² and
//     writes the clipped sum Σ_i c_i g_i: from kept per-sample gradients, or
//     by "book-keeping", ∇W = (c ⊙ G)ᵀA, one matmul per layer on the stored A
//     and G — no second backward. In recording mode the backward computes only
//     input gradients; the weight gradient is computed once, already clipped
//     (computing the plain one too would double the weight-gradient cost).
//
// Clipping modes:
//   naive: materialise the per-sample gradients — the reference. Linear and
//          Conv2d compute them in the backward (B × d_out × d_in each, kept
//          until step()), Embedding in step() (B × V × d).
//   ghost: never a per-sample gradient: keep A and G, and
//          ‖G_iᵀA_i‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s) from the two T×T Gram
//          matrices A_iA_iᵀ and G_iG_iᵀ (for Embedding [x_t = x_s] replaces
//          a_t·a_s); memory B·T² in step(); clipped sum by book-keeping.
//   fused: per layer (and per call), the cheaper way:
//          * keep whichever is smaller per sample: the per-sample gradient
//            (d_in·d_out, computed in the backward, after which A and G are
//            freed; its clipped sum is then Σ c_i g_i, no book-keeping matmul)
//            or A and G (T·(d_in+d_out); for Conv2d its input and G);
//          * with A and G kept, the norms come from per-sample gradients built
//            a few samples at a time when d_in·d_out < T² (plus, for Conv2d,
//            the unfolded input the Gram route needs), else from the Gram sums
//            in tiles of `tile`×`tile` over T, so no T×T matrix is ever held.
//          Temporaries in step() stay within about B·tile² elements (one
//          sample at least).
// LayerNorm, RMSNorm and GroupNorm have d-sized per-sample gradients
// (Σ_t G ⊙ x̂ and Σ_t G): computed in the backward in every mode, so x̂ and G
// are not kept.
//
// Memory beyond plain training, until step(): per DP layer either its
// per-sample gradients or its input and output gradient (plain training frees
// those during the backward), plus step()'s temporaries.
//
// BatchNorm cannot be used: its batch statistics make a sample's gradient
// depend on the other samples, so clipping per sample bounds nothing.
// DpSgd::create rejects such a model (use GroupNorm), and any trainable
// parameter outside the layers below.
//
// Use (the loss must be the SUM of per-sample losses, not the mean):
//
//   auto net = std::make_shared<MyNet>();  // built from dp::Linear, dp::Conv2d, …
//   DpOptions o;  o.mode = ClipMode::kFused;  o.max_grad_norm = 1.0;  o.noise_multiplier = 1.1;
//   MEMFL_ASSIGN_OR_RETURN(auto dp, DpSgd::create(net, o));
//   PoissonSampler sampler(train_indices, q, seed);
//   for (int64_t k = 0; k < steps; ++k) {
//     sampler.next(batch);
//     if (!batch.empty()) {
//       auto loss = cross_entropy(net->forward(x(batch)), y(batch), reduction = sum);
//       loss.backward();                 // layers record A and G (or per-sample gradients)
//     }
//     MEMFL_ASSIGN_OR_RETURN(auto st, dp->step(sampler.expected_batch_size()));  // sets p.grad
//     opt.step();                         // any optimizer: post-processing of a DP gradient
//   }
//
// One backward per step(): a layer called several times in one forward (weight
// sharing) is handled (its records concatenate along T, or its per-sample
// gradients add up), but gradients of two backward passes are not accumulated
// across a step. While a DpSgd is alive its layers record in every backward;
// destroy it to use the model without DP (the layers then run the plain
// libtorch ops, with ordinary summed gradients).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "train/torch_models.h"

namespace memfl::dp {

enum class ClipMode { kNaive, kGhost, kFused };

// Where the layers below allocate and initialise their parameters when
// constructed (this thread; default: the CPU). A sharded model of billions of
// parameters builds each unit straight on its GPU under this guard, instead of
// initialising it on the host and copying it over.
class InitDeviceGuard {
 public:
  explicit InitDeviceGuard(torch::Device device);
  ~InitDeviceGuard();
  InitDeviceGuard(const InitDeviceGuard&) = delete;
  InitDeviceGuard& operator=(const InitDeviceGuard&) = delete;

 private:
  torch::Device previous_;
};
// "naive" | "ghost" | "fused"; nullopt otherwise.
std::optional<ClipMode> parse_clip_mode(std::string_view name);
const char* clip_mode_name(ClipMode mode);

// fused mode's per-layer choice for Linear and Conv2d (Embedding: kGram takes
// the Gram route, anything else the sparse per-sample one); kAuto takes the
// cheaper, as described above; tests force the others:
//   kKeepPerSample:  per-sample gradients computed in the backward and kept;
//   kPerSampleNorms: A and G kept; norms from per-sample gradients built a
//                    sample chunk at a time; clipped sum by book-keeping;
//   kGram:           A and G kept; norms from tiled Gram sums; book-keeping.
enum class FusedRoute { kAuto, kKeepPerSample, kPerSampleNorms, kGram };

struct DpOptions {
  ClipMode mode = ClipMode::kFused;
  double max_grad_norm = 1.0;     // C: bound on each sample's gradient norm (over all parameters)
  double noise_multiplier = 1.0;  // σ: the noise's standard deviation is σ·C
  int64_t tile = 1024;            // fused: tile edge over T; temporaries ≈ B·tile² elements
  FusedRoute fused_route = FusedRoute::kAuto;
};

struct DpStepStats {
  int64_t batch_size = 0;  // samples in this step's batch (0 for an empty Poisson batch)
  double mean_norm = 0;    // mean per-sample gradient norm before clipping
  double max_norm = 0;
  double clipped_fraction = 0;  // share of samples with ‖g_i‖ > C
};

class DpSgd;

// What one call of a layer left for clipping: its input and output gradient
// (book-keeping needs both), or, where those would take more memory, the
// per-sample gradients computed in the backward (one B×… tensor per parameter,
// in dp_parameters() order).
struct DpRecord {
  torch::Tensor input;        // A (Linear), x (Conv2d), indices (Embedding); undefined when condensed
  torch::Tensor grad_output;  // G
  std::vector<torch::Tensor> per_sample;
  bool condensed() const { return !per_sample.empty(); }
  int64_t batch_size() const { return condensed() ? per_sample.front().size(0) : grad_output.size(0); }
};

// What DpSgd needs from a layer. Layers record in their backward while a
// DpSgd is attached; DpSgd turns the records into norms and clipped
// gradients, then clears them.
class DpLayer {
 public:
  virtual ~DpLayer() = default;
  // The trainable tensors whose per-sample gradients this layer tracks.
  virtual std::vector<torch::Tensor> dp_parameters() = 0;

  // --- used by DpSgd and by the layers' autograd Functions ---
  bool attached() const { return owner_ != nullptr; }
  // Called from the backward; false when no DpSgd is attached any more.
  bool record(const torch::Tensor& input, const torch::Tensor& grad_output);
  bool has_records();
  int64_t recorded_batch_size();  // -1 when nothing was recorded
  // ‖g_i‖² over this layer's parameters, one per sample (B).
  virtual torch::Tensor per_sample_sq_norms(const DpOptions& o) = 0;
  // p.grad = Σ_i clip[i]·g_i for each of dp_parameters().
  virtual void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) = 0;
  void clear_records();

 protected:
  // In the backward: the per-sample gradients to keep instead of (input,
  // grad_output), or {} to keep those.
  virtual std::vector<torch::Tensor> condense(const torch::Tensor& input, const torch::Tensor& grad_output,
                                              const DpOptions& o) {
    return {};
  }
  // True when the next forward must go through the recording Function.
  bool recording(const torch::Tensor& weight) const;
  std::vector<DpRecord> records_copy();
  std::vector<torch::Tensor> cache_;  // per-sample gradients kept from norms to clipping

 private:
  friend class DpSgd;
  DpSgd* owner_ = nullptr;
  std::mutex mu_;
  std::vector<DpRecord> records_;
};

// nn::Linear on inputs B×d_in or B×…×d_in (the middle dimensions are T).
class LinearImpl : public torch::nn::Module, public DpLayer {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight, bias;  // weight: out×in; bias undefined without one

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& x, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(Linear);

// nn::Embedding (no padding_idx, max_norm): indices B or B×T → B(×T)×dim.
class EmbeddingImpl : public torch::nn::Module, public DpLayer {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  torch::Tensor forward(const torch::Tensor& indices);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight;  // num_embeddings×dim
};
TORCH_MODULE(Embedding);

// nn::Conv2d, square kernel, groups = 1. The forward is libtorch's conv2d; the
// layer is Linear on the unfolded input (im2col: T = output positions, d_in =
// in·k²). Its per-sample gradients come from one bmm over the unfolded input
// on CUDA, from one grouped-convolution weight backward (groups = samples, no
// unfolding) on CPU; book-keeping keeps the input
// (not the unfolded input) and G, and its clipped sum is conv2d's weight
// backward on c ⊙ G; only the Gram route unfolds, in step(), a sample chunk at
// a time in fused mode.
class Conv2dImpl : public torch::nn::Module, public DpLayer {
 public:
  Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1, int64_t padding = 0,
             int64_t dilation = 1, bool bias = true);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight, bias;  // weight: out×in×k×k
  int64_t in_channels, out_channels, kernel, stride, padding, dilation;

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& x, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(Conv2d);

// A LoRA adapter pair as a DP layer: forward(x) = s · x Aᵀ Bᵀ on inputs
// B×…×d_in (PEFT's lora_A r×d_in and lora_B d_out×r, s = lora_alpha / r);
// the frozen weight beside it is not a DP parameter. Its per-sample gradients
//   ∇B_i = s·G_iᵀ H_i  (H_i = X_i Aᵀ, T×r),   ∇A_i = s·(G_i B)ᵀ X_i
// take r·(d_in + d_out) a sample, less than the layer's input and output
// gradient (T·(d_in + d_out)) whenever r < T, and are computed from two thin
// bmm's in the backward: every clipping mode keeps them (the naive route is
// the cheapest here). Initialised as PEFT does: A ~ U(±1/√d_in), B = 0.
class LoraAdapterImpl : public torch::nn::Module, public DpLayer {
 public:
  LoraAdapterImpl(int64_t in_features, int64_t out_features, int64_t r, double scaling,
                  const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor lora_A, lora_B;
  double scaling;

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& x, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(LoraAdapter);

// LayerNorm over the last dimension, with weight and bias.
class LayerNormImpl : public torch::nn::Module, public DpLayer {
 public:
  explicit LayerNormImpl(int64_t dim, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight, bias;
  int64_t dim;
  double eps;

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& xhat, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(LayerNorm);

// RMSNorm over the last dimension (x · rsqrt(mean(x²) + eps) · weight), as in Llama.
class RMSNormImpl : public torch::nn::Module, public DpLayer {
 public:
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight;
  int64_t dim;
  double eps;

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& xhat, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(RMSNorm);

// GroupNorm on B×C×… with a per-channel weight and bias: the DP replacement for BatchNorm.
class GroupNormImpl : public torch::nn::Module, public DpLayer {
 public:
  GroupNormImpl(int64_t num_groups, int64_t num_channels, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<torch::Tensor> dp_parameters() override;
  torch::Tensor per_sample_sq_norms(const DpOptions& o) override;
  void write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) override;
  torch::Tensor weight, bias;
  int64_t groups, channels;
  double eps;

 protected:
  std::vector<torch::Tensor> condense(const torch::Tensor& xhat, const torch::Tensor& g, const DpOptions& o) override;
};
TORCH_MODULE(GroupNorm);

// The per-model DP context: attaches to every DpLayer of a model (so they
// record in the backward) and turns the records into the DP-SGD gradient.
class DpSgd {
 public:
  // Fails (invalid_argument) on bad options, on a model with BatchNorm, or on a
  // trainable parameter that is not in a DP layer (its gradient could not be
  // clipped per sample), naming the module.
  static StatusOr<std::unique_ptr<DpSgd>> create(const std::shared_ptr<torch::nn::Module>& model,
                                                 const DpOptions& options);
  ~DpSgd();  // detaches the layers: they run as plain layers again
  DpSgd(const DpSgd&) = delete;
  DpSgd& operator=(const DpSgd&) = delete;

  // Per-sample gradient norms (B) of what the last backward recorded, before
  // clipping; the records stay for step(). Undefined if nothing was recorded.
  torch::Tensor per_sample_norms();
  // After loss.backward() (loss = Σ_i loss_i): sets every DP parameter's grad
  // to (Σ_i c_i g_i + N(0, σ²C²)) / expected_batch_size and clears the records.
  // With nothing recorded (an empty Poisson batch) the gradient is noise only:
  // still call it, and still count the step. Noise comes from libtorch's
  // default generator of the parameters' device (seed with torch::manual_seed).
  StatusOr<DpStepStats> step(double expected_batch_size);
  // Drops the records without a step (e.g. after a failed batch).
  void clear();

  const DpOptions& options() const { return options_; }
  std::vector<torch::Tensor> parameters() const;  // every DP-covered parameter

 private:
  DpSgd(DpOptions options, std::vector<std::shared_ptr<torch::nn::Module>> layers);
  torch::Tensor per_sample_sq_norms();
  DpOptions options_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;  // keeps the layers alive
  std::vector<DpLayer*> layers_;
  torch::Tensor sq_norms_;  // cached between per_sample_norms() and step()
};

// Poisson sampling, the sampling the RDP analysis of the subsampled Gaussian
// mechanism assumes (Abadi et al. 2016; Mironov, Talwar & Zhang 2019): at each
// step every sample of `pool` is in the batch independently with probability
// q = sample_rate, so the batch size is Binomial(n, q) and may be 0.
// Accounting assumptions that go with it:
//   * one step() = one sampled-Gaussian mechanism with rate q and noise σ;
//     ε after k steps is the accountant's ε(q, σ, k, δ) under add/remove-one
//     adjacency of the client's data;
//   * empty batches are steps too: call DpSgd::step (noise only) and count them
//     — skipping them would reveal that the batch was empty;
//   * the sum is divided by the expected batch size q·n, never by the realised
//     size (which depends on the data);
//   * batches of one epoch are not disjoint: an "epoch" is steps_per_epoch() =
//     round(1/q) steps, each sample seen once in expectation.
// std::mt19937_64 is not a cryptographic generator: fine for experiments; a
// deployment needing the formal guarantee should draw from a CSPRNG.
class PoissonSampler {
 public:
  PoissonSampler(std::span<const uint32_t> pool, double sample_rate, uint64_t seed);
  // The indices of the next batch, in pool order (cleared first; may end empty).
  void next(std::vector<uint32_t>& batch);
  double sample_rate() const { return q_; }
  double expected_batch_size() const { return q_ * static_cast<double>(pool_.size()); }
  int64_t steps_per_epoch() const;

 private:
  std::vector<uint32_t> pool_;
  double q_;
  std::mt19937_64 rng_;
};

// A CNN for Fashion-MNIST that DP-SGD can train, from the layers above:
// conv(C,32,5)+GroupNorm+ReLU+maxpool2, conv(32,64,5)+GroupNorm+ReLU+maxpool2,
// fc (64·s²→512)+ReLU, fc (512→classes); s = ((pixels−4)/2−4)/2 (4 for 28×28:
// fc 1024→512→10). The model registry's "CNN_GN".
std::shared_ptr<torch_internal::Net> make_groupnorm_cnn(int64_t channels, int64_t pixels, int64_t classes,
                                                        int64_t groups = 8);

}  // namespace memfl::dp
