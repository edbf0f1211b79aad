#include "model/llama.h"

#include "tensor/safetensors.h"

#include "model/lora.h"
#include "model/synthetic.h"

namespace memfl {

const std::vector<LlamaSpec>& llama_presets() {
  // Shapes from the models' published config.json files.
  static const std::vector<LlamaSpec> presets = {
      {"llama-tiny", 64, 2, 4, 2, 172, 256, false, 10000.0, 1e-5},
      {"llama-1b", 2048, 16, 32, 8, 8192, 128256, true, 500000.0, 1e-5},
      {"llama-8b", 4096, 32, 32, 8, 14336, 128256, false, 500000.0, 1e-5},
      {"llama-70b", 8192, 80, 64, 8, 28672, 128256, false, 500000.0, 1e-5},
  };
  return presets;
}

bool is_llama_model(std::string_view model_name) { return model_name == "llama" || model_name.starts_with("llama-"); }

StatusOr<LlamaSpec> llama_spec_from_config(const ModelConfig& model) {
  if (model.model_name == "llama") {
    LlamaSpec s;
    s.name = "llama";
    s.hidden_size = model.hidden_size;
    s.num_layers = model.num_layers;
    s.num_heads = model.num_heads;
    s.num_kv_heads = model.num_kv_heads;
    s.intermediate_size = model.intermediate_size;
    s.vocab_size = model.vocab_size;
    s.tie_word_embeddings = model.tie_word_embeddings;
    s.rope_theta = model.rope_theta;
    s.rms_norm_eps = model.rms_norm_eps;
    MEMFL_RETURN_IF_ERROR(validate_llama_spec(s).with_context("client_configs.model_configs.model_kwargs"));
    return s;
  }
  for (const auto& p : llama_presets()) {
    if (p.name == model.model_name) return p;
  }
  std::string names = "llama (custom spec)";
  for (const auto& p : llama_presets()) names += ", " + p.name;
  return invalid_argument("unknown llama preset '{}'; known: {}", model.model_name, names);
}

Status validate_llama_spec(const LlamaSpec& s) {
  if (s.hidden_size <= 0 || s.num_layers <= 0 || s.num_heads <= 0 || s.num_kv_heads <= 0 || s.intermediate_size <= 0 ||
      s.vocab_size <= 0) {
    return invalid_argument(
        "llama spec '{}': hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size and vocab_size must "
        "all be positive",
        s.name);
  }
  if (s.hidden_size % s.num_heads != 0) {
    return invalid_argument("llama spec '{}': hidden_size {} is not a multiple of num_heads {}", s.name, s.hidden_size,
                            s.num_heads);
  }
  if (s.num_heads % s.num_kv_heads != 0) {
    return invalid_argument("llama spec '{}': num_heads {} is not a multiple of num_kv_heads {}", s.name, s.num_heads,
                            s.num_kv_heads);
  }
  if (s.head_dim() % 2 != 0) {
    return invalid_argument("llama spec '{}': head dimension {} must be even for rotary embeddings", s.name,
                            s.head_dim());
  }
  return Status::Ok();
}

int64_t llama_num_params(const LlamaSpec& s) {
  const int64_t h = s.hidden_size, kv = s.num_kv_heads * s.head_dim();
  const int64_t per_layer = 2 * h                         // the two RMSNorms
                            + h * h + 2 * kv * h + h * h  // q, k, v, o
                            + 3 * h * s.intermediate_size;
  return s.vocab_size * h * (s.tie_word_embeddings ? 1 : 2) + s.num_layers * per_layer + h;
}

StatusOr<Layout> llama_layout(const LlamaSpec& s, DType dtype) {
  MEMFL_RETURN_IF_ERROR(validate_llama_spec(s));
  const int64_t h = s.hidden_size, kv = s.num_kv_heads * s.head_dim(), q = s.num_heads * s.head_dim();
  LayoutBuilder b;
  b.add("model.embed_tokens.weight", dtype, {s.vocab_size, h});
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    b.add(p + "input_layernorm.weight", dtype, {h});
    b.add(p + "self_attn.q_proj.weight", dtype, {q, h});
    b.add(p + "self_attn.k_proj.weight", dtype, {kv, h});
    b.add(p + "self_attn.v_proj.weight", dtype, {kv, h});
    b.add(p + "self_attn.o_proj.weight", dtype, {h, q});
    b.add(p + "post_attention_layernorm.weight", dtype, {h});
    b.add(p + "mlp.gate_proj.weight", dtype, {s.intermediate_size, h});
    b.add(p + "mlp.up_proj.weight", dtype, {s.intermediate_size, h});
    b.add(p + "mlp.down_proj.weight", dtype, {h, s.intermediate_size});
  }
  b.add("model.norm.weight", dtype, {h});
  if (!s.tie_word_embeddings) b.add("lm_head.weight", dtype, {s.vocab_size, h});
  return std::move(b).build();
}

StatusOr<Layout> layout_without_network(const ModelConfig& model) {
  auto dtype = dtype_from_name(model.dtype);
  if (!model.initial_model.empty()) {
    auto file = SafetensorsFile::open(model.initial_model);
    if (!file.ok()) {
      return Status(file.status().code(),
                    fmt::format("client_configs.model_configs.initial_model: {}", file.status().message()));
    }
    MEMFL_ASSIGN_OR_RETURN(Layout layout, (*file)->layout());
    // A synthetic model is its parameter count: a file of another size is
    // another model, not a way to start this one.
    if (model.model_name == "synthetic" && layout.num_params() != static_cast<size_t>(model.num_params)) {
      return invalid_argument(
          "client_configs.model_configs.initial_model: {} holds {} parameters but "
          "client_configs.model_configs.model_kwargs.num_params is {}; make them agree",
          model.initial_model, layout.num_params(), model.num_params);
    }
    return layout;
  }
  if (!dtype) return invalid_argument("model_kwargs.dtype: unknown dtype '{}'", model.dtype);
  if (model.model_name == "synthetic") return synthetic_layout(model.num_params, *dtype);
  if (is_llama_model(model.model_name)) {
    MEMFL_ASSIGN_OR_RETURN(LlamaSpec spec, llama_spec_from_config(model));
    // With LoRA the model that travels is the adapters; the base stays
    // with the clients.
    if (model.lora.enabled) return lora_layout(spec, model.lora);
    return llama_layout(spec, *dtype);
  }
  return failed_precondition("model {}: its layout comes from its network", model.model_name);
}

}  // namespace memfl
