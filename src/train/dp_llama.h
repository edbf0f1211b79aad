// The Llama-style sequence classifier of the DP-SGD benchmarks (plain and
// sharded), built from the DP layers of train/dp_sgd.h, and the helpers both
// benchmarks share (memory statistics, out-of-memory detection).
//
// The model: dp::Embedding → num_layers × [dp::RMSNorm, rotary causal
// attention (q/k/v/o: dp::Linear without bias, grouped-query heads), residual,
// dp::RMSNorm, SwiGLU MLP (gate/up/down: dp::Linear without bias), residual]
// → dp::RMSNorm → mean over tokens → dp::Linear head (with bias) to 2 classes.
#pragma once

#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "train/dp_sgd.h"
#include "train/llama_module.h"
#include "train/sharded_dp.h"

// The CUDA caching allocator's statistics exist only in CUDA builds of
// libtorch (the GPU machine's); Debian's is CPU-only.
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define MEMFL_HAVE_CUDA_STATS 1
#endif

namespace memfl::torch_internal {

using torch::Tensor;

struct DpLlamaSpec {
  std::string name;
  int64_t hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, intermediate_size = 0, vocab_size = 0;
  int64_t num_classes = 2;
  double rope_theta = 10000.0, rms_norm_eps = 1e-6;
  int64_t head_dim() const { return hidden_size / num_heads; }
  // Embedding, per layer (q, k, v, o, gate, up, down, two norms), final norm, head with bias.
  int64_t num_params() const {
    const int64_t d = hidden_size, hd = head_dim();
    const int64_t layer =
        d * num_heads * hd + 2 * d * num_kv_heads * hd + num_heads * hd * d + 3 * d * intermediate_size + 2 * d;
    return vocab_size * d + num_layers * layer + d + d * num_classes + num_classes;
  }
};

inline const std::vector<DpLlamaSpec>& presets() {
  static const std::vector<DpLlamaSpec> all = {
      {.name = "llama-dp-tiny",
       .hidden_size = 64,
       .num_layers = 2,
       .num_heads = 4,
       .num_kv_heads = 2,
       .intermediate_size = 172,
       .vocab_size = 512},
      // The shape of the Opacus measurement: ≈ 477M parameters.
      {.name = "llama-dp-0.5b",
       .hidden_size = 2048,
       .num_layers = 8,
       .num_heads = 16,
       .num_kv_heads = 16,
       .intermediate_size = 5632,
       .vocab_size = 32000},
      // Llama-3.2-1B's shape: ≈ 1.24B parameters with its 128256-token vocabulary.
      {.name = "llama-3.2-1b-dp",
       .hidden_size = 2048,
       .num_layers = 16,
       .num_heads = 32,
       .num_kv_heads = 8,
       .intermediate_size = 8192,
       .vocab_size = 128256},
      // ≈ 5.8B parameters: fp32 DP-SGD with Adam needs 16 bytes per parameter
      // (93 GB) before any activation, more than one 80 GB H100 holds.
      {.name = "llama-dp-6b",
       .hidden_size = 4096,
       .num_layers = 32,
       .num_heads = 32,
       .num_kv_heads = 8,
       .intermediate_size = 11008,
       .vocab_size = 32000},
      // ≈ 11.2B parameters: 179 GB for fp32 Adam DP-SGD, more than one 141 GB
      // H200 holds; half of it fits on each of two.
      {.name = "llama-dp-11b",
       .hidden_size = 5120,
       .num_layers = 40,
       .num_heads = 40,
       .num_kv_heads = 8,
       .intermediate_size = 13824,
       .vocab_size = 32000},
  };
  return all;
}

inline const char* attention_kind() { return fused_attention_available() ? "scaled_dot_product_attention" : "math"; }

struct DpAttentionImpl : torch::nn::Module {
  explicit DpAttentionImpl(const DpLlamaSpec& s)
      : heads(s.num_heads), kv_heads(s.num_kv_heads), head_dim(s.head_dim()), theta(s.rope_theta) {
    q_proj = register_module("q_proj", dp::Linear(s.hidden_size, heads * head_dim, false));
    k_proj = register_module("k_proj", dp::Linear(s.hidden_size, kv_heads * head_dim, false));
    v_proj = register_module("v_proj", dp::Linear(s.hidden_size, kv_heads * head_dim, false));
    o_proj = register_module("o_proj", dp::Linear(heads * head_dim, s.hidden_size, false));
  }
  Tensor forward(const Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto q = q_proj->forward(x).view({b, t, heads, head_dim}).transpose(1, 2);
    auto k = k_proj->forward(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    auto v = v_proj->forward(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
    rotary_and_repeat_kv(q, k, v, heads, kv_heads, theta);
    auto out = causal_attention(q, k, v);
    return o_proj->forward(out.transpose(1, 2).reshape({b, t, heads * head_dim}));
  }
  int64_t heads, kv_heads, head_dim;
  double theta;
  dp::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(DpAttention);

struct DpMlpImpl : torch::nn::Module {
  explicit DpMlpImpl(const DpLlamaSpec& s) {
    gate_proj = register_module("gate_proj", dp::Linear(s.hidden_size, s.intermediate_size, false));
    up_proj = register_module("up_proj", dp::Linear(s.hidden_size, s.intermediate_size, false));
    down_proj = register_module("down_proj", dp::Linear(s.intermediate_size, s.hidden_size, false));
  }
  Tensor forward(const Tensor& x) {
    return down_proj->forward(torch::silu(gate_proj->forward(x)) * up_proj->forward(x));
  }
  dp::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(DpMlp);

struct DpDecoderLayerImpl : torch::nn::Module {
  explicit DpDecoderLayerImpl(const DpLlamaSpec& s) {
    input_layernorm = register_module("input_layernorm", dp::RMSNorm(s.hidden_size, s.rms_norm_eps));
    self_attn = register_module("self_attn", DpAttention(s));
    post_attention_layernorm = register_module("post_attention_layernorm", dp::RMSNorm(s.hidden_size, s.rms_norm_eps));
    mlp = register_module("mlp", DpMlp(s));
  }
  Tensor forward(Tensor x) {
    x = x + self_attn->forward(input_layernorm->forward(x));
    return x + mlp->forward(post_attention_layernorm->forward(x));
  }
  dp::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  DpAttention self_attn{nullptr};
  DpMlp mlp{nullptr};
};
TORCH_MODULE(DpDecoderLayer);

// forward(tokens [B, T] int64) → logits [B, num_classes].
struct DpLlamaClassifier : torch::nn::Module {
  explicit DpLlamaClassifier(const DpLlamaSpec& s) {
    embed_tokens = register_module("embed_tokens", dp::Embedding(s.vocab_size, s.hidden_size));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.num_layers; ++i) {
      layers.push_back(DpDecoderLayer(s));
      list->push_back(layers.back());
    }
    norm = register_module("norm", dp::RMSNorm(s.hidden_size, s.rms_norm_eps));
    score = register_module("score", dp::Linear(s.hidden_size, s.num_classes, true));
  }
  // Llama's initializer_range 0.02 for every matrix (embedding included).
  void init_weights() {
    torch::NoGradGuard g;
    for (auto& p : parameters()) {
      if (p.dim() == 2) p.normal_(0.0, 0.02);
    }
  }
  Tensor forward(const Tensor& tokens) {
    Tensor x = embed_tokens->forward(tokens);
    for (auto& layer : layers) x = layer->forward(x);
    return score->forward(norm->forward(x).mean(1));
  }
  dp::Embedding embed_tokens{nullptr};
  std::vector<DpDecoderLayer> layers;
  dp::RMSNorm norm{nullptr};
  dp::Linear score{nullptr};
};

// The decoder blocks and the head as separate pieces, for sharding unit by
// unit (train/sharded_dp.h): the same forward as DpLlamaClassifier's tail.
struct DpLlamaHeadImpl : torch::nn::Module {
  explicit DpLlamaHeadImpl(const DpLlamaSpec& s) {
    norm = register_module("norm", dp::RMSNorm(s.hidden_size, s.rms_norm_eps));
    score = register_module("score", dp::Linear(s.hidden_size, s.num_classes, true));
  }
  Tensor forward(const Tensor& x) { return score->forward(norm->forward(x).mean(1)); }
  dp::RMSNorm norm{nullptr};
  dp::Linear score{nullptr};
};
TORCH_MODULE(DpLlamaHead);

// Unit i of the classifier as a chain for sharding: 0 the embedding, 1..L the
// decoder blocks, L+1 the head (num_layers + 2 units). Initialised as
// DpLlamaClassifier::init_weights does (N(0, 0.02) for every matrix), from
// libtorch's default generator: build units 0, 1, … in order after one
// torch::manual_seed and every rank gets the same values.
inline int dp_llama_num_units(const DpLlamaSpec& s) { return static_cast<int>(s.num_layers) + 2; }
inline sharded::Unit make_dp_llama_unit(const DpLlamaSpec& s, int i) {
  sharded::Unit u;
  if (i == 0) {
    auto e = dp::Embedding(s.vocab_size, s.hidden_size);
    u = {"embed_tokens", e.ptr(), [m = e.ptr()](const Tensor& t) { return m->forward(t); }};
  } else if (i <= s.num_layers) {
    auto l = DpDecoderLayer(s);
    u = {fmt::format("layers.{}", i - 1), l.ptr(), [m = l.ptr()](const Tensor& x) { return m->forward(x); }};
  } else {
    auto h = DpLlamaHead(s);
    u = {"head", h.ptr(), [m = h.ptr()](const Tensor& x) { return m->forward(x); }};
  }
  torch::NoGradGuard g;
  for (auto& p : u.module->parameters()) {
    if (p.dim() == 2) p.normal_(0.0, 0.02);
  }
  return u;
}

inline const DpLlamaSpec* find_preset(const std::string& name) {
  for (const auto& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

inline bool is_oom(const std::string& message) {
  return message.find("out of memory") != std::string::npos ||
         message.find("not enough memory") != std::string::npos ||  // libtorch's CPU allocator
         message.find("can't allocate memory") != std::string::npos;
}

inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Resets the kernel's VmHWM to the current RSS (Linux ≥ 4.0); false where
// /proc/self/clear_refs cannot be written.
inline bool reset_peak_rss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

inline void synchronize(const torch::Device& dev) {
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
}

inline void release_cached_memory(const torch::Device& dev) {
#ifdef MEMFL_HAVE_CUDA_STATS
  if (dev.is_cuda()) {
    synchronize(dev);
    c10::cuda::CUDACachingAllocator::emptyCache();
    return;
  }
#endif
  (void)dev;
  malloc_trim(0);
}

}  // namespace memfl::torch_internal
