// LoRA adapters over a frozen Llama (Hu et al., 2021), with PEFT's names and
// semantics: each targeted linear layer y = W x becomes
//
//   y = W x + (lora_alpha / r) · B A dropout(x),   A [r, in], B [out, r]
//
// A drawn as PEFT draws it (Kaiming-uniform with a = √5, i.e. U(±1/√in)),
// B zero, so the adapted model starts as the base. Only A and B train and
// travel: the federated layout is the adapters' (DESIGN invariant 12), and
// it is computed here from the spec and the `lora` keys alone, so a server
// never needs the base's weights.
//
// Tensor names are PEFT's as save_pretrained writes them, so the layout's
// arena is an adapter_model.safetensors as it stands:
//
//   base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
//   base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
//
// Adapters are float32 whatever the base's dtype, as PEFT keeps them
// (autocast_adapter_dtype): a bf16 mean of small updates would lose them.
//
//   MEMFL_ASSIGN_OR_RETURN(Layout adapters, lora_layout(spec, cfg.model.lora));
//   fill_initial_adapters(adapters, arena, seed);
//   MEMFL_RETURN_IF_ERROR(write_peft_adapter(dir, cfg.model, adapters, arena));
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

struct LlamaSpec;

inline constexpr std::string_view kLoraKey = "client_configs.train_configs.lora";

// PEFT's seven Llama linear layers, in the order a decoder layer runs them.
const std::vector<std::string>& lora_module_names();
// The modules `given` names, in lora_module_names() order: PEFT's names, or
// "all-linear" for all seven (the LM head stays frozen, as PEFT leaves it).
// An unknown name or an empty list is refused, naming the key.
StatusOr<std::vector<std::string>> resolve_target_modules(const std::vector<std::string>& given);
// "self_attn" for q/k/v/o_proj, "mlp" for gate/up/down_proj.
std::string_view lora_module_parent(std::string_view module);
// PEFT's name of layer `layer`'s `module` adapter matrix `which` ('A' or 'B').
std::string peft_tensor_name(int64_t layer, std::string_view module, char which);

// The adapters of every targeted module of every layer, A then B, layer by
// layer in the decoder's order; float32.
StatusOr<Layout> lora_layout(const LlamaSpec& spec, const LoraConfig& lora);
// (lora_alpha / r): the scale of B A x.
inline double lora_scaling(const LoraConfig& lora) { return lora.lora_alpha / static_cast<double>(lora.r); }

// The initial adapters: every A uniform in ±1/√in (PEFT's Kaiming-uniform
// with a = √5), from a counter-based generator of (seed, tensor, element) —
// the same bytes in every process and on every transport — and every B zero.
void fill_initial_adapters(const Layout& layout, Arena& arena, uint64_t seed);

// A PEFT adapter folder: adapter_config.json and adapter_model.safetensors.
// write_peft_adapter writes both (each atomically) from the adapters' arena;
// base_model_name_or_path is the checkpoint folder (or the model's name).
Status write_peft_adapter(const std::string& dir, const ModelConfig& model, const Layout& layout, const Arena& arena);
// Reads `lora.init_adapters` into `arena`: its adapter_config.json must be
// PEFT's LoRA with the same r, target modules and no options memfl does not
// run (DoRA, rsLoRA, bias, fan_in_fan_out, layers_to_transform, rank or alpha
// patterns); its tensors must be exactly the layout's, by PEFT's names and
// shapes (f32, bf16 or f16, converted to f32). Errors name the key, the file
// and the tensor.
Status load_peft_adapter(const LoraConfig& lora, const Layout& layout, Arena& arena);

}  // namespace memfl
