// LoRA's federated model without libtorch (model/lora.h): the adapters'
// layout under PEFT's names and shapes, the initial adapters, PEFT's adapter
// folder out and in, and the train_configs.lora keys' refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "model/llama.h"
#include "model/lora.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

LlamaSpec spec(int64_t hidden = 32) {
  LlamaSpec s;
  s.name = "llama";
  s.hidden_size = hidden;
  s.num_layers = 2;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.intermediate_size = 48;
  s.vocab_size = 64;
  return s;
}

LoraConfig lora(int r, std::vector<std::string> modules) {
  LoraConfig l;
  l.enabled = true;
  l.r = r;
  l.lora_alpha = 2.0 * r;
  l.target_modules = std::move(modules);
  return l;
}

// Shapes worked out from the spec by hand: hidden 32, 4 heads of 8, 2 KV
// heads (16 features), intermediate 48; A is [r, in], B [out, r].
TEST(Lora, LayoutHasPeftsNamesAndShapesForEveryTargetedModuleOfEveryLayer) {
  auto all = resolve_target_modules({"all-linear"});
  ASSERT_TRUE(all.ok());
  auto layout = lora_layout(spec(), lora(4, *all));
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const std::map<std::string, std::pair<std::vector<int64_t>, std::vector<int64_t>>> want = {
      {"self_attn.q_proj", {{4, 32}, {32, 4}}}, {"self_attn.k_proj", {{4, 32}, {16, 4}}},
      {"self_attn.v_proj", {{4, 32}, {16, 4}}}, {"self_attn.o_proj", {{4, 32}, {32, 4}}},
      {"mlp.gate_proj", {{4, 32}, {48, 4}}},    {"mlp.up_proj", {{4, 32}, {48, 4}}},
      {"mlp.down_proj", {{4, 48}, {32, 4}}}};
  ASSERT_EQ(layout->size(), 2u * 7u * 2u);
  size_t elements = 0;
  for (int l = 0; l < 2; ++l) {
    for (const auto& [module, shapes] : want) {
      const std::string p = "base_model.model.model.layers." + std::to_string(l) + "." + module;
      const LayoutEntry* a = layout->find(p + ".lora_A.weight");
      const LayoutEntry* b = layout->find(p + ".lora_B.weight");
      ASSERT_NE(a, nullptr) << p;
      ASSERT_NE(b, nullptr) << p;
      EXPECT_EQ(a->shape, shapes.first) << p;
      EXPECT_EQ(b->shape, shapes.second) << p;
      EXPECT_EQ(a->dtype, DType::kF32) << "PEFT keeps adapters in float32";
      elements += static_cast<size_t>(shapes.first[0] * shapes.first[1] + shapes.second[0] * shapes.second[1]);
    }
  }
  EXPECT_EQ(layout->payload_bytes(), elements * 4);
  // The layer's order is the decoder's, A before B.
  EXPECT_EQ(layout->entries()[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(layout->entries()[13].name, "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");

  // Two modules, named out of order: the decoder's order still.
  auto two = resolve_target_modules({"v_proj", "q_proj"});
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(*two, (std::vector<std::string>{"q_proj", "v_proj"}));
  auto small = lora_layout(spec(), lora(2, *two));
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->size(), 2u * 2u * 2u);
  EXPECT_EQ(small->payload_bytes(), 2u * (2 * 32 + 32 * 2 + 2 * 32 + 16 * 2) * 4);
  EXPECT_FALSE(resolve_target_modules({"q_proj", "lm_head"}).ok());
}

// PEFT draws A with kaiming_uniform_(a=√5): U(−1/√in, 1/√in), variance
// 1/(3·in); B is zero. The same seed gives the same bytes.
TEST(Lora, InitialAdaptersAreKaimingUniformAAndZeroB) {
  auto layout = lora_layout(spec(256), lora(8, {"q_proj", "down_proj"}));
  ASSERT_TRUE(layout.ok());
  Arena a(layout->total_bytes(), MemoryCategory::kModel), b(layout->total_bytes(), MemoryCategory::kModel),
      c(layout->total_bytes(), MemoryCategory::kModel);
  std::memset(a.data(), 0x7f, layout->total_bytes());  // B must be written, not left
  fill_initial_adapters(*layout, a, 11);
  fill_initial_adapters(*layout, b, 11);
  fill_initial_adapters(*layout, c, 12);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), layout->total_bytes()), 0);
  EXPECT_NE(std::memcmp(a.data(), c.data(), layout->total_bytes()), 0);
  for (const auto& e : layout->entries()) {
    const float* p = reinterpret_cast<const float*>(a.data() + e.offset);
    const size_t n = e.numel();
    if (e.name.find("lora_B") != std::string::npos) {
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(p[i], 0.0f) << e.name;
      continue;
    }
    const double in = static_cast<double>(e.shape[1]), bound = 1 / std::sqrt(in);
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_LE(std::abs(p[i]), bound) << e.name;
      sum += p[i];
      sq += static_cast<double>(p[i]) * p[i];
    }
    const double var = 1.0 / (3.0 * in), mean = sum / static_cast<double>(n);
    // The sample mean's σ is √(var/n); the sample variance's is var·√(0.8/n)
    // for a uniform: 5σ each.
    EXPECT_LT(std::abs(mean), 5 * std::sqrt(var / static_cast<double>(n))) << e.name;
    EXPECT_NEAR(sq / static_cast<double>(n), var, 5 * var * std::sqrt(0.8 / static_cast<double>(n))) << e.name;
  }
}

// A safetensors file written by hand: PEFT's names, bf16 values.
void write_bf16_adapter(const std::string& dir, const Layout& layout, float value_of_index_scale) {
  std::filesystem::create_directories(dir);
  nlohmann::json header;
  size_t at = 0;
  std::string data;
  for (const auto& e : layout.entries()) {
    header[e.name] = {{"dtype", "BF16"}, {"shape", e.shape}, {"data_offsets", {at, at + e.numel() * 2}}};
    for (size_t i = 0; i < e.numel(); ++i) {
      const uint16_t v = f32_to_bf16(value_of_index_scale * static_cast<float>(i % 7) - 0.5f);
      data.append(reinterpret_cast<const char*>(&v), 2);
    }
    at += e.numel() * 2;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream f(dir + "/adapter_model.safetensors", std::ios::binary);
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << text << data;
}

TEST(Lora, PeftAdapterFolderRoundTripsAndAnotherBaseIsRefused) {
  testing::TempDir tmp;
  ModelConfig model;
  model.model_name = "llama";
  model.lora = lora(4, {"q_proj", "k_proj", "v_proj", "o_proj"});
  auto layout = lora_layout(spec(), model.lora);
  ASSERT_TRUE(layout.ok());
  Arena out(layout->total_bytes(), MemoryCategory::kModel);
  testing::fill_random(*layout, out, 3);
  ASSERT_TRUE(write_peft_adapter(tmp.file("adapter"), model, *layout, out).ok());

  std::ifstream cfg(tmp.file("adapter/adapter_config.json"));
  const auto j = nlohmann::json::parse(cfg);
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["r"], 4);
  EXPECT_EQ(j["lora_alpha"], 8.0);
  EXPECT_EQ(j["target_modules"], (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(j["bias"], "none");

  LoraConfig in = model.lora;
  in.init_adapters = tmp.file("adapter");
  Arena back(layout->total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(load_peft_adapter(in, *layout, back).ok());
  for (const auto& e : layout->entries()) {
    EXPECT_EQ(std::memcmp(out.data() + e.offset, back.data() + e.offset, e.nbytes()), 0) << e.name;
  }

  // Adapters of a wider base: every shape differs from this model's.
  auto wider = lora_layout(spec(64), model.lora);
  ASSERT_TRUE(wider.ok());
  Arena w(wider->total_bytes(), MemoryCategory::kModel);
  const Status other = load_peft_adapter(in, *wider, w);
  ASSERT_FALSE(other.ok());
  EXPECT_HAS(other.message(), "init_adapters");
  EXPECT_HAS(other.message(), "adapter_model.safetensors");
  EXPECT_HAS(other.message(), "has shape [4, 32]");

  // Another r than the config's.
  LoraConfig r8 = in;
  r8.r = 8;
  auto l8 = lora_layout(spec(), r8);
  Arena a8(l8->total_bytes(), MemoryCategory::kModel);
  EXPECT_HAS(load_peft_adapter(r8, *l8, a8).message(), "r is 4, but client_configs.train_configs.lora.r is 8");

  // Fewer target modules than the folder's: its extra tensors are refused.
  LoraConfig qv = in;
  qv.target_modules = {"q_proj", "v_proj"};
  auto lqv = lora_layout(spec(), qv);
  Arena aqv(lqv->total_bytes(), MemoryCategory::kModel);
  EXPECT_HAS(load_peft_adapter(qv, *lqv, aqv).message(), "target_modules");

  // bf16 adapters (saved without PEFT's float32 autocast) load as float32.
  write_bf16_adapter(tmp.file("adapter"), *layout, 0.25f);
  ASSERT_TRUE(load_peft_adapter(in, *layout, back).ok());
  const auto& e = layout->entries()[3];
  const float* p = reinterpret_cast<const float*>(back.data() + e.offset);
  for (size_t i = 0; i < e.numel(); ++i) ASSERT_EQ(p[i], 0.25f * static_cast<float>(i % 7) - 0.5f) << i;
}

// Bad lora keys are refused at config load, naming the key and the file.
TEST(Lora, BadKeysAreRefusedNamingTheKeyAndTheFile) {
  const std::string llama =
      "client_configs:\n  model_configs:\n    model_name: llama\n  data_configs:\n    dataset_name: "
      "SyntheticTokens\n  train_configs:\n    lora:\n";
  auto err = [](const std::string& yaml) {
    auto c = load_config_text(yaml, "exp.yaml");
    EXPECT_FALSE(c.ok()) << yaml;
    return c.ok() ? std::string() : c.status().message();
  };
  std::string e = err(llama + "      r: 0\n");
  EXPECT_HAS(e, "exp.yaml");
  EXPECT_HAS(e, "client_configs.train_configs.lora.r");
  e = err(llama + "      target_modules: [q_proj, qkv_proj]\n");
  EXPECT_HAS(e, "exp.yaml");
  EXPECT_HAS(e, "unknown module 'qkv_proj'");
  e = err(llama + "      lora_dropout: 1.0\n");
  EXPECT_HAS(e, "client_configs.train_configs.lora.lora_dropout");
  EXPECT_HAS(e, "[0, 1)");
  e = err(llama + "      init_adapters: /nonexistent/adapter\n");
  EXPECT_HAS(e, "client_configs.train_configs.lora.init_adapters");
  EXPECT_HAS(e, "/nonexistent/adapter");
  e = err("client_configs:\n  train_configs:\n    lora:\n      r: 4\n");
  EXPECT_HAS(e, "exp.yaml");
  EXPECT_HAS(e, "model_name is CNN");
}

// A config without a lora section has no LoRA, and its resolved config
// (what a server hands its clients) does not turn it on; one with a section
// keeps it, its modules resolved.
TEST(Lora, TheSectionTurnsLoraOnAndTheResolvedConfigKeepsIt) {
  const std::string base =
      "client_configs:\n  model_configs:\n    model_name: llama\n  data_configs:\n    dataset_name: "
      "SyntheticTokens\n";
  auto off = load_config_text(base, "a.yaml");
  ASSERT_TRUE(off.ok()) << off.status().to_string();
  EXPECT_FALSE(off->model.lora.enabled);
  auto off_again = load_config_text(off->resolved_yaml, "resolved.yaml");
  ASSERT_TRUE(off_again.ok()) << off_again.status().to_string();
  EXPECT_FALSE(off_again->model.lora.enabled);

  auto on = load_config_text(base +
                                 "  train_configs:\n    lora:\n      r: 16\n      lora_alpha: 32\n"
                                 "      target_modules: all-linear\n",
                             "b.yaml");
  ASSERT_TRUE(on.ok()) << on.status().to_string();
  EXPECT_TRUE(on->model.lora.enabled);
  EXPECT_EQ(on->model.lora.r, 16);
  EXPECT_EQ(on->model.lora.target_modules.size(), 7u);
  auto on_again = load_config_text(on->resolved_yaml, "resolved.yaml");
  ASSERT_TRUE(on_again.ok()) << on_again.status().to_string();
  EXPECT_TRUE(on_again->model.lora.enabled);
  EXPECT_EQ(on_again->model.lora.target_modules, on->model.lora.target_modules);
  EXPECT_DOUBLE_EQ(on_again->model.lora.lora_alpha, 32.0);
  // The layout a server computes from the config alone is the adapters'.
  auto layout = layout_without_network(on->model);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  EXPECT_EQ(layout->size(), static_cast<size_t>(2 * 7 * on->model.num_layers));
}

}  // namespace
}  // namespace memfl
