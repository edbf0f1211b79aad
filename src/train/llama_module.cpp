#include "train/llama_module.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "model/lora.h"
#include "train/dp_sgd.h"

#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

namespace memfl::torch_internal {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
constexpr bool kHaveSdpa = true;
#else
constexpr bool kHaveSdpa = false;
#endif

// Initial weights as the reference initializer (normal, std 0.02 for
// matrices, ones for norms), drawn where the parameter lives.
torch::Tensor normal_param(std::vector<int64_t> shape, const torch::TensorOptions& o) {
  torch::NoGradGuard g;
  return torch::empty(shape, o).normal_(0.0, 0.02);
}

// A weight of the base: options.base's tensor of that name (shape checked),
// or one `make` creates. Frozen under LoRA.
torch::Tensor base_weight(const LlamaOptions& opt, const std::string& name, const std::vector<int64_t>& shape,
                          const std::function<torch::Tensor()>& make) {
  if (opt.base == nullptr) return make();
  auto it = opt.base->find(name);
  if (it == opt.base->end()) throw std::invalid_argument(fmt::format("the base model has no tensor '{}'", name));
  if (it->second.sizes().vec() != shape) {
    throw std::invalid_argument(fmt::format("the base model's '{}' has shape [{}], not [{}]", name,
                                            fmt::join(it->second.sizes().vec(), ", "), fmt::join(shape, ", ")));
  }
  return it->second;
}
bool base_trains(const LlamaOptions& opt) { return opt.lora == nullptr; }
bool adapted(const LlamaOptions& opt, std::string_view module) {
  return opt.lora != nullptr && std::find(opt.lora->target_modules.begin(), opt.lora->target_modules.end(),
                                          module) != opt.lora->target_modules.end();
}

// RMSNorm that keeps only its input and the per-row 1/rms for the backward
// (the composed form keeps the f32 copy of the input and the normalised
// values too: 1.5 × the input in bf16, twice a layer).
struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, double eps) {
    auto xf = x.to(torch::kFloat32);
    auto rstd = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, w, rstd});
    // In f32 whatever the weights' dtype, as the reference implementation does.
    return w * (xf * rstd).to(x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];
    auto g = grads[0].to(torch::kFloat32);
    auto n = x.to(torch::kFloat32) * rstd;
    const int64_t h = x.size(-1);
    // A frozen weight (LoRA's base) gets no gradient.
    auto dw = w.requires_grad()
                  ? (g * n.to(x.scalar_type()).to(torch::kFloat32)).reshape({-1, h}).sum(0).to(w.scalar_type())
                  : torch::Tensor();
    // d/dx of w·x·r(x), r = (mean x² + eps)^-½: r·(dn − n·mean(dn·n)).
    auto dn = g * w.to(torch::kFloat32);
    auto dx = rstd * (dn - n * (dn * n).mean(-1, /*keepdim=*/true));
    return {dx.to(x.scalar_type()), dw, torch::Tensor()};
  }
};

// down(silu(gate) · up) keeping only gate and up: the product and silu(gate)
// are recomputed in the backward (elementwise, cheap) instead of being kept,
// two [tokens, intermediate] tensors a layer fewer than the composed form.
struct SwiGluDownFn : torch::autograd::Function<SwiGluDownFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate, const torch::Tensor& up,
                               const torch::Tensor& w_down) {
    ctx->save_for_backward({gate, up, w_down});
    return torch::linear(torch::silu(gate) * up, w_down);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1], &w = saved[2];
    const auto& gy = grads[0];
    auto act = torch::silu(gate);
    auto dp = torch::matmul(gy, w);  // [.., intermediate]
    const int64_t out = gy.size(-1), inner = up.size(-1);
    // A frozen weight (LoRA's base): no weight-gradient matmul.
    auto dw = w.requires_grad() ? torch::matmul(gy.reshape({-1, out}).t(), (act * up).reshape({-1, inner}))
                                : torch::Tensor();
    auto dup = dp * act;
    // libtorch's own silu derivative, one kernel: σ(g)·(1 + g·(1 − σ(g))).
    auto dgate = torch::silu_backward(dp * up, gate);
    return {dgate, dup, dw};
  }
};

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double epsilon, const LlamaOptions& opt, const std::string& name) : eps(epsilon) {
    weight = register_parameter(
        "weight", base_weight(opt, name + ".weight", {dim}, [&] { return torch::ones({dim}, opt.tensors); }),
        base_trains(opt));
  }
  torch::Tensor forward(const torch::Tensor& x) { return RmsNormFn::apply(x, weight, eps); }
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// A bias-free linear layer whose weight is created on its device and dtype
// (torch::nn::Linear allocates f32 on the host and runs Kaiming's init there),
// with a LoRA adapter where the module is targeted.
struct ProjImpl : torch::nn::Module {
  ProjImpl(int64_t in, int64_t out, const LlamaOptions& opt, const std::string& name, bool adapter) {
    weight = register_parameter(
        "weight", base_weight(opt, name + ".weight", {out, in}, [&] { return normal_param({out, in}, opt.tensors); }),
        base_trains(opt));
    if (adapter) {
      // PEFT's initial adapters (the federated ones overwrite them), as a DP
      // layer: DP-SGD clips each sample's adapter gradients (train/dp_sgd.h).
      lora = register_module("lora", dp::LoraAdapter(in, out, opt.lora->r, lora_scaling(*opt.lora), opt.tensors));
      lora_A = lora->lora_A;
      lora_B = lora->lora_B;
      dropout = opt.lora->lora_dropout;
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return with_adapter(torch::linear(x, weight), x); }
  // y + (lora_alpha / r) · B A dropout(x) as PEFT computes it: x cast to the
  // adapters' float32, the sum rounded back to y's dtype.
  torch::Tensor with_adapter(const torch::Tensor& y, const torch::Tensor& x) {
    if (!lora_A.defined()) return y;
    auto xa = x.to(torch::kFloat32);
    if (dropout > 0 && is_training()) xa = torch::dropout(xa, dropout, /*train=*/true);
    return (y + lora(xa)).to(y.scalar_type());
  }
  torch::Tensor weight, lora_A, lora_B;  // lora_A, lora_B: the adapter's, where there is one
  dp::LoraAdapter lora{nullptr};
  double dropout = 0;
};
TORCH_MODULE(Proj);

struct EmbedImpl : torch::nn::Module {
  EmbedImpl(int64_t vocab, int64_t dim, const LlamaOptions& opt, const std::string& name) {
    weight = register_parameter(
        "weight",
        base_weight(opt, name + ".weight", {vocab, dim}, [&] { return normal_param({vocab, dim}, opt.tensors); }),
        base_trains(opt));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return torch::embedding(weight, tokens); }
  torch::Tensor weight;
};
TORCH_MODULE(Embed);

// at::scaled_dot_product_attention takes fewer KV heads than query heads (2.5+).
constexpr bool gqa_in_kernel() {
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5))
  return true;
#else
  return false;
#endif
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const LlamaSpec& s, const LlamaOptions& opt, const std::string& name)
      : heads(s.num_heads), kv_heads(s.num_kv_heads), head_dim(s.head_dim()), fused(opt.fused_attention) {
    auto proj = [&](const char* m, int64_t in, int64_t out) {
      return register_module(m, Proj(in, out, opt, name + "." + m, adapted(opt, m)));
    };
    q_proj = proj("q_proj", s.hidden_size, heads * head_dim);
    k_proj = proj("k_proj", s.hidden_size, kv_heads * head_dim);
    v_proj = proj("v_proj", s.hidden_size, kv_heads * head_dim);
    o_proj = proj("o_proj", heads * head_dim, s.hidden_size);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t b = x.size(0), t = x.size(1);
    auto q = q_proj(x).view({b, t, heads, head_dim}).transpose(1, 2);
    auto k = k_proj(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    auto v = v_proj(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (kv_heads != heads && !(fused && gqa_in_kernel())) {
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    auto out = causal_attention(q, k, v, fused);
    return o_proj(out.transpose(1, 2).reshape({b, t, heads * head_dim}));
  }
  int64_t heads, kv_heads, head_dim;
  bool fused;
  Proj q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  MlpImpl(const LlamaSpec& s, const LlamaOptions& opt, const std::string& name) {
    auto proj = [&](const char* m, int64_t in, int64_t out) {
      return register_module(m, Proj(in, out, opt, name + "." + m, adapted(opt, m)));
    };
    gate_proj = proj("gate_proj", s.hidden_size, s.intermediate_size);
    up_proj = proj("up_proj", s.hidden_size, s.intermediate_size);
    down_proj = proj("down_proj", s.intermediate_size, s.hidden_size);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto gate = gate_proj(x), up = up_proj(x);
    auto y = SwiGluDownFn::apply(gate, up, down_proj->weight);
    // An adapter on down_proj needs its input, which the fused form does
    // not keep: made here for the adapter's path alone.
    if (down_proj->lora_A.defined()) y = down_proj->with_adapter(y, torch::silu(gate) * up);
    return y;
  }
  Proj gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl(const LlamaSpec& s, const LlamaOptions& opt, const std::string& name) {
    // Registration order = llama_layout()'s order within a layer.
    input_layernorm =
        register_module("input_layernorm", RMSNorm(s.hidden_size, s.rms_norm_eps, opt, name + ".input_layernorm"));
    self_attn = register_module("self_attn", Attention(s, opt, name + ".self_attn"));
    post_attention_layernorm = register_module(
        "post_attention_layernorm", RMSNorm(s.hidden_size, s.rms_norm_eps, opt, name + ".post_attention_layernorm"));
    mlp = register_module("mlp", Mlp(s, opt, name + ".mlp"));
  }
  // One of the seven linear layers by PEFT's module name.
  Proj& proj(std::string_view m) {
    if (m == "q_proj") return self_attn->q_proj;
    if (m == "k_proj") return self_attn->k_proj;
    if (m == "v_proj") return self_attn->v_proj;
    if (m == "o_proj") return self_attn->o_proj;
    if (m == "gate_proj") return mlp->gate_proj;
    if (m == "up_proj") return mlp->up_proj;
    return mlp->down_proj;
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
    x = x + self_attn(input_layernorm(x), cos, sin);
    return x + mlp(post_attention_layernorm(x));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

// A decoder block whose activations are not kept: the forward runs without
// autograd and keeps only its input; the backward runs the block again with
// autograd on and back-propagates through that (the reentrant form of
// activation checkpointing). The block's parameters get their gradients by
// accumulation, as in the plain backward. Llama has no dropout, so the
// recomputation is the same function.
struct CheckpointedBlock : torch::autograd::Function<CheckpointedBlock> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin, int64_t layer_address) {
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["layer"] = layer_address;
    return layer(layer_address)->forward(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = layer(ctx->saved_data["layer"].toInt())->forward(x, saved[1], saved[2]);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
  static DecoderLayerImpl* layer(int64_t address) {
    return reinterpret_cast<DecoderLayerImpl*>(static_cast<intptr_t>(address));
  }
};

struct LlamaBody : torch::nn::Module {
  LlamaBody(const LlamaSpec& s, const LlamaOptions& opt) {
    embed_tokens = register_module("embed_tokens", Embed(s.vocab_size, s.hidden_size, opt, "model.embed_tokens"));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.num_layers; ++i) layers->push_back(DecoderLayer(s, opt, fmt::format("model.layers.{}", i)));
    norm = register_module("norm", RMSNorm(s.hidden_size, s.rms_norm_eps, opt, "model.norm"));
  }
  Embed embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};

struct LlamaNet final : Net {
  LlamaNet(const LlamaSpec& s, const LlamaOptions& opt)
      : tied(s.tie_word_embeddings),
        checkpointing(opt.gradient_checkpointing),
        head_dim(s.head_dim()),
        theta(s.rope_theta) {
    model = register_module("model", std::make_shared<LlamaBody>(s, opt));
    if (!tied) lm_head = register_module("lm_head", Proj(s.hidden_size, s.vocab_size, opt, "lm_head", false));
    if (opt.lora != nullptr) adapter_modules = opt.lora->target_modules;
  }
  bool is_language_model() const override { return true; }

  // The final hidden states [B, T, hidden].
  torch::Tensor hidden(const torch::Tensor& tokens) {
    auto x = model->embed_tokens(tokens);
    // The rotary tables once per forward, shared by every layer.
    auto [cos, sin] = rotary_tables(tokens.size(1), head_dim, theta, x.options());
    const bool recompute = checkpointing && torch::GradMode::is_enabled() && is_training();
    // A frozen embedding (LoRA's base) yields hidden states without a
    // gradient: the checkpointed blocks' Function would then record no graph
    // and the adapters inside them would get no gradient (what transformers'
    // enable_input_require_grads works around for PEFT).
    if (recompute && !x.requires_grad()) x = x.detach().requires_grad_(true);
    for (auto& layer : *model->layers) {
      auto* l = layer->as<DecoderLayerImpl>();
      x = recompute ? CheckpointedBlock::apply(x, cos, sin, static_cast<int64_t>(reinterpret_cast<intptr_t>(l)))
                    : l->forward(x, cos, sin);
    }
    return model->norm(x);
  }
  const torch::Tensor& head_weight() { return tied ? model->embed_tokens->weight : lm_head->weight; }

  torch::Tensor forward(torch::Tensor tokens) override { return torch::linear(hidden(tokens), head_weight()); }

  std::pair<torch::Tensor, torch::Tensor> loss_and_correct(const torch::Tensor& tokens,
                                                           const torch::Tensor& targets) override {
    auto h = hidden(tokens);
    return linear_cross_entropy(h.reshape({-1, h.size(-1)}), head_weight(), targets.reshape({-1}));
  }
  void set_gradient_checkpointing(bool on) override { checkpointing = on; }
  // Under LoRA the adapters alone, in lora_layout()'s order and names.
  std::vector<std::pair<std::string, torch::Tensor>> named_tensors() override {
    if (adapter_modules.empty()) return Net::named_tensors();
    std::vector<std::pair<std::string, torch::Tensor>> out;
    int64_t i = 0;
    for (auto& layer : *model->layers) {
      auto* l = layer->as<DecoderLayerImpl>();
      for (const auto& m : adapter_modules) {
        Proj& p = l->proj(m);
        out.emplace_back(peft_tensor_name(i, m, 'A'), p->lora_A);
        out.emplace_back(peft_tensor_name(i, m, 'B'), p->lora_B);
      }
      ++i;
    }
    return out;
  }

  std::vector<std::string> adapter_modules;  // LoRA's targets; empty: none
  bool tied, checkpointing;
  int64_t head_dim;
  double theta;
  std::shared_ptr<LlamaBody> model;
  Proj lm_head{nullptr};
};

// The loss over the vocabulary a chunk of rows at a time (see the header).
struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& targets, int64_t chunk_rows) {
    const int64_t n = h.size(0), vocab = w.size(0);
    const bool grad_h = h.requires_grad(), grad_w = w.requires_grad();
    auto f32 = h.options().dtype(torch::kFloat32);
    auto loss = torch::zeros({}, f32);
    auto correct = torch::zeros({}, h.options().dtype(torch::kInt64));
    torch::Tensor dh = grad_h ? torch::empty_like(h) : torch::Tensor();
    torch::Tensor dw = grad_w ? torch::zeros_like(w) : torch::Tensor();
    // A negative target (-100, torch's ignore_index: padding, a prompt under
    // train_on_response_only) is no target: its row adds nothing, and the
    // mean is over the rows that count. Kept on the device (no sync): the
    // count scales each row's gradient as the mean's 1/n did.
    auto counted = targets.ge(0);
    auto n_counted = counted.sum().clamp_min(1).to(torch::kFloat32);
    for (int64_t s = 0; s < n; s += chunk_rows) {
      const int64_t m = std::min(chunk_rows, n - s);
      auto hc = h.narrow(0, s, m);
      auto keep = counted.narrow(0, s, m).unsqueeze(1);
      auto yc = targets.narrow(0, s, m).unsqueeze(1).clamp_min(0);
      auto logits = torch::matmul(hc, w.t()).to(torch::kFloat32);  // [m, vocab]
      auto lse = torch::logsumexp(logits, -1, /*keepdim=*/true);
      loss.add_(((lse - logits.gather(1, yc)) * keep).sum());
      correct.add_(logits.argmax(-1).eq(yc.squeeze(1)).logical_and(keep.squeeze(1)).sum());
      if (!grad_h && !grad_w) continue;
      // d(mean loss)/d logits = (softmax − one-hot) / n, in place of the
      // logits; a row that does not count: 0.
      auto p = logits.sub_(lse).exp_();
      auto row_scale = keep.to(torch::kFloat32) / n_counted;  // [m, 1]
      p.scatter_add_(1, yc, torch::full({m, 1}, -1.0, f32));
      p.mul_(row_scale);
      auto pb = p.to(h.scalar_type());
      if (grad_h) dh.narrow(0, s, m).copy_(torch::matmul(pb, w));
      if (grad_w) dw.addmm_(pb.t(), hc);
    }
    (void)vocab;
    ctx->saved_data["dh"] = dh;
    ctx->saved_data["dw"] = dw;
    ctx->mark_non_differentiable({correct});
    return {loss.div_(n_counted), correct};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0];
    auto dh = ctx->saved_data["dh"].toTensor(), dw = ctx->saved_data["dw"].toTensor();
    auto scale = [&](torch::Tensor d) { return d.defined() ? d.mul_(g.to(d.scalar_type())) : d; };
    return {scale(dh), scale(dw), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool fused_attention_available() { return kHaveSdpa; }

std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t t, int64_t head_dim, double theta,
                                                      const torch::TensorOptions& like) {
  // Rotary position embedding (RoFormer; the "rotate half" form the Hugging
  // Face Llama code uses, so checkpoints' q/k projections mean the same).
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(like.device());
  auto inv_freq = torch::pow(theta, -torch::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  auto freqs = torch::outer(torch::arange(t, opts), inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  const auto dtype = like.dtype().toScalarType();
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

void rotary_and_repeat_kv(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, int64_t heads, int64_t kv_heads,
                          double theta) {
  auto [cos, sin] = rotary_tables(q.size(2), q.size(3), theta, q.options());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (kv_heads != heads) {  // grouped-query attention: each KV head serves heads / kv_heads queries
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
  }
}

torch::Tensor causal_attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t t = q.size(2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  auto causal = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool fused) {
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
  if (fused) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
    // Grouped-query heads inside the kernel: k and v are not repeated.
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                            /*enable_gqa=*/k.size(1) != q.size(1));
#else
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
  }
#else
  (void)fused;
#endif
  return causal_attention_math(q, k, v);
}

std::pair<torch::Tensor, torch::Tensor> linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& w,
                                                             const torch::Tensor& targets, int64_t chunk_rows) {
  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(64, (int64_t{256} << 20) / (4 * std::max<int64_t>(1, w.size(0))));
  auto out = LinearCrossEntropy::apply(h, w, targets, chunk_rows);
  return {out[0], out[1]};
}

std::shared_ptr<Net> make_llama(const LlamaSpec& spec, const LlamaOptions& options) {
  return std::make_shared<LlamaNet>(spec, options);
}

}  // namespace memfl::torch_internal
