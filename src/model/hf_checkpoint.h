// Hugging Face Llama checkpoints in, for training: a folder with config.json
// and model.safetensors (or model-0000i-of-0000n.safetensors shards and
// model.safetensors.index.json), as save_pretrained writes it.
//
// config.json's keys map onto memfl's Llama: hidden_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
// rope_theta, rms_norm_eps, tie_word_embeddings, and torch_dtype for the
// model's dtype. The tensor names are Hugging Face's (model/llama.h), so the
// weights load by name (ShardedCheckpoint::load_into: every tensor, dtype and
// shape checked, the file and the tensor named on a mismatch).
//
//   auto set = apply_hf_config(&cfg.model, [&](std::string_view key) { return user_set(key); });
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"

namespace memfl {

inline constexpr std::string_view kHfCheckpointKey = "client_configs.model_configs.hf_checkpoint";

// Reads `model->hf_checkpoint`/config.json and sets model_name (llama), the
// spec and the dtype from it. Refused, naming the file: an architecture that
// is not LlamaForCausalLM (or model_type llama), rope_scaling (memfl's rotary
// embedding is the plain one), a missing or non-numeric key, a model_name
// other than llama, and a key the user set in model_kwargs to another value
// (`user_set(key)`: the full key path was given in the YAML or by --set).
// Returns the keys it set, as (key path, YAML value), for the resolved config.
StatusOr<std::vector<std::pair<std::string, std::string>>> apply_hf_config(
    ModelConfig* model, const std::function<bool(std::string_view key)>& user_set);

}  // namespace memfl
