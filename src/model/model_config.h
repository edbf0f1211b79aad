// ModelConfig: the model_configs section of an experiment. It lives with
// the models (not in config/) so that model/ describes a model from its
// config without depending on the config parser, which in turn checks llama
// specs through model/: config → model, never back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memfl {

// client_configs.train_configs.lora: LoRA adapters over a frozen base, in
// PEFT's names (model/lora.h). It is a training choice to the user, so its
// keys sit under train_configs as in PEFT's recipes, but it is kept here:
// it changes the model that travels (the adapters, not the base), which
// every role derives from the model config alone.
struct LoraConfig {
  bool enabled = false;  // the config has a train_configs.lora section
  int r = 8;             // PEFT's defaults
  double lora_alpha = 8;
  double lora_dropout = 0;
  // PEFT's module names, resolved (all-linear expanded), in decoder order.
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  // A PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
  // whose adapters are the initial global model.
  std::string init_adapters;
};

struct ModelConfig {
  std::string model_name = "CNN";  // a registry model, or "synthetic"
  int64_t num_params = 1 << 20;    // synthetic
  std::string dtype = "f32";       // synthetic: f32 | bf16 | f16
  // 0 = take it from the data set; otherwise must agree with it.
  int num_channel = 0, num_pixel = 0, num_classes = 0;
  int hidden_size = 200;  // MLP; llama (custom spec)
  // model_name "llama": a custom spec (the llama-* presets fix their own).
  int num_layers = 2, num_heads = 4, num_kv_heads = 2;
  int64_t intermediate_size = 172, vocab_size = 256;
  bool tie_word_embeddings = false;
  double rope_theta = 500000.0, rms_norm_eps = 1e-5;  // llama (custom spec)
  int seq_length = 64;                                // llama training: tokens per sample
  // model_name "TorchScript": a torch.jit.save'd module (scripted or traced)
  // whose forward takes an N×C×H×W batch and returns logits.
  std::string torchscript_path;
  // A safetensors file with the model's tensors (names, dtypes, shapes, in
  // arena order) and initial weights: the server starts from it without a
  // network, and a DummyTrainer client takes its layout from it. `memfl
  // inspect model.pt --write-layout FILE` writes one for a TorchScript model.
  std::string initial_model;
  // A Hugging Face Llama checkpoint folder (config.json + model.safetensors,
  // or shards with their index): its config.json sets model_name llama, the
  // spec and the dtype when the config is loaded (model/hf_checkpoint.h), and
  // its weights are the initial global model.
  std::string hf_checkpoint;
  LoraConfig lora;
};

// The model starts from a file's weights (initial_model or hf_checkpoint),
// not a seeded draw.
inline bool has_initial_weights(const ModelConfig& m) { return !m.initial_model.empty() || !m.hf_checkpoint.empty(); }

}  // namespace memfl
