// DP-SGD: layers with custom autograd that record what per-sample clipping
// needs, per-sample norms in three modes, book-keeping clipped gradients,
// Gaussian noise, Poisson sampling. See dp_sgd.h for the method.
#include "train/dp_sgd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <set>
#include <stdexcept>

namespace memfl::dp {

std::optional<ClipMode> parse_clip_mode(std::string_view name) {
  if (name == "naive") return ClipMode::kNaive;
  if (name == "ghost") return ClipMode::kGhost;
  if (name == "fused") return ClipMode::kFused;
  return std::nullopt;
}

const char* clip_mode_name(ClipMode mode) {
  switch (mode) {
    case ClipMode::kNaive:
      return "naive";
    case ClipMode::kGhost:
      return "ghost";
    case ClipMode::kFused:
      return "fused";
  }
  return "?";
}

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The layer travels through the autograd graph as an integer in the node's
// saved_data (IValue has no raw pointer). It outlives the graph: DpSgd holds
// the layers while attached, and the model holds them while it runs.
int64_t layer_handle(DpLayer* layer) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(layer)); }
DpLayer* layer_of(AutogradContext* ctx) {
  return reinterpret_cast<DpLayer*>(static_cast<intptr_t>(ctx->saved_data["layer"].toInt()));
}

// Sets p.grad to g (a fresh tensor each step; the optimizer reads p.grad).
// Never a view: an optimizer's zero_grad() detaches p.grad in place, which
// libtorch refuses for views. The writers below produce tensors of the
// parameter's shape, so this copies nothing in the usual case.
void set_grad(const Tensor& p, const Tensor& g) {
  Tensor out = g.to(p.scalar_type());
  if (out.sizes() != p.sizes()) out = out.reshape(p.sizes());
  if (out.is_view() || !out.is_contiguous()) out = out.clone(at::MemoryFormat::Contiguous);
  p.mutable_grad() = out;
}

// Runs f(b0, b1) on sample chunks of at most n and concatenates the per-sample results.
template <typename F>
Tensor over_chunks(int64_t batch, int64_t n, F&& f) {
  if (n >= batch) return f(0, batch);
  std::vector<Tensor> parts;
  for (int64_t b0 = 0; b0 < batch; b0 += n) parts.push_back(f(b0, std::min(batch, b0 + n)));
  return torch::cat(parts);
}

int64_t chunk_size(int64_t batch, int64_t tile, int64_t per_sample_elems) {
  const int64_t budget = std::max<int64_t>(batch, 1) * tile * tile;  // fused mode's temporaries, in elements
  return std::clamp<int64_t>(budget / std::max<int64_t>(per_sample_elems, 1), 1, std::max<int64_t>(batch, 1));
}

Tensor sq_sum(const Tensor& t) {  // Σ over all but dim 0 of t², without a t-sized temporary
  return t.flatten(1).norm(2, {1}).pow(2);
}

// T = 1: ‖g aᵀ‖² = ‖a‖²‖g‖², exact and cheap.
Tensor dense_single_position(const Tensor& a, const Tensor& g) { return sq_sum(a) * sq_sum(g); }

// Σ_{t,s} ⟨a_t,a_s⟩⟨g_t,g_s⟩ per sample (for tokens [x_t = x_s] instead of
// ⟨a_t,a_s⟩), in tile×tile blocks over T: at most n·tile² elements per Gram
// block exist at once, and only blocks on or above the diagonal are computed
// (both Gram matrices are symmetric: an off-diagonal block counts twice).
// Ghost mode calls it with tile = T: one block, the full T×T Gram matrices.
Tensor gram_sq(const Tensor& a, const Tensor& g, int64_t tile, bool tokens) {
  const int64_t n = g.size(0), t_len = g.size(1);
  Tensor sq = torch::zeros({n}, g.options());
  for (int64_t t0 = 0; t0 < t_len; t0 += tile) {
    const int64_t nt = std::min(tile, t_len - t0);
    Tensor at = a.narrow(1, t0, nt), gt = g.narrow(1, t0, nt);
    for (int64_t s0 = t0; s0 < t_len; s0 += tile) {
      const int64_t ns = std::min(tile, t_len - s0);
      Tensor as = a.narrow(1, s0, ns), gs = g.narrow(1, s0, ns);
      Tensor ka = tokens ? at.unsqueeze(2).eq(as.unsqueeze(1)).to(g.scalar_type()) : torch::bmm(at, as.transpose(1, 2));
      Tensor kg = torch::bmm(gt, gs.transpose(1, 2));
      sq.add_(ka.mul_(kg).sum({1, 2}), s0 == t0 ? 1.0 : 2.0);
    }
  }
  return sq;
}

// Embedding, per-sample gradients kept sparse: each (sample, token id) pair
// is one row Σ_{t: x_t = v} g_t (torch's unique); ‖row‖² summed per sample.
// At most n·T·d elements — the size of G itself, never n·V·d.
Tensor token_per_sample(const Tensor& idx, const Tensor& g, int64_t vocab) {
  const int64_t n = g.size(0), t_len = g.size(1), d = g.size(2);
  Tensor sample = torch::arange(n, idx.options()).unsqueeze(1).expand({n, t_len});
  Tensor keys = (sample * vocab + idx).flatten();
  auto uniq = at::_unique2(keys, /*sorted=*/false, /*return_inverse=*/true, /*return_counts=*/false);
  const Tensor& ids = std::get<0>(uniq);
  Tensor inverse = std::get<1>(uniq).flatten();
  Tensor rows = torch::zeros({ids.size(0), d}, g.options()).index_add_(0, inverse, g.reshape({-1, d}));
  Tensor row_sample = torch::zeros_like(ids).scatter_(0, inverse, sample.flatten());
  return torch::zeros({n}, g.options()).index_add_(0, row_sample, sq_sum(rows));
}

// Embedding's materialised per-sample gradients, n×V×d (the naive reference).
Tensor token_dense(const Tensor& idx, const Tensor& g, int64_t vocab) {
  const int64_t n = g.size(0), d = g.size(2);
  Tensor keys = (torch::arange(n, idx.options()).unsqueeze(1) * vocab + idx).flatten();
  return torch::zeros({n * vocab, d}, g.options()).index_add_(0, keys, g.reshape({-1, d})).view({n, vocab, d});
}

// Conv2d's input as im2col patches, n×L×(in·k·k) in the weight's (c, ki, kj)
// order, through strided views (unfold) and one copy: libtorch 1.13's CPU
// im2col is about 40 times slower.
Tensor unfold_patches(const Tensor& x, int64_t k, int64_t stride, int64_t padding, int64_t dilation) {
  Tensor xp = padding > 0 ? torch::constant_pad_nd(x, {padding, padding, padding, padding}) : x;
  const int64_t span = dilation * (k - 1) + 1;
  Tensor u = xp.unfold(2, span, stride).unfold(3, span, stride);  // n×C×Ho×Wo×span×span
  if (dilation > 1) u = u.slice(4, 0, span, dilation).slice(5, 0, span, dilation);
  const int64_t n = x.size(0), c = x.size(1), l = u.size(2) * u.size(3);
  return u.permute({0, 2, 3, 1, 4, 5}).reshape({n, l, c * k * k});
}

// Per-sample Conv2d weight gradients, n×out×(in·k·k). On CUDA, G_iᵀA_i in one
// bmm over the unfolded input (cuDNN's grouped convolutions with one group per
// sample were 37 times slower on an H200 at B = 256). On CPU, the n samples as
// the groups of one grouped convolution's weight backward (1×(n·in)×H×W input,
// 1×(n·out)×Ho×Wo output gradient): oneDNN does the work with no unfolding,
// 3 to 5 times faster than bmm with the reference BLAS of Debian's libtorch.
Tensor conv_per_sample_grads(const Tensor& x, const Tensor& g, int64_t k, int64_t stride, int64_t padding,
                             int64_t dilation) {
  const int64_t n = x.size(0), c_in = x.size(1), c_out = g.size(1);
  if (x.is_cuda()) return torch::bmm(g.flatten(2), unfold_patches(x, k, stride, padding, dilation));
  Tensor shape_only = torch::empty({n * c_out, c_in, k, k}, g.options());  // read for its shape only
  const std::array<int64_t, 1> bias_sizes{n * c_out};
  auto r = at::convolution_backward(g.reshape({1, n * c_out, g.size(2), g.size(3)}),
                                    x.reshape({1, n * c_in, x.size(2), x.size(3)}), shape_only,
                                    at::IntArrayRef(bias_sizes), {stride, stride}, {padding, padding},
                                    {dilation, dilation}, false, {0, 0}, n, {false, true, false});
  return std::get<1>(r).view({n, c_out, c_in * k * k});
}

// Whether a layer call keeps its per-sample gradients (grad_elems per sample)
// instead of A and G (kept_elems per sample): naive always, ghost never,
// fused when they are no larger (or as forced).
bool keep_per_sample(const DpOptions& o, int64_t grad_elems, int64_t kept_elems) {
  switch (o.mode) {
    case ClipMode::kNaive:
      return true;
    case ClipMode::kGhost:
      return false;
    case ClipMode::kFused:
      break;
  }
  if (o.fused_route == FusedRoute::kKeepPerSample) return true;
  if (o.fused_route != FusedRoute::kAuto) return false;
  // On a tie the per-sample gradients win: they cost the same bytes and save
  // the step a matmul per layer (measured at T = 1024, 2048×2048 projections:
  // both 1.00× no_dp's memory; 1.20× against 1.28× its time).
  return grad_elems <= kept_elems;
}

// ‖G_iᵀA_i‖² per sample for a Linear-like layer whose A and G were kept.
// `get(b0, b1)` returns A (n×T×d_in) and G (n×T×d_out) for samples [b0, b1);
// `grads(b0, b1)` their per-sample gradients (n×d_out×d_in); `a_cost` is what
// A costs per sample to build (0 for Linear, whose A is a view; T·d_in for
// Conv2d's unfolded input, which its per-sample gradients do not need).
template <typename Get, typename Grads>
Tensor dense_weight_sq(int64_t batch, int64_t t_len, int64_t d_in, int64_t d_out, int64_t a_cost, const Get& get,
                       const Grads& grads, const DpOptions& o) {
  if (o.mode == ClipMode::kNaive) return sq_sum(grads(0, batch));
  if (o.mode == ClipMode::kGhost) {
    auto [a, g] = get(0, batch);
    return t_len == 1 ? dense_single_position(a, g) : gram_sq(a, g, t_len, false);
  }
  if (t_len == 1) {
    return over_chunks(batch, chunk_size(batch, o.tile, a_cost + 1), [&](int64_t b0, int64_t b1) {
      auto [a, g] = get(b0, b1);
      return dense_single_position(a, g);
    });
  }
  // Per sample, per-sample gradients take d_in·d_out, the Gram route T² (plus
  // A, where A must be built): take the smaller.
  const bool per_sample = o.fused_route == FusedRoute::kPerSampleNorms ||
                          (o.fused_route == FusedRoute::kAuto && d_in * d_out < t_len * t_len + a_cost);
  if (per_sample) {  // a few samples at a time
    return over_chunks(batch, chunk_size(batch, o.tile, d_in * d_out),
                       [&](int64_t b0, int64_t b1) { return sq_sum(grads(b0, b1)); });
  }
  const int64_t tile = std::min(o.tile, t_len);
  return over_chunks(batch, chunk_size(batch, o.tile, a_cost + tile * tile), [&](int64_t b0, int64_t b1) {
    auto [a, g] = get(b0, b1);
    return gram_sq(a, g, tile, false);
  });
}

// Book-keeping: Σ_i c_i G_iᵀA_i = (c ⊙ G)ᵀA in one matmul; the smaller of A
// and G is the one scaled (a temporary of its size).
Tensor bookkeeping_dense(const Tensor& a, const Tensor& g, const Tensor& clip) {
  const int64_t batch = g.size(0), d_in = a.size(2), d_out = g.size(2);
  Tensor c = clip.to(g.scalar_type()).view({batch, 1, 1});
  if (d_in <= d_out) return g.reshape({-1, d_out}).t().mm((a * c).reshape({-1, d_in}));
  return (g * c).reshape({-1, d_out}).t().mm(a.reshape({-1, d_in}));
}

// Per-sample gradients of a layer summed over its calls (records), one B×…
// tensor per parameter; records that kept A and G get theirs from `compute`.
template <typename F>
std::vector<Tensor> summed_per_sample(const std::vector<DpRecord>& records, F&& compute) {
  std::vector<Tensor> sum;
  for (const DpRecord& r : records) {
    std::vector<Tensor> ps = r.condensed() ? r.per_sample : compute(r);
    if (sum.empty()) {
      sum = std::move(ps);
    } else {
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + ps[i];
    }
  }
  return sum;
}

bool any_condensed(const std::vector<DpRecord>& records) {
  return std::any_of(records.begin(), records.end(), [](const DpRecord& r) { return r.condensed(); });
}

Tensor sq_sum_all(const std::vector<Tensor>& per_sample) {
  Tensor sq = sq_sum(per_sample.front());
  for (size_t i = 1; i < per_sample.size(); ++i) sq = sq + sq_sum(per_sample[i]);
  return sq;
}

// p.grad = Σ_i c_i g_i from kept per-sample gradients (B×…, one per parameter).
void write_from_per_sample(const std::vector<Tensor>& params, const std::vector<Tensor>& per_sample,
                           const Tensor& clip) {
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& ps = per_sample[i];
    // c (1×B) · per-sample (B×numel), written straight into a tensor of the parameter's shape.
    Tensor out = torch::empty(params[i].sizes(), ps.options());
    Tensor flat = out.view({1, -1});
    at::mm_out(flat, clip.to(ps.scalar_type()).view({1, -1}), ps.reshape({ps.size(0), -1}));
    set_grad(params[i], out);
  }
}

int64_t batch_of(const std::vector<DpRecord>& records, const char* layer) {
  const int64_t batch = records.front().batch_size();
  for (const DpRecord& r : records) {
    TORCH_CHECK(r.batch_size() == batch, layer, ": records of different batch sizes (one backward per step())");
  }
  return batch;
}

// y = x̂ ⊙ w broadcast over `channel_dim` (1 or -1): the affine part of
// LayerNorm / RMSNorm / GroupNorm. Their per-sample gradients are d-sized.
Tensor channel_view(const Tensor& w, int64_t ndim, int64_t channel_dim) {
  if (channel_dim != 1) return w;
  std::vector<int64_t> shape(static_cast<size_t>(ndim - 1), 1);
  shape[0] = w.size(0);
  return w.view(shape);
}
Tensor per_channel_sum(const Tensor& t, int64_t channels, int64_t channel_dim) {  // B×…  → B×C
  const int64_t batch = t.size(0);
  return channel_dim == 1 ? t.reshape({batch, channels, -1}).sum(2) : t.reshape({batch, -1, channels}).sum(1);
}

// Per-sample gradients of x̂ ⊙ w (+ b): Σ over positions of G ⊙ x̂ (and of G).
std::vector<Tensor> affine_per_sample(const Tensor& xhat, const Tensor& g, int64_t channels, int64_t channel_dim,
                                      bool with_bias) {
  std::vector<Tensor> ps{per_channel_sum(g * xhat, channels, channel_dim)};  // activation-sized temporary
  if (with_bias) ps.push_back(per_channel_sum(g, channels, channel_dim));
  return ps;
}

// ---------------------------------------------------------------- autograd
// Each Function's backward returns the input gradient only and records
// (activation, output gradient) in its layer, which may condense them into
// per-sample gradients; the weight gradient is left to DpSgd::step, which
// computes it once, already clipped. If the layer was detached between
// forward and backward, the plain summed gradient is returned instead.

struct LinearFn : torch::autograd::Function<LinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, int64_t layer) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["layer"] = layer;
    return torch::linear(x, w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &g = grads[0];
    Tensor gx, gw;
    if (ctx->needs_input_grad(0)) gx = g.matmul(w);
    if (!layer_of(ctx)->record(x.detach(), g.detach())) {
      gw = g.reshape({-1, g.size(-1)}).t().mm(x.reshape({-1, x.size(-1)}));
    }
    return {gx, gw, Tensor()};
  }
};

// s · x Aᵀ Bᵀ. The backward returns x's gradient and records (x, G); the
// adapter condenses them into per-sample gradients at once.
struct LoraFn : torch::autograd::Function<LoraFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& a, const Tensor& b, double scaling,
                        int64_t layer) {
    ctx->save_for_backward({x, a, b});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["scaling"] = scaling;
    return torch::linear(torch::linear(x, a), b).mul(scaling);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &a = saved[1], &b = saved[2], &g = grads[0];
    const double s = ctx->saved_data["scaling"].toDouble();
    Tensor gh = g.matmul(b).mul(s);  // the gradient at H = X Aᵀ: [.., r]
    Tensor gx = ctx->needs_input_grad(0) ? gh.matmul(a) : Tensor();
    Tensor ga, gb;
    if (!layer_of(ctx)->record(x.detach(), g.detach())) {
      const int64_t r = a.size(0);
      ga = gh.reshape({-1, r}).t().mm(x.reshape({-1, x.size(-1)}));
      gb = g.reshape({-1, g.size(-1)}).t().mm(torch::linear(x, a).reshape({-1, r})).mul(s);
    }
    return {gx, ga, gb, Tensor(), Tensor()};
  }
};

struct EmbeddingFn : torch::autograd::Function<EmbeddingFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& w, const Tensor& idx, int64_t layer) {
    ctx->save_for_backward({idx});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["vocab"] = w.size(0);
    return torch::embedding(w, idx);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor idx = ctx->get_saved_variables()[0];
    const Tensor& g = grads[0];
    Tensor gw;
    if (!layer_of(ctx)->record(idx.detach(), g.detach())) {
      const int64_t d = g.size(-1);
      gw = torch::zeros({ctx->saved_data["vocab"].toInt(), d}, g.options())
               .index_add_(0, idx.flatten(), g.reshape({-1, d}));
    }
    return {gw, Tensor(), Tensor()};
  }
};

struct ConvFn : torch::autograd::Function<ConvFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, int64_t layer, int64_t stride,
                        int64_t padding, int64_t dilation) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    return torch::conv2d(x, w, {}, {stride, stride}, {padding, padding}, {dilation, dilation});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &g = grads[0];
    const bool recorded = layer_of(ctx)->record(x.detach(), g.detach());
    const bool need_x = ctx->needs_input_grad(0);
    Tensor gx, gw;
    if (need_x || !recorded) {
      const int64_t s = ctx->saved_data["stride"].toInt(), p = ctx->saved_data["padding"].toInt(),
                    d = ctx->saved_data["dilation"].toInt();
      const std::array<int64_t, 1> bias_sizes{w.size(0)};  // unused: the bias is outside this Function
      auto r = at::convolution_backward(g, x, w, at::IntArrayRef(bias_sizes), {s, s}, {p, p}, {d, d}, false, {0, 0}, 1,
                                        {need_x, !recorded, false});
      gx = std::get<0>(r);
      gw = std::get<1>(r);
    }
    return {gx, gw, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

struct AffineFn : torch::autograd::Function<AffineFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& xhat, const Tensor& w, int64_t layer, int64_t channel_dim) {
    ctx->save_for_backward({xhat, w});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["channel_dim"] = channel_dim;
    return xhat * channel_view(w, xhat.dim(), channel_dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &xhat = saved[0], &w = saved[1], &g = grads[0];
    const int64_t cd = ctx->saved_data["channel_dim"].toInt();
    Tensor gx, gw;
    if (ctx->needs_input_grad(0)) gx = g * channel_view(w, xhat.dim(), cd);
    if (!layer_of(ctx)->record(xhat.detach(), g.detach())) gw = per_channel_sum(g * xhat, w.size(0), cd).sum(0);
    return {gx, gw, Tensor(), Tensor()};
  }
};

thread_local torch::Device t_init_device(torch::kCPU);

Tensor plain_uniform(std::vector<int64_t> shape, int64_t fan_in) {  // nn::Linear / nn::Conv2d's initialisation
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return torch::empty(shape, torch::TensorOptions().device(t_init_device)).uniform_(-bound, bound);
}

}  // namespace

InitDeviceGuard::InitDeviceGuard(torch::Device device) : previous_(t_init_device) { t_init_device = device; }
InitDeviceGuard::~InitDeviceGuard() { t_init_device = previous_; }

// ---------------------------------------------------------------- DpLayer

bool DpLayer::record(const torch::Tensor& input, const torch::Tensor& grad_output) {
  DpOptions o;
  {
    std::lock_guard<std::mutex> lock(mu_);  // CPU and CUDA backward threads may both reach a layer
    if (owner_ == nullptr) return false;
    o = owner_->options();
  }
  DpRecord r;
  {
    torch::NoGradGuard no_grad;  // even under create_graph: these are gradients, not graph
    r.per_sample = condense(input, grad_output, o);
  }
  if (!r.condensed()) {
    r.input = input;
    r.grad_output = grad_output;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (owner_ == nullptr) return false;
  records_.push_back(std::move(r));
  return true;
}

bool DpLayer::has_records() {
  std::lock_guard<std::mutex> lock(mu_);
  return !records_.empty();
}

int64_t DpLayer::recorded_batch_size() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.empty() ? -1 : records_.front().batch_size();
}

void DpLayer::clear_records() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
  cache_.clear();
}

bool DpLayer::recording(const torch::Tensor& weight) const {
  return owner_ != nullptr && torch::GradMode::is_enabled() && weight.requires_grad();
}

std::vector<DpRecord> DpLayer::records_copy() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

// ---------------------------------------------------------------- Linear

namespace {

// A layer called k times in one forward has per-sample gradient
// Σ_k G_kᵀA_k = [G_1;…;G_k]ᵀ[A_1;…;A_k]: its records concatenate along T.
std::pair<Tensor, Tensor> gather_sequences(const std::vector<DpRecord>& records, int64_t batch, int64_t d_in,
                                           int64_t d_out) {
  std::vector<Tensor> as, gs;
  for (const DpRecord& r : records) {
    as.push_back(r.input.reshape({batch, -1, d_in}));
    gs.push_back(r.grad_output.reshape({batch, -1, d_out}));
  }
  if (records.size() == 1) return {as[0], gs[0]};
  return {torch::cat(as, 1), torch::cat(gs, 1)};
}

std::vector<Tensor> linear_per_sample(const Tensor& x, const Tensor& g, int64_t d_in, int64_t d_out, bool with_bias) {
  const int64_t batch = g.size(0);
  Tensor a3 = x.reshape({batch, -1, d_in}), g3 = g.reshape({batch, -1, d_out});
  std::vector<Tensor> ps{torch::bmm(g3.transpose(1, 2), a3)};  // G_iᵀA_i: B×d_out×d_in
  if (with_bias) ps.push_back(g3.sum(1));
  return ps;
}

}  // namespace

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", plain_uniform({out_features, in_features}, in_features));
  if (with_bias) bias = register_parameter("bias", plain_uniform({out_features}, in_features));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (!recording(weight)) return torch::linear(x, weight, bias);
  Tensor y = LinearFn::apply(x, weight, layer_handle(this));
  return bias.defined() ? y + bias : y;  // the bias's autograd gradient is overwritten by step()
}

std::vector<torch::Tensor> LinearImpl::dp_parameters() {
  if (bias.defined()) return {weight, bias};
  return {weight};
}

std::vector<torch::Tensor> LinearImpl::condense(const torch::Tensor& x, const torch::Tensor& g, const DpOptions& o) {
  const int64_t d_in = weight.size(1), d_out = weight.size(0), batch = g.size(0);
  if (batch == 0) return {};
  const int64_t t_len = g.numel() / (batch * d_out);
  if (!keep_per_sample(o, d_in * d_out, t_len * (d_in + d_out))) return {};
  return linear_per_sample(x, g, d_in, d_out, bias.defined());
}

torch::Tensor LinearImpl::per_sample_sq_norms(const DpOptions& o) {
  const auto records = records_copy();
  const int64_t batch = batch_of(records, "dp::Linear"), d_in = weight.size(1), d_out = weight.size(0);
  cache_.clear();
  if (any_condensed(records)) {
    cache_ = summed_per_sample(records, [&](const DpRecord& r) {
      return linear_per_sample(r.input, r.grad_output, d_in, d_out, bias.defined());
    });
    return sq_sum_all(cache_);
  }
  const auto ag = gather_sequences(records, batch, d_in, d_out);
  const Tensor &a = ag.first, &g = ag.second;
  auto get = [&](int64_t b0, int64_t b1) { return std::make_pair(a.narrow(0, b0, b1 - b0), g.narrow(0, b0, b1 - b0)); };
  auto grads = [&](int64_t b0, int64_t b1) {
    return torch::bmm(g.narrow(0, b0, b1 - b0).transpose(1, 2), a.narrow(0, b0, b1 - b0));
  };
  Tensor sq = dense_weight_sq(batch, g.size(1), d_in, d_out, 0, get, grads, o);
  if (bias.defined()) sq = sq + sq_sum(g.sum(1));  // per-sample bias gradients: B×d_out
  return sq;
}

void LinearImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) {
  const auto records = records_copy();
  if (cache_.empty() && any_condensed(records)) per_sample_sq_norms(o);
  if (!cache_.empty()) {
    write_from_per_sample(dp_parameters(), cache_, clip);
  } else {
    const auto ag = gather_sequences(records, batch_of(records, "dp::Linear"), weight.size(1), weight.size(0));
    set_grad(weight, bookkeeping_dense(ag.first, ag.second, clip));
    if (bias.defined()) set_grad(bias, clip.to(ag.second.scalar_type()).matmul(ag.second.sum(1)));
  }
  cache_.clear();
}

// ---------------------------------------------------------------- LoRA adapter

LoraAdapterImpl::LoraAdapterImpl(int64_t in_features, int64_t out_features, int64_t r, double s,
                                 const torch::TensorOptions& options)
    : scaling(s) {
  const auto f32 = options.dtype(torch::kFloat32);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  Tensor a, b;
  {
    torch::NoGradGuard g;
    a = torch::empty({r, in_features}, f32).uniform_(-bound, bound);
    b = torch::zeros({out_features, r}, f32);
  }
  lora_A = register_parameter("lora_A", a);
  lora_B = register_parameter("lora_B", b);
}

torch::Tensor LoraAdapterImpl::forward(const torch::Tensor& x) {
  if (!recording(lora_A)) return torch::linear(torch::linear(x, lora_A), lora_B).mul(scaling);
  return LoraFn::apply(x, lora_A, lora_B, scaling, layer_handle(this));
}

std::vector<torch::Tensor> LoraAdapterImpl::dp_parameters() { return {lora_A, lora_B}; }

std::vector<torch::Tensor> LoraAdapterImpl::condense(const torch::Tensor& x, const torch::Tensor& g,
                                                     const DpOptions& o) {
  (void)o;
  const int64_t batch = g.size(0), d_in = lora_A.size(1), d_out = lora_B.size(0);
  if (batch == 0) return {};
  Tensor x3 = x.reshape({batch, -1, d_in}), g3 = g.reshape({batch, -1, d_out});
  Tensor h3 = torch::linear(x3, lora_A);                            // B×T×r
  Tensor gh3 = g3.matmul(lora_B).mul(scaling);                      // B×T×r
  Tensor ga = torch::bmm(gh3.transpose(1, 2), x3);                  // B×r×d_in
  Tensor gb = torch::bmm(g3.transpose(1, 2), h3).mul_(scaling);     // B×d_out×r
  return {ga, gb};
}

torch::Tensor LoraAdapterImpl::per_sample_sq_norms(const DpOptions& o) {
  const auto records = records_copy();
  batch_of(records, "dp::LoraAdapter");
  cache_ = summed_per_sample(records, [&](const DpRecord& r) { return condense(r.input, r.grad_output, o); });
  return sq_sum_all(cache_);
}

void LoraAdapterImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) {
  if (cache_.empty()) per_sample_sq_norms(o);
  write_from_per_sample(dp_parameters(), cache_, clip);
  cache_.clear();
}

// ---------------------------------------------------------------- Embedding

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim) {
  weight = register_parameter("weight", torch::randn({num_embeddings, embedding_dim},
                                                     torch::TensorOptions().device(t_init_device)));  // N(0, 1)
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& indices) {
  if (!recording(weight)) return torch::embedding(weight, indices);
  return EmbeddingFn::apply(weight, indices, layer_handle(this));
}

std::vector<torch::Tensor> EmbeddingImpl::dp_parameters() { return {weight}; }

namespace {

std::pair<Tensor, Tensor> gather_tokens(const std::vector<DpRecord>& records, int64_t batch, int64_t d) {
  std::vector<Tensor> xs, gs;
  for (const DpRecord& r : records) {
    xs.push_back(r.input.to(torch::kLong).reshape({batch, -1}));
    gs.push_back(r.grad_output.reshape({batch, -1, d}));
  }
  if (records.size() == 1) return {xs[0], gs[0]};
  return {torch::cat(xs, 1), torch::cat(gs, 1)};
}

}  // namespace

torch::Tensor EmbeddingImpl::per_sample_sq_norms(const DpOptions& o) {
  const auto records = records_copy();
  const int64_t batch = batch_of(records, "dp::Embedding"), d = weight.size(1), vocab = weight.size(0);
  const auto xg = gather_tokens(records, batch, d);
  const Tensor &idx = xg.first, &g = xg.second;
  const int64_t t_len = g.size(1);
  cache_.clear();
  if (o.mode == ClipMode::kNaive) {
    cache_ = {token_dense(idx, g, vocab)};
    return sq_sum(cache_[0]);
  }
  if (t_len == 1) return sq_sum(g);  // one token: its row of the gradient is g
  if (o.mode == ClipMode::kGhost) return gram_sq(idx, g, t_len, true);
  // Sparse per-sample gradients hold at most min(T, V)·d per sample, the Gram route T².
  const bool per_sample = o.fused_route == FusedRoute::kGram
                              ? false
                              : o.fused_route != FusedRoute::kAuto || std::min(t_len, vocab) * d < t_len * t_len;
  if (per_sample) {
    return over_chunks(batch, chunk_size(batch, o.tile, t_len * d), [&](int64_t b0, int64_t b1) {
      return token_per_sample(idx.narrow(0, b0, b1 - b0), g.narrow(0, b0, b1 - b0), vocab);
    });
  }
  return gram_sq(idx, g, std::min(o.tile, t_len), true);
}

void EmbeddingImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) {
  if (!cache_.empty()) {  // naive: Σ_i c_i g_i from the per-sample gradients
    write_from_per_sample({weight}, cache_, clip);
  } else {  // book-keeping: scatter c_i·g_t into the rows of the tokens
    const auto records = records_copy();
    const int64_t batch = batch_of(records, "dp::Embedding"), d = weight.size(1);
    const auto xg = gather_tokens(records, batch, d);
    Tensor c = clip.to(xg.second.scalar_type()).view({batch, 1, 1});
    set_grad(weight, torch::zeros_like(weight, xg.second.options())
                         .index_add_(0, xg.first.flatten(), (xg.second * c).reshape({-1, d})));
  }
  cache_.clear();
}

// ---------------------------------------------------------------- Conv2d

Conv2dImpl::Conv2dImpl(int64_t in, int64_t out, int64_t kernel_size, int64_t stride_, int64_t padding_,
                       int64_t dilation_, bool with_bias)
    : in_channels(in), out_channels(out), kernel(kernel_size), stride(stride_), padding(padding_), dilation(dilation_) {
  const int64_t fan_in = in * kernel_size * kernel_size;
  weight = register_parameter("weight", plain_uniform({out, in, kernel_size, kernel_size}, fan_in));
  if (with_bias) bias = register_parameter("bias", plain_uniform({out}, fan_in));
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, "dp::Conv2d expects B×C×H×W input, got ", x.dim(), " dimensions");
  if (!recording(weight)) {
    return torch::conv2d(x, weight, bias, {stride, stride}, {padding, padding}, {dilation, dilation});
  }
  Tensor y = ConvFn::apply(x, weight, layer_handle(this), stride, padding, dilation);
  return bias.defined() ? y + bias.view({1, -1, 1, 1}) : y;
}

std::vector<torch::Tensor> Conv2dImpl::dp_parameters() {
  if (bias.defined()) return {weight, bias};
  return {weight};
}

std::vector<torch::Tensor> Conv2dImpl::condense(const torch::Tensor& x, const torch::Tensor& g, const DpOptions& o) {
  const int64_t batch = g.size(0);
  if (batch == 0) return {};
  // Book-keeping keeps the input and G (not the unfolded input): compare with those.
  if (!keep_per_sample(o, weight.numel(), (x.numel() + g.numel()) / batch)) return {};
  std::vector<Tensor> ps{conv_per_sample_grads(x, g, kernel, stride, padding, dilation)};
  if (bias.defined()) ps.push_back(g.sum({2, 3}));
  return ps;
}

torch::Tensor Conv2dImpl::per_sample_sq_norms(const DpOptions& o) {
  // Conv2d is Linear on the unfolded input: A_i = L×(in·k²), G_i = L×out,
  // L = output positions. The Gram route unfolds here, a sample chunk at a
  // time in fused mode, never kept between steps; per-sample gradients need
  // no unfolding (a grouped convolution's weight backward).
  const auto records = records_copy();
  const int64_t batch = batch_of(records, "dp::Conv2d"), d_in = weight[0].numel(), d_out = out_channels;
  auto per_sample_of = [&](const DpRecord& r) {
    std::vector<Tensor> ps{conv_per_sample_grads(r.input, r.grad_output, kernel, stride, padding, dilation)};
    if (bias.defined()) ps.push_back(r.grad_output.sum({2, 3}));
    return ps;
  };
  cache_.clear();
  if (any_condensed(records)) {
    cache_ = summed_per_sample(records, per_sample_of);
    return sq_sum_all(cache_);
  }
  int64_t t_len = 0;
  for (const DpRecord& r : records) t_len += r.grad_output.size(2) * r.grad_output.size(3);
  auto get = [&](int64_t b0, int64_t b1) {
    std::vector<Tensor> as, gs;
    for (const DpRecord& r : records) {
      as.push_back(unfold_patches(r.input.narrow(0, b0, b1 - b0), kernel, stride, padding, dilation));  // n×L×in·k²
      gs.push_back(r.grad_output.narrow(0, b0, b1 - b0).flatten(2).transpose(1, 2));                    // n×L×out
    }
    if (records.size() == 1) return std::make_pair(as[0], gs[0]);
    return std::make_pair(torch::cat(as, 1), torch::cat(gs, 1));
  };
  auto grads = [&](int64_t b0, int64_t b1) {
    Tensor sum;
    for (const DpRecord& r : records) {
      Tensor p = conv_per_sample_grads(r.input.narrow(0, b0, b1 - b0), r.grad_output.narrow(0, b0, b1 - b0), kernel,
                                       stride, padding, dilation);
      sum = sum.defined() ? sum.add_(p) : p;
    }
    return sum;
  };
  Tensor sq = dense_weight_sq(batch, t_len, d_in, d_out, t_len * d_in, get, grads, o);
  if (bias.defined()) {
    Tensor gb;
    for (const DpRecord& r : records) gb = gb.defined() ? gb + r.grad_output.sum({2, 3}) : r.grad_output.sum({2, 3});
    sq = sq + sq_sum(gb);
  }
  return sq;
}

void Conv2dImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions& o) {
  const auto records = records_copy();
  if (cache_.empty() && any_condensed(records)) per_sample_sq_norms(o);
  if (!cache_.empty()) {
    write_from_per_sample(dp_parameters(), cache_, clip);
    cache_.clear();
    return;
  }
  // Book-keeping without unfolding: conv2d's own weight backward on c ⊙ G.
  const int64_t batch = batch_of(records, "dp::Conv2d");
  Tensor c = clip.to(weight.scalar_type()).view({batch, 1, 1, 1});
  Tensor gw, gb;
  const std::array<int64_t, 1> bias_sizes{out_channels};
  for (const DpRecord& r : records) {
    Tensor gc = r.grad_output * c;
    auto res =
        at::convolution_backward(gc, r.input, weight.detach(), at::IntArrayRef(bias_sizes), {stride, stride},
                                 {padding, padding}, {dilation, dilation}, false, {0, 0}, 1, {false, true, false});
    gw = gw.defined() ? gw + std::get<1>(res) : std::get<1>(res);
    if (bias.defined()) gb = gb.defined() ? gb + gc.sum({0, 2, 3}) : gc.sum({0, 2, 3});
  }
  set_grad(weight, gw);
  if (bias.defined()) set_grad(bias, gb);
}

// ---------------------------------------------------------------- norms
// x̂ through libtorch's own normalisation (no affine), then the recording
// affine, whose backward keeps only the d-sized per-sample gradients.

namespace {

Tensor affine_norms(std::vector<Tensor>& cache, const std::vector<DpRecord>& records, int64_t channels,
                    int64_t channel_dim, bool with_bias) {
  batch_of(records, "dp affine");
  cache = summed_per_sample(records, [&](const DpRecord& r) {
    return affine_per_sample(r.input, r.grad_output, channels, channel_dim, with_bias);
  });
  return sq_sum_all(cache);
}

void affine_write(std::vector<Tensor>& cache, const std::vector<DpRecord>& records, const Tensor& clip,
                  const std::vector<Tensor>& params, int64_t channels, int64_t channel_dim) {
  if (cache.empty()) affine_norms(cache, records, channels, channel_dim, params.size() > 1);
  write_from_per_sample(params, cache, clip);
  cache.clear();
}

}  // namespace

LayerNormImpl::LayerNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (!recording(weight)) return torch::layer_norm(x, {dim}, weight, bias, eps);
  Tensor xhat = torch::layer_norm(x, {dim}, {}, {}, eps);
  return AffineFn::apply(xhat, weight, layer_handle(this), int64_t{-1}) + bias;
}

std::vector<torch::Tensor> LayerNormImpl::dp_parameters() { return {weight, bias}; }

std::vector<torch::Tensor> LayerNormImpl::condense(const torch::Tensor& xhat, const torch::Tensor& g,
                                                   const DpOptions&) {
  return affine_per_sample(xhat, g, dim, -1, true);
}

torch::Tensor LayerNormImpl::per_sample_sq_norms(const DpOptions&) {
  return affine_norms(cache_, records_copy(), dim, -1, true);
}

void LayerNormImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions&) {
  affine_write(cache_, records_copy(), clip, dp_parameters(), dim, -1);
}

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}, torch::TensorOptions().device(t_init_device)));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  Tensor xhat = x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (!recording(weight)) return xhat * weight;
  return AffineFn::apply(xhat, weight, layer_handle(this), int64_t{-1});
}

std::vector<torch::Tensor> RMSNormImpl::dp_parameters() { return {weight}; }

std::vector<torch::Tensor> RMSNormImpl::condense(const torch::Tensor& xhat, const torch::Tensor& g, const DpOptions&) {
  return affine_per_sample(xhat, g, dim, -1, false);
}

torch::Tensor RMSNormImpl::per_sample_sq_norms(const DpOptions&) {
  return affine_norms(cache_, records_copy(), dim, -1, false);
}

void RMSNormImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions&) {
  affine_write(cache_, records_copy(), clip, dp_parameters(), dim, -1);
}

GroupNormImpl::GroupNormImpl(int64_t num_groups, int64_t num_channels, double eps_)
    : groups(num_groups), channels(num_channels), eps(eps_) {
  TORCH_CHECK(num_channels % num_groups == 0, "dp::GroupNorm: ", num_channels, " channels in ", num_groups, " groups");
  weight = register_parameter("weight", torch::ones({channels}));
  bias = register_parameter("bias", torch::zeros({channels}));
}

torch::Tensor GroupNormImpl::forward(const torch::Tensor& x) {
  if (!recording(weight)) return torch::group_norm(x, groups, weight, bias, eps);
  Tensor xhat = torch::group_norm(x, groups, {}, {}, eps);
  return AffineFn::apply(xhat, weight, layer_handle(this), int64_t{1}) + channel_view(bias, x.dim(), 1);
}

std::vector<torch::Tensor> GroupNormImpl::dp_parameters() { return {weight, bias}; }

std::vector<torch::Tensor> GroupNormImpl::condense(const torch::Tensor& xhat, const torch::Tensor& g,
                                                   const DpOptions&) {
  return affine_per_sample(xhat, g, channels, 1, true);
}

torch::Tensor GroupNormImpl::per_sample_sq_norms(const DpOptions&) {
  return affine_norms(cache_, records_copy(), channels, 1, true);
}

void GroupNormImpl::write_clipped_grads(const torch::Tensor& clip, const DpOptions&) {
  affine_write(cache_, records_copy(), clip, dp_parameters(), channels, 1);
}

// ---------------------------------------------------------------- DpSgd

namespace {

bool is_batch_norm(torch::nn::Module& m) {
  return dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m) != nullptr || m.name().find("BatchNorm") != std::string::npos;
}

}  // namespace

StatusOr<std::unique_ptr<DpSgd>> DpSgd::create(const std::shared_ptr<torch::nn::Module>& model, const DpOptions& o) {
  if (!model) return invalid_argument("DP-SGD: no model");
  if (!(o.max_grad_norm > 0)) return invalid_argument("DP-SGD: max_grad_norm must be > 0, got {}", o.max_grad_norm);
  if (!(o.noise_multiplier >= 0)) {
    return invalid_argument("DP-SGD: noise_multiplier must be >= 0, got {}", o.noise_multiplier);
  }
  if (o.tile < 1) return invalid_argument("DP-SGD: tile must be >= 1, got {}", o.tile);
  const auto modules = model->named_modules("", /*include_self=*/true);
  auto where = [](const std::string& key) { return key.empty() ? std::string("the model") : "module '" + key + "'"; };
  // BatchNorm first, anywhere in the model: its message is the one to act on.
  for (const auto& item : modules) {
    if (is_batch_norm(*item.value())) {
      return invalid_argument(
          "DP-SGD cannot use BatchNorm ({} is {}): batch statistics mix the samples of a batch, so a sample's "
          "gradient depends on the others and clipping it bounds nothing. Use GroupNorm instead (memfl::dp::GroupNorm; "
          "model CNN_GN)",
          where(item.key()), item.value()->name());
    }
  }
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
  std::set<DpLayer*> seen;
  for (const auto& item : modules) {
    torch::nn::Module& m = *item.value();
    if (auto* layer = dynamic_cast<DpLayer*>(&m)) {
      if (layer->attached() && !seen.count(layer)) {
        return failed_precondition("DP-SGD: {} is already attached to another DpSgd", where(item.key()));
      }
      if (seen.insert(layer).second) layers.push_back(item.value());
      continue;
    }
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      if (!p.value().requires_grad()) continue;
      return invalid_argument(
          "DP-SGD cannot clip parameter '{}' of {} ({}): it has no per-sample gradients. Build the model from "
          "memfl::dp layers (Linear, Embedding, Conv2d, LayerNorm, RMSNorm, GroupNorm) or freeze it",
          p.key(), where(item.key()), m.name());
    }
  }
  return std::unique_ptr<DpSgd>(new DpSgd(o, std::move(layers)));
}

DpSgd::DpSgd(DpOptions options, std::vector<std::shared_ptr<torch::nn::Module>> layers)
    : options_(options), modules_(std::move(layers)) {
  for (auto& m : modules_) {
    auto* layer = dynamic_cast<DpLayer*>(m.get());
    std::lock_guard<std::mutex> lock(layer->mu_);
    layer->owner_ = this;
    layer->records_.clear();
    layers_.push_back(layer);
  }
}

DpSgd::~DpSgd() {
  for (DpLayer* layer : layers_) {
    std::lock_guard<std::mutex> lock(layer->mu_);
    layer->owner_ = nullptr;
    layer->records_.clear();
    layer->cache_.clear();
  }
}

std::vector<torch::Tensor> DpSgd::parameters() const {
  std::vector<Tensor> ps;
  for (DpLayer* layer : layers_) {
    for (auto& p : layer->dp_parameters()) {
      if (p.requires_grad()) ps.push_back(p);
    }
  }
  return ps;
}

void DpSgd::clear() {
  for (DpLayer* layer : layers_) layer->clear_records();
  sq_norms_ = Tensor();
}

torch::Tensor DpSgd::per_sample_sq_norms() {
  // Nothing here needs autograd: the records are detached and every result
  // is a gradient, so no graph is built and no activation is kept.
  torch::NoGradGuard no_grad;
  Tensor total;
  int64_t batch = -1;
  for (DpLayer* layer : layers_) {
    if (!layer->has_records()) continue;
    const int64_t b = layer->recorded_batch_size();
    TORCH_CHECK(batch < 0 || b == batch, "DP-SGD: layers recorded different batch sizes (", batch, " and ", b,
                "); call step() after each backward");
    batch = b;
    Tensor sq = layer->per_sample_sq_norms(options_).to(torch::kFloat32);
    total = total.defined() ? total.add_(sq) : sq;
  }
  return total;
}

torch::Tensor DpSgd::per_sample_norms() {
  if (!sq_norms_.defined()) sq_norms_ = per_sample_sq_norms();
  return sq_norms_.defined() ? sq_norms_.sqrt() : Tensor();
}

StatusOr<DpStepStats> DpSgd::step(double expected_batch_size) {
  if (!(expected_batch_size > 0)) {
    return invalid_argument("DP-SGD: expected batch size must be > 0, got {}", expected_batch_size);
  }
  try {
    torch::NoGradGuard no_grad;
    Tensor sq = sq_norms_.defined() ? sq_norms_ : per_sample_sq_norms();
    DpStepStats st;
    Tensor clip;
    if (sq.defined() && sq.size(0) > 0) {
      const double c_max = options_.max_grad_norm;
      Tensor norms = sq.sqrt();
      clip = (c_max / (norms + 1e-6)).clamp_max(1.0);
      st.batch_size = norms.size(0);
      // One device→host copy for the three statistics.
      Tensor n64 = norms.to(torch::kFloat64);
      Tensor stats = torch::stack({n64.mean(), n64.max(), n64.gt(c_max).to(torch::kFloat64).mean()}).to(torch::kCPU);
      st.mean_norm = stats[0].item<double>();
      st.max_norm = stats[1].item<double>();
      st.clipped_fraction = stats[2].item<double>();
    }
    for (DpLayer* layer : layers_) {
      if (clip.defined() && layer->has_records()) {
        layer->write_clipped_grads(clip.to(layer->dp_parameters().front().device()), options_);
      } else {  // an empty batch, or a layer this forward did not use: no gradient but noise
        for (auto& p : layer->dp_parameters()) {
          if (p.requires_grad()) set_grad(p, torch::zeros_like(p));
        }
      }
      // A layer's A and G (or per-sample gradients) are dead once its
      // gradient is written: dropping them here lets the gradients being
      // written take their place, so the step's peak is the larger of the two
      // rather than their sum (measured: 1.33× → see BENCHMARKS, seq 1024).
      layer->clear_records();
    }
    const double noise_std = options_.noise_multiplier * options_.max_grad_norm;
    for (auto& p : parameters()) {
      Tensor& g = p.mutable_grad();
      if (noise_std > 0) g.add_(torch::randn_like(g), noise_std);
      g.div_(expected_batch_size);
    }
    clear();
    return st;
  } catch (const c10::Error& e) {
    clear();
    return internal_error("DP-SGD step failed in libtorch: {}", e.what_without_backtrace());
  } catch (const std::exception& e) {
    clear();
    return internal_error("DP-SGD step failed: {}", e.what());
  }
}

// ---------------------------------------------------------------- sampling

PoissonSampler::PoissonSampler(std::span<const uint32_t> pool, double sample_rate, uint64_t seed)
    : pool_(pool.begin(), pool.end()), q_(sample_rate), rng_(seed) {
  if (!(sample_rate > 0 && sample_rate <= 1)) {
    throw std::invalid_argument("Poisson sampling rate must be in (0, 1], got " + std::to_string(sample_rate));
  }
}

void PoissonSampler::next(std::vector<uint32_t>& batch) {
  batch.clear();
  const int64_t n = static_cast<int64_t>(pool_.size());
  if (q_ >= 1) {
    batch = pool_;
    return;
  }
  // Bernoulli(q) per sample, drawn as geometric gaps between the chosen ones:
  // O(q·n) draws instead of n.
  std::geometric_distribution<int64_t> gap(q_);
  for (int64_t i = gap(rng_); i < n; i += 1 + gap(rng_)) batch.push_back(pool_[static_cast<size_t>(i)]);
}

int64_t PoissonSampler::steps_per_epoch() const { return std::max<int64_t>(1, std::llround(1.0 / q_)); }

// ---------------------------------------------------------------- model

namespace {

struct GroupNormCNN : torch_internal::Net {
  GroupNormCNN(int64_t channels, int64_t pixels, int64_t classes, int64_t groups) {
    conv1 = register_module("conv1", Conv2d(channels, 32, 5));
    gn1 = register_module("gn1", GroupNorm(groups, 32));
    conv2 = register_module("conv2", Conv2d(32, 64, 5));
    gn2 = register_module("gn2", GroupNorm(groups, 64));
    const int64_t side = ((pixels - 4) / 2 - 4) / 2;
    fc1 = register_module("fc1", Linear(64 * side * side, 512));
    fc2 = register_module("fc2", Linear(512, classes));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::max_pool2d(torch::relu(gn1->forward(conv1->forward(x))), 2);
    x = torch::max_pool2d(torch::relu(gn2->forward(conv2->forward(x))), 2);
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }
  Conv2d conv1{nullptr}, conv2{nullptr};
  GroupNorm gn1{nullptr}, gn2{nullptr};
  Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace

std::shared_ptr<torch_internal::Net> make_groupnorm_cnn(int64_t channels, int64_t pixels, int64_t classes,
                                                        int64_t groups) {
  return std::make_shared<GroupNormCNN>(channels, pixels, classes, groups);
}

}  // namespace memfl::dp
