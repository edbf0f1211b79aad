#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/input_file.h"
#include "io/durable_file.h"
#include "model/llama.h"
#include "model/synthetic.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

// adapter_config.json is a few KiB.
constexpr uint64_t kAdapterConfigLimit = uint64_t{1} << 20;

// in and out features of `module` in `spec`'s decoder layer.
std::pair<int64_t, int64_t> module_shape(const LlamaSpec& s, std::string_view module) {
  const int64_t h = s.hidden_size, q = s.num_heads * s.head_dim(), kv = s.num_kv_heads * s.head_dim();
  if (module == "q_proj") return {h, q};
  if (module == "k_proj" || module == "v_proj") return {h, kv};
  if (module == "o_proj") return {q, h};
  if (module == "gate_proj" || module == "up_proj") return {h, s.intermediate_size};
  return {s.intermediate_size, h};  // down_proj
}

}  // namespace

const std::vector<std::string>& lora_module_names() {
  static const std::vector<std::string> names = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};
  return names;
}

StatusOr<std::vector<std::string>> resolve_target_modules(const std::vector<std::string>& given) {
  const auto& known = lora_module_names();
  if (given.empty()) {
    return invalid_argument("{}.target_modules: empty; name PEFT's modules ({}) or all-linear", kLoraKey,
                            fmt::join(known, ", "));
  }
  std::vector<bool> chosen(known.size(), false);
  for (const auto& name : given) {
    if (name == "all-linear") {
      std::fill(chosen.begin(), chosen.end(), true);
      continue;
    }
    auto it = std::find(known.begin(), known.end(), name);
    if (it == known.end()) {
      return invalid_argument("{}.target_modules: unknown module '{}'; a Llama's are {}, or all-linear", kLoraKey, name,
                              fmt::join(known, ", "));
    }
    chosen[static_cast<size_t>(it - known.begin())] = true;
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < known.size(); ++i) {
    if (chosen[i]) out.push_back(known[i]);
  }
  return out;
}

std::string_view lora_module_parent(std::string_view module) {
  return module == "q_proj" || module == "k_proj" || module == "v_proj" || module == "o_proj" ? "self_attn" : "mlp";
}

std::string peft_tensor_name(int64_t layer, std::string_view module, char which) {
  return fmt::format("base_model.model.model.layers.{}.{}.{}.lora_{}.weight", layer, lora_module_parent(module), module,
                     which);
}

StatusOr<Layout> lora_layout(const LlamaSpec& spec, const LoraConfig& lora) {
  MEMFL_RETURN_IF_ERROR(validate_llama_spec(spec));
  if (lora.r < 1) return invalid_argument("{}.r: must be at least 1, got {}", kLoraKey, lora.r);
  MEMFL_ASSIGN_OR_RETURN(auto modules, resolve_target_modules(lora.target_modules));
  LayoutBuilder b;
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    for (const auto& m : modules) {
      const auto [in, out] = module_shape(spec, m);
      b.add(peft_tensor_name(i, m, 'A'), DType::kF32, {lora.r, in});
      b.add(peft_tensor_name(i, m, 'B'), DType::kF32, {out, lora.r});
    }
  }
  return std::move(b).build();
}

void fill_initial_adapters(const Layout& layout, Arena& arena, uint64_t seed) {
  const auto& entries = layout.entries();
  for (size_t t = 0; t < entries.size(); ++t) {
    const LayoutEntry& e = entries[t];
    auto* p = reinterpret_cast<float*>(arena.data() + e.offset);
    const size_t n = e.numel();
    if (e.name.find(".lora_A.") == std::string::npos || e.shape.size() != 2) {
      std::memset(p, 0, n * sizeof(float));
      continue;
    }
    // U(-1/√in, 1/√in): 24 random bits per element, from (seed, tensor, i).
    const double bound = 1.0 / std::sqrt(static_cast<double>(e.shape[1]));
    const uint64_t stream = splitmix64(seed ^ splitmix64(0x4c6f5241ULL + t));
    for (size_t i = 0; i < n; ++i) {
      const double u = static_cast<double>(splitmix64(stream + i) >> 40) * 0x1.0p-24;  // [0, 1)
      p[i] = static_cast<float>((2.0 * u - 1.0) * bound);
    }
  }
}

Status write_peft_adapter(const std::string& dir, const ModelConfig& model, const Layout& layout, const Arena& arena) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return internal_error("cannot create {}: {}", dir, ec.message());
  const LoraConfig& l = model.lora;
  // The keys PEFT's LoraConfig reads, with the values that say what memfl
  // ran: plain LoRA on the named modules of every layer, no bias trained.
  nlohmann::json j = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", model.hf_checkpoint.empty() ? model.model_name : model.hf_checkpoint},
      {"r", l.r},
      {"lora_alpha", l.lora_alpha},
      {"lora_dropout", l.lora_dropout},
      {"target_modules", l.target_modules},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"revision", nullptr},
  };
  MEMFL_RETURN_IF_ERROR(
      write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), layout, arena, {{"format", "pt"}}));
  return write_text_file_durably((fs::path(dir) / "adapter_config.json").string(), j.dump(2) + "\n");
}

Status load_peft_adapter(const LoraConfig& lora, const Layout& layout, Arena& arena) {
  const std::string key = std::string(kLoraKey) + ".init_adapters";
  const std::string dir = lora.init_adapters;
  if (!fs::is_directory(dir)) {
    return invalid_argument(
        "{}: '{}' is not a folder (a PEFT adapter: adapter_config.json and "
        "adapter_model.safetensors)",
        key, dir);
  }
  const std::string cfg_path = (fs::path(dir) / "adapter_config.json").string();
  MEMFL_ASSIGN_OR_RETURN(std::string text,
                         read_input_file(cfg_path, fmt::format("{} (adapter_config.json)", key), kAdapterConfigLimit));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("{}: {} is not JSON: {}", key, cfg_path, e.what());
  }
  if (!j.is_object()) return invalid_argument("{}: {} is not a JSON object", key, cfg_path);
  auto str = [&](const char* k) {
    auto it = j.find(k);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  if (str("peft_type") != "LORA") {
    return invalid_argument("{}: {}: peft_type is '{}', not LORA", key, cfg_path, str("peft_type"));
  }
  auto r = j.find("r");
  if (r == j.end() || !r->is_number_integer() || r->get<int64_t>() != lora.r) {
    return invalid_argument("{}: {}: r is {}, but {}.r is {}; make them agree", key, cfg_path,
                            r == j.end() ? std::string("missing") : r->dump(), kLoraKey, lora.r);
  }
  // target_modules: a list, or a string (PEFT: a regular expression, or
  // "all-linear").
  std::vector<std::string> targets;
  if (auto t = j.find("target_modules"); t != j.end() && t->is_array()) {
    for (const auto& m : *t) {
      if (!m.is_string()) return invalid_argument("{}: {}: target_modules holds a non-string", key, cfg_path);
      targets.push_back(m.get<std::string>());
    }
  } else if (t != j.end() && t->is_string()) {
    targets.push_back(t->get<std::string>());
  }
  auto resolved = resolve_target_modules(targets);
  if (!resolved.ok() || *resolved != lora.target_modules) {
    return invalid_argument("{}: {}: target_modules {} are not {}.target_modules [{}]; make them agree", key, cfg_path,
                            j.contains("target_modules") ? j["target_modules"].dump() : "(missing)", kLoraKey,
                            fmt::join(lora.target_modules, ", "));
  }
  // Options that change the computation memfl does not run.
  for (const char* flag : {"use_dora", "use_rslora", "fan_in_fan_out"}) {
    if (auto it = j.find(flag); it != j.end() && it->is_boolean() && it->get<bool>()) {
      return invalid_argument("{}: {}: {} is true; memfl runs plain LoRA", key, cfg_path, flag);
    }
  }
  if (auto b = str("bias"); !b.empty() && b != "none") {
    return invalid_argument("{}: {}: bias '{}'; memfl trains no biases (bias: none)", key, cfg_path, b);
  }
  for (const char* field : {"rank_pattern", "alpha_pattern"}) {
    if (auto it = j.find(field); it != j.end() && it->is_object() && !it->empty()) {
      return invalid_argument("{}: {}: {} is set; memfl gives every module the same r and lora_alpha", key, cfg_path,
                              field);
    }
  }
  for (const char* field : {"layers_to_transform", "modules_to_save"}) {
    if (auto it = j.find(field); it != j.end() && !it->is_null() && !(it->is_array() && it->empty())) {
      return invalid_argument("{}: {}: {} is set; memfl adapts every layer and trains nothing else", key, cfg_path,
                              field);
    }
  }
  if (auto a = j.find("lora_alpha"); a != j.end() && a->is_number() && a->get<double>() != lora.lora_alpha) {
    return invalid_argument("{}: {}: lora_alpha is {}, but {}.lora_alpha is {}; make them agree", key, cfg_path,
                            a->dump(), kLoraKey, lora.lora_alpha);
  }
  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  MEMFL_RETURN_IF_ERROR(open_input_file(st_path, key, UINT64_MAX).status());
  MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(st_path));
  // Every check before the first byte is written.
  for (const auto& t : file->tensors()) {
    if (layout.find(t.name) == nullptr) {
      return invalid_argument(
          "{}: {} holds '{}', which this model's adapters do not have (another base or "
          "other target modules)",
          key, st_path, t.name);
    }
  }
  for (const auto& e : layout.entries()) {
    const SafetensorsTensor* t = file->find(e.name);
    if (t == nullptr) return invalid_argument("{}: {} lacks '{}'", key, st_path, e.name);
    if (t->shape != e.shape) {
      return invalid_argument("{}: {}: '{}' has shape [{}], this model's adapter [{}] (another base?)", key, st_path,
                              e.name, fmt::join(t->shape, ", "), fmt::join(e.shape, ", "));
    }
    if (t->dtype != DType::kF32 && t->dtype != DType::kBF16 && t->dtype != DType::kF16) {
      return invalid_argument("{}: {}: '{}' is {}, not a float type", key, st_path, e.name, dtype_name(t->dtype));
    }
  }
  for (const auto& e : layout.entries()) {
    const SafetensorsTensor* t = file->find(e.name);
    auto* dst = reinterpret_cast<float*>(arena.data() + e.offset);
    const size_t n = e.numel();
    if (t->dtype == DType::kF32) {
      std::memcpy(dst, t->data.data(), n * sizeof(float));
      continue;
    }
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, t->data.data() + 2 * i, 2);
      dst[i] = t->dtype == DType::kBF16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
  }
  for (const auto& e : layout.entries()) {
    const float* p = reinterpret_cast<const float*>(arena.data() + e.offset);
    if (!std::all_of(p, p + e.numel(), [](float x) { return std::isfinite(x); })) {
      return invalid_argument("{}: {}: '{}' holds a value that is not finite", key, st_path, e.name);
    }
  }
  return Status::Ok();
}

}  // namespace memfl
