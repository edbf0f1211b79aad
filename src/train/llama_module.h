// The Llama-family network in libtorch (plugin side of model/llama.h): token
// embedding, RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP,
// LM head. Parameters are registered in the order and with the names of
// llama_layout(), so the arena of an instantiated module and the layout a
// server computes from the spec alone are the same bytes (tested).
#pragma once

#include "model/llama.h"
#include "train/torch_models.h"

namespace memfl::torch_internal {

// forward(tokens [B, T] int64) → logits [B, T, vocab].
std::shared_ptr<Net> make_llama(const LlamaSpec& spec);

// The parameter-free parts of Llama attention, shared with the DP sweep's
// classifier (train/dp_bench.cpp). On q (B×heads×T×hd), k and v
// (B×kv_heads×T×hd): rotary position embedding on q and k, then k and v
// repeated to the query heads (grouped-query attention).
void rotary_and_repeat_kv(torch::Tensor& q, torch::Tensor& k, torch::Tensor& v, int64_t heads, int64_t kv_heads,
                          double theta);
// Causal softmax attention written out (libtorch 1.13 has no fused kernel).
torch::Tensor causal_attention_math(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

}  // namespace memfl::torch_internal
