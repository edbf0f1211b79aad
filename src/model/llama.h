// Llama-family decoder-only transformers described by a spec (token
// embedding, RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP,
// LM head), with named presets of the shapes of Meta's released models.
//
// The layout of any spec — names, shapes, dtype, offsets — is computed here
// from the spec alone, without libtorch, so a server or a DummyTrainer client
// of a 70B model never builds the network (DESIGN invariant 2). Tensor names
// follow the Hugging Face Llama convention, so a safetensors checkpoint of
// that architecture loads by name with shape checks:
//
//   model.embed_tokens.weight                      [vocab, hidden]
//   model.layers.{i}.input_layernorm.weight        [hidden]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
//   model.layers.{i}.post_attention_layernorm.weight
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight
//   model.norm.weight                              [hidden]
//   lm_head.weight                                 [vocab, hidden]  (absent when tied)
//
// The libtorch module (train/llama_module.cpp) registers its parameters in
// exactly this order, and a test checks that the two layouts are equal.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"
#include "tensor/layout.h"

namespace memfl {

struct LlamaSpec {
  std::string name;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  double rope_theta = 500000.0;
  double rms_norm_eps = 1e-5;
  int64_t head_dim() const { return num_heads > 0 ? hidden_size / num_heads : 0; }
};

// llama-tiny (tests), llama-1b (Llama-3.2-1B), llama-8b (Llama-3.1-8B),
// llama-70b (Llama-3.1-70B).
const std::vector<LlamaSpec>& llama_presets();
bool is_llama_model(std::string_view model_name);
// A preset by name, or (model_name "llama") the spec in the model kwargs.
StatusOr<LlamaSpec> llama_spec_from_config(const ModelConfig& model);
// Heads divide the hidden size, KV heads divide the heads, sizes positive.
Status validate_llama_spec(const LlamaSpec& spec);
int64_t llama_num_params(const LlamaSpec& spec);
StatusOr<Layout> llama_layout(const LlamaSpec& spec, DType dtype);

// A model's layout from its config alone (synthetic, every llama spec, an
// initial_model file; with train_configs.lora, the adapters' layout); an
// error for a model that needs its network.
StatusOr<Layout> layout_without_network(const ModelConfig& model);

}  // namespace memfl
