#include "model/hf_checkpoint.h"

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/input_file.h"

namespace memfl {

namespace {

// A config.json is a few KiB; anything larger is not one.
constexpr uint64_t kConfigJsonLimit = uint64_t{1} << 20;

}  // namespace

StatusOr<std::vector<std::pair<std::string, std::string>>> apply_hf_config(
    ModelConfig* model, const std::function<bool(std::string_view key)>& user_set) {
  const std::string dir = model->hf_checkpoint;
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::is_directory(dir)) {
    return invalid_argument("{}: '{}' is not a folder (a Hugging Face checkpoint: config.json and safetensors)",
                            kHfCheckpointKey, dir);
  }
  MEMFL_ASSIGN_OR_RETURN(std::string text,
                         read_input_file(path, fmt::format("{} (config.json)", kHfCheckpointKey), kConfigJsonLimit));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("{}: {} is not JSON: {}", kHfCheckpointKey, path, e.what());
  }
  if (!j.is_object()) return invalid_argument("{}: {} is not a JSON object", kHfCheckpointKey, path);
  bool llama = j.value("model_type", std::string()) == "llama";
  std::string architectures;
  if (auto a = j.find("architectures"); a != j.end() && a->is_array()) {
    for (const auto& name : *a) {
      if (!name.is_string()) continue;
      if (!architectures.empty()) architectures += ", ";
      architectures += name.get<std::string>();
      llama = llama || name.get<std::string>() == "LlamaForCausalLM";
    }
  }
  if (!llama) {
    return invalid_argument(
        "{}: {} describes {} (model_type '{}'); memfl trains LlamaForCausalLM checkpoints (model_type llama)",
        kHfCheckpointKey, path, architectures.empty() ? std::string("no architecture") : architectures,
        j.value("model_type", std::string()));
  }
  // transformers 5 writes the rotary settings as rope_parameters
  // {rope_type, rope_theta}; the plain ("default") one is memfl's.
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object()) {
    const std::string type = rp->value("rope_type", std::string("default"));
    if (type != "default") {
      return invalid_argument(
          "{}: {} sets rope_parameters.rope_type '{}'; memfl's rotary embedding is the plain one, so this "
          "checkpoint would give other logits than it was trained with",
          kHfCheckpointKey, path, type);
    }
    if (rp->contains("rope_theta") && !j.contains("rope_theta")) j["rope_theta"] = (*rp)["rope_theta"];
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    return invalid_argument(
        "{}: {} sets rope_scaling ({}); memfl's rotary embedding is the plain one, so this checkpoint would give "
        "other logits than it was trained with",
        kHfCheckpointKey, path, rs->dump());
  }
  if (model->model_name != "llama") {
    return invalid_argument(
        "{}: a Hugging Face checkpoint sets the model's spec; set "
        "'client_configs.model_configs.model_name: llama' (it is '{}')",
        kHfCheckpointKey, model->model_name);
  }
  std::vector<std::pair<std::string, std::string>> set;
  const std::string kw = "client_configs.model_configs.model_kwargs.";
  // A number from config.json into `field`; a user's differing value is refused.
  auto number = [&](const char* json_key, const char* our_key, auto* field, bool required) -> Status {
    auto it = j.find(json_key);
    if (it == j.end() || it->is_null()) {
      if (!required) return Status::Ok();
      return invalid_argument("{}: {} has no '{}'", kHfCheckpointKey, path, json_key);
    }
    if (!it->is_number()) return invalid_argument("{}: {}: '{}' is not a number", kHfCheckpointKey, path, json_key);
    using T = std::remove_pointer_t<decltype(field)>;
    const T value = it->get<T>();
    const std::string key = kw + our_key;
    if (user_set(key) && *field != value) {
      return invalid_argument("{}: {} says {} = {}, but '{}' is {}; remove the key or make them agree",
                              kHfCheckpointKey, path, json_key, value, key, *field);
    }
    *field = value;
    set.emplace_back(key, fmt::format("{}", value));
    return Status::Ok();
  };
  MEMFL_RETURN_IF_ERROR(number("hidden_size", "hidden_size", &model->hidden_size, true));
  MEMFL_RETURN_IF_ERROR(number("num_hidden_layers", "num_layers", &model->num_layers, true));
  MEMFL_RETURN_IF_ERROR(number("num_attention_heads", "num_heads", &model->num_heads, true));
  if (j.contains("num_key_value_heads")) {
    MEMFL_RETURN_IF_ERROR(number("num_key_value_heads", "num_kv_heads", &model->num_kv_heads, true));
  } else {
    // Absent in older Llama configs: as many KV heads as heads.
    model->num_kv_heads = model->num_heads;
    set.emplace_back(kw + "num_kv_heads", fmt::format("{}", model->num_heads));
  }
  MEMFL_RETURN_IF_ERROR(number("intermediate_size", "intermediate_size", &model->intermediate_size, true));
  MEMFL_RETURN_IF_ERROR(number("vocab_size", "vocab_size", &model->vocab_size, true));
  MEMFL_RETURN_IF_ERROR(number("rope_theta", "rope_theta", &model->rope_theta, false));
  MEMFL_RETURN_IF_ERROR(number("rms_norm_eps", "rms_norm_eps", &model->rms_norm_eps, false));
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) {
      return invalid_argument("{}: {}: 'tie_word_embeddings' is not true or false", kHfCheckpointKey, path);
    }
    model->tie_word_embeddings = it->get<bool>();
  } else {
    model->tie_word_embeddings = false;  // LlamaConfig's default
  }
  set.emplace_back(kw + "tie_word_embeddings", model->tie_word_embeddings ? "true" : "false");
  // The weights' dtype; the tensors themselves are checked when they load.
  const std::string torch_dtype = j.value("torch_dtype", j.value("dtype", std::string("float32")));
  const std::string dtype = torch_dtype == "bfloat16"  ? "bf16"
                            : torch_dtype == "float16" ? "f16"
                            : torch_dtype == "float32" ? "f32"
                                                       : "";
  if (dtype.empty()) {
    return invalid_argument("{}: {}: torch_dtype '{}' is not float32, bfloat16 or float16", kHfCheckpointKey, path,
                            torch_dtype);
  }
  const std::string dtype_key = kw + "dtype";
  if (user_set(dtype_key) && model->dtype != dtype) {
    return invalid_argument("{}: {} says torch_dtype {}, but '{}' is {}; remove the key or make them agree",
                            kHfCheckpointKey, path, torch_dtype, dtype_key, model->dtype);
  }
  model->dtype = dtype;
  set.emplace_back(dtype_key, dtype);
  return set;
}

}  // namespace memfl
