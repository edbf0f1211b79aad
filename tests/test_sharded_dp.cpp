// Sharded DP-SGD (src/train/sharded_dp.*), on the CPU over libtorch's Gloo
// group: two ranks (threads of this process, each with its own process group
// and its own copy of the model) against the plain, unsharded DP-SGD of
// train/dp_sgd.h on the whole batch in one model — an implementation that
// has its own tests against per-sample autograd — for the Llama-style
// classifier and the GroupNorm CNN, in every mode.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"
#include "train/dp_llama.h"
#include "tensor/layout.h"
#include "train/sharded_dp.h"

namespace memfl::torch_internal {
namespace {

using sharded::Unit;
using torch::Tensor;

constexpr double kLr = 0.05;

// Below the kernel's ephemeral range (32768–60999 here): a port in it may
// be a live connection's source port or another test's listener on port 0
// (CI once saw c10d's bind fail with "Address already in use" at 42754).
int next_port() {
  static int n = 0;
  return 20000 + static_cast<int>((getpid() * 37 + 1000 * n++) % 12000);
}

// The GroupNorm CNN of dp::make_groupnorm_cnn, cut into four units.
Unit make_cnn_unit(int i) {
  Unit u;
  if (i == 0) {
    auto seq = torch::nn::Sequential(dp::Conv2d(1, 8, 5), dp::GroupNorm(4, 8));
    u = {"block1", seq.ptr(),
         [m = seq.ptr()](const Tensor& x) { return torch::max_pool2d(torch::relu(m->forward(x)), 2); }};
  } else if (i == 1) {
    auto seq = torch::nn::Sequential(dp::Conv2d(8, 16, 5), dp::GroupNorm(4, 16));
    u = {"block2", seq.ptr(),
         [m = seq.ptr()](const Tensor& x) { return torch::max_pool2d(torch::relu(m->forward(x)), 2).flatten(1); }};
  } else if (i == 2) {
    auto l = dp::Linear(16 * 4 * 4, 32);
    u = {"fc1", l.ptr(), [m = l.ptr()](const Tensor& x) { return torch::relu(m->forward(x)); }};
  } else {
    auto l = dp::Linear(32, 10);
    u = {"fc2", l.ptr(), [m = l.ptr()](const Tensor& x) { return m->forward(x); }};
  }
  return u;
}

struct Model {
  std::string name;
  int num_units;
  std::function<Unit(int)> make;
  std::function<Tensor(int64_t, uint64_t)> inputs;  // a batch of n, seeded
  int64_t classes;
};

Model llama_model() {
  const DpLlamaSpec* s = find_preset("llama-dp-tiny");
  return {"llama", dp_llama_num_units(*s), [s](int i) { return make_dp_llama_unit(*s, i); },
          [s](int64_t n, uint64_t seed) {
            torch::manual_seed(seed);
            return torch::randint(0, s->vocab_size, {n, 12}, torch::kLong);
          },
          s->num_classes};
}

Model cnn_model() {
  return {"cnn", 4, make_cnn_unit,
          [](int64_t n, uint64_t seed) {
            torch::manual_seed(seed);
            return torch::randn({n, 1, 28, 28});
          },
          10};
}

// Every rank's copy of the units, built in order after one seed.
std::vector<Unit> build(const Model& m, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Unit> units;
  for (int i = 0; i < m.num_units; ++i) units.push_back(m.make(i));
  return units;
}

using Params = std::map<std::string, Tensor>;

// The reference: one unsharded model, the whole batch, train/dp_sgd.h's
// DpSgd (or plain autograd for no_dp), SGD.
Params reference(const Model& m, const std::string& mode, const std::vector<Tensor>& xs,
                 const std::vector<Tensor>& ys) {
  std::vector<Unit> units = build(m, 11);
  auto root = std::make_shared<torch::nn::Module>();
  for (auto& u : units) {
    std::string key = u.name;
    std::replace(key.begin(), key.end(), '.', '_');
    root->register_module(key, u.module);
  }
  std::unique_ptr<dp::DpSgd> dpsgd;
  if (mode != "no_dp") {
    dp::DpOptions o;
    o.mode = *dp::parse_clip_mode(mode);
    o.max_grad_norm = 0.05;  // small enough that most samples are clipped
    o.noise_multiplier = 0;
    dpsgd = std::move(*dp::DpSgd::create(root, o));
  }
  torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(kLr));
  for (size_t k = 0; k < xs.size(); ++k) {
    opt.zero_grad();
    Tensor x = xs[k];
    for (auto& u : units) x = u.forward(x);
    Tensor loss = torch::nn::functional::cross_entropy(
        x, ys[k], torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    loss.backward();
    const double batch = static_cast<double>(ys[k].size(0));
    if (dpsgd) {
      EXPECT_TRUE(dpsgd->step(batch).ok());
    } else {
      torch::NoGradGuard g;
      for (auto& p : root->parameters()) p.mutable_grad().div_(batch);
    }
    opt.step();
  }
  Params out;
  for (auto& u : units) {
    for (const auto& kv : u.module->named_parameters()) out[u.name + "." + kv.key()] = kv.value().detach().clone();
  }
  return out;
}

// `world` ranks as threads; rank r trains on its slice of each batch.
Params run_sharded(const Model& m, int world, const sharded::Options& opts, const std::vector<Tensor>& xs,
                   const std::vector<Tensor>& ys) {
  std::vector<std::vector<Unit>> copies;
  for (int r = 0; r < world; ++r) copies.push_back(build(m, 11));
  const int port = next_port();
  std::vector<Params> results(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      sharded::Rendezvous where;
      where.rank = r;
      where.world_size = world;
      where.port = port;
      auto group = sharded::ShardGroup::create(where, torch::kCPU);
      if (!group.ok()) {
        errors[r] = group.status().to_string();
        return;
      }
      auto model = sharded::ShardedModel::create(
          group->get(), m.num_units, [&](int i) { return copies[r][static_cast<size_t>(i)]; }, opts, torch::kCPU);
      if (!model.ok()) {
        errors[r] = model.status().to_string();
        return;
      }
      for (size_t k = 0; k < xs.size(); ++k) {
        const int64_t n = xs[k].size(0) / world;
        auto st =
            (*model)->step(xs[k].narrow(0, r * n, n), ys[k].narrow(0, r * n, n), static_cast<double>(xs[k].size(0)));
        if (!st.ok()) {
          errors[r] = st.status().to_string();
          return;
        }
      }
      for (auto& [name, t] : (*model)->gathered_parameters()) results[r][name] = t;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  // Every rank gathers the same model.
  for (int r = 1; r < world; ++r) {
    for (auto& [name, t] : results[0]) EXPECT_TRUE(torch::equal(t, results[r][name])) << name << " rank " << r;
  }
  return results[0];
}

void expect_close(const Params& a, const Params& b, double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    const double diff = (t - b.at(name)).abs().max().item<double>();
    EXPECT_LE(diff, tol) << what << ": " << name;
  }
}

double max_change(const Params& a, const Params& b) {
  double m = 0;
  for (const auto& [name, t] : a) m = std::max(m, (t - b.at(name)).abs().max().item<double>());
  return m;
}

void batches(const Model& m, std::vector<Tensor>& xs, std::vector<Tensor>& ys) {
  for (int k = 0; k < 2; ++k) {
    xs.push_back(m.inputs(4, 100 + k));
    ys.push_back(torch::randint(0, m.classes, {4}, torch::kLong));
  }
}

class ShardedDpModes : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ShardedDpModes, TwoRanksTakeTheSameStepsAsOneUnshardedModel) {
  const auto& [model_name, mode] = GetParam();
  torch::set_num_threads(1);
  const Model m = model_name == "llama" ? llama_model() : cnn_model();
  std::vector<Tensor> xs, ys;
  batches(m, xs, ys);
  const Params want = reference(m, mode, xs, ys);
  sharded::Options o;
  o.mode = mode;
  o.max_grad_norm = 0.05;
  o.noise_multiplier = 0;
  o.lr = kLr;
  const Params two = run_sharded(m, 2, o, xs, ys);
  Params initial;
  for (auto& u : build(m, 11)) {
    for (const auto& kv : u.module->named_parameters()) initial[u.name + "." + kv.key()] = kv.value().detach().clone();
  }
  // The steps moved the model (so agreeing means something), and agree.
  // Clipped DP steps move a weight by at most 2·lr·C = 5e-3; agreement is
  // asked to within 1/50 of the smallest movement expected.
  const double moved = max_change(want, initial);
  EXPECT_GT(moved, 1e-4);
  expect_close(two, want, 2e-6, model_name + " " + mode);
}

INSTANTIATE_TEST_SUITE_P(ShardedDp, ShardedDpModes,
                         ::testing::Combine(::testing::Values("llama", "cnn"),
                                            ::testing::Values("no_dp", "naive", "ghost", "fused")),
                         [](const auto& test) { return std::get<0>(test.param) + "_" + std::get<1>(test.param); });

// Noise on: each coordinate's draw depends on (seed, step, unit, coordinate)
// only, so one rank and two ranks take the same noisy step; and one step's
// noise has standard deviation lr·σ·C / B.
TEST(ShardedDp, NoiseDoesNotDependOnTheNumberOfRanksAndHasStdLrSigmaCOverB) {
  torch::set_num_threads(1);
  const Model m = llama_model();
  std::vector<Tensor> xs, ys;
  batches(m, xs, ys);
  xs.resize(1);
  ys.resize(1);
  sharded::Options o;
  o.mode = "fused";
  o.max_grad_norm = 0.05;
  o.lr = kLr;
  o.noise_seed = 1234;
  const Params quiet = run_sharded(m, 2, o, xs, ys);
  o.noise_multiplier = 2.0;
  const Params one = run_sharded(m, 1, o, xs, ys);
  const Params two = run_sharded(m, 2, o, xs, ys);
  expect_close(two, one, 2e-5, "noisy, 1 vs 2 ranks");
  // The difference from the noiseless step is the noise alone: lr·N(0, σ²C²)/B.
  std::vector<Tensor> d;
  for (const auto& [name, t] : two) d.push_back((t - quiet.at(name)).reshape(-1));
  Tensor all = torch::cat(d);
  const double want = kLr * 2.0 * 0.05 / 4.0;
  EXPECT_GT(all.numel(), 50000);
  EXPECT_NEAR(all.std().item<double>(), want, 0.02 * want);
  EXPECT_NEAR(all.mean().item<double>(), 0.0, 0.02 * want);
  // A different seed gives different noise.
  o.noise_seed = 99;
  const Params other = run_sharded(m, 2, o, xs, ys);
  EXPECT_GT(max_change(other, two), want);
}

TEST(ShardedDp, ThreeRanksWithUnevenShardsAndAdam) {
  // 3 does not divide the units' sizes: the padding must not leak into the model.
  torch::set_num_threads(1);
  const Model m = cnn_model();
  std::vector<Tensor> xs, ys;
  for (int k = 0; k < 2; ++k) {
    xs.push_back(m.inputs(6, 300 + k));
    ys.push_back(torch::randint(0, m.classes, {6}, torch::kLong));
  }
  sharded::Options o;
  o.mode = "fused";
  o.max_grad_norm = 0.05;
  o.optimizer = "adam";
  o.lr = 1e-3;
  const Params one = run_sharded(m, 1, o, xs, ys);
  const Params three = run_sharded(m, 3, o, xs, ys);
  expect_close(three, one, 1e-5, "adam, 1 vs 3 ranks");
  Params initial;
  for (auto& u : build(m, 11)) {
    for (const auto& kv : u.module->named_parameters()) initial[u.name + "." + kv.key()] = kv.value().detach().clone();
  }
  // Adam's first steps move every weight by about lr.
  EXPECT_GT(max_change(one, initial), 0.5e-3);
}

// A sharded FL client's chunk streams: bytes of the arena layout written
// into and read out of the shards, in chunks whose edges fall inside floats,
// parameters and shards (1001 and 777 bytes; 3 ranks, so shards are uneven),
// end as the values the test wrote — no rank holding more than a chunk.
TEST(ShardedDp, ChunksOfTheLayoutGoStraightIntoAndOutOfTheShards) {
  torch::set_num_threads(1);
  const Model m = cnn_model();
  constexpr int kWorld = 3;
  std::vector<std::vector<Unit>> copies;
  for (int r = 0; r < kWorld; ++r) copies.push_back(build(m, 11));
  // The layout an unsharded client's arena has: every parameter, f32, in unit order.
  LayoutBuilder b;
  for (auto& u : build(m, 11)) {
    for (const auto& kv : u.module->named_parameters()) {
      b.add(u.name + "." + kv.key(), DType::kF32, kv.value().sizes().vec());
    }
  }
  auto built = std::move(b).build();
  ASSERT_TRUE(built.ok());
  const Layout layout = std::move(*built);
  // What the "server" sends: seeded values the model never had, zero padding.
  std::vector<std::byte> sent(layout.total_bytes(), std::byte{0});
  torch::manual_seed(2024);
  for (const LayoutEntry& e : layout.entries()) {
    Tensor v = torch::randn({static_cast<int64_t>(e.nbytes() / 4)});
    std::memcpy(sent.data() + e.offset, v.data_ptr<float>(), e.nbytes());
  }
  // A byte range as pieces of parameters, worked out here from the layout.
  auto pieces_of = [&](size_t off, size_t len) {
    std::vector<sharded::ShardedModel::BytePiece> out;
    for (const LayoutEntry& e : layout.entries()) {
      const size_t lo = std::max(off, e.offset), hi = std::min(off + len, e.end());
      if (lo < hi) {
        out.push_back({e.name, static_cast<int64_t>(lo - e.offset), static_cast<int64_t>(lo - off),
                       static_cast<int64_t>(hi - lo)});
      }
    }
    return out;
  };
  std::vector<std::byte> received(layout.total_bytes(), std::byte{0x55});
  std::map<std::string, Tensor> gathered;
  std::vector<std::string> errors(kWorld);
  const int port = next_port();
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        sharded::Rendezvous where;
        where.rank = r;
        where.world_size = kWorld;
        where.port = port;
        auto group = sharded::ShardGroup::create(where, torch::kCPU);
        if (!group.ok()) throw std::runtime_error(group.status().to_string());
        sharded::Options o;
        o.mode = "no_dp";
        auto model = sharded::ShardedModel::create(
            group->get(), m.num_units, [&](int i) { return copies[r][static_cast<size_t>(i)]; }, o, torch::kCPU);
        if (!model.ok()) throw std::runtime_error(model.status().to_string());
        for (size_t off = 0; off < sent.size(); off += 1001) {
          const size_t len = std::min<size_t>(1001, sent.size() - off);
          std::span<const std::byte> chunk;
          if (r == 0) chunk = std::span<const std::byte>(sent).subspan(off, len);
          (*model)->write_bytes(pieces_of(off, len), chunk, static_cast<int64_t>(len));
        }
        for (size_t off = 0; off < sent.size(); off += 777) {
          const size_t len = std::min<size_t>(777, sent.size() - off);
          std::span<std::byte> chunk;
          if (r == 0) chunk = std::span<std::byte>(received).subspan(off, len);
          (*model)->read_bytes(pieces_of(off, len), chunk, static_cast<int64_t>(len));
        }
        auto params = (*model)->gathered_parameters();
        if (r == 0) {
          for (auto& [name, t] : params) gathered[name] = t;
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  // Every parameter now holds exactly the bytes sent for it…
  ASSERT_EQ(gathered.size(), layout.size());
  for (const LayoutEntry& e : layout.entries()) {
    ASSERT_TRUE(gathered.count(e.name)) << e.name;
    Tensor want = torch::from_blob(sent.data() + e.offset, {static_cast<int64_t>(e.nbytes() / 4)}, torch::kFloat32);
    EXPECT_TRUE(torch::equal(gathered[e.name].reshape(-1), want)) << e.name;
  }
  // …and reading the layout back gives the bytes sent, padding as zeros.
  EXPECT_TRUE(received == sent);
}

TEST(ShardedDp, RendezvousFromTheEnvironmentNamesABadVariable) {
  setenv("MEMFL_RANK", "1", 1);
  setenv("MEMFL_WORLD_SIZE", "2", 1);
  setenv("MEMFL_MASTER_PORT", "31234", 1);
  auto r = sharded::rendezvous_from_env();
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->rank, 1);
  EXPECT_EQ((*r)->world_size, 2);
  EXPECT_EQ((*r)->local_rank, 1);
  EXPECT_EQ((*r)->port, 31234);
  setenv("MEMFL_RANK", "2", 1);
  r = sharded::rendezvous_from_env();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("MEMFL_RANK=2"), std::string::npos) << r.status().message();
  setenv("MEMFL_RANK", "x", 1);
  r = sharded::rendezvous_from_env();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("MEMFL_RANK"), std::string::npos);
  unsetenv("MEMFL_RANK");
  unsetenv("MEMFL_WORLD_SIZE");
  unsetenv("MEMFL_MASTER_PORT");
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  r = sharded::rendezvous_from_env();
  unsetenv("OMPI_COMM_WORLD_RANK");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->world_size, 3);
  EXPECT_EQ((*r)->port, 29500);
}

// llama-dp-tiny's parameters, counted by hand from its shape (hidden 64,
// 2 layers, 4 heads of 16, 2 KV heads, MLP 172, vocabulary 512, 2 classes):
// embedding 512·64; per layer q, o 64·64, k, v 64·32, gate, up, down 64·172,
// two norms 64; final norm 64; head 64·2 + 2.
constexpr int64_t kTinyParams = 512 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 172 + 2 * 64) + 64 + 64 * 2 + 2;

void expect_sharded_records(const std::string& path, int gpus) {
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  const auto records = nlohmann::json::parse(in);
  ASSERT_EQ(records.size(), 2u);
  for (const auto& r : records) {
    EXPECT_EQ(r.value("gpus", 0), gpus);
    EXPECT_TRUE(r.value("sharded", false));
    EXPECT_EQ(r["config"].value("backend", ""), "gloo");
    EXPECT_EQ(r.value("num_params", int64_t{0}), kTinyParams);
    EXPECT_FALSE(r.contains("error")) << r.dump();
    EXPECT_GT(r.value("avg_iteration_ms", 0.0), 0.0);
    // The median of the timed steps lies between the fastest and the slowest
    // (whose mean is avg): above the min, and the min no higher than the mean.
    EXPECT_GE(r.value("median_iteration_ms", 0.0), r.value("min_iteration_ms", 1e9));
    EXPECT_LE(r.value("min_iteration_ms", 1e9), r.value("avg_iteration_ms", 0.0));
  }
  EXPECT_GT(records[1].value("mean_per_sample_norm", 0.0), 0.0);  // fused ran and clipped
}

// `memfl bench dp --gpus 2` starts its two ranks itself (processes, Gloo on
// the CPU); under mpirun it takes the ranks mpirun started.
TEST(ShardedDp, BenchDpStartsItsOwnRanksOrRunsUnderMpirun) {
  memfl::testing::TempDir tmp;
  const std::string common =
      " bench dp --gpus 2 --model llama-dp-tiny --seq 16 --modes no_dp,fused --iters 1 --warmup 0";
  Result r = memfl_cli(common + " --json " + tmp.file("own/out.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_sharded_records(tmp.file("own/out.json"), 2);
  EXPECT_TRUE(std::filesystem::exists(tmp.file("own/out.json.rank1.log")));
#ifdef MEMFL_TEST_MPI
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const int port = next_port();
  r = run_shell("mpirun -np 2 --oversubscribe -x MASTER_PORT=" + std::to_string(port) + " " +
                std::string(MEMFL_BINARY) + common + " --json " + tmp.file("mpi/out.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_sharded_records(tmp.file("mpi/out.json"), 2);
#endif
  // More ranks than the environment has: refused, naming both.
  r = run_shell("MEMFL_RANK=0 MEMFL_WORLD_SIZE=3 " + std::string(MEMFL_BINARY) + common + " --json " +
                tmp.file("bad/out.json"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--gpus 2 but the environment says world size 3"), std::string::npos) << r.output;
}

// Largest |a − b| over every f32 tensor of two checkpoints.
double max_model_difference(const std::string& a, const std::string& b) {
  auto fa = SafetensorsFile::open(a);
  auto fb = SafetensorsFile::open(b);
  EXPECT_TRUE(fa.ok() && fb.ok()) << a << " " << b;
  if (!fa.ok() || !fb.ok()) return 1e9;
  double m = 0;
  for (const auto& t : (*fa)->tensors()) {
    const auto* u = (*fb)->find(t.name);
    EXPECT_NE(u, nullptr) << t.name;
    if (u == nullptr || u->data.size() != t.data.size()) return 1e9;
    const auto* x = reinterpret_cast<const float*>(t.data.data());
    const auto* y = reinterpret_cast<const float*>(u->data.data());
    for (size_t i = 0; i < t.data.size() / 4; ++i) m = std::max(m, static_cast<double>(std::fabs(x[i] - y[i])));
  }
  return m;
}

double final_test_accuracy(const std::string& run) {
  const auto rows = read_csv(run + "/metrics.csv");
  EXPECT_GE(rows.size(), 2u);
  return rows.size() < 2 ? -1 : std::stod(rows.back().at(7));
}

// DP-SGD federated training of the GroupNorm CNN on Fashion-MNIST, 2 clients ×
// 2 rounds of 3 Poisson steps, short enough for CI.
const std::string kFlArgs =
    std::string(MEMFL_SOURCE_DIR) +
    "/configs/dp_fmnist_cnn_gn.yaml -q --set client_configs.train_configs.mode=step"
    " --set client_configs.train_configs.num_local_steps=3 --set client_configs.train_configs.train_batch_size=32"
    " --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2"
    " --set client_configs.train_configs.optim_args.lr=0.5"
    " --set client_configs.data_configs.dataset_kwargs.max_test_samples=500";

// train_configs.num_gpus: the client shards its model over that many ranks
// (processes it starts; Gloo on the CPU). Without noise the federated run is
// the unsharded one to float rounding; with noise, 2 and 3 ranks draw the same.
TEST(ShardedDp, AFederatedClientShardedOverRanksTrainsAsAnUnshardedOne) {
  memfl::testing::TempDir tmp;
  const std::string quiet = kFlArgs + " --set client_configs.train_configs.dp.noise_multiplier=0";
  Result r = memfl_cli("run " + quiet + " --out " + tmp.file("one"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = memfl_cli("run " + quiet + " --set client_configs.train_configs.num_gpus=2 --out " + tmp.file("two"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double diff =
      max_model_difference(tmp.file("one/global_model.safetensors"), tmp.file("two/global_model.safetensors"));
  EXPECT_LE(diff, 1e-6);
  EXPECT_NEAR(final_test_accuracy(tmp.file("two")), final_test_accuracy(tmp.file("one")), 1e-9);
  EXPECT_GT(final_test_accuracy(tmp.file("two")), 0.2);  // it learned: chance is 0.1

  const std::string noisy = kFlArgs + " --set client_configs.train_configs.dp.noise_multiplier=0.5";
  r = memfl_cli("run " + noisy + " --set client_configs.train_configs.num_gpus=2 --out " + tmp.file("n2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = memfl_cli("run " + noisy + " --set client_configs.train_configs.num_gpus=3 --out " + tmp.file("n3"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // What must be equal is equal in NoiseDoesNotDependOnTheNumberOfRanks…
  // (the draws, coordinate by coordinate) and below (the privacy ledger,
  // exactly). What is left is float rounding: each rank sums its own
  // samples' clipped gradients, so 2 and 3 ranks add them in different
  // groupings, and over the run's noisy steps the difference grows by an
  // amount that depends on the BLAS kernels the CPU gets (9.4e-6 on one AMD
  // EPYC, 1.4e-4 on another, < 1e-6 on a Xeon). So the bound is not a
  // constant but a fraction of what the noise itself does to this run: had
  // the two runs drawn different noise, they would differ by about as much as
  // the noisy model differs from the quiet one (√2 × for independent draws);
  // a tenth of that tells "same noise, other rounding" from "other noise" on
  // any CPU.
  const double noise_moved =
      max_model_difference(tmp.file("n2/global_model.safetensors"), tmp.file("two/global_model.safetensors"));
  EXPECT_GT(noise_moved, 1e-2) << "the noise is there: the noisy model is not the quiet one";
  EXPECT_LE(max_model_difference(tmp.file("n2/global_model.safetensors"), tmp.file("n3/global_model.safetensors")),
            0.1 * noise_moved);
  // The privacy ledger counts the client's whole batch, whatever the ranks.
  EXPECT_EQ(read_csv(tmp.file("n2/privacy.csv")), read_csv(tmp.file("n3/privacy.csv")));
}

// What memfl's allocation ledger says a process held as model arenas at most.
int64_t ledger_model_peak(const std::string& memory_json) {
  std::ifstream in(memory_json);
  EXPECT_TRUE(in.good()) << memory_json;
  if (!in.good()) return -1;
  return nlohmann::json::parse(in)["ledger"]["model"].value("peak_bytes", int64_t{-1});
}

// The same client as real processes over gRPC: each client process starts
// its own second rank. The broadcast and the upload stream straight into and
// out of the shards, so a client never holds a model arena (its ledger's
// model peak is 0; an unsharded client's is the model), and the run ends with
// the unsharded run's model.
TEST(ShardedDp, ShardedClientsTrainOverGrpcWithTheModelOnlyInShards) {
  memfl::testing::TempDir tmp;
  const std::string args = kFlArgs +
                           " --clients 2 --set client_configs.train_configs.dp.noise_multiplier=0"
                           " --set server_configs.comm_configs.grpc_configs.model_chunk_size=100001";
  Result r = memfl_cli("launch " + args + " --set client_configs.train_configs.num_gpus=2 --out " + tmp.file("g"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = memfl_cli("launch " + args + " --out " + tmp.file("one"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = read_csv(tmp.file("g/server/metrics.csv"));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[2][1], "2");             // both clients in the last round
  EXPECT_GT(std::stod(rows[2][7]), 0.2);  // test accuracy above chance (0.1)
  EXPECT_LE(max_model_difference(tmp.file("g/server/global_model.safetensors"),
                                 tmp.file("one/server/global_model.safetensors")),
            1e-6);
  for (const char* c : {"client_0", "client_1"}) {
    EXPECT_EQ(ledger_model_peak(tmp.file(std::string("g/") + c + "/memory.json")), 0) << c;
    EXPECT_GT(ledger_model_peak(tmp.file(std::string("one/") + c + "/memory.json")), 2'000'000) << c;
  }
}

// Under mpirun (a server rank and two client ranks, each client sharded over
// two processes it starts): the same model as the simulator's sharded run,
// and no model arena on a client rank.
TEST(ShardedDp, ShardedMpiClientsStreamIntoTheirShards) {
  memfl::testing::TempDir tmp;
  const std::string args = kFlArgs +
                           " --set client_configs.train_configs.dp.noise_multiplier=0"
                           " --set client_configs.train_configs.num_gpus=2"
                           " --set server_configs.comm_configs.grpc_configs.model_chunk_size=100001";
  Result m = mpirun(3, args + " --out " + tmp.file("mpi"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  Result r = memfl_cli("run " + args + " --out " + tmp.file("sim"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LE(
      max_model_difference(tmp.file("mpi/rank_0/global_model.safetensors"), tmp.file("sim/global_model.safetensors")),
      1e-6);
  for (const char* rank : {"rank_1", "rank_2"}) {
    EXPECT_EQ(ledger_model_peak(tmp.file(std::string("mpi/") + rank + "/memory.json")), 0) << rank;
  }
  // Chunks as point-to-point messages instead of through the shared-memory ring.
  m = mpirun(3, args + " --set server_configs.mpi_shared_memory=false --out " + tmp.file("p2p"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_LE(
      max_model_difference(tmp.file("p2p/rank_0/global_model.safetensors"), tmp.file("sim/global_model.safetensors")),
      1e-6);
  EXPECT_EQ(ledger_model_peak(tmp.file("p2p/rank_1/memory.json")), 0);
}

TEST(ShardedDp, ShardingAModelThatIsNotCutIntoUnitsIsRefusedNamingTheKey) {
  memfl::testing::TempDir tmp;
  Result r =
      memfl_cli("run " + kFlArgs +
                " --set client_configs.model_configs.model_name=CNN --set client_configs.train_configs.dp.enabled=false"
                " --set client_configs.train_configs.num_gpus=2 --out " +
                tmp.file("x"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("client_configs.train_configs.num_gpus"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CNN_GN"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memfl::torch_internal
