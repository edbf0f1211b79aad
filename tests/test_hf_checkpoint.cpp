// Hugging Face Llama checkpoints as a run's initial model
// (client_configs.model_configs.hf_checkpoint): a folder as save_pretrained
// writes it — config.json, and the weights in one safetensors file or in
// shards with their index — written here byte by byte, in HF's tensor order
// (sorted names), not memfl's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

struct Spec {
  int hidden = 32, layers = 2, heads = 4, kv_heads = 2, intermediate = 48, vocab = 64;
};

// Every tensor of a Llama of `s` under HF's names with its shape.
std::map<std::string, std::vector<int64_t>> hf_tensors(const Spec& s, bool tied) {
  const int64_t hd = s.hidden / s.heads;
  std::map<std::string, std::vector<int64_t>> t;
  t["model.embed_tokens.weight"] = {s.vocab, s.hidden};
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t[p + "input_layernorm.weight"] = {s.hidden};
    t[p + "self_attn.q_proj.weight"] = {s.heads * hd, s.hidden};
    t[p + "self_attn.k_proj.weight"] = {s.kv_heads * hd, s.hidden};
    t[p + "self_attn.v_proj.weight"] = {s.kv_heads * hd, s.hidden};
    t[p + "self_attn.o_proj.weight"] = {s.hidden, s.heads * hd};
    t[p + "post_attention_layernorm.weight"] = {s.hidden};
    t[p + "mlp.gate_proj.weight"] = {s.intermediate, s.hidden};
    t[p + "mlp.up_proj.weight"] = {s.intermediate, s.hidden};
    t[p + "mlp.down_proj.weight"] = {s.hidden, s.intermediate};
  }
  t["model.norm.weight"] = {s.hidden};
  if (!tied) t["lm_head.weight"] = {s.vocab, s.hidden};
  return t;
}

// bf16 values, seeded, distinct per tensor: a tensor loaded under another
// name, or at another offset, would not match.
std::map<std::string, std::vector<uint16_t>> draw(const std::map<std::string, std::vector<int64_t>>& shapes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.f, 0.05f);
  std::map<std::string, std::vector<uint16_t>> out;
  for (const auto& [name, shape] : shapes) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    auto& v = out[name];
    for (int64_t i = 0; i < count; ++i) v.push_back(f32_to_bf16(n(rng)));
  }
  return out;
}

// One safetensors file of `names`, in that order, as the format says: an
// 8-byte little-endian header length, the JSON header, the data.
void write_file(const std::string& path, const std::vector<std::string>& names,
                const std::map<std::string, std::vector<int64_t>>& shapes,
                const std::map<std::string, std::vector<uint16_t>>& values) {
  nlohmann::json header;
  size_t at = 0;
  for (const auto& name : names) {
    const size_t bytes = values.at(name).size() * 2;
    header[name] = {{"dtype", "BF16"}, {"shape", shapes.at(name)}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary);
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& name : names) {
    f.write(reinterpret_cast<const char*>(values.at(name).data()),
            static_cast<std::streamsize>(values.at(name).size() * 2));
  }
}

// `v5`: as transformers 5 writes it — the rotary base inside
// rope_parameters, the dtype as "dtype".
nlohmann::json config_json(const Spec& s, bool tied, bool v5 = false) {
  if (v5) {
    nlohmann::json j = config_json(s, tied);
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j.erase("torch_dtype");
    j["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "default"}};
    j["dtype"] = "bfloat16";
    return j;
  }
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", s.hidden},
          {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads},
          {"intermediate_size", s.intermediate},
          {"vocab_size", s.vocab},
          {"rope_theta", 10000.0},
          {"rms_norm_eps", 1e-6},
          {"rope_scaling", nullptr},
          {"tie_word_embeddings", tied},
          {"torch_dtype", "bfloat16"}};
}

// A checkpoint folder: config.json and the tensors, in one file or in two
// shards (the first half of the sorted names, then the rest) with an index.
void write_checkpoint(const std::string& dir, const nlohmann::json& cfg,
                      const std::map<std::string, std::vector<int64_t>>& shapes,
                      const std::map<std::string, std::vector<uint16_t>>& values, bool sharded) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  std::vector<std::string> names;
  for (const auto& [name, v] : values) names.push_back(name);  // sorted, as HF writes them
  if (!sharded) {
    write_file(dir + "/model.safetensors", names, shapes, values);
    return;
  }
  const std::vector<std::string> first(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(names.size() / 2));
  const std::vector<std::string> second(names.begin() + static_cast<std::ptrdiff_t>(names.size() / 2), names.end());
  write_file(dir + "/model-00001-of-00002.safetensors", first, shapes, values);
  write_file(dir + "/model-00002-of-00002.safetensors", second, shapes, values);
  nlohmann::json index;
  size_t total = 0;
  for (const auto& n : first) index["weight_map"][n] = "model-00001-of-00002.safetensors";
  for (const auto& n : second) index["weight_map"][n] = "model-00002-of-00002.safetensors";
  for (const auto& [name, v] : values) total += v.size() * 2;
  index["metadata"] = {{"total_size", total}};
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
}

std::string run_config(const TempDir& tmp, const std::string& ckpt, const std::string& extra = "") {
  const std::string path = tmp.file("run.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: 0\n"
                         "  model_configs:\n    model_name: llama\n    hf_checkpoint: "
                      << ckpt << "\n"
                      << extra
                      << "server_configs:\n  num_clients: 2\n  num_global_epochs: 1\n  do_server_eval: false\n";
  return path;
}

// The global model a run starts from is the checkpoint's weights, each under
// its own name, from one file or from shards; the spec and dtype come from
// config.json (the run's resolved config says so). With a DummyTrainer that
// changes nothing, the round's model is that initial model bit for bit.
TEST(HfCheckpoint, ItsWeightsAreTheInitialGlobalModelFromOneFileOrShards) {
  for (const bool sharded : {false, true}) {
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(std::string(sharded ? "sharded" : "one file") + (tied ? ", tied embeddings" : ""));
      TempDir tmp;
      const Spec s;
      const auto shapes = hf_tensors(s, tied);
      const auto values = draw(shapes);
      // The sharded folders' config.json is transformers 5's form.
      write_checkpoint(tmp.file("ckpt"), config_json(s, tied, /*v5=*/sharded), shapes, values, sharded);
      Result r = memfl_cli("run " + run_config(tmp, tmp.file("ckpt")) + " -q --out " + tmp.file("run"));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      auto file = SafetensorsFile::open(tmp.file("run/global_model.safetensors"));
      ASSERT_TRUE(file.ok()) << file.status().to_string();
      size_t seen = 0;
      for (const auto& t : (*file)->tensors()) {
        ASSERT_TRUE(values.count(t.name)) << "a tensor the checkpoint does not have: " << t.name;
        ASSERT_EQ(t.dtype, DType::kBF16) << t.name;
        const auto& want = values.at(t.name);
        ASSERT_EQ(t.data.size(), want.size() * 2) << t.name;
        EXPECT_EQ(std::memcmp(t.data.data(), want.data(), t.data.size()), 0) << t.name;
        ++seen;
      }
      EXPECT_EQ(seen, values.size());
      const std::string resolved = testing::read_file(tmp.file("run/config.yaml"));
      EXPECT_NE(resolved.find("rope_theta: 10000"), std::string::npos) << resolved;
      EXPECT_NE(resolved.find("intermediate_size: 48"), std::string::npos) << resolved;
    }
  }
}

// What does not fit is refused before any round, naming the file and what is
// wrong: another architecture, rope scaling, a key the user set to another
// value, a tensor missing from the weights, a tensor of another shape.
TEST(HfCheckpoint, ACheckpointThatDoesNotFitIsRefusedNamingTheFileAndTheTensor) {
  const Spec s;
  const auto shapes = hf_tensors(s, false);
  const auto values = draw(shapes);
  auto refused = [&](const nlohmann::json& cfg, std::map<std::string, std::vector<int64_t>> sh,
                     std::map<std::string, std::vector<uint16_t>> v, const std::string& extra,
                     const std::vector<std::string>& says) {
    TempDir tmp;
    write_checkpoint(tmp.file("ckpt"), cfg, sh, v, /*sharded=*/false);
    Result r = memfl_cli("run " + run_config(tmp, tmp.file("ckpt"), extra) + " -q --out " + tmp.file("run"));
    EXPECT_NE(r.exit_code, 0) << r.output;
    for (const auto& what : says) EXPECT_NE(r.output.find(what), std::string::npos) << what << "\n" << r.output;
    const std::string metrics =
        fs::exists(tmp.file("run/metrics.csv")) ? testing::read_file(tmp.file("run/metrics.csv")) : "";
    EXPECT_EQ(metrics.find("\n1,"), std::string::npos) << "no round was played";
  };
  nlohmann::json mistral = config_json(s, false);
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["model_type"] = "mistral";
  refused(mistral, shapes, values, "", {"config.json", "MistralForCausalLM", "hf_checkpoint"});
  nlohmann::json scaled = config_json(s, false);
  scaled["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  refused(scaled, shapes, values, "", {"config.json", "rope_scaling"});
  nlohmann::json scaled_v5 = config_json(s, false, /*v5=*/true);
  scaled_v5["rope_parameters"]["rope_type"] = "llama3";
  refused(scaled_v5, shapes, values, "", {"config.json", "rope_type 'llama3'"});
  refused(config_json(s, false), shapes, values, "    model_kwargs:\n      hidden_size: 64\n",
          {"config.json", "hidden_size = 32", "model_kwargs.hidden_size' is 64"});
  auto missing_v = values;
  auto missing_s = shapes;
  missing_v.erase("model.layers.1.mlp.up_proj.weight");
  missing_s.erase("model.layers.1.mlp.up_proj.weight");
  refused(config_json(s, false), missing_s, missing_v, "",
          {"model.safetensors", "model.layers.1.mlp.up_proj.weight", "missing"});
  Spec narrow = s;
  narrow.intermediate = 40;  // the weights of another MLP width than config.json says
  const auto other = hf_tensors(narrow, false);
  refused(config_json(s, false), other, draw(other), "",
          {"model.safetensors", "model.layers.0.mlp.down_proj.weight", "shape"});
}

#ifdef MEMFL_TEST_TORCH
// Federated LoRA over a Hugging Face checkpoint: only the adapters train and
// travel. The same run in process, over gRPC and as MPI ranks ends with the
// same adapters bit for bit; the held-out loss falls; each upload is the
// adapters' bytes (computed here from their shapes); the base checkpoint is
// never written; the run directory holds the global adapters in PEFT's
// format.
TEST(LoraRun, OnlyTheAdaptersTrainAndTravelAndEveryTransportGivesTheSameOnes) {
  TempDir tmp;
  Spec s;
  s.vocab = 256;  // SyntheticTokens' tokens are bytes
  const auto shapes = hf_tensors(s, false);
  const auto values = draw(shapes);
  write_checkpoint(tmp.file("ckpt"), config_json(s, false), shapes, values, /*sharded=*/true);
  auto checkpoint_bytes = [&] {
    std::string all;
    for (const auto& e : fs::directory_iterator(tmp.file("ckpt"))) all += testing::read_file(e.path().string());
    return all;
  };
  const std::string before = checkpoint_bytes();
  const int clients = 2;
  std::ofstream(tmp.file("lora.yaml"))
      << "client_configs:\n  train_configs:\n    trainer: VanillaTrainer\n    mode: step\n    num_local_steps: 8\n"
         "    optim: Adam\n    optim_args: {lr: 0.02}\n    train_batch_size: 8\n    num_threads: 1\n"
         "    lora:\n      r: 4\n      lora_alpha: 8\n      target_modules: [v_proj, q_proj, down_proj]\n"
         "  model_configs:\n    model_name: llama\n    hf_checkpoint: "
      << tmp.file("ckpt") << "\n    model_kwargs: {seq_length: 16}\n"
      << "  data_configs:\n    dataset_name: SyntheticTokens\n"
         "    dataset_kwargs: {num_train_samples: 256, num_test_samples: 64}\n"
         "server_configs:\n  num_clients: "
      << clients << "\n  num_global_epochs: 3\n  eval_batch_size: 32\n";
  std::vector<std::string> adapters;
  Result in = memfl_cli("run " + tmp.file("lora.yaml") + " -q --out " + tmp.file("inproc"));
  ASSERT_EQ(in.exit_code, 0) << in.output;
  adapters.push_back(tmp.file("inproc/global_model.safetensors"));
#ifdef MEMFL_TEST_GRPC
  Result g = memfl_cli("launch " + tmp.file("lora.yaml") + " -q --clients " + std::to_string(clients) + " --out " +
                       tmp.file("grpc"));
  ASSERT_EQ(g.exit_code, 0) << g.output;
  adapters.push_back(tmp.file("grpc/server/global_model.safetensors"));
#endif
#ifdef MEMFL_TEST_MPI
  Result m = mpirun(clients + 1, tmp.file("lora.yaml") + " -q --out " + tmp.file("mpi"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  adapters.push_back(tmp.file("mpi/rank_0/global_model.safetensors"));
#endif
  for (const auto& path : adapters) EXPECT_TRUE(same_model(adapters.front(), path)) << path;

  // The adapters by PEFT's names, in float32: A [4, in], B [out, 4]; the
  // base's tensors are not in it.
  auto file = SafetensorsFile::open(adapters.front());
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  const int64_t hd = s.hidden / s.heads;
  std::map<std::string, std::pair<int64_t, int64_t>> in_out = {
      {"self_attn.q_proj", {s.hidden, s.heads * hd}},
      {"self_attn.v_proj", {s.hidden, s.kv_heads * hd}},
      {"mlp.down_proj", {s.intermediate, s.hidden}}};
  size_t adapter_bytes = 0;
  for (int l = 0; l < s.layers; ++l) {
    for (const auto& [module, io] : in_out) {
      const std::string p = "base_model.model.model.layers." + std::to_string(l) + "." + module;
      const auto* a = (*file)->find(p + ".lora_A.weight");
      const auto* b = (*file)->find(p + ".lora_B.weight");
      ASSERT_NE(a, nullptr) << p;
      ASSERT_NE(b, nullptr) << p;
      EXPECT_EQ(a->shape, (std::vector<int64_t>{4, io.first}));
      EXPECT_EQ(b->shape, (std::vector<int64_t>{io.second, 4}));
      EXPECT_EQ(a->dtype, DType::kF32);
      adapter_bytes += static_cast<size_t>(4 * io.first + io.second * 4) * 4;
      // B moved from its zero start: the adapters trained.
      const float* bv = reinterpret_cast<const float*>(b->data.data());
      EXPECT_TRUE(std::any_of(bv, bv + b->data.size() / 4, [](float v) { return v != 0; })) << p;
    }
  }
  EXPECT_EQ((*file)->tensors().size(), static_cast<size_t>(s.layers) * in_out.size() * 2);

  const auto rows = read_csv(tmp.file("inproc/metrics.csv"));
  ASSERT_EQ(rows.size(), 4u);
  const auto& head = rows[0];
  const size_t loss = std::find(head.begin(), head.end(), "test_loss") - head.begin();
  const size_t up = std::find(head.begin(), head.end(), "bytes_up") - head.begin();
  ASSERT_LT(loss, head.size());
  ASSERT_LT(up, head.size());
  EXPECT_LT(std::stod(rows[3][loss]), std::stod(rows[1][loss])) << "the held-out loss falls";
  for (size_t r = 1; r < rows.size(); ++r) {
    const double bytes = std::stod(rows[r][up]);
    // Each client's upload is its adapters (plus the arena's alignment
    // padding between tensors: 64 bytes at most each), not the base.
    EXPECT_GE(bytes, clients * static_cast<double>(adapter_bytes)) << "round " << r;
    EXPECT_LE(bytes, clients * static_cast<double>(adapter_bytes + 64 * (*file)->tensors().size())) << "round " << r;
  }

  // The global adapters in PEFT's format in the run directory: its config,
  // and the same tensors as the global model.
  const auto peft = nlohmann::json::parse(testing::read_file(tmp.file("inproc/adapter/adapter_config.json")));
  EXPECT_EQ(peft["peft_type"], "LORA");
  EXPECT_EQ(peft["r"], 4);
  EXPECT_EQ(peft["target_modules"], (std::vector<std::string>{"q_proj", "v_proj", "down_proj"}));
  EXPECT_TRUE(same_model(adapters.front(), tmp.file("inproc/adapter/adapter_model.safetensors")));
  EXPECT_EQ(checkpoint_bytes(), before) << "the base checkpoint was written to";
}

// Every privacy.csv row under `dir` (whichever role wrote it), sorted.
std::vector<std::vector<std::string>> privacy_rows(const std::string& dir) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().filename() != "privacy.csv") continue;
    auto r = read_csv(e.path().string());
    if (!r.empty()) rows.insert(rows.end(), r.begin() + 1, r.end());
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

// DP-SGD on the adapters of a federated LoRA run: each client clips every
// sequence's adapter gradient and adds noise, so the adapters differ from
// the same run without DP; in process, over gRPC and as MPI ranks the
// adapters are the same bit for bit and every client's privacy ledger is
// the same, one row per client and round with ε growing over the rounds.
TEST(LoraRun, DpSgdOnTheAdaptersGivesOneModelAndOneLedgerOnEveryTransport) {
  TempDir tmp;
  Spec s;
  s.vocab = 256;
  const auto shapes = hf_tensors(s, false);
  write_checkpoint(tmp.file("ckpt"), config_json(s, false), shapes, draw(shapes), /*sharded=*/false);
  const int clients = 2;
  auto yaml = [&](const std::string& name, bool dp) {
    std::ofstream(tmp.file(name))
        << "client_configs:\n  train_configs:\n    trainer: VanillaTrainer\n    mode: step\n    num_local_steps: 4\n"
           "    optim: SGD\n    optim_args: {lr: 0.5}\n    train_batch_size: 8\n    num_threads: 1\n"
           "    lora:\n      r: 4\n      lora_alpha: 8\n      target_modules: [q_proj, up_proj]\n"
        << (dp ? "    dp:\n      enabled: true\n      noise_multiplier: 0.8\n      max_grad_norm: 0.05\n" : "")
        << "  model_configs:\n    model_name: llama\n    hf_checkpoint: " << tmp.file("ckpt")
        << "\n    model_kwargs: {seq_length: 16}\n"
        << "  data_configs:\n    dataset_name: SyntheticTokens\n"
           "    dataset_kwargs: {num_train_samples: 128, num_test_samples: 32}\n"
           "server_configs:\n  num_clients: "
        << clients << "\n  num_global_epochs: 2\n  eval_batch_size: 32\n";
    return tmp.file(name);
  };
  const std::string dp = yaml("dp.yaml", true), plain = yaml("plain.yaml", false);
  Result p = memfl_cli("run " + plain + " -q --out " + tmp.file("plain"));
  ASSERT_EQ(p.exit_code, 0) << p.output;
  std::vector<std::string> runs = {"inproc"};
  Result in = memfl_cli("run " + dp + " -q --out " + tmp.file("inproc"));
  ASSERT_EQ(in.exit_code, 0) << in.output;
#ifdef MEMFL_TEST_GRPC
  Result g = memfl_cli("launch " + dp + " -q --clients " + std::to_string(clients) + " --out " + tmp.file("grpc"));
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("grpc/server/global_model.safetensors")));
  runs.push_back("grpc");
#endif
#ifdef MEMFL_TEST_MPI
  Result m = mpirun(clients + 1, dp + " -q --out " + tmp.file("mpi"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("mpi/rank_0/global_model.safetensors")));
  runs.push_back("mpi");
#endif
  EXPECT_FALSE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("plain/global_model.safetensors")))
      << "clipping and noise left the adapters as they were without DP";
  const auto ledger = privacy_rows(tmp.file("inproc"));
  ASSERT_EQ(ledger.size(), static_cast<size_t>(2 * clients));  // a row per client and round
  const auto head = read_csv(tmp.file("inproc/privacy.csv")).front();
  const size_t eps = std::find(head.begin(), head.end(), "epsilon") - head.begin();
  ASSERT_LT(eps, head.size());
  for (const auto& row : ledger) {
    EXPECT_GT(std::stod(row[eps]), 0) << row[0];
    EXPECT_TRUE(std::isfinite(std::stod(row[eps]))) << row[0];
  }
  // Sorted by round: a client's second row has spent more than its first.
  EXPECT_GT(std::stod(ledger[clients][eps]), std::stod(ledger[0][eps]));
  for (const auto& run : runs) EXPECT_EQ(privacy_rows(tmp.file(run)), ledger) << run;
}
#endif

}  // namespace
}  // namespace memfl
