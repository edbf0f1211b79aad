#include "train/llama_module.h"

#include <cmath>
#include <limits>

namespace memfl::torch_internal {

namespace {

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double epsilon) : eps(epsilon) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) {
    // In f32 whatever the weights' dtype, as the reference implementation does.
    auto xf = x.to(torch::kFloat32);
    auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * normed.to(x.scalar_type());
  }
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const LlamaSpec& s)
      : heads(s.num_heads), kv_heads(s.num_kv_heads), head_dim(s.head_dim()), theta(s.rope_theta) {
    q_proj = register_module("q_proj", linear(s.hidden_size, heads * head_dim));
    k_proj = register_module("k_proj", linear(s.hidden_size, kv_heads * head_dim));
    v_proj = register_module("v_proj", linear(s.hidden_size, kv_heads * head_dim));
    o_proj = register_module("o_proj", linear(heads * head_dim, s.hidden_size));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto q = q_proj(x).view({b, t, heads, head_dim}).transpose(1, 2);
    auto k = k_proj(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    auto v = v_proj(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    rotary_and_repeat_kv(q, k, v, heads, kv_heads, theta);
    auto out = causal_attention_math(q, k, v);
    return o_proj(out.transpose(1, 2).reshape({b, t, heads * head_dim}));
  }
  int64_t heads, kv_heads, head_dim;
  double theta;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const LlamaSpec& s) {
    gate_proj = register_module("gate_proj", linear(s.hidden_size, s.intermediate_size));
    up_proj = register_module("up_proj", linear(s.hidden_size, s.intermediate_size));
    down_proj = register_module("down_proj", linear(s.intermediate_size, s.hidden_size));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down_proj(torch::silu(gate_proj(x)) * up_proj(x)); }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const LlamaSpec& s) {
    // Registration order = llama_layout()'s order within a layer.
    input_layernorm = register_module("input_layernorm", RMSNorm(s.hidden_size, s.rms_norm_eps));
    self_attn = register_module("self_attn", Attention(s));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(s.hidden_size, s.rms_norm_eps));
    mlp = register_module("mlp", Mlp(s));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + self_attn(input_layernorm(x));
    return x + mlp(post_attention_layernorm(x));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

struct LlamaBody : torch::nn::Module {
  explicit LlamaBody(const LlamaSpec& s) {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(s.vocab_size, s.hidden_size));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.num_layers; ++i) layers->push_back(DecoderLayer(s));
    norm = register_module("norm", RMSNorm(s.hidden_size, s.rms_norm_eps));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};

struct LlamaNet final : Net {
  explicit LlamaNet(const LlamaSpec& s) : tied(s.tie_word_embeddings) {
    model = register_module("model", std::make_shared<LlamaBody>(s));
    if (!tied) lm_head = register_module("lm_head", linear(s.hidden_size, s.vocab_size));
    // Small initial weights (as the reference's initializer_range 0.02), so
    // the initial loss is near log(vocab).
    torch::NoGradGuard g;
    for (auto& p : parameters()) {
      if (p.dim() == 2) p.normal_(0.0, 0.02);
    }
  }
  bool is_language_model() const override { return true; }
  torch::Tensor forward(torch::Tensor tokens) override {
    auto x = model->embed_tokens(tokens);
    for (auto& layer : *model->layers) x = layer->as<DecoderLayerImpl>()->forward(x);
    x = model->norm(x);
    return tied ? torch::matmul(x, model->embed_tokens->weight.t()) : lm_head(x);
  }
  bool tied;
  std::shared_ptr<LlamaBody> model;
  torch::nn::Linear lm_head{nullptr};
};

}  // namespace

// Rotary position embedding (RoFormer; the "rotate half" form the Hugging
// Face Llama code uses, so checkpoints' q/k projections mean the same).
namespace {
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

void rotary_and_repeat_kv(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, int64_t heads, int64_t kv_heads,
                          double theta) {
  const int64_t t = q.size(2), head_dim = q.size(3);
  // cos/sin computed per call: not buffers, so the arena holds weights only.
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(q.device());
  auto inv_freq = torch::pow(theta, -torch::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  auto freqs = torch::outer(torch::arange(t, opts), inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos().to(q.scalar_type()), sin = emb.sin().to(q.scalar_type());
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

std::shared_ptr<Net> make_llama(const LlamaSpec& spec) { return std::make_shared<LlamaNet>(spec); }

}  // namespace memfl::torch_internal
