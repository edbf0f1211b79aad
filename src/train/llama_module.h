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

}  // namespace memfl::torch_internal
