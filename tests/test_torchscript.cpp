// A user's TorchScript model in the trainer: a module written here in
// TorchScript (as torch.jit.script would compile a Python nn.Module) and
// saved with torch.jit.save's format, trained federatedly by `memfl run`
// through the plugin, as users do.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "cli_util.h"
#include "tensor/safetensors.h"
#include "train/trainer_backend.h"
#include "test_util.h"

namespace memfl {
namespace {

using testing::TempDir;

// A two-layer perceptron with a buffer, named as PyTorch would name it
// (fc1.weight, …): fc1 and fc2 are submodules of the script module.
constexpr const char* kMlpForward = R"(
def forward(self, x):
    h = torch.relu(torch.addmm(self.fc1.bias, x.flatten(1) * self.scale, self.fc1.weight.t()))
    return torch.addmm(self.fc2.bias, h, self.fc2.weight.t())
)";

// The same, whose forward returns a non-finite output on a batch of one
// sample: a user's model that goes wrong on some inputs.
constexpr const char* kMlpForwardNanOnSingleSamples = R"(
def forward(self, x):
    h = torch.relu(torch.addmm(self.fc1.bias, x.flatten(1) * self.scale, self.fc1.weight.t()))
    y = torch.addmm(self.fc2.bias, h, self.fc2.weight.t())
    if x.size(0) < 2:
        y = y * torch.log(torch.zeros_like(y))
    return y
)";

void save_script_mlp(const std::string& path, const char* forward = kMlpForward) {
  torch::manual_seed(3);
  torch::jit::Module net("MLP");
  torch::jit::Module fc1("Linear1"), fc2("Linear2");
  // Trainable, as nn.Parameter is (requires_grad travels in the file).
  auto param = [](torch::Tensor t) { return t.set_requires_grad(true); };
  fc1.register_parameter("weight", param(torch::randn({64, 784}) * 0.05), false);
  fc1.register_parameter("bias", param(torch::zeros({64})), false);
  fc2.register_parameter("weight", param(torch::randn({10, 64}) * 0.05), false);
  fc2.register_parameter("bias", param(torch::zeros({10})), false);
  net.register_module("fc1", fc1);
  net.register_module("fc2", fc2);
  net.register_buffer("scale", torch::full({1}, 1.0));
  net.define(forward);
  net.save(path);
}

// A config that trains the saved script for 2 rounds on the first
// `train_samples` Fashion-MNIST images; `server` adds server_configs keys.
std::string script_config(const std::string& model, int train_samples, int test_samples, const std::string& server) {
  return "client_configs:\n  train_configs:\n    optim: SGD\n    optim_args:\n      lr: 0.05\n      momentum: 0.9\n"
         "    do_validation: false\n  model_configs:\n    model_name: TorchScript\n    torchscript_path: " +
         model + "\n  data_configs:\n    dataset_kwargs:\n      max_train_samples: " + std::to_string(train_samples) +
         "\n      max_test_samples: " + std::to_string(test_samples) + "\nserver_configs:\n  num_global_epochs: 2\n" +
         server;
}

// 99 samples over 3 clients leave each 33; one more client sample (100)
// gives one client 34, and with batches of 33 its last batch is one
// sample: its loss is not finite, it says so and sends nothing, and the
// round goes on with the other two — in rounds, and asynchronously.
TEST(TorchScript, AClientWhoseLossIsNotFiniteSendsNothingAndTheOthersGoOn) {
  TempDir tmp;
  save_script_mlp(tmp.file("mlp.pt"), kMlpForwardNanOnSingleSamples);
  const std::string common =
      " -q --set server_configs.num_clients=3 --set client_configs.train_configs.train_batch_size=33"
      " --set client_configs.data_configs.dataset_kwargs.val_ratio=0"
      " --set client_configs.train_configs.num_threads=1";
  std::ofstream(tmp.file("c.yaml")) << script_config(tmp.file("mlp.pt"), 100, 100, "");
  Result r = memfl_cli("run " + tmp.file("c.yaml") + common + " --out " + tmp.file("sync"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("local training produced a non-finite loss"), std::string::npos) << r.output;
  auto rows = read_csv(tmp.file("sync/metrics.csv"));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[1][1], "2") << "round 1 folded the two other clients";
  EXPECT_EQ(rows[2][1], "2");
  Result a =
      memfl_cli("run " + tmp.file("c.yaml") + common +
                " --set server_configs.scheduler=AsyncScheduler --set server_configs.aggregator=FedAsyncAggregator"
                " --set server_configs.num_global_epochs=4 --out " +
                tmp.file("async"));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("is out for the rest of the run"), std::string::npos) << a.output;
  const auto log = read_csv(tmp.file("async/async_log.csv"));
  ASSERT_EQ(log.size(), 5u) << "4 updates, from the two other clients";
  std::set<std::string> senders;
  for (size_t i = 1; i < log.size(); ++i) senders.insert(log[i][1]);
  EXPECT_EQ(senders.size(), 2u);
}

TEST(TorchScript, AScriptedModuleTrainsFederatedlyUnderItsOwnNames) {
  TempDir tmp;
  const std::string model = tmp.file("mlp.pt");
  save_script_mlp(model);
  std::ofstream(tmp.file("c.yaml")) << script_config(model, 3000, 1000, "  num_clients: 3\n");
  Result r = memfl_cli("run " + tmp.file("c.yaml") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The global model keeps the script's names, values moved by training.
  auto f = SafetensorsFile::open(tmp.file("run/global_model.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::set<std::string> names;
  for (const auto& t : (*f)->tensors()) names.insert(t.name);
  EXPECT_EQ(names, (std::set<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"}));
  const auto* bias = (*f)->find("fc2.bias");
  ASSERT_NE(bias, nullptr);
  float b0 = 0;
  std::memcpy(&b0, bias->data.data(), sizeof b0);
  EXPECT_NE(b0, 0.0f);  // it started at zero
  // 2 rounds of 3 clients × 1000 images: far above chance (0.1).
  auto metrics = read_csv(tmp.file("run/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_GT(std::stod(metrics[2][7]), 0.5) << r.output;
}

#ifdef MEMFL_HAVE_GRPC
// Over gRPC the server never loads libtorch: its initial weights and
// evaluation come from a model worker, which loads the script as clients do.
TEST(TorchScript, TrainsOverGrpcWithAServerThatNeverMapsLibtorch) {
  TempDir tmp;
  const std::string model = tmp.file("mlp.pt");
  save_script_mlp(model);
  std::ofstream(tmp.file("c.yaml")) << script_config(model, 2000, 500,
                                                     "  num_clients: 2\n  comm_configs:\n    grpc_configs:\n"
                                                     "      server_uri: 127.0.0.1:0\n");
  Result r = memfl_cli("launch " + tmp.file("c.yaml") + " --clients 2 -q --out " + tmp.file("g"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(tmp.file("g/server/summary.json"));
  std::string summary((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(summary.find("\"maps_libtorch\": false"), std::string::npos) << summary;
  auto f = SafetensorsFile::open(tmp.file("g/server/global_model.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_NE((*f)->find("fc1.weight"), nullptr);
  auto metrics = read_csv(tmp.file("g/server/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_GT(std::stod(metrics[2][7]), 0.3);  // evaluated by the model worker, above chance (0.1)
}
#endif

// `memfl inspect model.pt --write-layout FILE` writes the script's tensors
// (names, shapes, initial values); with model_configs.initial_model a server
// and DummyTrainer clients take the model from that file and never load
// libtorch, not even a model worker.
TEST(TorchScript, InspectWritesTheLayoutThatServersAndDummyClientsUseWithoutLibtorch) {
  TempDir tmp;
  const std::string model = tmp.file("mlp.pt");
  save_script_mlp(model);
  Result r = memfl_cli("inspect " + model + " --write-layout " + tmp.file("mlp.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto f = SafetensorsFile::open(tmp.file("mlp.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::vector<std::string> names;
  for (const auto& t : (*f)->tensors()) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"}));
  // The values are the script's own.
  torch::jit::Module script = torch::jit::load(model);
  for (const auto& p : script.named_parameters()) {
    const auto* t = (*f)->find(p.name);
    ASSERT_NE(t, nullptr) << p.name;
    ASSERT_EQ(t->data.size(), static_cast<size_t>(p.value.numel()) * 4);
    EXPECT_EQ(std::memcmp(t->data.data(), p.value.data_ptr<float>(), t->data.size()), 0) << p.name;
  }
#ifdef MEMFL_HAVE_GRPC
  std::ofstream(tmp.file("c.yaml")) << script_config(model, 300, 100,
                                                     "  num_clients: 2\n  comm_configs:\n    grpc_configs:\n"
                                                     "      server_uri: 127.0.0.1:0\n");
  r = memfl_cli("launch " + tmp.file("c.yaml") +
                " --clients 2 -q --set client_configs.train_configs.trainer=DummyTrainer"
                " --set client_configs.model_configs.initial_model=" +
                tmp.file("mlp.safetensors") + " --out " + tmp.file("g"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(tmp.file("g/server/summary.json"));
  std::string summary((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(summary.find("\"maps_libtorch\": false"), std::string::npos) << summary;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("g/server/model_worker.log")));  // no worker was started
  auto g = SafetensorsFile::open(tmp.file("g/server/global_model.safetensors"));
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_NE((*g)->find("scale"), nullptr);
#endif
}

TEST(TorchScript, AnInitialModelOfAnotherNetworkIsRefusedNamingTheKeyAndFile) {
  TempDir tmp;
  save_script_mlp(tmp.file("mlp.pt"));
  // A one-tensor file: not the script's model.
  {
    torch::jit::Module other("Other");
    other.register_parameter("w", torch::zeros({3}), false);
    other.define("def forward(self, x):\n    return x\n");
    other.save(tmp.file("other.pt"));
  }
  Result r = memfl_cli("inspect " + tmp.file("other.pt") + " --write-layout " + tmp.file("other.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ofstream(tmp.file("c.yaml")) << script_config(tmp.file("mlp.pt"), 300, 100, "  num_clients: 1\n");
  r = memfl_cli("run " + tmp.file("c.yaml") + " -q --set client_configs.model_configs.initial_model=" +
                tmp.file("other.safetensors") + " --out " + tmp.file("run"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("client_configs.model_configs.initial_model: " + tmp.file("other.safetensors")),
            std::string::npos)
      << r.output;
}

#ifdef MEMFL_TEST_MPI
// As ranks of an MPI job: rank 0's model worker loads the script too.
TEST(TorchScript, TrainsAsRanksOfAnMpiJob) {
  TempDir tmp;
  const std::string model = tmp.file("mlp.pt");
  save_script_mlp(model);
  std::ofstream(tmp.file("c.yaml")) << script_config(model, 2000, 500, "");
  Result r = mpirun(3, tmp.file("c.yaml") + " -q --out " + tmp.file("m"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto f = SafetensorsFile::open(tmp.file("m/rank_0/global_model.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_NE((*f)->find("fc2.bias"), nullptr);
  auto metrics = read_csv(tmp.file("m/rank_0/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_GT(std::stod(metrics[2][7]), 0.3);
}
#endif

// DP-SGD on a TorchScript model takes the naive route: one backward per
// sample. One step on 4 samples (q = 1), C small enough to clip every
// sample, σ = 0, SGD lr 1: the new weights are the old minus the mean of the
// clipped per-sample gradients, which the test computes itself with plain
// autograd on a second copy of the script, one sample at a time.
TEST(TorchScript, NaiveDpClipsEachSampleAsPerSampleAutogradWould) {
  TempDir tmp;
  const std::string path = tmp.file("mlp.pt");
  save_script_mlp(path);
  TrainerBackend* backend = memfl_trainer_backend();
  ModelConfig mc;
  mc.model_name = "TorchScript";
  mc.torchscript_path = path;
  InputSpec in{1, 28, 28, 10};
  auto replica = backend->create_replica(mc, in, "cpu", 1);
  ASSERT_TRUE(replica.ok()) << replica.status().to_string();
  ImageDataset d;
  d.channels = 1, d.height = 28, d.width = 28, d.num_classes = 10, d.mean = 0.25f, d.std = 0.5f;
  torch::manual_seed(5);
  auto px = torch::randint(0, 256, {4 * 784}, torch::kInt64);
  for (int64_t i = 0; i < px.numel(); ++i) d.pixels.push_back(static_cast<uint8_t>(px[i].item<int64_t>()));
  d.labels = {3, 7, 1, 3};
  TrainConfig tc;
  tc.mode = "step";
  tc.num_local_steps = 1;
  tc.train_batch_size = 4;
  tc.do_validation = false;
  tc.optim.optim = "SGD";
  tc.optim.lr = 1.0;
  tc.optim.momentum = 0;
  tc.dp.enabled = true;
  tc.dp.clipping = "naive";
  tc.dp.max_grad_norm = 0.01;
  tc.dp.noise_multiplier = 0;
  auto weights = [&](const std::string& name) {
    const auto* e = (*replica)->layout().find(name);
    return torch::from_blob((*replica)->arena().data() + e->offset, e->shape, torch::kFloat32).clone();
  };
  const std::vector<std::string> names = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  std::map<std::string, torch::Tensor> before;
  for (const auto& n : names) before[n] = weights(n);
  const std::vector<uint32_t> idx = {0, 1, 2, 3};
  auto r = (*replica)->train(d, idx, {}, tc, 9);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->dp_steps, 1);
  // The reference: the same script, the same starting weights, autograd per sample.
  torch::jit::Module ref = torch::jit::load(path);
  std::map<std::string, torch::Tensor> sum;
  for (int i = 0; i < 4; ++i) {
    for (auto p : ref.named_parameters()) p.value.mutable_grad() = torch::Tensor();
    auto x = torch::from_blob(d.pixels.data() + i * 784, {1, 1, 28, 28}, torch::kUInt8).to(torch::kFloat32);
    x = x / (255.0 * d.std) - d.mean / d.std;
    auto logits = ref.forward({x}).toTensor();
    torch::nn::functional::cross_entropy(logits, torch::tensor({static_cast<int64_t>(d.labels[i])}),
                                         torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
        .backward();
    double sq = 0;
    for (auto p : ref.named_parameters()) sq += p.value.grad().pow(2).sum().item<double>();
    const double clip = std::min(1.0, 0.01 / (std::sqrt(sq) + 1e-6));
    EXPECT_LT(clip, 1.0);  // every sample is clipped
    for (auto p : ref.named_parameters()) {
      auto g = p.value.grad() * clip;
      sum[p.name] = sum.count(p.name) ? sum[p.name] + g : g;
    }
  }
  for (const auto& n : names) {
    auto want = before[n] - sum[n] / 4.0;
    EXPECT_LE((weights(n) - want).abs().max().item<double>(), 1e-7) << n;
    EXPECT_GT((weights(n) - before[n]).abs().max().item<double>(), 1e-5) << n;  // it moved
  }
}

TEST(TorchScript, GhostOrFusedClippingOnAScriptIsRefusedNamingTheKey) {
  TempDir tmp;
  save_script_mlp(tmp.file("mlp.pt"));
  std::ofstream(tmp.file("c.yaml")) << script_config(tmp.file("mlp.pt"), 300, 100, "  num_clients: 1\n");
  Result r = memfl_cli("run " + tmp.file("c.yaml") + " -q --set client_configs.train_configs.dp.enabled=true --out " +
                       tmp.file("run"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("client_configs.train_configs.dp.clipping: fused"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("clipping: naive"), std::string::npos) << r.output;
}

TEST(TorchScript, AMissingOrBadFileIsNamed) {
  TempDir tmp;
  std::ofstream(tmp.file("bad.pt")) << "not a zip archive";
  Result r = memfl_cli("run -q --out " + tmp.file("run") +
                       " --set client_configs.model_configs.model_name=TorchScript"
                       " --set client_configs.model_configs.torchscript_path=" +
                       tmp.file("bad.pt"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("bad.pt"), std::string::npos) << r.output;
  Result none =
      memfl_cli("run -q --out " + tmp.file("run2") + " --set client_configs.model_configs.model_name=TorchScript");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("torchscript_path"), std::string::npos) << none.output;
}

}  // namespace
}  // namespace memfl
