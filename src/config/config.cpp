#include "config/config.h"

#include "data/experiment_data.h"
#include "data/tokenizer.h"
#include "io/input_file.h"
#include "memory/budget.h"
#include "model/hf_checkpoint.h"
#include "model/llama.h"
#include "model/lora.h"
#include "secagg/secagg.h"

#include <fmt/ranges.h>  // fmt::join (its home since fmt 11; here on 9 too)
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

namespace memfl {

SecAggParams secagg_params(const SecAggConfig& a) {
  return SecAggParams{a.num_shares,
                      a.reconstruction_threshold,
                      a.max_weight,
                      a.clipping_range,
                      static_cast<uint64_t>(a.quantization_range),
                      static_cast<uint64_t>(a.modulus_range)};
}

const std::vector<std::string>& known_model_names() {
  static const std::vector<std::string> names = {"CNN",       "MLP",        "ResNet18",   "CNN_GN",
                                                 "synthetic", "llama-tiny", "llama-1b",   "llama-8b",
                                                 "llama-70b", "llama",      "TorchScript"};
  return names;
}

namespace {

enum class Type { kInt, kFloat, kBool, kString, kFloatPair, kStringList };

const char* type_name(Type t) {
  switch (t) {
    case Type::kInt:
      return "integer";
    case Type::kFloat:
      return "number";
    case Type::kBool:
      return "boolean";
    case Type::kString:
      return "string";
    case Type::kFloatPair:
      return "list of 2 numbers";
    case Type::kStringList:
      return "list of strings";
  }
  return "?";
}

// A value after type checking.
struct Value {
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  double pair[2] = {0, 0};
  std::vector<std::string> list;
};

struct KeySpec {
  std::string path;
  Type type;
  std::string default_text;  // YAML text of the default
  std::vector<std::string> choices;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::string doc;
  std::function<void(ExperimentConfig&, const Value&)> apply;
};

#define I(field) [](ExperimentConfig& c, const Value& v) { c.field = static_cast<decltype(c.field)>(v.i); }
#define F(field) [](ExperimentConfig& c, const Value& v) { c.field = v.f; }
#define B(field) [](ExperimentConfig& c, const Value& v) { c.field = v.b; }
#define S(field) [](ExperimentConfig& c, const Value& v) { c.field = v.s; }

constexpr double kInf = std::numeric_limits<double>::infinity();

const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = {
      // client_configs.train_configs
      {"client_configs.train_configs.trainer",
       Type::kString,
       "VanillaTrainer",
       {"VanillaTrainer", "DummyTrainer"},
       -kInf,
       kInf,
       "local trainer (DummyTrainer: no training, for transfer and memory measurements)",
       S(train.trainer)},
      {"client_configs.train_configs.dummy_update_scale",
       Type::kFloat,
       "0",
       {},
       0,
       1e6,
       "DummyTrainer: 0 = send the model back as received; s > 0 = client c in round r adds s*(c+1)*(1 + (i + r) mod "
       "5) to float element i of every tensor and reports 5*(c+1) samples, so updates differ per client and round "
       "(tests, benchmarks)",
       F(train.dummy_update_scale)},
      {"client_configs.train_configs.dummy_update_noise",
       Type::kFloat,
       "0",
       {},
       0,
       1e6,
       "DummyTrainer: adds s*noise*z to each float element's change, z a standard normal seeded by round, client and "
       "element (0: none): a change that compresses like a trained one, not a pattern (benchmarks of compression)",
       F(train.dummy_update_noise)},
      {"client_configs.train_configs.dummy_update_noise_values",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "DummyTrainer: a file of little-endian f32 values (e.g. a trained update) the noise is drawn from, "
       "standardised to mean 0 and σ 1, instead of a standard normal (empty: Gaussian; benchmarks of compression)",
       S(train.dummy_update_noise_values)},
      {"client_configs.train_configs.dummy_delay_s",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "DummyTrainer: seconds client c spends in its local update, a comma-separated list taken by c mod its length "
       "(e.g. 1.5,0.5,0.5,0.5: client 0 three times slower)",
       S(train.dummy_delay_s)},
      {"client_configs.train_configs.mode",
       Type::kString,
       "epoch",
       {"epoch", "step"},
       -kInf,
       kInf,
       "train for num_local_epochs epochs or num_local_steps batches",
       S(train.mode)},
      {"client_configs.train_configs.num_local_epochs",
       Type::kInt,
       "1",
       {},
       1,
       1e6,
       "epochs per round (mode: epoch)",
       I(train.num_local_epochs)},
      {"client_configs.train_configs.mu",
       Type::kFloat,
       "0",
       {},
       0,
       1e6,
       "FedProx: weight of the proximal term mu/2 ||w - w_global||^2 in the local loss (0 = plain local training)",
       F(train.mu)},
      {"client_configs.train_configs.gradient_checkpointing",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "Llama: recompute each decoder block in the backward pass instead of keeping its activations",
       B(train.gradient_checkpointing)},
      // LoRA (model/lora.h): on when the config has a train_configs.lora
      // section, PEFT's keys and defaults.
      {"client_configs.train_configs.lora.r",
       Type::kInt,
       "8",
       {},
       1,
       65536,
       "LoRA: the adapters' rank (a train_configs.lora section turns LoRA on: only the adapters train and travel)",
       I(model.lora.r)},
      {"client_configs.train_configs.lora.lora_alpha",
       Type::kFloat,
       "8",
       {},
       1e-6,
       1e6,
       "LoRA: the adapters' output is scaled by lora_alpha / r",
       F(model.lora.lora_alpha)},
      {"client_configs.train_configs.lora.lora_dropout",
       Type::kFloat,
       "0",
       {},
       0,
       1,
       "LoRA: dropout on the adapters' input while training, in [0, 1)",
       F(model.lora.lora_dropout)},
      {"client_configs.train_configs.lora.target_modules",
       Type::kStringList,
       "[q_proj, v_proj]",
       {},
       -kInf,
       kInf,
       "LoRA: PEFT's module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or all-linear",
       [](ExperimentConfig& c, const Value& v) { c.model.lora.target_modules = v.list; }},
      {"client_configs.train_configs.lora.init_adapters",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "LoRA: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from; empty: A "
       "Kaiming-uniform, B zero",
       S(model.lora.init_adapters)},
      {"client_configs.train_configs.num_local_steps",
       Type::kInt,
       "100",
       {},
       1,
       1e9,
       "batches per round (mode: step)",
       I(train.num_local_steps)},
      {"client_configs.train_configs.optim",
       Type::kString,
       "SGD",
       {"SGD", "Adam"},
       -kInf,
       kInf,
       "optimizer",
       S(train.optim.optim)},
      {"client_configs.train_configs.optim_args.lr",
       Type::kFloat,
       "0.01",
       {},
       0,
       1e3,
       "learning rate",
       F(train.optim.lr)},
      {"client_configs.train_configs.optim_args.momentum",
       Type::kFloat,
       "0",
       {},
       0,
       1,
       "SGD momentum",
       F(train.optim.momentum)},
      {"client_configs.train_configs.optim_args.weight_decay",
       Type::kFloat,
       "0",
       {},
       0,
       1e3,
       "L2 penalty",
       F(train.optim.weight_decay)},
      {"client_configs.train_configs.optim_args.nesterov",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "SGD Nesterov",
       B(train.optim.nesterov)},
      {"client_configs.train_configs.optim_args.betas",
       Type::kFloatPair,
       "[0.9, 0.999]",
       {},
       0,
       1,
       "Adam betas",
       [](ExperimentConfig& c, const Value& v) {
         c.train.optim.beta1 = v.pair[0];
         c.train.optim.beta2 = v.pair[1];
       }},
      {"client_configs.train_configs.optim_args.eps",
       Type::kFloat,
       "1e-8",
       {},
       0,
       1,
       "Adam epsilon",
       F(train.optim.eps)},
      {"client_configs.train_configs.optimizer_state_dtype",
       Type::kString,
       "param",
       {"param", "float32"},
       -kInf,
       kInf,
       "Adam's moments: in the parameters' dtype (as torch.optim), or float32 for bf16/f16 weights (8 bytes a "
       "parameter instead of 4)",
       S(train.optim.state_dtype)},
      {"client_configs.train_configs.loss_fn_name",
       Type::kString,
       "CrossEntropyLoss",
       {"CrossEntropyLoss", "CELoss"},
       -kInf,
       kInf,
       "loss (cross-entropy)",
       [](ExperimentConfig&, const Value&) {}},
      {"client_configs.train_configs.train_batch_size",
       Type::kInt,
       "64",
       {},
       1,
       1e6,
       "training batch size",
       I(train.train_batch_size)},
      {"client_configs.train_configs.val_batch_size",
       Type::kInt,
       "64",
       {},
       1,
       1e6,
       "validation batch size",
       I(train.val_batch_size)},
      {"client_configs.train_configs.train_data_shuffle",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "shuffle training data each epoch",
       B(train.train_data_shuffle)},
      {"client_configs.train_configs.do_validation",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "validate on the client's held-out split after training",
       B(train.do_validation)},
      {"client_configs.train_configs.device",
       Type::kString,
       "cpu",
       {"cpu", "cuda"},
       -kInf,
       kInf,
       "where clients train",
       S(train.device)},
      {"client_configs.train_configs.num_threads",
       Type::kInt,
       "0",
       {},
       0,
       1024,
       "libtorch intra-op threads (0 = cores)",
       I(train.num_threads)},
      {"client_configs.train_configs.num_gpus",
       Type::kInt,
       "1",
       {},
       1,
       64,
       "ranks a client's model is sharded over (FSDP-style DP-SGD, model CNN_GN): one process per GPU (cuda), or per "
       "Gloo rank on the CPU; the client starts them",
       I(train.num_gpus)},
      // clang-format off
      {"client_configs.train_configs.dp.enabled", Type::kBool, "false", {}, -kInf, kInf, "DP-SGD: per-sample clipping, Gaussian noise, Poisson batches, RDP accounting", B(train.dp.enabled)},
      {"client_configs.train_configs.dp.noise_multiplier", Type::kFloat, "1.0", {}, 0, 1e6, "DP-SGD: noise std ÷ max_grad_norm (σ)", F(train.dp.noise_multiplier)},
      {"client_configs.train_configs.dp.max_grad_norm", Type::kFloat, "1.0", {}, 1e-12, 1e12, "DP-SGD: per-sample clipping bound C", F(train.dp.max_grad_norm)},
      {"client_configs.train_configs.dp.clipping", Type::kString, "fused", {"naive", "ghost", "fused"}, -kInf, kInf, "DP-SGD: how per-sample norms are computed", S(train.dp.clipping)},
      {"client_configs.train_configs.dp.accountant", Type::kString, "rdp", {"rdp"}, -kInf, kInf, "DP-SGD: privacy accountant", S(train.dp.accountant)},
      {"client_configs.train_configs.dp.delta", Type::kFloat, "1e-5", {}, 1e-300, 0.999999, "DP-SGD: δ of the reported (ε, δ)", F(train.dp.delta)},
      // client_configs.comm_configs.compressor_configs: APPFL's keys (compress/settings.h)
      {"client_configs.comm_configs.compressor_configs.enable_compression", Type::kBool, "false", {}, -kInf, kInf, "compress each client update chunk by chunk (frames; broadcasts stay uncompressed unless broadcast_compression says otherwise). For slow links: a core encodes 0.06-0.3 GB/s, so on loopback or fast LANs uploads get slower, not faster (docs/guide/compression.md)", B(compressor.enable_compression)},
      {"client_configs.comm_configs.compressor_configs.lossy_compressor", Type::kString, "ZFPCompressor", {"ZFPCompressor", "SZ2Compressor", "SZ3Compressor", "SZxCompressor", "none"}, -kInf, kInf, "lossy codec for the update's change from the global model: ZFPCompressor (libzfp, fixed accuracy); the SZ names run memfl's error-bounded quantiser (Debian has no SZ); none: lossless only", S(compressor.lossy_compressor)},
      {"client_configs.comm_configs.compressor_configs.lossless_compressor", Type::kString, "zstd", {"zstd", "gzip", "zlib", "lzma", "blosc", "none"}, -kInf, kInf, "lossless stage of every frame", S(compressor.lossless_compressor)},
      {"client_configs.comm_configs.compressor_configs.error_bounding_mode", Type::kString, "REL", {"ABS", "REL"}, -kInf, kInf, "ABS: every element within error_bound; REL: within error_bound × the tensor's value range (of its change this round)", S(compressor.error_bounding_mode)},
      {"client_configs.comm_configs.compressor_configs.error_bound", Type::kFloat, "1e-3", {}, 1e-30, 1e30, "the lossy codecs' bound (see error_bounding_mode)", F(compressor.error_bound)},
      {"client_configs.comm_configs.compressor_configs.param_cutoff", Type::kInt, "1024", {}, 0, 9.2e18, "tensors with at most this many elements, and tensors whose name lacks 'weight', go lossless", I(compressor.param_cutoff)},
      {"client_configs.comm_configs.compressor_configs.error_feedback", Type::kBool, "false", {}, -kInf, kInf, "the client keeps what lossy compression lost (a model-sized residual, file-backed when the model is) and adds it to its next update", B(compressor.error_feedback)},
      {"client_configs.comm_configs.compressor_configs.broadcast_compression", Type::kString, "none", {"none", "lossy"}, -kInf, kInf, "none: the global model leaves as its bytes; lossy: as the change since the model each client received the round before, through lossy_compressor at error_bound (the server keeps the rebuilt model, so every side holds the same bits). Shrinks the broadcast over gRPC; other transports send the rebuilt model's bytes", S(compressor.broadcast_compression)},
      // server_configs.secure_aggregation: Flower's SecAggPlusWorkflow names (secagg/secagg.h)
      {"server_configs.secure_aggregation.enable", Type::kBool, "false", {}, -kInf, kInf, "SecAgg+: the server learns only the sum of the round's updates (masked, quantised, summed mod modulus_range)", B(secagg.enable)},
      {"server_configs.secure_aggregation.num_shares", Type::kFloat, "1", {}, 1e-9, 1e9, "neighbours each client secret-shares its keys with, itself included: <= 1 a proportion of the selected clients, > 1 a count (made odd); 1 = all (SecAgg)", F(secagg.num_shares)},
      {"server_configs.secure_aggregation.reconstruction_threshold", Type::kFloat, "0.67", {}, 1e-9, 1e9, "shares that reconstruct a secret (t): <= 1 a proportion of num_shares, > 1 a count; up to num_shares - t neighbours may drop", F(secagg.reconstruction_threshold)},
      {"server_configs.secure_aggregation.max_weight", Type::kFloat, "1000", {}, 1e-9, 1e15, "a client's weight is min(sample count, max_weight) / max_weight, sent masked alongside its update", F(secagg.max_weight)},
      {"server_configs.secure_aggregation.clipping_range", Type::kFloat, "8.0", {}, 1, 1e12, "each weighted element is clipped to [-clipping_range, clipping_range] before quantisation", F(secagg.clipping_range)},
      {"server_configs.secure_aggregation.quantization_range", Type::kInt, "4194304", {}, 2, 4294967296, "quantised elements lie in [0, quantization_range); stochastic rounding", I(secagg.quantization_range)},
      {"server_configs.secure_aggregation.modulus_range", Type::kInt, "4294967296", {}, 2, 4294967296, "masked sums are taken modulo this (a power of two, at most 2^32; must exceed clients x (quantization_range - 1))", I(secagg.modulus_range)},
      {"server_configs.secure_aggregation.timeout", Type::kFloat, "0", {}, 0, 1e9, "seconds the server waits for a client's reply to a secure-aggregation stage (0 = server_configs.upload_timeout_s)", F(secagg.timeout)},
      // clang-format on
      // client_configs.model_configs
      {"client_configs.model_configs.model_name", Type::kString, "CNN", known_model_names(), -kInf, kInf,
       "model from the registry", S(model.model_name)},
      {"client_configs.model_configs.model_kwargs.num_params",
       Type::kInt,
       "1048576",
       {},
       1,
       1e12,
       "synthetic model: parameters",
       I(model.num_params)},
      {"client_configs.model_configs.model_kwargs.dtype",
       Type::kString,
       "f32",
       {"f32", "bf16", "f16"},
       -kInf,
       kInf,
       "synthetic and llama models: dtype of the weights",
       S(model.dtype)},
      {"client_configs.model_configs.model_kwargs.num_channel",
       Type::kInt,
       "0",
       {},
       0,
       1024,
       "input channels (0 = from the data set)",
       I(model.num_channel)},
      {"client_configs.model_configs.model_kwargs.num_pixel",
       Type::kInt,
       "0",
       {},
       0,
       65536,
       "input height = width (0 = from the data set)",
       I(model.num_pixel)},
      {"client_configs.model_configs.model_kwargs.num_classes",
       Type::kInt,
       "0",
       {},
       0,
       1e6,
       "output classes (0 = from the data set)",
       I(model.num_classes)},
      {"client_configs.model_configs.torchscript_path",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "model_name TorchScript: the file torch.jit.save wrote (its forward takes N x C x H x W and returns logits)",
       S(model.torchscript_path)},
      {"client_configs.model_configs.initial_model",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "a safetensors file: the model's layout and initial weights, so a server or DummyTrainer client needs no "
       "network (libtorch) to describe it (memfl inspect model.pt --write-layout FILE writes one)",
       S(model.initial_model)},
      {"client_configs.model_configs.model_kwargs.hidden_size",
       Type::kInt,
       "200",
       {},
       1,
       1e6,
       "MLP hidden width; model_name llama: hidden size",
       I(model.hidden_size)},
      // clang-format off
      {"client_configs.model_configs.model_kwargs.num_layers", Type::kInt, "2", {}, 1, 1024, "llama: decoder layers", I(model.num_layers)},
      {"client_configs.model_configs.model_kwargs.num_heads", Type::kInt, "4", {}, 1, 1024, "llama: attention heads", I(model.num_heads)},
      {"client_configs.model_configs.model_kwargs.num_kv_heads", Type::kInt, "2", {}, 1, 1024, "llama: key/value heads (grouped-query attention)", I(model.num_kv_heads)},
      {"client_configs.model_configs.model_kwargs.intermediate_size", Type::kInt, "172", {}, 1, 1e7, "llama: SwiGLU MLP width", I(model.intermediate_size)},
      {"client_configs.model_configs.model_kwargs.vocab_size", Type::kInt, "256", {}, 2, 1e7, "llama: vocabulary", I(model.vocab_size)},
      {"client_configs.model_configs.model_kwargs.tie_word_embeddings", Type::kBool, "false", {}, -kInf, kInf, "llama: LM head shares the embedding", B(model.tie_word_embeddings)},
      {"client_configs.model_configs.model_kwargs.rope_theta", Type::kFloat, "500000", {}, 1, 1e12, "llama: rotary embedding base", F(model.rope_theta)},
      {"client_configs.model_configs.model_kwargs.rms_norm_eps", Type::kFloat, "1e-05", {}, 1e-12, 1, "llama: RMSNorm epsilon", F(model.rms_norm_eps)},
      {"client_configs.model_configs.hf_checkpoint", Type::kString, "\"\"", {}, -kInf, kInf, "a Hugging Face Llama checkpoint folder (config.json + model.safetensors or shards and their index): model_name llama, the spec and dtype from its config.json, the initial global model from its weights", S(model.hf_checkpoint)},
      {"client_configs.model_configs.model_kwargs.seq_length", Type::kInt, "64", {}, 2, 1 << 20, "llama training: tokens per sample", I(model.seq_length)},
      // clang-format on
      // client_configs.data_configs
      {"client_configs.data_configs.dataset_name",
       Type::kString,
       "FashionMNIST",
       {"FashionMNIST", "SyntheticCIFAR10", "SyntheticTokens", "TextFile", "JsonLines"},
       -kInf,
       kInf,
       "data set (SyntheticTokens, TextFile, JsonLines: token sequences for llama models)",
       S(data.dataset_name)},
      {"client_configs.data_configs.dataset_path",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "directory of the IDX files (empty = /usr/share/datasets/fashion-mnist); TextFile: a text file, or with a "
       "tokenizer a folder of .txt files (each a group); JsonLines: a .jsonl file",
       S(data.dataset_path)},
      {"client_configs.data_configs.tokenizer_path",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "a SentencePiece tokenizer.model for TextFile and JsonLines (its vocabulary must equal the model's "
       "vocab_size); empty: TextFile's bytes are the tokens",
       S(data.text.tokenizer_path)},
      {"client_configs.data_configs.dataset_kwargs.sample_by",
       Type::kString,
       "line",
       {"line", "paragraph", "document"},
       -kInf,
       kInf,
       "TextFile with a tokenizer: a document is a line, a paragraph (up to a blank line) or a whole file",
       S(data.text.sample_by)},
      {"client_configs.data_configs.dataset_kwargs.packing",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "tokenized text: true = documents (BOS ... EOS) concatenated and cut into samples of seq_length + 1 "
       "tokens; false = one document per sample, truncated or padded (the padding out of the loss)",
       B(data.text.packing)},
      {"client_configs.data_configs.dataset_kwargs.text_field",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "JsonLines: the field of a plain-text record; empty: instruction records (instruction_field, input_field, "
       "output_field)",
       S(data.text.text_field)},
      {"client_configs.data_configs.dataset_kwargs.instruction_field",
       Type::kString,
       "instruction",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records: the instruction's field",
       S(data.text.instruction_field)},
      {"client_configs.data_configs.dataset_kwargs.input_field",
       Type::kString,
       "input",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records: the input's field (absent or empty: prompt_template_no_input)",
       S(data.text.input_field)},
      {"client_configs.data_configs.dataset_kwargs.output_field",
       Type::kString,
       "output",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records: the response's field",
       S(data.text.output_field)},
      {"client_configs.data_configs.dataset_kwargs.prompt_template",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records with an input: the prompt, {instruction} and {input} replaced ({{ }} are "
       "braces); empty: Stanford Alpaca's",
       S(data.text.prompt_template)},
      {"client_configs.data_configs.dataset_kwargs.prompt_template_no_input",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records without an input: the prompt, {instruction} replaced; empty: Stanford "
       "Alpaca's",
       S(data.text.prompt_template_no_input)},
      {"client_configs.data_configs.dataset_kwargs.train_on_response_only",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "JsonLines instruction records: the prompt's tokens out of the loss (only the response and EOS count)",
       B(data.text.train_on_response_only)},
      {"client_configs.data_configs.dataset_kwargs.group_field",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "JsonLines: a record's value of this field (a string or a number) is its group, for partition_strategy "
       "by_group or dirichlet; empty: one group",
       S(data.text.group_field)},
      {"client_configs.data_configs.dataset_kwargs.partition_strategy",
       Type::kString,
       "iid",
       {"iid", "dirichlet", "class_shards", "lognormal", "power_law", "by_group"},
       -kInf,
       kInf,
       "how samples are split among clients (by_group: each group — a class, a token set's source file or "
       "group_field value — to one client, groups dealt round-robin in sorted order)",
       S(data.partition_strategy)},
      {"client_configs.data_configs.dataset_kwargs.alpha",
       Type::kFloat,
       "0.5",
       {},
       1e-6,
       1e6,
       "Dirichlet concentration (smaller = more skew)",
       F(data.alpha)},
      {"client_configs.data_configs.dataset_kwargs.shards_per_client",
       Type::kInt,
       "2",
       {},
       1,
       1e6,
       "class shards per client",
       I(data.shards_per_client)},
      {"client_configs.data_configs.dataset_kwargs.sigma",
       Type::kFloat,
       "1.0",
       {},
       1e-3,
       10,
       "lognormal client sizes: sigma of log(size)",
       F(data.sigma)},
      {"client_configs.data_configs.dataset_kwargs.power_law_a",
       Type::kFloat,
       "1.5",
       {},
       0.1,
       100,
       "power-law client sizes: tail exponent (smaller = more skew)",
       F(data.power_law_a)},
      {"client_configs.data_configs.dataset_kwargs.val_ratio",
       Type::kFloat,
       "0.1",
       {},
       0,
       0.9,
       "share of each client's samples held out for validation",
       F(data.val_ratio)},
      {"client_configs.data_configs.dataset_kwargs.max_train_samples",
       Type::kInt,
       "0",
       {},
       0,
       1e12,
       "use only the first N training samples (0 = all)",
       I(data.max_train_samples)},
      {"client_configs.data_configs.dataset_kwargs.max_test_samples",
       Type::kInt,
       "0",
       {},
       0,
       1e12,
       "use only the first N test samples (0 = all)",
       I(data.max_test_samples)},
      {"client_configs.data_configs.dataset_kwargs.num_train_samples",
       Type::kInt,
       "5000",
       {},
       1,
       1e9,
       "synthetic data: training samples",
       I(data.num_train_samples)},
      {"client_configs.data_configs.dataset_kwargs.num_test_samples",
       Type::kInt,
       "1000",
       {},
       1,
       1e9,
       "synthetic data: test samples",
       I(data.num_test_samples)},
      // server_configs
      {"server_configs.num_clients", Type::kInt, "10", {}, 1, 1e7, "virtual clients", I(server.num_clients)},
      {"server_configs.clients_per_round",
       Type::kInt,
       "0",
       {},
       0,
       1e7,
       "clients selected per round (0 = all)",
       I(server.clients_per_round)},
      {"server_configs.num_global_epochs", Type::kInt, "5", {}, 1, 1e7, "rounds", I(server.num_global_epochs)},
      {"server_configs.scheduler",
       Type::kString,
       "SyncScheduler",
       // The registry's names (schedule/scheduler.h), written out so that
       // config/ depends on nothing above model/; a test keeps them equal.
       {"SyncScheduler", "AsyncScheduler", "CompassScheduler"},
       -kInf,
       kInf,
       "SyncScheduler (rounds), AsyncScheduler (each update as it comes: FedAsync, FedBuff) or CompassScheduler "
       "(FedCompass); the asynchronous ones run in the simulator (memfl run)",
       S(server.scheduler)},
      {"server_configs.aggregator",
       Type::kString,
       "FedAvgAggregator",
       // The registry's names (aggregate/registry.h); a test keeps them equal.
       {"FedAvgAggregator", "FedAvgMAggregator", "FedAdagradAggregator", "FedAdamAggregator", "FedYogiAggregator",
        "FedAsyncAggregator", "FedBuffAggregator", "FedCompassAggregator"},
       -kInf,
       kInf,
       "aggregation rule",
       S(server.aggregator)},
      {"server_configs.aggregator_kwargs.server_learning_rate",
       Type::kFloat,
       "1.0",
       {},
       1e-12,
       1e6,
       "server optimizers: the server's step size (eta); APPFL's examples use 0.1 for FedAdam/FedYogi, 0.01 for "
       "FedAdagrad",
       F(server.server_learning_rate)},
      {"server_configs.aggregator_kwargs.server_momentum_param_1",
       Type::kFloat,
       "0.9",
       {},
       0,
       0.999999,
       "server optimizers: momentum of the pseudo-gradient (beta1)",
       F(server.server_momentum_param_1)},
      {"server_configs.aggregator_kwargs.server_momentum_param_2",
       Type::kFloat,
       "0.99",
       {},
       0,
       0.999999,
       "FedAdam, FedYogi: decay of the second moment (beta2)",
       F(server.server_momentum_param_2)},
      {"server_configs.aggregator_kwargs.server_adapt_param",
       Type::kFloat,
       "1e-3",
       {},
       1e-12,
       1e6,
       "FedAdagrad, FedAdam, FedYogi: adaptivity (tau), added to the square root of the second moment",
       F(server.server_adapt_param)},
      {"server_configs.aggregator_kwargs.client_weights_mode",
       Type::kString,
       "equal",
       {"equal", "sample_size"},
       -kInf,
       kInf,
       "FedAvg weights",
       S(server.client_weights_mode)},
      {"server_configs.device",
       Type::kString,
       "cpu",
       {"cpu", "cuda"},
       -kInf,
       kInf,
       "where the server evaluates",
       S(server.device)},
      {"server_configs.logging_output_dirname",
       Type::kString,
       "runs",
       {},
       -kInf,
       kInf,
       "parent of run directories when --out is not given",
       S(server.logging_output_dirname)},
      {"server_configs.seed", Type::kInt, "42", {}, 0, 9.2e18, "seed for partitions, init, sampling", I(server.seed)},
      {"server_configs.do_server_eval",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "evaluate the global model on the test set every round",
       B(server.do_server_eval)},
      {"server_configs.eval_batch_size",
       Type::kInt,
       "64",
       {},
       1,
       1e6,
       "server evaluation batch size",
       I(server.eval_batch_size)},
      {"server_configs.round_timeout_s",
       Type::kInt,
       "600",
       {},
       1,
       1e7,
       "a round whose clients have not all finished by then ends with those that did",
       I(server.round_timeout_s)},
      {"server_configs.broadcast_timeout_s",
       Type::kInt,
       "0",
       {},
       0,
       1e7,
       "seconds from a round's start for each selected client to receive the global model; a client that has not "
       "is dropped and the round goes on with the others (0 = round_timeout_s)",
       I(server.broadcast_timeout_s)},
      {"server_configs.upload_timeout_s",
       Type::kInt,
       "0",
       {},
       0,
       1e7,
       "seconds from the end of the broadcast for each client to train and upload its update; a client that has "
       "not is dropped and the round ends with those that did (0 = round_timeout_s)",
       I(server.upload_timeout_s)},
      {"server_configs.max_round_retries",
       Type::kInt,
       "3",
       {},
       0,
       1e6,
       "times a synchronous round is played again after it could not complete (an upload broken part-way, a "
       "secure-aggregation round that cannot be unmasked); one more and the run stops, naming why",
       I(server.max_round_retries)},
      {"server_configs.max_num_samples",
       Type::kFloat,
       "1e12",
       {},
       1,
       1e300,
       "the largest sample count a client update may report; an update whose count is not finite, not positive or "
       "larger is refused (and one with a non-finite value in any float tensor), naming the client, and the round "
       "goes on with the others",
       F(server.max_num_samples)},
      {"server_configs.clients_per_rank",
       Type::kInt,
       "1",
       {},
       1,
       1e6,
       "MPI: virtual clients each client rank runs one after another",
       I(server.clients_per_rank)},
      {"server_configs.mpi_shared_memory",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "MPI: when every rank shares the server's node, chunks pass through a shared-memory ring (MPI-3 window) "
       "with point-to-point control messages; false = chunks as point-to-point messages",
       B(server.mpi_shared_memory)},
      {"server_configs.parallel_clients",
       Type::kInt,
       "1",
       {},
       -1,
       1024,
       "in-process simulation: worker replicas training selected clients at once (K); -1 = from memory_budget",
       I(server.parallel_clients)},
      {"server_configs.memory_budget",
       Type::kString,
       "80%",
       {},
       -kInf,
       kInf,
       "memory budget: 80% (of the cgroup's memory limit where there is one, else MemTotal), 12GiB, 512MiB or "
       "bytes; the server's bound and accumulator: auto are checked against it; the simulator warns at 85 %, "
       "sheds workers at 90 %",
       S(server.memory_budget)},
      {"server_configs.checkpoint_keep",
       Type::kInt,
       "2",
       {},
       1,
       1e6,
       "committed server states (model checkpoint + state JSON under RUN_DIR/state) kept on disk; --resume uses "
       "the newest that checks out, so 1 leaves no fallback for a torn newest commit; disk needed: model bytes x "
       "(this + 1), + 1 more when rounds are skipped (checkpoint_every > 1 or checkpoint_final_only)",
       I(server.checkpoint_keep)},
      {"server_configs.checkpoint_every",
       Type::kInt,
       "1",
       {},
       1,
       1e7,
       "commit the server state (resumable) every K rounds: rounds K, 2K, ... and always the last; --resume "
       "replays the rounds after the newest commit",
       I(server.checkpoint_every)},
      {"server_configs.checkpoint_final_only",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "commit only the last round (overrides checkpoint_every): a run stopped before its end cannot be resumed",
       B(server.checkpoint_final_only)},
      {"server_configs.client_selection",
       Type::kString,
       "random",
       {"random", "round_robin", "proportional_data", "topk_loss", "oort", "fairness"},
       -kInf,
       kInf,
       "which clients a round trains when clients_per_round < num_clients (memfl list-methods)",
       S(server.client_selection)},
      {"server_configs.client_selection_kwargs.power_of_choice_d",
       Type::kInt,
       "0",
       {},
       0,
       1e7,
       "topk_loss: candidates drawn by data size before the top-k by loss (0 = 2k)",
       I(server.power_of_choice_d)},
      {"server_configs.client_selection_kwargs.exploration",
       Type::kFloat,
       "0.2",
       {},
       0,
       1,
       "oort: share of slots for clients not yet tried",
       F(server.exploration)},
      {"server_configs.client_selection_kwargs.fairness_penalty",
       Type::kFloat,
       "1.0",
       {},
       0,
       100,
       "fairness: exponent on (1 + times picked)",
       F(server.fairness_penalty)},
      {"server_configs.memory_mode",
       Type::kString,
       "streaming",
       {"streaming", "naive"},
       -kInf,
       kInf,
       "naive: hold every client's serialised model, average at the end (for comparison)",
       S(server.memory_mode)},
      {"server_configs.comm_configs.grpc_configs.use_model_chunking",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "move models in chunks of model_chunk_size (false = one chunk); every transport",
       B(server.use_model_chunking)},
      {"server_configs.comm_configs.grpc_configs.model_chunk_size",
       Type::kInt,
       "1048576",
       {},
       1,
       2147483647,
       "bytes per chunk; every transport",
       I(server.model_chunk_size)},
      {"server_configs.comm_configs.grpc_configs.server_uri",
       Type::kString,
       "127.0.0.1:50051",
       {},
       -kInf,
       kInf,
       "host:port the server listens on and clients dial (port 0: any free port)",
       S(server.server_uri)},
      {"server_configs.comm_configs.grpc_configs.connect_timeout_s",
       Type::kInt,
       "30",
       {},
       1,
       1e6,
       "how long a client tries to reach the server",
       I(server.connect_timeout_s)},
      {"server_configs.comm_configs.grpc_configs.max_message_size",
       Type::kInt,
       "0",
       {},
       0,
       2147483647,
       "gRPC message limit in bytes (0 = model_chunk_size + 64 KiB)",
       I(server.max_message_size)},
      {"server_configs.comm_configs.grpc_configs.data_channel",
       Type::kString,
       "auto",
       {"auto", "grpc", "tcp"},
       -kInf,
       kInf,
       "where chunks travel: tcp (a connection beside the stream, opened with a per-session ticket: a Unix socket "
       "for clients on the server's host, the TCP port for others; not encrypted, so not with use_ssl), grpc "
       "(inside the stream), or auto (the fastest safe one: tcp without TLS; with use_ssl, the Unix socket for "
       "clients on the server's host and the encrypted stream for the others)",
       S(server.data_channel)},
      {"server_configs.comm_configs.grpc_configs.data_channel_port",
       Type::kInt,
       "0",
       {},
       0,
       65535,
       "data_channel tcp or auto: the port the server listens on for it (0: any free port, told to clients)",
       I(server.data_channel_port)},
      {"server_configs.comm_configs.grpc_configs.data_channel_unix",
       Type::kBool,
       "true",
       {},
       -kInf,
       kInf,
       "data_channel tcp or auto: clients on the server's host use a Unix-domain socket (faster than loopback "
       "TCP); others dial the port",
       B(server.data_channel_unix)},
      {"server_configs.comm_configs.grpc_configs.use_ssl",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "TLS",
       B(server.use_ssl)},
      {"server_configs.comm_configs.grpc_configs.server_cert",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "server certificate (PEM) for TLS",
       S(server.server_cert)},
      {"server_configs.comm_configs.grpc_configs.server_key",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "server private key (PEM) for TLS",
       S(server.server_key)},
      {"server_configs.comm_configs.grpc_configs.root_cert",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "root certificate (PEM) clients trust for TLS",
       S(server.root_cert)},
      {"server_configs.comm_configs.grpc_configs.auth_token",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "one token every client presents at Register (empty = none); it does not tell clients apart, see "
       "client_tokens_file",
       S(server.auth_token)},
      {"server_configs.comm_configs.grpc_configs.client_tokens_file",
       Type::kString,
       "\"\"",
       {},
       -kInf,
       kInf,
       "file of '<client_id> <token>' lines: each client registers with its own token (the server reads every "
       "line, a client its own); not with auth_token",
       S(server.client_tokens_file)},
      // memory_configs
      // clang-format off
      {"memory_configs.arena_backing", Type::kString, "memory", {"memory", "file"}, -kInf, kInf, "model-sized arenas in anonymous memory, or in mmap'd files (models larger than RAM)", S(memory.arena_backing)},
      {"memory_configs.scratch_dir", Type::kString, "\"\"", {}, -kInf, kInf, "arena_backing file: directory of the arena files (empty = the role's run directory)", S(memory.scratch_dir)},
      {"server_configs.aggregator_kwargs.alpha", Type::kFloat, "0.9", {}, 0, 1, "asynchronous: mixing rate; an update moves the model by alpha x s(staleness) x its weight", F(server.alpha)},
      {"server_configs.aggregator_kwargs.staleness_fn", Type::kString, "constant", {"constant", "polynomial", "hinge"}, -kInf, kInf, "asynchronous: s(t) = 1, (t+1)^-a, or 1 if t <= b else 1/(a(t-b)+1)", S(server.staleness_fn)},
      {"server_configs.aggregator_kwargs.staleness_fn_kwargs.a", Type::kFloat, "0.5", {}, 0, 1e6, "staleness_fn's a (polynomial, hinge)", F(server.staleness_a)},
      {"server_configs.aggregator_kwargs.staleness_fn_kwargs.b", Type::kFloat, "4", {}, 0, 1e9, "staleness_fn's b (hinge): staleness up to b counts in full", F(server.staleness_b)},
      {"server_configs.aggregator_kwargs.K", Type::kInt, "3", {}, 1, 1e6, "FedBuff: updates per buffer (the model moves every K updates)", I(server.buffer_size)},
      {"server_configs.aggregator_kwargs.gradient_based", Type::kBool, "false", {}, -kInf, kInf, "asynchronous: combine client updates as the change from their base model (x_base - y) instead of as models", B(server.gradient_based)},
      {"server_configs.aggregator_kwargs.weights", Type::kString, "unset", {"unset", "equal", "sample_size"}, -kInf, kInf, "FedCompass's name for client_weights_mode (APPFL); when given, it sets that", [](ExperimentConfig& c, const Value& v) {
        c.server.weights_alias = v.s;
        if (v.s != "unset") c.server.client_weights_mode = v.s;
      }},
      {"server_configs.aggregator_kwargs.num_clients", Type::kInt, "0", {}, 0, 1e7, "APPFL's copy of server_configs.num_clients (0 = that; another value is refused)", I(server.kwargs_num_clients)},
      {"server_configs.scheduler_kwargs.num_clients", Type::kInt, "0", {}, 0, 1e7, "APPFL's copy of server_configs.num_clients (0 = that; another value is refused)", I(server.scheduler_num_clients)},
      {"server_configs.scheduler_kwargs.same_init_model", Type::kBool, "true", {}, -kInf, kInf, "every client starts from the server's initial model (memfl always does; false is refused)", B(server.same_init_model)},
      {"server_configs.scheduler_kwargs.max_local_steps", Type::kInt, "100", {}, 1, 1e9, "CompassScheduler: most local steps a client is given", I(server.max_local_steps)},
      {"server_configs.scheduler_kwargs.min_local_steps", Type::kInt, "20", {}, 1, 1e9, "CompassScheduler: fewest local steps a client is given", I(server.min_local_steps)},
      {"server_configs.scheduler_kwargs.speed_momentum", Type::kFloat, "0.9", {}, 0, 1, "CompassScheduler: weight of the newest measured time per step in each client's speed estimate", F(server.speed_momentum)},
      {"server_configs.scheduler_kwargs.latest_time_factor", Type::kFloat, "1.5", {}, 1, 1e3, "CompassScheduler: a group waits until its expected arrival time x this", F(server.latest_time_factor)},
      {"server_configs.client_speed_distribution", Type::kString, "constant", {"constant", "lognormal", "uniform"}, -kInf, kInf, "simulator: how each client's time per local step is drawn (seeded by server_configs.seed)", S(server.client_speed_distribution)},
      {"server_configs.client_step_time_s", Type::kFloat, "0.1", {}, 1e-9, 1e9, "simulator: seconds per local step (the scale of the distribution)", F(server.client_step_time_s)},
      {"server_configs.client_speed_sigma", Type::kFloat, "0.5", {}, 0, 10, "simulator, lognormal: sigma of log(time per step)", F(server.client_speed_sigma)},
      {"server_configs.client_speed_max_ratio", Type::kFloat, "4", {}, 1, 1e6, "simulator, uniform: slowest / fastest time per step", F(server.client_speed_max_ratio)},
      {"server_configs.async_eval_every", Type::kInt, "0", {}, 0, 1e9, "asynchronous: evaluate the global model every N client updates (0 = num_clients)", I(server.async_eval_every)},
      {"server_configs.async_virtual_seconds", Type::kFloat, "0", {}, 0, 1e12, "simulator, asynchronous: stop at this virtual time, with num_global_epochs updates as a cap (0 = no time limit)", F(server.async_virtual_seconds)},
      {"server_configs.logging_output_filename", Type::kString, "result", {}, -kInf, kInf, "APPFL's log file name; memfl writes a run directory (metrics.csv, summary.json) and keeps it only for the record", S(server.logging_output_filename)},
      {"server_configs.aggregator_kwargs.dp_fedavg_clip_norm", Type::kFloat, "0", {}, 0, 1e12, "client-level DP-FedAvg: clip each client's update to this L2 norm (0 = off)", F(server.dp_fedavg_clip_norm)},
      {"server_configs.aggregator_kwargs.dp_fedavg_noise_multiplier", Type::kFloat, "1.0", {}, 0, 1e6, "client-level DP-FedAvg: server noise std = this × clip norm ÷ clients", F(server.dp_fedavg_noise_multiplier)},
      {"server_configs.aggregator_kwargs.dp_fedavg_delta", Type::kFloat, "1e-5", {}, 1e-300, 0.999999, "client-level DP-FedAvg: δ of the reported ε", F(server.dp_fedavg_delta)},
      {"server_configs.aggregator_kwargs.accumulator", Type::kString, "auto", {"auto", "f32", "model_dtype"}, -kInf, kInf, "FedAvg state for bf16/f16 models: f32 running sum (2x the model), model_dtype running mean in the model's own bytes (1x); auto = model_dtype when arena_backing is file, else f32 when server_configs.memory_budget holds the model + the f32 sum + 4 MiB, else model_dtype (logged)", S(server.accumulator)},
      // clang-format on
      {"memory_configs.sample_interval_ms",
       Type::kInt,
       "5",
       {},
       1,
       60000,
       "RSS sampling period",
       I(memory.sample_interval_ms)},
      {"memory_configs.profile",
       Type::kBool,
       "false",
       {},
       -kInf,
       kInf,
       "record allocations with stacks into profile.bin (same as --profile)",
       B(memory.profile)},
      {"memory_configs.profile_threshold",
       Type::kInt,
       "65536",
       {},
       1,
       1e12,
       "allocations at or above this many bytes get a stack; smaller ones are counted",
       I(memory.profile_threshold)},
  };
  return keys;
}

#undef I
#undef F
#undef B
#undef S

const KeySpec* find_key(std::string_view path) {
  for (const auto& k : schema()) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

bool is_section(std::string_view path) {
  std::string prefix = std::string(path) + ".";
  return std::any_of(schema().begin(), schema().end(),
                     [&](const KeySpec& k) { return k.path.compare(0, prefix.size(), prefix) == 0; });
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// APPFL keys memfl cannot honour as APPFL does (they name Python files or
// objects), with what to use instead.
std::string appfl_alternative(std::string_view path) {
  static const std::pair<std::string_view, std::string_view> known[] = {
      {"model_path",
       "memfl builds models in C++: name one with client_configs.model_configs.model_name (see "
       "`memfl config-keys`), or load weights from a safetensors file"},
      {"loss_fn_path", "the loss is built in: client_configs.train_configs.loss_fn_name (CrossEntropyLoss)"},
      {"loss_fn", "the loss is built in: client_configs.train_configs.loss_fn_name (CrossEntropyLoss)"},
      {"metric_path", "accuracy is the built-in metric; memfl reports train/val/test accuracy in metrics.csv"},
      {"dataset_path", "data sets are built in: client_configs.data_configs.dataset_name and dataset_kwargs"},
      {"trainer_path", "trainers are built in: client_configs.train_configs.trainer (VanillaTrainer, DummyTrainer)"},
  };
  const std::string_view leaf = path.substr(path.rfind('.') == std::string_view::npos ? 0 : path.rfind('.') + 1);
  for (const auto& [key, instead] : known) {
    if (leaf == key) return fmt::format(" — APPFL's {} names Python code, which memfl cannot run; {}", key, instead);
  }
  return "";
}

std::string suggestion(std::string_view path) {
  if (std::string appfl = appfl_alternative(path); !appfl.empty()) return appfl;
  // Only a key within `limit` edits is suggested, and a key whose length
  // differs by more cannot be: skip it before the O(m·n) distance, so a
  // hostile key name of megabytes is not compared with every key (seconds).
  const size_t limit = std::max<size_t>(3, path.size() / 5);
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& k : schema()) {
    if (std::max(path.size(), k.path.size()) - std::min(path.size(), k.path.size()) > limit) continue;
    size_t d = edit_distance(path, k.path);
    if (d < best_d) {
      best_d = d;
      best = k.path;
    }
  }
  // Also try the same leaf name in another section (a key put in the wrong place).
  const auto leaf = path.substr(path.rfind('.') + 1);
  for (const auto& k : schema()) {
    if (k.path.substr(k.path.rfind('.') + 1) == leaf) return fmt::format(" (did you mean '{}'?)", k.path);
  }
  if (best_d <= limit) return fmt::format(" (did you mean '{}'?)", best);
  return "";
}

std::string line_of(const YAML::Node& n) {
  const auto m = n.Mark();
  return m.line >= 0 ? fmt::format(":{}", m.line + 1) : "";
}

Status check_unknown_keys(const YAML::Node& node, const std::string& prefix, const std::string& source) {
  if (!node.IsMap()) {
    return invalid_argument("{}{}: '{}' must be a mapping of keys", source, line_of(node),
                            prefix.empty() ? "top level" : prefix);
  }
  std::map<std::string, std::string> seen;  // key → where it first appeared
  for (const auto& kv : node) {
    // A complex key (`? [a, b]`) or an alias is not a name: say so instead of
    // letting yaml-cpp throw past us.
    if (!kv.first.IsScalar()) {
      return invalid_argument("{}{}: a key{} must be a plain name, not {}", source, line_of(kv.first),
                              prefix.empty() ? "" : " under '" + prefix + "'",
                              kv.first.IsSequence() ? "a list"
                              : kv.first.IsMap()    ? "a mapping"
                                                    : "empty");
    }
    const std::string key = kv.first.Scalar();
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    // yaml-cpp keeps both entries of a repeated key and reads the first:
    // the second would be silently ignored.
    if (auto [it, fresh] = seen.emplace(key, line_of(kv.first)); !fresh) {
      return invalid_argument("{}{}: key '{}' appears twice (first at line{}); which one is meant?", source,
                              line_of(kv.first), path, it->second.empty() ? " ?" : " " + it->second.substr(1));
    }
    if (find_key(path) != nullptr) continue;
    if (is_section(path)) {
      if (kv.second.IsNull()) continue;  // an empty section is harmless
      MEMFL_RETURN_IF_ERROR(check_unknown_keys(kv.second, path, source));
      continue;
    }
    return invalid_argument("{}{}: unknown key '{}'{}", source, line_of(kv.first), path, suggestion(path));
  }
  return Status::Ok();
}

StatusOr<Value> convert(const KeySpec& k, const YAML::Node& n, const std::string& where) {
  Value v;
  auto bad_type = [&](const std::string& text) {
    return invalid_argument("{}: key '{}' must be a {}, got '{}'", where, k.path, type_name(k.type), text);
  };
  if (k.type == Type::kFloatPair) {
    if (!n.IsSequence() || n.size() != 2) return bad_type(YAML::Dump(n));
    for (int i = 0; i < 2; ++i) {
      try {
        v.pair[i] = n[i].as<double>();
      } catch (const YAML::Exception&) {
        return bad_type(YAML::Dump(n));
      }
      if (!(v.pair[i] >= k.min && v.pair[i] < k.max)) {  // NaN fails too
        return invalid_argument("{}: key '{}' values must lie in [{}, {}), got {}", where, k.path, k.min, k.max,
                                v.pair[i]);
      }
    }
    return v;
  }
  if (k.type == Type::kStringList) {
    // A YAML list, or one name as a scalar (PEFT's target_modules: "all-linear").
    if (n.IsScalar()) {
      v.list.push_back(n.Scalar());
      return v;
    }
    if (!n.IsSequence()) return bad_type(YAML::Dump(n));
    for (const auto& item : n) {
      if (!item.IsScalar()) return bad_type(YAML::Dump(n));
      v.list.push_back(item.Scalar());
    }
    return v;
  }
  if (!n.IsScalar()) return bad_type(YAML::Dump(n));
  const std::string text = n.Scalar();
  try {
    switch (k.type) {
      case Type::kInt: {
        if (text.find_first_of(".eE") != std::string::npos) return bad_type(text);
        v.i = n.as<int64_t>();
        v.f = static_cast<double>(v.i);
        break;
      }
      case Type::kFloat:
        v.f = n.as<double>();
        break;
      case Type::kBool:
        v.b = n.as<bool>();
        break;
      case Type::kString:
        v.s = text;
        break;
      case Type::kFloatPair:
      case Type::kStringList:
        break;
    }
  } catch (const YAML::Exception&) {
    return bad_type(text);
  }
  // Written so that NaN fails: `.nan` is a float to YAML, and every
  // comparison with it is false (it would turn DP off, or every weight NaN).
  if ((k.type == Type::kInt || k.type == Type::kFloat) && !(v.f >= k.min && v.f <= k.max)) {
    return invalid_argument("{}: key '{}' must lie in [{}, {}], got {}{}", where, k.path, k.min, k.max, text,
                            std::isnan(v.f) ? " (not a number)" : "");
  }
  if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), v.s) == k.choices.end()) {
    return invalid_argument("{}: key '{}' must be one of [{}], got '{}'", where, k.path, fmt::join(k.choices, ", "),
                            text);
  }
  return v;
}

YAML::Node lookup(const YAML::Node& root, const std::string& path) {
  // Node::operator= would assign through to the tree (yaml-cpp's reference
  // semantics); reset() rebinds, and keeps the marks (line numbers).
  YAML::Node cur;
  cur.reset(root);
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (!cur.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    YAML::Node next = cur[part];
    if (!next.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
    cur.reset(next);
  }
  return cur;
}

void assign(YAML::Node& root, const std::string& path, const YAML::Node& value) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '.')) parts.push_back(part);
  std::function<void(YAML::Node, size_t)> rec = [&](YAML::Node node, size_t i) {
    if (i + 1 == parts.size()) {
      node[parts[i]] = value;
      return;
    }
    if (!node[parts[i]].IsMap()) node[parts[i]] = YAML::Node(YAML::NodeType::Map);
    rec(node[parts[i]], i + 1);
  };
  rec(root, 0);
}

// What secure aggregation can run with: only what folds a round's updates
// as one sum (FedAvg and the server optimizers on the mean).
Status check_secure_aggregation(const ExperimentConfig& c, const std::string& source) {
  const SecAggConfig& a = c.secagg;
  if (!a.enable) return Status::Ok();
  const std::string key = "server_configs.secure_aggregation.";
  const auto m = static_cast<uint64_t>(a.modulus_range);
  if ((m & (m - 1)) != 0) {
    return invalid_argument("{}: '{}modulus_range: {}' must be a power of two (at most 2^32)", source, key, m);
  }
  if (a.quantization_range > a.modulus_range) {
    return invalid_argument("{}: '{}quantization_range: {}' exceeds modulus_range ({})", source, key,
                            a.quantization_range, a.modulus_range);
  }
  const int per_round = c.server.clients_per_round > 0 ? c.server.clients_per_round : c.server.num_clients;
  const uint64_t clients = static_cast<uint64_t>(std::max(per_round, 1));
  if (clients * static_cast<uint64_t>(a.quantization_range - 1) >= m) {
    return invalid_argument(
        "{}: '{}quantization_range: {}' × {} clients per round can wrap modulus_range ({}): the sum of the "
        "quantised updates must stay below it; lower quantization_range or raise modulus_range",
        source, key, a.quantization_range, clients, m);
  }
  if (a.num_shares > 1 && a.num_shares != std::floor(a.num_shares)) {
    return invalid_argument("{}: '{}num_shares: {}' above 1 is a count and must be whole", source, key, a.num_shares);
  }
  if (a.reconstruction_threshold > 1 && a.reconstruction_threshold != std::floor(a.reconstruction_threshold)) {
    return invalid_argument("{}: '{}reconstruction_threshold: {}' above 1 is a count and must be whole", source, key,
                            a.reconstruction_threshold);
  }
  if (a.num_shares > 1 && a.reconstruction_threshold > a.num_shares) {
    return invalid_argument("{}: '{}reconstruction_threshold: {}' exceeds num_shares ({})", source, key,
                            a.reconstruction_threshold, a.num_shares);
  }
  // k and t as the first round resolves them: what the run would refuse.
  const SecAggParams params = secagg_params(a);
  if (auto s = SecAggSettings::resolve(params, clients); !s.ok()) {
    return invalid_argument("{}: {}", source, s.status().message());
  }
  if (c.server.is_async() || c.server.aggregator == "FedAsyncAggregator" ||
      c.server.aggregator == "FedBuffAggregator" || c.server.aggregator == "FedCompassAggregator") {
    return invalid_argument(
        "{}: '{}enable: true' with server_configs.scheduler: {} / server_configs.aggregator: {}: an asynchronous "
        "aggregator applies each client's update on its own, which secure aggregation hides; use SyncScheduler "
        "with FedAvgAggregator or a server optimizer",
        source, key, c.server.scheduler, c.server.aggregator);
  }
  if (c.server.memory_mode == "naive") {
    return invalid_argument(
        "{}: '{}enable: true' with server_configs.memory_mode: naive, which holds each client's model whole on the "
        "server; secure aggregation needs the streaming sum",
        source, key);
  }
  if (c.compressor.enable_compression) {
    return invalid_argument(
        "{}: '{}enable: true' with client_configs.comm_configs.compressor_configs.enable_compression: masked "
        "updates are uniform integers that do not compress, and the server must not decode an individual update",
        source, key);
  }
  if (c.server.client_weights_mode != "equal" && c.server.client_weights_mode != "sample_size") {
    return invalid_argument("{}: '{}enable: true' needs client_weights_mode equal or sample_size", source, key);
  }
  return Status::Ok();
}

// What compressor_configs can do with the rest of the experiment, and with
// the libraries this build has (each codec's library is optional in CMake).
Status check_compressor(const ExperimentConfig& c, const std::string& source) {
  const CompressorConfig& z = c.compressor;
  const std::string key = "client_configs.comm_configs.compressor_configs.";
  if (!z.enable_compression) {
    if (z.broadcast_compression != "none") {
      return invalid_argument("{}: '{}broadcast_compression: {}' needs {}enable_compression: true", source, key,
                              z.broadcast_compression, key);
    }
    return Status::Ok();
  }
  const bool lossy = z.lossy_compressor != "none";
  auto missing = [&](const std::string& name, bool built, const char* package) -> Status {
    if (built) return Status::Ok();
    return invalid_argument("{}: '{}{}: {}' needs {}, which this memfl was built without (install it and rebuild)",
                            source, key, name == z.lossy_compressor ? "lossy_compressor" : "lossless_compressor", name,
                            package);
  };
#if !defined(MEMFL_HAVE_ZFP)
  if (z.lossy_compressor == "ZFPCompressor") MEMFL_RETURN_IF_ERROR(missing(z.lossy_compressor, false, "libzfp-dev"));
#endif
#if !defined(MEMFL_HAVE_ZSTD)
  if (z.lossless_compressor == "zstd") MEMFL_RETURN_IF_ERROR(missing("zstd", false, "libzstd-dev"));
#endif
#if !defined(MEMFL_HAVE_LZMA)
  if (z.lossless_compressor == "lzma") MEMFL_RETURN_IF_ERROR(missing("lzma", false, "liblzma-dev"));
#endif
#if !defined(MEMFL_HAVE_BLOSC)
  if (z.lossless_compressor == "blosc") MEMFL_RETURN_IF_ERROR(missing("blosc", false, "libblosc-dev"));
#endif
  (void)missing;
  if (z.error_feedback && !lossy) {
    return invalid_argument("{}: '{}error_feedback: true' needs a lossy_compressor: lossless compression loses nothing",
                            source, key);
  }
  if (z.broadcast_compression == "lossy") {
    if (!lossy) {
      return invalid_argument(
          "{}: '{}broadcast_compression: lossy' needs a lossy_compressor (the broadcast's change goes through it)",
          source, key);
    }
    if (c.server.is_async()) {
      // Each client starts from a version of its own; there is no one
      // model they all held the round before.
      return invalid_argument(
          "{}: '{}broadcast_compression: lossy' needs a synchronous aggregator (clients of an "
          "asynchronous server hold different versions)",
          source, key);
    }
  }
  if (c.server.memory_mode == "naive") {
    return invalid_argument(
        "{}: '{}enable_compression' streams frames into the aggregator; server_configs.memory_mode: naive holds "
        "serialised copies instead — use one or the other",
        source, key);
  }
  if (lossy && c.server.dp_fedavg_clip_norm > 0) {
    // DP-FedAvg's noise is calibrated to updates clipped to norm C; a lossy
    // code (and its residual) can carry an update past C.
    return invalid_argument(
        "{}: '{}lossy_compressor: {}' with client-level DP-FedAvg (server_configs.aggregator_kwargs."
        "dp_fedavg_clip_norm): a lossy update is no longer clipped to the norm the noise is calibrated to; use "
        "lossy_compressor: none",
        source, key, z.lossy_compressor);
  }
  if (lossy && c.server.is_async() && !c.server.gradient_based) {
    // The server rebuilds a lossy delta against the model the client started
    // from, and an asynchronous server has moved on from it.
    return invalid_argument(
        "{}: '{}lossy_compressor: {}' in an asynchronous run needs server_configs.aggregator_kwargs.gradient_based: "
        "true (the update is then a change, compressed as it is), or lossy_compressor: none",
        source, key, z.lossy_compressor);
  }
  if (lossy && c.train.num_gpus > 1) {
    return invalid_argument(
        "{}: '{}lossy_compressor: {}' needs the client's model in one arena to take its change from the global "
        "model; a model sharded over train_configs.num_gpus ranks takes lossy_compressor: none",
        source, key, z.lossy_compressor);
  }
  return Status::Ok();
}

// Tokenizers, text and instruction data: the keys that go together, then
// (where this machine has the files) what loading would refuse — the
// tokenizer and its vocabulary, every JSON line — and by_group's group count.
Status check_text_data(const ExperimentConfig& c, const std::string& source, bool llama) {
  const DataConfig& d = c.data;
  const TextDataConfig& t = d.text;
  const std::string kw = "client_configs.data_configs.dataset_kwargs.";
  const bool tokenized = d.dataset_name == "JsonLines" || (d.dataset_name == "TextFile" && !t.tokenizer_path.empty());
  if (!t.tokenizer_path.empty() && d.dataset_name != "TextFile" && d.dataset_name != "JsonLines") {
    return invalid_argument("{}: '{}' tokenizes TextFile and JsonLines data, not dataset '{}'", source,
                            kTokenizerPathKey, d.dataset_name);
  }
  if (d.dataset_name == "JsonLines" && t.tokenizer_path.empty()) {
    return invalid_argument("{}: dataset JsonLines needs '{}' (a SentencePiece tokenizer.model)", source,
                            kTokenizerPathKey);
  }
  if (tokenized && !have_sentencepiece()) {
    return failed_precondition(
        "{}: '{}' needs SentencePiece, and this memfl was built without its plugin (it needs "
        "libsentencepiece-dev — scripts/install-deps.sh installs it — and a build without MEMFL_SANITIZE)",
        source, kTokenizerPathKey);
  }
  if (!t.packing && !tokenized) {
    return invalid_argument("{}: '{}packing: false' (a document per sample) needs tokenized text: set '{}'", source, kw,
                            kTokenizerPathKey);
  }
  if (t.train_on_response_only && !(d.dataset_name == "JsonLines" && t.text_field.empty())) {
    return invalid_argument(
        "{}: '{}train_on_response_only: true' needs instruction records: dataset JsonLines without a text_field",
        source, kw);
  }
  if (!t.group_field.empty() && d.dataset_name != "JsonLines") {
    return invalid_argument(
        "{}: '{}group_field' names a JSON field, for dataset JsonLines (a TextFile folder's groups are its files)",
        source, kw);
  }
  if (d.dataset_name == "JsonLines" && t.text_field.empty()) {
    // A template that would fail on the first record fails here, and one
    // that would silently drop the record's input too.
    const std::string with = t.prompt_template.empty() ? std::string(alpaca_prompt_template(true)) : t.prompt_template;
    const std::string without =
        t.prompt_template_no_input.empty() ? std::string(alpaca_prompt_template(false)) : t.prompt_template_no_input;
    MEMFL_ASSIGN_OR_RETURN(std::string a, render_prompt(with, "\x01", "\x02", kw + "prompt_template"));
    MEMFL_ASSIGN_OR_RETURN(std::string b, render_prompt(without, "\x01", "\x02", kw + "prompt_template_no_input"));
    if (a.find('\x01') == std::string::npos || a.find('\x02') == std::string::npos) {
      return invalid_argument("{}: '{}prompt_template' must hold {{instruction}} and {{input}}", source, kw);
    }
    if (b.find('\x01') == std::string::npos || b.find('\x02') != std::string::npos) {
      return invalid_argument(
          "{}: '{}prompt_template_no_input' must hold {{instruction}} and not {{input}} (it is for records "
          "without one)",
          source, kw);
    }
  }
  const bool bytes = d.dataset_name == "SyntheticTokens" || (d.dataset_name == "TextFile" && !tokenized);
  if (llama && bytes && c.train.trainer != "DummyTrainer") {
    if (auto spec = llama_spec_from_config(c.model); spec.ok() && spec->vocab_size < 256) {
      return invalid_argument(
          "{}: dataset {} holds byte tokens (0 … 255) but the model's vocab_size is {}; set "
          "'client_configs.model_configs.model_kwargs.vocab_size' to 256 or more, or give a tokenizer ('{}')",
          source, d.dataset_name, spec->vocab_size, kTokenizerPathKey);
    }
  }
  int groups = 0;
  if (tokenized) {
    // The files' kinds and sizes only: the tokenizer, its vocabulary and the
    // records are read by the process that loads the data (and by memfl
    // validate, check_experiment_data).
    auto g = check_text_inputs(text_data_source(c));
    if (!g.ok()) return g.status().with_context(source);
    groups = *g;
  } else if (d.dataset_name == "FashionMNIST" || d.dataset_name == "SyntheticCIFAR10") {
    groups = 10;
  } else if (bytes) {
    groups = 1;
  }
  if (d.partition_strategy == "by_group" && groups > 0 && groups < c.server.num_clients) {
    return invalid_argument(
        "{}: '{}partition_strategy: by_group' gives each client a group of its own, but the data has {} group(s) "
        "for {} clients (server_configs.num_clients)",
        source, kw, groups, c.server.num_clients);
  }
  return Status::Ok();
}

// train_configs.lora: what PEFT's LoraConfig would refuse or memfl does not
// run, before any work. The adapter folder is checked for being one; its
// files are read by the roles that start from it.
Status check_lora(const ExperimentConfig& c, const std::string& source, bool llama) {
  const std::string k(kLoraKey);
  if (!llama) {
    return invalid_argument("{}: '{}' adapts a Llama's linear layers; client_configs.model_configs.model_name is {}",
                            source, k, c.model.model_name);
  }
  if (!(c.model.lora.lora_dropout < 1)) {
    return invalid_argument("{}: key '{}.lora_dropout' must lie in [0, 1), got {}", source, k,
                            c.model.lora.lora_dropout);
  }
  if (c.model.lora.lora_dropout > 0 && c.train.gradient_checkpointing) {
    // A recomputed block would draw another dropout mask than its forward.
    return invalid_argument(
        "{}: '{}.lora_dropout' {} with client_configs.train_configs.gradient_checkpointing: the recomputed blocks "
        "would drop other inputs than the forward did; set lora_dropout to 0 or turn checkpointing off",
        source, k, c.model.lora.lora_dropout);
  }
  if (!c.model.initial_model.empty()) {
    return invalid_argument(
        "{}: '{}' trains adapters over the base; the base comes from client_configs.model_configs.hf_checkpoint "
        "(or the seed), and '{}.init_adapters' starts the adapters, not client_configs.model_configs.initial_model",
        source, k, k);
  }
  if (c.train.num_gpus > 1) {
    return invalid_argument("{}: '{}' with client_configs.train_configs.num_gpus {}: a sharded client trains the "
                            "whole model; set num_gpus to 1",
                            source, k, c.train.num_gpus);
  }
  if (const auto& dir = c.model.lora.init_adapters; !dir.empty() && !std::filesystem::is_directory(dir)) {
    return invalid_argument("{}: '{}.init_adapters': '{}' is not a folder (a PEFT adapter: adapter_config.json and "
                            "adapter_model.safetensors)",
                            source, k, dir);
  }
  return Status::Ok();
}

Status cross_checks(const ExperimentConfig& c, const std::string& source) {
  // The budget's syntax is checked here, before any work, not when the
  // simulator first needs it.
  if (auto budget = parse_memory_budget(c.server.memory_budget, total_ram_bytes()); !budget.ok()) {
    return budget.status().with_context(source);
  }
  if (c.server.parallel_clients == 0) {
    return invalid_argument("{}: key 'server_configs.parallel_clients' must be ≥ 1, or -1 for 'as many as fit'",
                            source);
  }
  const bool llama = c.model.model_name == "llama" || c.model.model_name.starts_with("llama-");
  const bool tokens = c.data.dataset_name == "SyntheticTokens" || c.data.dataset_name == "TextFile" ||
                      c.data.dataset_name == "JsonLines";
  if (llama) {
    // A spec that cannot be built is named here, with the file, before any work.
    if (auto spec = llama_spec_from_config(c.model); !spec.ok()) return spec.status().with_context(source);
  }
  if (c.model.lora.enabled) MEMFL_RETURN_IF_ERROR(check_lora(c, source, llama));
  if (llama && c.train.trainer != "DummyTrainer" && !tokens) {
    return invalid_argument(
        "{}: model_name '{}' trains on tokens; set 'client_configs.data_configs.dataset_name' to SyntheticTokens, "
        "TextFile or JsonLines (or the trainer to DummyTrainer)",
        source, c.model.model_name);
  }
  if (tokens && !llama) {
    return invalid_argument("{}: dataset '{}' holds tokens, for a llama model, not '{}'", source, c.data.dataset_name,
                            c.model.model_name);
  }
  if ((c.data.dataset_name == "TextFile" || c.data.dataset_name == "JsonLines") && c.data.dataset_path.empty()) {
    return invalid_argument("{}: dataset {} needs 'client_configs.data_configs.dataset_path'", source,
                            c.data.dataset_name);
  }
  MEMFL_RETURN_IF_ERROR(check_text_data(c, source, llama));
  if (!c.train.dummy_delay_s.empty() && !parse_delays(c.train.dummy_delay_s).ok()) {
    return parse_delays(c.train.dummy_delay_s).status().with_context(source);
  }
  if (c.server.dp_fedavg_clip_norm > 0 && c.server.client_weights_mode != "equal") {
    return invalid_argument(
        "{}: client-level DP-FedAvg ('server_configs.aggregator_kwargs.dp_fedavg_clip_norm') needs "
        "client_weights_mode: equal — its noise is calibrated to a mean of equally weighted updates",
        source);
  }
  if (c.train.dp.enabled && c.model.model_name == "TorchScript" && c.train.dp.clipping != "naive") {
    return invalid_argument(
        "{}: 'client_configs.train_configs.dp.clipping: {}' needs memfl's DP layers (their per-sample norms come "
        "from each layer's input and output gradient); a TorchScript model takes 'clipping: naive' (one backward per "
        "sample)",
        source, c.train.dp.clipping);
  }
  // A Llama under LoRA trains its adapters alone, and they are DP layers.
  if (c.train.dp.enabled && c.model.model_name != "CNN_GN" && c.model.model_name != "TorchScript" &&
      !(llama && c.model.lora.enabled)) {
    return invalid_argument(
        "{}: 'client_configs.train_configs.dp.enabled' needs a model built from DP layers; model '{}' is not one "
        "(use CNN_GN: the CNN with GroupNorm, since BatchNorm mixes samples and DP cannot use it; a Llama trains "
        "with DP-SGD under LoRA, client_configs.train_configs.lora)",
        source, c.model.model_name);
  }
  if (c.model.model_name == "TorchScript" && c.model.torchscript_path.empty()) {
    return invalid_argument(
        "{}: model_name TorchScript needs 'client_configs.model_configs.torchscript_path' (a torch.jit.save'd module)",
        source);
  }
  if (c.model.model_name == "TorchScript") {
    // libtorch opens the module by name and would wait forever on a FIFO.
    MEMFL_RETURN_IF_ERROR(check_input_file_if_present(c.model.torchscript_path,
                                                      "client_configs.model_configs.torchscript_path",
                                                      kTorchScriptFileLimit)
                              .with_context(source));
  }
  if (c.compressor.enable_compression && c.compressor.lossy_compressor != "none" &&
      c.compressor.error_bounding_mode == "REL" && c.compressor.error_bound >= 0.5) {
    // Every value of a tensor lies within half its range of the range's
    // midpoint, so a bound of 0.5 x range is met by sending that one
    // constant: every change arrives as zero and training stops, silently.
    return invalid_argument(
        "{}: 'client_configs.comm_configs.compressor_configs.error_bound: {}' with error_bounding_mode REL allows "
        "an error of {} x each tensor's value range; from 0.5 up every value may come back as one constant and "
        "no change gets through. Use a bound below 0.5 (1e-3 is the default; 1e-2 is already coarse)",
        source, c.compressor.error_bound, c.compressor.error_bound);
  }
  if (!c.train.dummy_update_noise_values.empty() && !(c.train.dummy_update_noise > 0)) {
    return invalid_argument(
        "{}: 'client_configs.train_configs.dummy_update_noise_values' shapes the DummyTrainer's noise, and "
        "'client_configs.train_configs.dummy_update_noise' is 0 (no noise): set its σ too",
        source);
  }
  if (c.model.model_name == "synthetic" && c.train.trainer != "DummyTrainer") {
    return invalid_argument(
        "{}: model_name 'synthetic' has no network to train; set "
        "'client_configs.train_configs.trainer' to DummyTrainer",
        source);
  }
  if (c.server.use_ssl && (c.server.server_cert.empty() || c.server.server_key.empty() || c.server.root_cert.empty())) {
    return invalid_argument(
        "{}: 'server_configs.comm_configs.grpc_configs.use_ssl' needs server_cert, server_key "
        "and root_cert",
        source);
  }
  if (!c.server.auth_token.empty() && !c.server.client_tokens_file.empty()) {
    return invalid_argument(
        "{}: 'server_configs.comm_configs.grpc_configs.auth_token' and 'client_tokens_file' are both set; a client "
        "has one credential: keep client_tokens_file (a token per client) and drop auth_token",
        source);
  }
  if (c.server.use_ssl && c.server.data_channel == "tcp") {
    // The data channel carries the model in the clear: TLS on the stream
    // alone would protect the control messages and leave the model open.
    return invalid_argument(
        "{}: 'server_configs.comm_configs.grpc_configs.data_channel: tcp' is not encrypted and cannot be used with "
        "use_ssl: true; set data_channel: grpc for TLS",
        source);
  }
  if (c.server.is_async() || c.server.aggregator == "FedAsyncAggregator" ||
      c.server.aggregator == "FedBuffAggregator" || c.server.aggregator == "FedCompassAggregator") {
    const auto& sv = c.server;
    const bool compass = sv.scheduler == "CompassScheduler";
    const bool ok = compass ? sv.aggregator == "FedCompassAggregator"
                            : sv.scheduler == "AsyncScheduler" &&
                                  (sv.aggregator == "FedAsyncAggregator" || sv.aggregator == "FedBuffAggregator");
    if (!ok) {
      return invalid_argument(
          "{}: 'server_configs.aggregator' {} does not go with 'server_configs.scheduler' {}: AsyncScheduler takes "
          "FedAsyncAggregator or FedBuffAggregator, CompassScheduler takes FedCompassAggregator, SyncScheduler the "
          "others",
          source, sv.aggregator, sv.scheduler);
    }
    if (sv.min_local_steps > sv.max_local_steps) {
      return invalid_argument("{}: 'server_configs.scheduler_kwargs.min_local_steps' ({}) exceeds max_local_steps ({})",
                              source, sv.min_local_steps, sv.max_local_steps);
    }
  }
  for (const auto& [key, n] :
       {std::pair<const char*, int>{"aggregator_kwargs.num_clients", c.server.kwargs_num_clients},
        {"scheduler_kwargs.num_clients", c.server.scheduler_num_clients}}) {
    if (n != 0 && n != c.server.num_clients) {
      return invalid_argument("{}: 'server_configs.{}' is {} but server_configs.num_clients is {}; they must agree",
                              source, key, n, c.server.num_clients);
    }
  }
  if (!c.server.same_init_model) {
    return invalid_argument(
        "{}: 'server_configs.scheduler_kwargs.same_init_model: false' — memfl's clients always start from the "
        "server's model; remove the key or set it to true",
        source);
  }
  if (c.train.optim.state_dtype == "float32" && c.train.optim.optim != "Adam") {
    return invalid_argument(
        "{}: 'client_configs.train_configs.optimizer_state_dtype: float32' is for Adam's moments; "
        "client_configs.train_configs.optim is {}",
        source, c.train.optim.optim);
  }
  MEMFL_RETURN_IF_ERROR(check_compressor(c, source));
  MEMFL_RETURN_IF_ERROR(check_secure_aggregation(c, source));
  if (c.server.clients_per_round > c.server.num_clients) {
    return invalid_argument("{}: key 'server_configs.clients_per_round' ({}) exceeds server_configs.num_clients ({})",
                            source, c.server.clients_per_round, c.server.num_clients);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<double>> parse_delays(const std::string& text) {
  std::vector<double> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || end == item.c_str() || *end != '\0' || !std::isfinite(v) || v < 0 || v > 86400) {
      return invalid_argument(
          "'client_configs.train_configs.dummy_delay_s': '{}' is not a comma-separated list of seconds in [0, 86400]",
          text);
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

StatusOr<ExperimentConfig> load_config_text(const std::string& yaml_text, const std::string& source,
                                            const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return invalid_argument("{}:{}: not valid YAML: {}", source, e.mark.line + 1, e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  MEMFL_RETURN_IF_ERROR(check_unknown_keys(root, "", source));

  std::vector<std::pair<std::string, std::string>> set_sources;  // path -> where it was set
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      return invalid_argument("--set '{}': expected key.path=value", o);
    }
    const std::string path = o.substr(0, eq);
    if (find_key(path) == nullptr) {
      return invalid_argument("--set: unknown key '{}'{}", path, suggestion(path));
    }
    YAML::Node value;
    try {
      value = YAML::Load(o.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      return invalid_argument("--set {}: value is not valid YAML: {}", path, e.msg);
    }
    if (value.IsNull()) value = YAML::Node(std::string());
    assign(root, path, value);
    set_sources.emplace_back(path, "--set");
  }

  ExperimentConfig cfg;
  cfg.source = source;
  YAML::Node resolved(YAML::NodeType::Map);
  for (const auto& k : schema()) {
    YAML::Node n = lookup(root, k.path);
    std::string where = source;
    for (const auto& [p, w] : set_sources) {
      if (p == k.path) where = w;
    }
    if (!n.IsDefined() || n.IsNull()) {
      n = YAML::Load(k.default_text);
      where = "default";
    } else if (where == source) {
      where += line_of(n);
    }
    MEMFL_ASSIGN_OR_RETURN(Value v, convert(k, n, where));
    k.apply(cfg, v);
    assign(resolved, k.path, n);
  }
  // LoRA is on when the config has a train_configs.lora section; without
  // one, its keys' defaults are not part of the experiment (a resolved
  // config read back must not turn it on).
  {
    const YAML::Node lora = lookup(root, std::string(kLoraKey));
    cfg.model.lora.enabled = lora.IsDefined() && !lora.IsNull();
    if (!cfg.model.lora.enabled) {
      YAML::Node train = lookup(resolved, "client_configs.train_configs");
      if (train.IsDefined() && train.IsMap()) train.remove("lora");
    } else {
      auto modules = resolve_target_modules(cfg.model.lora.target_modules);
      if (!modules.ok()) return modules.status().with_context(source);
      cfg.model.lora.target_modules = *modules;
    }
  }
  if (!cfg.model.hf_checkpoint.empty()) {
    // The spec and dtype come from the checkpoint's config.json; the
    // resolved config says what they became.
    auto user_set = [&](std::string_view key) {
      const YAML::Node n = lookup(root, std::string(key));
      return n.IsDefined() && !n.IsNull();
    };
    auto set = apply_hf_config(&cfg.model, user_set);
    if (!set.ok()) return set.status().with_context(source);
    for (const auto& [key, value] : *set) assign(resolved, key, YAML::Load(value));
  }
  MEMFL_RETURN_IF_ERROR(cross_checks(cfg, source));
  YAML::Emitter out;
  out << resolved;
  cfg.resolved_yaml = std::string(out.c_str()) + "\n";
  return cfg;
}

std::string first_config_difference(const std::string& resolved_here, const std::string& resolved_there) {
  YAML::Node here, there;
  try {
    here = YAML::Load(resolved_here);
    there = YAML::Load(resolved_there);
  } catch (const YAML::Exception& e) {
    return std::string("(the configs could not be compared: ") + e.what() + ")";
  }
  for (const auto& k : schema()) {
    const YAML::Node a = lookup(here, k.path), b = lookup(there, k.path);
    const std::string va = a.IsDefined() ? YAML::Dump(a) : "(unset)";
    const std::string vb = b.IsDefined() ? YAML::Dump(b) : "(unset)";
    if (va != vb) return fmt::format("{}: {} here, {} there", k.path, va, vb);
  }
  return "";
}

bool may_change_on_resume(std::string_view key) {
  // How long the run goes on, how long it waits, where it listens, what it
  // logs or profiles and which rounds it commits: none of them changes what
  // a round computes, so a resumed run ends where one uninterrupted run with
  // them would have.
  static const char* const kMayChange[] = {
      "server_configs.num_global_epochs",
      "server_configs.round_timeout_s",
      "server_configs.broadcast_timeout_s",
      "server_configs.upload_timeout_s",
      "server_configs.max_round_retries",
      "server_configs.comm_configs.grpc_configs.connect_timeout_s",
      // Credentials: rotating them changes who may join, not what a round computes.
      "server_configs.comm_configs.grpc_configs.auth_token",
      "server_configs.comm_configs.grpc_configs.client_tokens_file",
      "server_configs.comm_configs.grpc_configs.server_uri",
      "server_configs.comm_configs.grpc_configs.data_channel_port",
      "server_configs.logging_output_dirname",
      "server_configs.checkpoint_keep",
      "server_configs.checkpoint_every",
      "server_configs.checkpoint_final_only",
  };
  for (const char* k : kMayChange) {
    if (key == k) return true;
  }
  return key.rfind("memory_configs.profile", 0) == 0 || key.rfind("memory_configs.sample", 0) == 0;
}

std::map<std::string, std::string> experiment_identity(const ExperimentConfig& cfg) {
  std::map<std::string, std::string> out;
  YAML::Node resolved;
  try {
    resolved = YAML::Load(cfg.resolved_yaml);
  } catch (const YAML::Exception&) {
    return out;  // not reached: resolved_yaml is memfl's own dump
  }
  for (const auto& k : schema()) {
    if (may_change_on_resume(k.path)) continue;
    const YAML::Node n = lookup(resolved, k.path);
    out[k.path] = n.IsDefined() ? YAML::Dump(n) : "(unset)";
  }
  return out;
}

Status check_resume_config(const std::string& committed_resolved, const std::string& committed_path,
                           const ExperimentConfig& now) {
  YAML::Node before, after;
  try {
    before = YAML::Load(committed_resolved);
    after = YAML::Load(now.resolved_yaml);
  } catch (const YAML::Exception& e) {
    return invalid_argument("--resume: {} cannot be compared with this config: {}", committed_path, e.what());
  }
  std::vector<std::string> refused;
  for (const auto& k : schema()) {
    const YAML::Node a = lookup(before, k.path), b = lookup(after, k.path);
    const std::string va = a.IsDefined() ? YAML::Dump(a) : "(unset)";
    const std::string vb = b.IsDefined() ? YAML::Dump(b) : "(unset)";
    if (va == vb) continue;
    if (may_change_on_resume(k.path)) {
      spdlog::warn("--resume: {} changes from {} to {}", k.path, va, vb);
      continue;
    }
    refused.push_back(fmt::format("{}: {} in the run, {} now", k.path, va, vb));
  }
  if (refused.empty()) return Status::Ok();
  return invalid_argument(
      "--resume: this config is another experiment than the run's ({}): {}. Only the run's length, timeouts, "
      "addresses and profiling may change on resume; nothing was written",
      committed_path, fmt::join(refused, "; "));
}

StatusOr<ExperimentConfig> load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  MEMFL_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "config file", kConfigFileLimit));
  return load_config_text(text, path, overrides);
}

std::string describe_config_keys() {
  std::string out;
  for (const auto& k : schema()) {
    out += fmt::format("{} ({}, default {}){}: {}\n", k.path, type_name(k.type), k.default_text,
                       k.choices.empty() ? "" : fmt::format(" one of [{}]", fmt::join(k.choices, ", ")), k.doc);
  }
  return out;
}

}  // namespace memfl
