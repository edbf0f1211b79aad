// End-to-end: the CLI, the dlopen'd libtorch plugin, real Fashion-MNIST.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <random>
#include <set>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/config.h"
#include "data/dataset.h"
#include "model/llama.h"
#include "tensor/safetensors.h"
#include "cli_util.h"
#include "test_util.h"
#include "train/trainer_backend.h"

namespace memfl {
namespace {

constexpr const char* kSmallRun =
    "--set server_configs.num_clients=3 --set server_configs.num_global_epochs=2 "
    "--set client_configs.data_configs.dataset_kwargs.max_train_samples=3000 "
    "--set client_configs.data_configs.dataset_kwargs.max_test_samples=1000 "
    "--set client_configs.train_configs.num_threads=1 --set "
    "server_configs.comm_configs.grpc_configs.model_chunk_size=7777 -q";

TEST(Training, ThreeClientsTwoRoundsBeatChance) {
  testing::TempDir tmp;
  const std::string out = tmp.file("run");
  Result r = memfl_cli(std::string("run ") + kSmallRun + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  auto rows = read_csv(out + "/metrics.csv");
  ASSERT_EQ(rows.size(), 3u) << "header + 2 rounds";
  ASSERT_EQ(rows[0][7], "test_accuracy");
  const double acc1 = std::stod(rows[1][7]), acc2 = std::stod(rows[2][7]);
  // 10 classes: chance is 0.1. Each round is evaluated on its own model:
  // the first already beats chance, the second by far.
  EXPECT_GT(acc1, 0.15) << "round 1";
  EXPECT_GT(acc2, 0.3) << "round 2";
  EXPECT_GT(std::stod(rows[2][8]), 0.0) << "bytes moved";

  // The memory timeline has the phases of both rounds and a peak.
  std::ifstream in(out + "/memory.json");
  auto mem = nlohmann::json::parse(in);
  std::set<std::string> phases;
  for (const auto& p : mem["phases"]) phases.insert(p["phase"].get<std::string>());
  for (const char* p : {"broadcast", "train", "upload", "aggregate", "evaluate"}) EXPECT_TRUE(phases.count(p)) << p;
  EXPECT_GT(mem["peak_rss_bytes"].get<int64_t>(), 0);

  // The checkpoint is a valid safetensors file of the CNN, named as libtorch names it.
  auto ckpt = SafetensorsFile::open(out + "/global_model.safetensors");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_NE((*ckpt)->find("conv1.weight"), nullptr);
  EXPECT_EQ((*ckpt)->metadata().at("round"), "2");
  EXPECT_TRUE(std::ifstream(out + "/config.yaml").good());
  auto parts = read_csv(out + "/partition.csv");
  EXPECT_EQ(parts.size(), 4u);

  // A run directory that already holds a run is not overwritten.
  Result again = memfl_cli(std::string("run ") + kSmallRun + " --out " + out);
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.output.find("already holds a run"), std::string::npos) << again.output;
}

#if defined(MEMFL_HAVE_SENTENCEPIECE)
// A Llama trained federatedly on instruction records tokenized by a
// SentencePiece model (trained here by Debian's spm_train), its loss on the
// responses only: the held-out loss falls over 3 rounds, and metrics.csv's
// test_perplexity is exp(test_loss). Records are "repeat the word" tasks, so
// a response is predictable from its prompt and the loss can fall.
TEST(Training, InstructionRecordsTrainOnTheirResponsesAndTheHeldOutLossFalls) {
  testing::TempDir tmp;
  const char* syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa"};
  std::mt19937_64 rng(17);
  auto word = [&] {
    std::string w;
    for (int k = 0; k < 2; ++k) w += syl[rng() % 10];
    return w;
  };
  {
    std::ofstream corpus(tmp.file("corpus.txt")), records(tmp.file("train.jsonl"));
    for (int i = 0; i < 600; ++i) {
      const std::string a = word(), b = word();
      const std::string output = a + " " + b + " " + a + " " + b;
      corpus << "Repeat twice " << a << " " << b << " " << output << "\n";
      records << nlohmann::json{{"instruction", "Repeat twice"},
                                {"input", a + " " + b},
                                {"output", output},
                                {"topic", i % 3 == 0   ? "x"
                                          : i % 3 == 1 ? "y"
                                                       : "z"}}
                     .dump()
              << "\n";
    }
  }
  Result spm = run_shell("spm_train --input=" + tmp.file("corpus.txt") + " --model_prefix=" + tmp.file("tok") +
                         " --vocab_size=96 --model_type=bpe --character_coverage=1.0 --pad_id=3 --minloglevel=2");
  ASSERT_EQ(spm.exit_code, 0) << spm.output;
  std::ofstream(tmp.file("c.yaml"))
      << "client_configs:\n  train_configs:\n    trainer: VanillaTrainer\n    mode: step\n    num_local_steps: 30\n"
         "    optim: Adam\n    optim_args: {lr: 0.01}\n    train_batch_size: 16\n"
         "  model_configs:\n    model_name: llama\n    model_kwargs: {hidden_size: 32, num_layers: 1, num_heads: 2, "
         "num_kv_heads: 1, intermediate_size: 64, vocab_size: 96, seq_length: 48}\n"
         "  data_configs:\n    dataset_name: JsonLines\n    dataset_path: "
      << tmp.file("train.jsonl") << "\n    tokenizer_path: " << tmp.file("tok.model")
      << "\n    dataset_kwargs: {packing: false, train_on_response_only: true, group_field: topic, "
         "partition_strategy: by_group, prompt_template: '{instruction} {input} '}\n"
         "server_configs:\n  num_clients: 3\n  num_global_epochs: 3\n";
  Result r = memfl_cli("run " + tmp.file("c.yaml") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = read_csv(tmp.file("run/metrics.csv"));
  ASSERT_EQ(rows.size(), 4u) << r.output;
  const auto& head = rows[0];
  const size_t loss = std::find(head.begin(), head.end(), "test_loss") - head.begin();
  const size_t ppl = std::find(head.begin(), head.end(), "test_perplexity") - head.begin();
  ASSERT_LT(ppl, head.size());
  std::vector<double> losses;
  for (size_t i = 1; i < rows.size(); ++i) {
    const double l = std::stod(rows[i][loss]), p = std::stod(rows[i][ppl]);
    EXPECT_NEAR(p, std::exp(l), 1e-4 * std::exp(l)) << "round " << i;
    losses.push_back(l);
  }
  EXPECT_LT(losses[2], losses[0]) << r.output;
  EXPECT_LT(losses[0], std::log(96.0) + 0.5) << "a first round no worse than a uniform guess, give or take";
}
#endif

// A Llama's evaluation computes its loss a chunk of rows at a time, as its
// training does: with a 32k vocabulary, eval_batch_size 64 and seq 256 the
// full logits would be 64 × 256 × 32000 × 4 B = 2.1 GB (and their f32 log-
// softmax as much again); a chunk is max(64, 256 MiB / (4 · vocab)) rows of
// f32 logits. The run that evaluates peaks at most 4 chunks above the same
// run without the evaluation (the logits, logsumexp's temporary, slack).
TEST(Training, LlmEvaluationStaysWithinTheChunkedLossBound) {
  testing::TempDir tmp;
  const int64_t vocab = 32000, seq = 256, batch = 64;
  std::ofstream(tmp.file("c.yaml"))
      << "client_configs:\n  train_configs:\n    trainer: VanillaTrainer\n    mode: step\n    num_local_steps: 1\n"
         "    optim: SGD\n    train_batch_size: 1\n    num_threads: 1\n    do_validation: false\n"
         "  model_configs:\n    model_name: llama\n    model_kwargs: {hidden_size: 64, num_layers: 1, num_heads: 4, "
         "num_kv_heads: 2, intermediate_size: 128, vocab_size: "
      << vocab << ", seq_length: " << seq
      << "}\n  data_configs:\n    dataset_name: SyntheticTokens\n"
         "    dataset_kwargs: {num_train_samples: 8, num_test_samples: "
      << batch << "}\nserver_configs:\n  num_clients: 1\n  num_global_epochs: 1\n  eval_batch_size: " << batch
      << "\n";
  auto peak = [&](bool eval) -> int64_t {
    const std::string out = tmp.file(eval ? "eval" : "plain");
    Result r = memfl_cli("run " + tmp.file("c.yaml") + " -q --out " + out +
                         " --set server_configs.do_server_eval=" + (eval ? "true" : "false"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(out + "/summary.json");
    if (!in) return -1;
    return nlohmann::json::parse(in)["peak_rss_bytes"].get<int64_t>();
  };
  const int64_t with_eval = peak(true), without = peak(false);
  ASSERT_GT(with_eval, 0);
  ASSERT_GT(without, 0);
  const int64_t rows = std::max<int64_t>(64, (int64_t{256} << 20) / (4 * vocab));
  const int64_t chunk_bytes = rows * vocab * 4;
  const int64_t full_logits = batch * seq * vocab * 4;
  ASSERT_GT(full_logits, 4 * chunk_bytes) << "the bound must tell chunks from the full logits";
  EXPECT_LE(with_eval - without, 4 * chunk_bytes)
      << "evaluation peaked " << (with_eval - without) / (1 << 20) << " MiB above training alone; a chunk is "
      << chunk_bytes / (1 << 20) << " MiB, the full logits " << full_logits / (1 << 20) << " MiB";
}

TEST(Training, BadConfigFailsBeforeAnyWork) {
  testing::TempDir tmp;
  const std::string cfg = tmp.file("bad.yaml");
  std::ofstream(cfg) << "server_configs:\n  num_clients: 3\n  aggregator: FedProx\n";
  Result r = memfl_cli("run " + cfg + " --out " + tmp.file("run"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("bad.yaml:3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("server_configs.aggregator"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("run"))) << "nothing was started";

  Result m = memfl_cli("run --set client_configs.model_configs.model_name=Transformer");
  EXPECT_EQ(m.exit_code, 2);
  EXPECT_NE(m.output.find("CNN, MLP, ResNet18"), std::string::npos) << m.output;

  // model_kwargs that contradict the data set are named.
  Result k = memfl_cli(std::string("run ") + kSmallRun +
                       " --set client_configs.model_configs.model_kwargs.num_channel=3 --out " + tmp.file("k"));
  EXPECT_EQ(k.exit_code, 2);
  EXPECT_NE(k.output.find("model_kwargs.num_channel"), std::string::npos) << k.output;

  Result d = memfl_cli(std::string("run ") + kSmallRun +
                       " --set client_configs.data_configs.dataset_path=/nonexistent --out " + tmp.file("d"));
  EXPECT_EQ(d.exit_code, 3);
  EXPECT_NE(d.output.find("dataset-fashion-mnist"), std::string::npos) << d.output;
}

TEST(Training, CliHelpAndUsageErrors) {
  Result h = memfl_cli("--help");
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.output.find("Exit codes"), std::string::npos);
  Result rh = memfl_cli("run --help");
  EXPECT_EQ(rh.exit_code, 0);
  EXPECT_NE(rh.output.find("--set"), std::string::npos);
  EXPECT_EQ(memfl_cli("no-such-command").exit_code, 2);
}

class Plugin : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = load_trainer_backend();
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    backend = *b;
    backend->set_num_threads(1);
  }
  TrainerBackend* backend = nullptr;
};

TEST_F(Plugin, KnowsTheModelsTheConfigAccepts) {
  auto known = known_model_names();
  known.erase(std::remove(known.begin(), known.end(), "synthetic"), known.end());  // needs no libtorch
  EXPECT_EQ(backend->model_names(), known);
  ModelConfig m;
  m.model_name = "Nope";
  auto r = backend->create_replica(m, {}, "cpu", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("known models: CNN, MLP, ResNet18"), std::string::npos);
}

// Debian's libtorch calls OpenBLAS (scripts/install-deps.sh installs
// libopenblas0-pthread), whose own pool of one thread per core contends with
// libtorch's intra-op threads; memfl runs each BLAS call on one thread unless
// the user set OPENBLAS_NUM_THREADS. The counts come from OpenBLAS itself.
TEST_F(Plugin, OpenBlasRunsOneThreadPerCallUnlessTheUserSetsIt) {
  void* blas = dlopen("libblas.so.3", RTLD_LAZY | RTLD_NOLOAD);
  ASSERT_NE(blas, nullptr) << "libtorch's BLAS is not loaded";
  using Get = int (*)();
  using Set = void (*)(int);
  auto get = reinterpret_cast<Get>(dlsym(blas, "openblas_get_num_threads"));
  auto set = reinterpret_cast<Set>(dlsym(blas, "openblas_set_num_threads"));
  ASSERT_TRUE(get != nullptr && set != nullptr)
      << "libblas.so.3 is not OpenBLAS: scripts/install-deps.sh installs libopenblas0-pthread";
  set(2);  // as OpenBLAS starts on a 2-core machine
  ASSERT_EQ(get(), 2);
  backend->set_num_threads(2);
  EXPECT_EQ(get(), 1);
  EXPECT_EQ(backend->blas_threads_per_call(), 1);
  // The user's choice stands.
  set(2);
  ASSERT_EQ(setenv("OPENBLAS_NUM_THREADS", "2", 1), 0);
  backend->set_num_threads(2);
  EXPECT_EQ(get(), 2);
  EXPECT_EQ(backend->blas_threads_per_call(), 2);
  ASSERT_EQ(unsetenv("OPENBLAS_NUM_THREADS"), 0);
  backend->set_num_threads(1);
  EXPECT_EQ(get(), 1);
  dlclose(blas);
}

TEST_F(Plugin, ParametersAreViewsIntoTheArena) {
  auto data = make_synthetic_cifar10(64, 64, 3);
  std::vector<uint32_t> idx(64);
  std::iota(idx.begin(), idx.end(), 0u);
  for (const char* name : {"CNN", "MLP", "ResNet18"}) {
    ModelConfig m;
    m.model_name = name;
    auto rep = backend->create_replica(m, {3, 32, 32, 10}, "cpu", 5);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    auto& replica = **rep;
    // Writing zeros into the arena changes the module itself: every logit
    // becomes 0, so the loss is exactly ln(10).
    replica.arena().zero();
    auto ev = replica.evaluate(data.test, idx, 32);
    ASSERT_TRUE(ev.ok()) << ev.status().to_string();
    EXPECT_NEAR(ev->loss, std::log(10.0), 1e-5) << name;
  }
  ModelConfig r18;
  r18.model_name = "ResNet18";
  auto rep = backend->create_replica(r18, {3, 32, 32, 10}, "cpu", 5);
  ASSERT_TRUE(rep.ok());
  const auto* nbt = (*rep)->layout().find("layer1.0.bn1.num_batches_tracked");
  ASSERT_NE(nbt, nullptr) << "BatchNorm buffers are in the arena too";
  EXPECT_EQ(nbt->dtype, DType::kI64);
  EXPECT_NEAR(static_cast<double>((*rep)->layout().num_params()), 11.17e6, 0.05e6);
}

TEST_F(Plugin, LlamaLayoutFromTheSpecIsTheInstantiatedModulesLayout) {
  for (const char* dtype : {"f32", "bf16"}) {
    ModelConfig m;
    m.model_name = "llama-tiny";
    m.dtype = dtype;
    auto rep = backend->create_replica(m, {1, 1, 65, 256}, "cpu", 3);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    auto spec_layout = layout_without_network(m);
    ASSERT_TRUE(spec_layout.ok());
    const Layout& built = (*rep)->layout();
    ASSERT_EQ(built.size(), spec_layout->size());
    for (size_t i = 0; i < built.size(); ++i) {
      const auto& a = built.entries()[i];
      const auto& b = spec_layout->entries()[i];
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ(a.shape, b.shape) << a.name;
      EXPECT_EQ(a.dtype, b.dtype) << a.name;
      EXPECT_EQ(a.offset, b.offset) << a.name;
    }
    EXPECT_EQ(built.hash(), spec_layout->hash()) << dtype;
  }
  // A custom spec with tied embeddings too.
  ModelConfig tied;
  tied.model_name = "llama";
  tied.hidden_size = 32;
  tied.num_layers = 1;
  tied.num_heads = 4;
  tied.num_kv_heads = 1;
  tied.intermediate_size = 64;
  tied.vocab_size = 256;
  tied.tie_word_embeddings = true;
  auto rep = backend->create_replica(tied, {1, 1, 17, 256}, "cpu", 3);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  EXPECT_EQ((*rep)->layout().hash(), layout_without_network(tied)->hash());
  EXPECT_EQ((*rep)->layout().find("lm_head.weight"), nullptr);
}

// DP-SGD end to end: two clients train CNN_GN with Poisson batches and
// per-sample clipping; each client's ε in privacy.csv is the accountant's for
// the steps it took, and `memfl privacy` agrees.
TEST(DpTraining, ClientsReportTheirEpsilon) {
  testing::TempDir tmp;
  Result r =
      memfl_cli(std::string("run ") + MEMFL_SOURCE_DIR +
                "/configs/dp_fmnist_cnn_gn.yaml -q --set server_configs.num_clients=2 "
                "--set server_configs.num_global_epochs=2 --set client_configs.train_configs.train_batch_size=64 "
                "--set client_configs.data_configs.dataset_kwargs.max_train_samples=640 "
                "--set client_configs.data_configs.dataset_kwargs.max_test_samples=200 "
                "--set client_configs.train_configs.num_threads=1 --out " +
                tmp.file("dp"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rows = read_csv(tmp.file("dp/privacy.csv"));
  ASSERT_EQ(rows.size(), 5u);   // header + 2 rounds × 2 clients
  EXPECT_EQ(rows[3][2], "10");  // 2 rounds × ceil(320 / 64) steps
  const double eps = std::stod(rows[4][5]);
  EXPECT_GT(eps, 0);
  Result p =
      memfl_cli("privacy --noise-multiplier 0.9 --sample-rate " + rows[4][3] + " --steps 10 --delta 1e-5 --json");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const double cli_eps = nlohmann::json::parse(p.output.substr(p.output.find('{')))["epsilon"].get<double>();
  EXPECT_NEAR(eps, cli_eps, 1e-3 * cli_eps);
  // A model with BatchNorm-free but non-DP layers is refused before any work.
  Result bad =
      memfl_cli(std::string("run ") + MEMFL_SOURCE_DIR +
                "/configs/dp_fmnist_cnn_gn.yaml -q --set client_configs.model_configs.model_name=ResNet18 --out " +
                tmp.file("bad"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("GroupNorm"), std::string::npos) << bad.output;
}

TEST(DpFedAvgRun, ServerNoiseAndClientClippingGiveAnEpsilon) {
  testing::TempDir tmp;
  Result r = memfl_cli(std::string("run ") + kSmallRun +
                       " --set server_configs.aggregator_kwargs.dp_fedavg_clip_norm=1.0"
                       " --set server_configs.aggregator_kwargs.client_weights_mode=equal"
                       " --set server_configs.aggregator_kwargs.dp_fedavg_noise_multiplier=0.5 --out " +
                       tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(tmp.file("run/summary.json"));
  auto summary = nlohmann::json::parse(in);
  ASSERT_TRUE(summary.contains("dp_fedavg"));
  const double eps = summary["dp_fedavg"]["epsilon"].get<double>();
  EXPECT_GT(eps, 0);
  EXPECT_TRUE(std::isfinite(eps));
  Result bad = memfl_cli(std::string("run ") + kSmallRun +
                         " --set server_configs.aggregator_kwargs.dp_fedavg_clip_norm=1.0"
                         " --set server_configs.aggregator_kwargs.client_weights_mode=sample_size --out " +
                         tmp.file("bad"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("equal"), std::string::npos) << bad.output;
}

// FedProx: the proximal term μ/2·‖w − w_global‖² pulls local training
// toward the received model. Same data, seeds and steps; μ = 10 (lr·μ = 0.5,
// a contraction) must leave the round's model nearer the initial one than
// μ = 0 does — by more than half, since each step pulls the drift back by a
// half — and still move it.
TEST(FedProx, TheProximalTermKeepsTheModelNearTheGlobalOne) {
  testing::TempDir tmp;
  const std::string base = std::string(MEMFL_SOURCE_DIR) +
                           "/configs/fedavg_fmnist_cnn.yaml -q --set server_configs.num_clients=2 "
                           "--set server_configs.num_global_epochs=1 --set client_configs.train_configs.mode=step "
                           "--set client_configs.train_configs.num_local_steps=30 "
                           "--set client_configs.train_configs.optim_args.momentum=0 "
                           "--set client_configs.data_configs.dataset_kwargs.max_train_samples=2000 "
                           "--set client_configs.data_configs.dataset_kwargs.max_test_samples=200 "
                           "--set client_configs.train_configs.num_threads=1 ";
  Result plain = memfl_cli("run " + base + "--out " + tmp.file("plain"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  Result prox = memfl_cli("run " + base + "--set client_configs.train_configs.mu=10 --out " + tmp.file("prox"));
  ASSERT_EQ(prox.exit_code, 0) << prox.output;
  Result init =
      memfl_cli("model-worker " + tmp.file("plain/config.yaml") + " --write-initial " + tmp.file("init.safetensors"));
  ASSERT_EQ(init.exit_code, 0) << init.output;
  auto distance = [&](const std::string& path) {
    auto a = SafetensorsFile::open(path);
    auto b = SafetensorsFile::open(tmp.file("init.safetensors"));
    EXPECT_TRUE(a.ok() && b.ok());
    double d2 = 0;
    for (const auto& t : (*a)->tensors()) {
      const auto* u = (*b)->find(t.name);
      if (u == nullptr || t.dtype != DType::kF32) continue;
      for (size_t i = 0; i < t.data.size() / 4; ++i) {
        float x, y;
        std::memcpy(&x, t.data.data() + 4 * i, 4);
        std::memcpy(&y, u->data.data() + 4 * i, 4);
        d2 += (static_cast<double>(x) - y) * (static_cast<double>(x) - y);
      }
    }
    return std::sqrt(d2);
  };
  const double d_plain = distance(tmp.file("plain/global_model.safetensors"));
  const double d_prox = distance(tmp.file("prox/global_model.safetensors"));
  EXPECT_GT(d_plain, 0);
  EXPECT_GT(d_prox, 0);
  EXPECT_LT(d_prox, 0.5 * d_plain) << "plain " << d_plain << ", prox " << d_prox;
}

TEST(Inspect, DescribesALlamaPresetWithoutBuildingIt) {
  Result r = memfl_cli("inspect llama-70b --dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("70553706496 parameters"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("server, arena_backing: file"), std::string::npos) << r.output;
  Result bad = memfl_cli("inspect llama-9b");
  EXPECT_NE(bad.exit_code, 0);
}

TEST_F(Plugin, TinyLlamaLossFallsOnSyntheticTokens) {
  auto data = make_synthetic_tokens(512, 64, 32, 7);
  std::vector<uint32_t> train(512), test(64);
  std::iota(train.begin(), train.end(), 0u);
  std::iota(test.begin(), test.end(), 0u);
  ModelConfig m;
  m.model_name = "llama-tiny";
  auto rep = backend->create_replica(m, {1, 1, 33, 256}, "cpu", 11);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  auto before = (*rep)->evaluate(data.test, test, 32);
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  EXPECT_NEAR(before->loss, std::log(256.0), 0.3);  // small initial weights: near uniform
  TrainConfig tc;
  tc.mode = "step";
  tc.num_local_steps = 60;
  tc.train_batch_size = 16;
  tc.optim.optim = "Adam";
  tc.optim.lr = 3e-3;
  tc.do_validation = false;
  auto tr = (*rep)->train(data.train, train, {}, tc, 1);
  ASSERT_TRUE(tr.ok()) << tr.status().to_string();
  auto after = (*rep)->evaluate(data.test, test, 32);
  ASSERT_TRUE(after.ok());
  EXPECT_LT(after->loss, before->loss - 0.5) << "before " << before->loss << " after " << after->loss;
}

TEST_F(Plugin, TrainingChangesTheArenaInPlace) {
  auto data = make_synthetic_cifar10(256, 64, 4);
  std::vector<uint32_t> idx(256);
  std::iota(idx.begin(), idx.end(), 0u);
  ModelConfig m;
  m.model_name = "MLP";
  auto rep = backend->create_replica(m, {3, 32, 32, 10}, "cpu", 9);
  ASSERT_TRUE(rep.ok());
  std::vector<std::byte> before((*rep)->arena().bytes().begin(), (*rep)->arena().bytes().end());
  TrainConfig tc;
  tc.mode = "step";
  tc.num_local_steps = 5;
  tc.optim.optim = "Adam";
  tc.optim.lr = 1e-3;
  auto tr = (*rep)->train(data.train, idx, std::span<const uint32_t>(idx).subspan(0, 32), tc, 1);
  ASSERT_TRUE(tr.ok()) << tr.status().to_string();
  EXPECT_EQ(tr->num_steps, 5);
  EXPECT_EQ(tr->num_samples, 5 * 64);
  EXPECT_TRUE(tr->has_validation);
  EXPECT_EQ(tr->optimizer_bytes, 2 * static_cast<int64_t>((*rep)->layout().payload_bytes()));  // Adam: two moments
  EXPECT_NE(std::memcmp(before.data(), (*rep)->arena().data(), before.size()), 0);
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// Flat memory by construction: RSS at the end of each round, fitted over
// rounds 10–40 of a 40-round run, grows by less than 1 MiB a round.
TEST(Simulation, MemoryStaysFlatOverRounds) {
  testing::TempDir tmp;
  const std::string cfg = tmp.file("flat.yaml");
  std::ofstream(cfg) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n  model_configs:\n"
                        "    model_name: synthetic\n    model_kwargs:\n      num_params: 2000000\n"
                        "server_configs:\n  num_clients: 50\n  clients_per_round: 10\n  num_global_epochs: 40\n";
  Result r = memfl_cli("run " + cfg + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rows = read_csv(tmp.file("run/metrics.csv"));
  ASSERT_EQ(rows.size(), 41u);
  ASSERT_EQ(rows[0][15], "rss_bytes");
  double sx = 0, sy = 0, sxx = 0, sxy = 0, n = 0;
  for (size_t i = 10; i < rows.size(); ++i) {
    const double x = static_cast<double>(i), y = std::stod(rows[i][15]) / (1 << 20);
    sx += x, sy += y, sxx += x * x, sxy += x * y, n += 1;
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  EXPECT_LT(slope, 1.0) << "MiB per round";
}

TEST(Simulation, CompareMethodsWritesTheTableAndPlot) {
  testing::TempDir tmp;
  Result r = memfl_cli(
      "compare-methods --methods random,topk_loss --repeats 2 --target 0.3"
      " --set server_configs.num_clients=6 --set server_configs.clients_per_round=2"
      " --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=600"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
      " --set client_configs.train_configs.num_threads=1 --out " +
      tmp.file("cm"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rows = read_csv(tmp.file("cm/results.csv"));
  ASSERT_EQ(rows.size(), 5u) << "header + 2 methods × 2 repeats";
  EXPECT_EQ(rows[3][0], "topk_loss");
  std::ifstream svg(tmp.file("cm/accuracy.svg"));
  const std::string s((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_NE(s.find("<polyline"), std::string::npos);
  EXPECT_NE(s.find("topk_loss"), std::string::npos);
  Result bad = memfl_cli("compare-methods --methods random,greedy --out " + tmp.file("bad"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("greedy"), std::string::npos) << bad.output;
}

#ifdef MEMFL_HAVE_GRPC  // `memfl bench` exists in gRPC builds
// `memfl bench dp` on the tiny DP Llama classifier: one record per (seq, mode)
// with a measured peak and time, and the HTML report.
TEST(BenchDp, TinySweepWritesRecordsAndReport) {
  testing::TempDir tmp;
  const std::string json_path = tmp.file("dp.json");
  Result r = memfl_cli("bench dp --model llama-dp-tiny --seq 16,32 --batch 2 --warmup 1 --iters 1 --json " + json_path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json_path);
  ASSERT_TRUE(in.good()) << json_path;
  auto records = nlohmann::json::parse(in);
  ASSERT_TRUE(records.is_array());
  ASSERT_EQ(records.size(), 8u) << "2 sequence lengths × 4 modes";
  std::set<std::pair<std::string, int>> runs;
  for (const auto& rec : records) {
    const std::string mode = rec.value("mode", "");
    runs.insert({mode, rec.value("seq_length", 0)});
    EXPECT_FALSE(rec.contains("error")) << rec.dump();
    EXPECT_GT(rec.value("peak_memory_bytes", int64_t{0}), 0) << rec.dump();
    EXPECT_GT(rec.value("avg_iteration_ms", 0.0), 0.0) << rec.dump();
    EXPECT_EQ(rec.value("batch_size", 0), 2);
    EXPECT_EQ(rec.value("device", ""), "cpu");
    EXPECT_GT(rec.value("num_params", int64_t{0}), 100000);
    EXPECT_EQ(rec["config"].value("hidden_size", 0), 64);
    if (mode != "no_dp") {
      EXPECT_GT(rec.value("mean_per_sample_norm", 0.0), 0.0) << rec.dump();
    }
  }
  EXPECT_EQ(runs.size(), 8u) << "every (mode, seq) once";
  EXPECT_TRUE(std::filesystem::exists(tmp.file("dp_sweep/dp_sweep.html"))) << r.output;

  Result bad = memfl_cli("bench dp --model llama-dp-tiny --modes no_dp,clipall --json " + tmp.file("bad.json"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("clipall"), std::string::npos) << bad.output;
  Result model = memfl_cli("bench dp --model llama-dp-9b --seq 16 --json " + tmp.file("bad.json"));
  EXPECT_NE(model.exit_code, 0);
  EXPECT_NE(model.output.find("llama-dp-9b"), std::string::npos) << model.output;
}
#endif

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// K workers fold in client order, so K = 2 gives the model K = 1 gives
// (with the same intra-op threads per worker; more threads per op would
// change float summation order inside libtorch's kernels).
TEST(Simulation, TwoWorkersGiveTheSameModelAsOne) {
  testing::TempDir tmp;
  const std::string sets =
      " -q --set server_configs.num_clients=4 --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1200"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=201"
      " --set client_configs.train_configs.num_threads=1";
  Result one = memfl_cli("run" + sets + " --out " + tmp.file("k1"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  Result two = memfl_cli("run" + sets + " --set server_configs.parallel_clients=2 --out " + tmp.file("k2"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_TRUE(same_model(tmp.file("k1/global_model.safetensors"), tmp.file("k2/global_model.safetensors")));
  // With two workers the server's evaluation is split between them (100 and
  // 101 of the 201 test samples): the same model must get the same test
  // accuracy and loss as one replica evaluating all of them — a lost, doubled
  // or wrongly weighted part would show.
  const auto k1 = read_csv(tmp.file("k1/metrics.csv")), k2 = read_csv(tmp.file("k2/metrics.csv"));
  ASSERT_EQ(k1.size(), 3u);
  ASSERT_EQ(k2.size(), 3u);
  for (size_t r = 1; r < k1.size(); ++r) {
    EXPECT_EQ(k2[r][7], k1[r][7]) << "round " << r << " test_accuracy";
    EXPECT_NEAR(std::stod(k2[r][6]), std::stod(k1[r][6]), 2e-6) << "round " << r << " test_loss";
  }
  // The summary says what ran: workers × intra-op threads.
  std::ifstream in(tmp.file("k2/summary.json"));
  const auto summary = nlohmann::json::parse(in);
  EXPECT_EQ(summary.value("parallel_clients", 0), 2);
  EXPECT_EQ(summary.value("intra_op_threads", 0), 1);
  EXPECT_GE(summary.value("cores", 0), 1);
  EXPECT_EQ(summary.value("blas_threads_per_call", 0), 1);  // OpenBLAS, one thread under each worker
  // The workers train: the heap is kept between batches (memory/malloc_policy.h).
  EXPECT_EQ(summary.value("malloc_policy", ""), "training");
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

TEST(Simulation, BudgetChoosesWorkersAndShedsThemWhenExceeded) {
  testing::TempDir tmp;
  const std::string sets =
      " --set server_configs.num_clients=4 --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=800"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200";
  Result fit = memfl_cli("run" + sets +
                         " --set server_configs.parallel_clients=-1 --set server_configs.memory_budget=16GiB"
                         " --out " +
                         tmp.file("fit"));
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_NE(fit.output.find("parallel_clients: -1 →"), std::string::npos) << fit.output;
  // A budget far below what the run uses: warned, workers shed to one, and
  // the run still completes with every round.
  Result over = memfl_cli("run" + sets +
                          " --set server_configs.parallel_clients=2 --set server_configs.memory_budget=64MiB"
                          " --out " +
                          tmp.file("over"));
  ASSERT_EQ(over.exit_code, 0) << over.output;
  EXPECT_NE(over.output.find("shedding a worker, 1 left"), std::string::npos) << over.output;
  EXPECT_EQ(read_csv(tmp.file("over/metrics.csv")).size(), 3u);
  Result bad = memfl_cli("run" + sets + " --set server_configs.memory_budget=lots --out " + tmp.file("bad"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("server_configs.memory_budget"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace memfl
