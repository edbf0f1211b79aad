// Llama specs and layouts without a network, file-backed arenas, and the
// running-mean FedAvg that keeps an LLM's aggregate in the model's own bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "model/llama.h"
#include "tensor/safetensors.h"
#include "tensor/safetensors_arena.h"
#include "test_util.h"

namespace memfl {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / fmt::format("memfl_test_{}_{}", name, getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

const LlamaSpec& preset(const std::string& name) {
  for (const auto& p : llama_presets()) {
    if (p.name == name) return p;
  }
  throw std::runtime_error("no preset " + name);
}

TEST(Llama, PresetParameterCountsMatchThePublishedModels) {
  // Counts of the Hugging Face checkpoints (config.json shapes).
  EXPECT_EQ(llama_num_params(preset("llama-1b")), 1'235'814'400);    // Llama-3.2-1B (tied embeddings)
  EXPECT_EQ(llama_num_params(preset("llama-8b")), 8'030'261'248);    // Llama-3.1-8B
  EXPECT_EQ(llama_num_params(preset("llama-70b")), 70'553'706'496);  // Llama-3.1-70B
  for (const auto& p : llama_presets()) {
    auto layout = llama_layout(p, DType::kBF16);
    ASSERT_TRUE(layout.ok()) << p.name;
    EXPECT_EQ(static_cast<int64_t>(layout->num_params()), llama_num_params(p)) << p.name;
  }
}

TEST(Llama, LayoutUsesHuggingFaceNamesAndShapes) {
  const LlamaSpec& s = preset("llama-8b");
  Layout l = llama_layout(s, DType::kBF16).value();
  const LayoutEntry* k = l.find("model.layers.31.self_attn.k_proj.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->shape, (std::vector<int64_t>{1024, 4096}));  // 8 KV heads × 128
  ASSERT_NE(l.find("model.layers.0.mlp.down_proj.weight"), nullptr);
  EXPECT_EQ(l.find("model.layers.0.mlp.down_proj.weight")->shape, (std::vector<int64_t>{4096, 14336}));
  EXPECT_NE(l.find("lm_head.weight"), nullptr);
  EXPECT_EQ(l.find("lm_head.weight")->dtype, DType::kBF16);
  // Llama-3.2-1B ties its LM head to the embedding: no lm_head tensor.
  Layout tied = llama_layout(preset("llama-1b"), DType::kBF16).value();
  EXPECT_EQ(tied.find("lm_head.weight"), nullptr);
  EXPECT_EQ(tied.entries().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(tied.entries().back().name, "model.norm.weight");
  EXPECT_TRUE(layout_is_dense(l));
}

TEST(Llama, BadSpecsNameTheProblem) {
  LlamaSpec s = preset("llama-tiny");
  s.num_kv_heads = 3;
  Status st = validate_llama_spec(s);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("num_kv_heads"), std::string::npos) << st.message();
  ModelConfig m;
  m.model_name = "llama";
  m.hidden_size = 100;
  m.num_heads = 3;
  auto bad = llama_spec_from_config(m);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("hidden_size"), std::string::npos) << bad.status().message();
}

TEST(FileArena, ScratchFileHoldsBytesOutsideAnonymousMemory) {
  fs::path dir = fresh_dir("scratch");
  auto a = Arena::scratch_file(dir.string(), 3 << 20, MemoryCategory::kModel);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_TRUE(a->file_backed());
  std::memset(a->data(), 0x5a, a->size());
  EXPECT_EQ(static_cast<uint8_t>(a->data()[a->size() - 1]), 0x5a);
  EXPECT_TRUE(a->sync().ok());
  EXPECT_TRUE(fs::is_empty(dir));  // unnamed: nothing left behind
  auto missing = Arena::scratch_file((dir / "nope").string(), 1 << 20, MemoryCategory::kModel);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  fs::remove_all(dir);
}

TEST(FileArena, SafetensorsArenaIsACheckpointReadableByTheReader) {
  fs::path dir = fresh_dir("starena");
  Layout l = llama_layout(preset("llama-tiny"), DType::kBF16).value();
  const std::string path = (dir / "m.safetensors").string();
  {
    auto a = create_safetensors_arena(path, l, {{"round", "7"}});
    ASSERT_TRUE(a.ok()) << a.status().message();
    testing::fill_random(l, *a, 3);
    ASSERT_TRUE(a->sync().ok());
    Arena expect(l.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(l, expect, 3);
    auto file = SafetensorsFile::open(path);
    ASSERT_TRUE(file.ok()) << file.status().message();
    EXPECT_EQ((*file)->metadata().at("round"), "7");
    Arena loaded(l.total_bytes(), MemoryCategory::kModel);
    ASSERT_TRUE((*file)->load_into(l, loaded).ok());
    EXPECT_EQ(std::memcmp(loaded.data(), expect.data(), l.total_bytes()), 0);
  }
  auto again = open_safetensors_arena(path, l, /*writable=*/false);
  ASSERT_TRUE(again.ok()) << again.status().message();
  Arena expect(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, expect, 3);
  EXPECT_EQ(std::memcmp(again->data(), expect.data(), l.total_bytes()), 0);
  // Another model's layout is refused with the file's name.
  Layout other = llama_layout(preset("llama-tiny"), DType::kF32).value();
  auto wrong = open_safetensors_arena(path, other, false);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("m.safetensors"), std::string::npos);
  fs::remove_all(dir);
}

// FedAvg by running mean (the model's own bytes) against the f32 sum.
void run_rounds(const Layout& layout, const std::vector<Arena>& clients, const std::vector<double>& w,
                FedAvgAggregator& agg, Arena& out) {
  ASSERT_TRUE(agg.begin_round(1).ok());
  for (size_t k = 0; k < clients.size(); ++k) {
    auto up = agg.open_update("client_" + std::to_string(k), w[k]);
    ASSERT_TRUE(up.ok());
    ASSERT_TRUE(stream_arena(layout, clients[k], 1000, **up).ok());
    ASSERT_TRUE((*up)->commit().ok());
  }
  ASSERT_TRUE(agg.finalize(out).ok());
}

double ulp_bf16(float x) {
  int e = 0;
  std::frexp(std::fabs(x), &e);
  return std::ldexp(1.0, e - 8);  // bf16 keeps 8 significant bits
}

TEST(FedAvgRunningMean, TwoBf16UpdatesGiveTheCorrectlyRoundedMean) {
  Layout l = llama_layout(preset("llama-tiny"), DType::kBF16).value();
  std::vector<Arena> clients;
  for (int k = 0; k < 2; ++k) {
    clients.emplace_back(l.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(l, clients.back(), 20 + k);
  }
  Arena sum_out(l.total_bytes(), MemoryCategory::kModel);
  FedAvgAggregator by_sum(l, ClientWeightsMode::kEqual);
  run_rounds(l, clients, {1, 1}, by_sum, sum_out);
  Arena global(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, global, 99);  // last round's model: overwritten
  FedAvgAggregator by_mean(l, ClientWeightsMode::kEqual, global, Accumulation::kRunningMean);
  EXPECT_EQ(by_mean.state_bytes(), 0u);
  run_rounds(l, clients, {1, 1}, by_mean, global);
  EXPECT_EQ(std::memcmp(global.data(), sum_out.data(), l.total_bytes()), 0);
}

TEST(FedAvgRunningMean, ManyWeightedUpdatesStayWithinTheStatedBound) {
  Layout l = llama_layout(preset("llama-tiny"), DType::kBF16).value();
  const std::vector<double> w = {100, 250, 37, 80, 5};
  std::vector<Arena> clients;
  for (size_t k = 0; k < w.size(); ++k) {
    clients.emplace_back(l.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(l, clients.back(), 40 + static_cast<uint64_t>(k));
  }
  Arena global(l.total_bytes(), MemoryCategory::kModel);
  FedAvgAggregator agg(l, ClientWeightsMode::kSampleSize, global, Accumulation::kRunningMean);
  run_rounds(l, clients, w, agg, global);
  double worst = 0;
  for (const auto& e : l.entries()) {
    for (size_t i = 0; i < e.numel(); ++i) {
      double ref = 0, ws = 0, biggest = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        const double x = testing::element_as_double(clients[k], e, i);
        ref += w[k] * x;
        ws += w[k];
        biggest = std::max(biggest, std::fabs(x));
      }
      ref /= ws;
      const double got = testing::element_as_double(global, e, i);
      // Each step rounds a value no larger than the largest input.
      worst = std::max(worst, std::fabs(got - ref) / ulp_bf16(static_cast<float>(biggest)));
    }
  }
  // Half an ulp per rounding step after the first (exact) update.
  EXPECT_LE(worst, (static_cast<double>(w.size()) - 1) / 2);
  EXPECT_GT(worst, 0.0);  // bf16 rounding did happen: the test can fail
}

TEST(FedAvgRunningMean, InterleavedUpdatesFoldInTheirOrder) {
  // A running mean cannot fold two updates at once; the second one parks
  // until the first is in, so interleaving gives the sequential result.
  Layout l = llama_layout(preset("llama-tiny"), DType::kBF16).value();
  Arena a(l.total_bytes(), MemoryCategory::kModel), b(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 1);
  testing::fill_random(l, b, 2);
  testing::TempDir tmp;
  auto run = [&](bool interleave) {
    Arena global(l.total_bytes(), MemoryCategory::kModel);
    FedAvgAggregator agg(l, ClientWeightsMode::kSampleSize, global, Accumulation::kRunningMean);
    agg.set_spool_dir(tmp.path.string());
    EXPECT_TRUE(agg.begin_round(1, {"c1", "c2"}).ok());
    auto u1 = agg.open_update("c1", 3);
    auto u2 = agg.open_update("c2", 5);
    EXPECT_TRUE(u1.ok() && u2.ok());
    const size_t chunk = 4096;
    auto send = [&](UpdateStream& u, Arena& m, size_t off) {
      const size_t len = std::min(chunk, l.total_bytes() - off);
      auto bytes = m.bytes(off, len);
      EXPECT_TRUE(u.accept({l.hash(), off, len, chunk_checksum(bytes)}, bytes).ok());
    };
    if (interleave) {
      for (size_t off = 0; off < l.total_bytes(); off += chunk) {
        send(**u2, b, off);  // the second in fold order arrives first
        send(**u1, a, off);
      }
    } else {
      for (size_t off = 0; off < l.total_bytes(); off += chunk) send(**u1, a, off);
      for (size_t off = 0; off < l.total_bytes(); off += chunk) send(**u2, b, off);
    }
    EXPECT_TRUE((*u2)->commit().ok());
    EXPECT_TRUE((*u1)->commit().ok());
    EXPECT_TRUE(agg.finalize(global).ok());
    return std::vector<std::byte>(global.data(), global.data() + l.total_bytes());
  };
  const auto sequential = run(false);
  EXPECT_EQ(run(true), sequential);
  // m ← m + (w₂/W)(x₂ − m) with w₂/W = 5/8, from the first update's bf16: by hand for element 0.
  const auto& e = l.entries()[0];
  uint16_t a0, b0, got;
  std::memcpy(&a0, a.data() + e.offset, 2);
  std::memcpy(&b0, b.data() + e.offset, 2);
  std::memcpy(&got, sequential.data() + e.offset, 2);
  EXPECT_EQ(got, f32_to_bf16(bf16_to_f32(a0) + 0.625f * (bf16_to_f32(b0) - bf16_to_f32(a0))));
}

}  // namespace
}  // namespace memfl
