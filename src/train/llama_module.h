// The Llama-family network in libtorch (plugin side of model/llama.h): token
// embedding, RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP,
// LM head. Parameters are registered in the order and with the names of
// llama_layout(), so the arena of an instantiated module and the layout a
// server computes from the spec alone are the same bytes (tested).
#pragma once

#include <map>
#include <string>

#include "model/llama.h"
#include "model/model_config.h"
#include "train/torch_models.h"

namespace memfl::torch_internal {

// How the network is built and run. The parameters are created where they
// train (`tensors`: device and dtype) and initialised there, so a GPU client
// of 8B never materialises an f32 model on the host.
struct LlamaOptions {
  torch::TensorOptions tensors = torch::TensorOptions().dtype(torch::kFloat32);
  // Fused attention (at::scaled_dot_product_attention) where libtorch has it.
  bool fused_attention = true;
  // Recompute each decoder block in the backward pass instead of keeping its
  // activations (train_configs.gradient_checkpointing).
  bool gradient_checkpointing = false;
  // LoRA (model/lora.h): adapters on lora->target_modules of every layer,
  // float32 on the weights' device, and every base weight frozen (no
  // gradient, so no weight-gradient matmul). named_tensors() is then the
  // adapters alone, by PEFT's names in lora_layout()'s order: what binds
  // to the arena and travels.
  const LoraConfig* lora = nullptr;
  // The base's weights by Hugging Face name (model/llama.h), used as they
  // are instead of being created: every network built over one map shares
  // its tensors (each simulator worker's adapters over one base). Shapes
  // are checked; null: the weights are created and initialised here.
  const std::map<std::string, torch::Tensor>* base = nullptr;
};

// forward(tokens [B, T] int64) → logits [B, T, vocab]. Throws
// std::invalid_argument when options.base lacks a tensor or holds one of
// another shape.
std::shared_ptr<Net> make_llama(const LlamaSpec& spec, const LlamaOptions& options = {});

// Whether this libtorch has at::scaled_dot_product_attention (2.x does;
// Debian's 1.13 does not).
bool fused_attention_available();

// The parameter-free parts of Llama attention, shared with the DP sweep's
// classifier (train/dp_bench.cpp). On q (B×heads×T×hd), k and v
// (B×kv_heads×T×hd): rotary position embedding on q and k, then k and v
// repeated to the query heads (grouped-query attention).
void rotary_and_repeat_kv(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, int64_t heads, int64_t kv_heads,
                          double theta);
// cos and sin of the rotary angles, [T, head_dim] in `like`'s dtype and device.
std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t t, int64_t head_dim, double theta,
                                                      const torch::TensorOptions& like);
// Causal softmax attention written out: the scores materialised (O(T²)).
torch::Tensor causal_attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
// Causal attention through libtorch's fused kernels (flash or memory-efficient
// on CUDA) where `fused` and the libtorch has them, the math form otherwise.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               bool fused = true);

// Mean cross-entropy of logits = h · wᵀ against `targets`, and the number of
// rows whose arg-max is the target, computed `chunk_rows` rows at a time so
// the full [N, vocab] f32 logits never exist: h [N, H], w [vocab, H],
// targets [N] int64; a negative target (-100, as torch's ignore_index) is
// left out of the mean, the count and the gradients. Under autograd the gradients of h and w are worked out
// chunk by chunk in the forward pass (the chunk's logits are at hand then)
// and scaled in the backward. chunk_rows ≤ 0 picks rows for ~256 MiB of f32
// logits a chunk.
std::pair<torch::Tensor, torch::Tensor> linear_cross_entropy(const torch::Tensor& h, const torch::Tensor& w,
                                                             const torch::Tensor& targets, int64_t chunk_rows = 0);

}  // namespace memfl::torch_internal
