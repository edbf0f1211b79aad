// Secure aggregation end to end through `memfl run` (DummyTrainer clients
// whose updates the test knows): the global model against plain FedAvg of
// the same updates (tests/dummy_oracle.h) within the quantisation bound
// derived here, and the configurations it refuses, naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.h"
#include "dummy_oracle.h"
#include "test_util.h"

namespace memfl {
namespace {

constexpr int kClients = 4, kRounds = 3;
constexpr int64_t kParams = 3001;
constexpr double kScale = 0.001;

std::string write_config(const testing::TempDir& tmp, const std::string& extra) {
  const std::string path = tmp.file("secagg.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: "
                      << kScale
                      << "\n  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: "
                      << kParams << "\nserver_configs:\n  num_clients: " << kClients
                      << "\n  num_global_epochs: " << kRounds
                      << "\n  aggregator_kwargs:\n    client_weights_mode: sample_size\n"
                         "  comm_configs:\n    grpc_configs:\n      model_chunk_size: 4000\n"
                         "  secure_aggregation:\n    enable: true\n    max_weight: 20\n"
                      << extra;
  return path;
}

// Rounds of the test's experiment and the clients in each.
using Rounds = std::vector<std::vector<int>>;
Rounds every_client() { return Rounds(kRounds, std::vector<int>{0, 1, 2, 3}); }

// The largest |element| any client sends in any round: the global model's
// (FedAvg's, the oracle's) plus the largest DummyTrainer change, s·n·5.
double max_client_element(const Rounds& rounds) {
  double M = 0;
  for (size_t r = 0; r <= rounds.size(); ++r) {
    const auto g = testing::dummy_fedavg_model(kParams, kScale, Rounds(rounds.begin(), rounds.begin() + r));
    for (double v : g) M = std::max(M, std::abs(v) + kScale * kClients * 5);
  }
  return M;
}

// The quantisation bound of one round with `clients`: ratios rᶜ =
// 5(c+1)/max_weight (W their sum), step = 2·8/(2²² − 1), every client
// element below M in magnitude:  |m̂ − m| ≤ n·step·(W + W·M) / (W·(W − n·step)).
double round_bound(const std::vector<int>& clients, double M) {
  const double n = static_cast<double>(clients.size()), step = 16.0 / ((1 << 22) - 1);
  double W = 0;
  for (int c : clients) W += 5.0 * (c + 1) / 20.0;
  return n * step * (W + W * M) / (W * (W - n * step));
}

// The global model in `path` against plain FedAvg of the same updates.
void expect_fedavg_within_quantisation_bound(const std::string& path, const Rounds& rounds = every_client()) {
  const std::vector<double> want = testing::dummy_fedavg_model(kParams, kScale, rounds);
  // The mean is the global model plus a fixed change, so an error carries
  // into the next round one for one: the bounds add up over the rounds.
  const double M = max_client_element(rounds);
  ASSERT_LT(M, 8.0) << "the updates must lie inside clipping_range for the bound to hold";
  double bound = 0;
  for (const auto& clients : rounds) bound += round_bound(clients, M);
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  size_t k = 0;
  double worst = 0;
  for (const auto& t : (*f)->tensors()) {
    for (size_t i = 0; i < t.data.size() / 4; ++i, ++k) {
      float v;
      std::memcpy(&v, t.data.data() + 4 * i, 4);
      const double err = std::abs(v - want[k]);
      worst = std::max(worst, err);
      ASSERT_LE(err, bound + 4e-7 * (1 + std::abs(want[k]))) << t.name << "[" << i << "]";
    }
  }
  ASSERT_EQ(k, want.size());
  // Quantised, not copied: the model is off plain FedAvg's f32 result somewhere.
  EXPECT_GT(worst, 0.0);
}

TEST(SecAggRun, GlobalModelIsFedAvgWithinTheQuantisationBound) {
  testing::TempDir tmp;
  Result r = memfl_cli("run " + write_config(tmp, "") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_fedavg_within_quantisation_bound(tmp.file("run/global_model.safetensors"));
  EXPECT_NE(r.output.find("secure aggregation unmasked the mean of 4 clients"), std::string::npos) << r.output;
}

#ifdef MEMFL_TEST_GRPC
// The same experiment as separate processes: the keys, shares and unmasking
// requests cross each client's gRPC session, the masked words its data
// channel; the server folds only masked words.
TEST(SecAggRun, OverGrpcTheGlobalModelIsFedAvgWithinTheQuantisationBound) {
  testing::TempDir tmp;
  Result r =
      memfl_cli("launch " + write_config(tmp, "  round_timeout_s: 60\n") + " --clients 4 --out " + tmp.file("grpc"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_fedavg_within_quantisation_bound(tmp.file("grpc/server/global_model.safetensors"));
  const std::string log = testing::read_file(tmp.file("grpc/server.log"));
  for (int round = 1; round <= kRounds; ++round) {
    EXPECT_NE(log.find(fmt::format("round {}: secure aggregation unmasked the mean of 4 clients (0 dropped)", round)),
              std::string::npos)
        << log;
  }
}
#endif

#ifdef MEMFL_TEST_GRPC
// A client that shared its keys and then left before the first chunk of its
// update (its connection dropped): SecAgg+ takes its pairwise masks out of
// the others' uploads with the shares its neighbours reveal, and the round
// is the mean of the three others; the client is out for the rest of the run.
TEST(SecAggRun, OverGrpcAClientGoneAfterSharingKeysIsRecovered) {
  testing::TempDir tmp;
  setenv("MEMFL_FAULT", "disconnect_before_upload", 1);
  setenv("MEMFL_FAULT_CLIENT", "1", 1);
  Result r = memfl_cli(
      "launch " + write_config(tmp, "    num_shares: 3\n    reconstruction_threshold: 2\n  round_timeout_s: 60\n") +
      " --clients 4 --out " + tmp.file("grpc"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_CLIENT");
  const std::string log = testing::read_file(tmp.file("grpc/server.log"));
  EXPECT_NE(r.output.find("some clients failed (the server finished)"), std::string::npos) << r.output;
  EXPECT_NE(log.find("round 1: secure aggregation unmasked the mean of 3 clients (1 dropped)"), std::string::npos)
      << log;
  expect_fedavg_within_quantisation_bound(tmp.file("grpc/server/global_model.safetensors"),
                                          Rounds(kRounds, std::vector<int>{0, 2, 3}));
}
#endif

#ifdef MEMFL_TEST_MPI
// Ranks of an MPI job: the stages go point to point with each client's
// rank; through the shared-memory ring with one client a rank, point to
// point with two clients a rank (a rank answers each stage for both).
TEST(SecAggRun, OverMpiTheGlobalModelIsFedAvgWithinTheQuantisationBound) {
  testing::TempDir tmp;
  const std::string cfg = write_config(tmp, "  round_timeout_s: 60\n");
  struct Case {
    std::string name, sets;
    int ranks;
  };
  for (const Case& c :
       {Case{"ring", "", kClients + 1},
        Case{"p2p", " --set server_configs.mpi_shared_memory=false --set server_configs.clients_per_rank=2",
             kClients / 2 + 1}}) {
    Result r = mpirun(c.ranks, cfg + c.sets + " --out " + tmp.file(c.name));
    ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << r.output;
    expect_fedavg_within_quantisation_bound(tmp.file(c.name + "/rank_0/global_model.safetensors"));
    for (int round = 1; round <= kRounds; ++round) {
      EXPECT_NE(
          r.output.find(fmt::format("round {}: secure aggregation unmasked the mean of 4 clients (0 dropped)", round)),
          std::string::npos)
          << c.name << "\n"
          << r.output;
    }
  }
}
#endif

TEST(SecAggRun, ServerOptimizerActsOnTheUnmaskedMean) {
  testing::TempDir tmp;
  // FedAvgM (server momentum) is linear in the round's mean.
  const std::string cfg = write_config(tmp, "  aggregator: FedAvgMAggregator\n");
  Result sec = memfl_cli("run " + cfg + " -q --out " + tmp.file("sec"));
  ASSERT_EQ(sec.exit_code, 0) << sec.output;
  Result plain =
      memfl_cli("run " + cfg + " -q --set server_configs.secure_aggregation.enable=false --out " + tmp.file("plain"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto a = SafetensorsFile::open(tmp.file("sec/global_model.safetensors"));
  auto b = SafetensorsFile::open(tmp.file("plain/global_model.safetensors"));
  ASSERT_TRUE(a.ok() && b.ok());
  double worst = 0;
  for (const auto& t : (*a)->tensors()) {
    const auto* u = (*b)->find(t.name);
    ASSERT_NE(u, nullptr);
    for (size_t i = 0; i < t.data.size() / 4; ++i) {
      float x, y;
      std::memcpy(&x, t.data.data() + 4 * i, 4);
      std::memcpy(&y, u->data.data() + 4 * i, 4);
      worst = std::max(worst, static_cast<double>(std::abs(x - y)));
    }
  }
  // DummyTrainer's mean is the model plus a fixed change, so the
  // pseudo-gradient carries only the quantisation error e_j of round j, and
  // momentum (β = 0.9, lr = 1: the defaults) spreads it over later rounds:
  // the model is off by at most lr·Σ_j Σ_k β^k·e_j ≤ rounds²·max e_j (loose,
  // but could fail), with e_j bounded as in the test above.
  const double M = max_client_element(every_client());
  ASSERT_LT(M, 8.0);
  const double per_round = round_bound({0, 1, 2, 3}, M);
  EXPECT_LE(worst, kRounds * kRounds * per_round + 1e-6);
  EXPECT_GT(worst, 0.0);
}

TEST(SecAggRun, RefusesWhatCannotRunWithItNamingTheKey) {
  testing::TempDir tmp;
  const std::string cfg = write_config(tmp, "");
  const auto refused = [&](const std::string& set, const std::string& says) {
    Result r = memfl_cli("run " + cfg + " -q --set " + set + " --out " + tmp.file("x"));
    EXPECT_NE(r.exit_code, 0) << set;
    EXPECT_NE(r.output.find(says), std::string::npos) << set << ": " << r.output;
  };
  refused("server_configs.scheduler=AsyncScheduler --set server_configs.aggregator=FedAsyncAggregator",
          "server_configs.secure_aggregation.enable: true' with server_configs.scheduler: AsyncScheduler");
  refused("server_configs.memory_mode=naive",
          "secure_aggregation.enable: true' with server_configs.memory_mode: naive");
  refused("client_configs.comm_configs.compressor_configs.enable_compression=true",
          "secure_aggregation.enable: true' with client_configs.comm_configs.compressor_configs.enable_compression");
  refused("server_configs.secure_aggregation.modulus_range=1000",
          "secure_aggregation.modulus_range: 1000' must be a power of two");
  refused("server_configs.secure_aggregation.quantization_range=2000000000",
          "secure_aggregation.quantization_range: 2000000000' × 4 clients per round can wrap");
}

// What the first round would refuse, `memfl validate` refuses too, naming
// the key and the k and t it resolves to for the 4 clients of a round.
TEST(SecAggRun, ValidateRefusesSharesAndThresholdsTheRunWould) {
  testing::TempDir tmp;
  const std::string cfg = write_config(tmp, "");
  const auto refused = [&](const std::string& set, const std::string& says) {
    Result r = memfl_cli("validate " + cfg + " --set " + set);
    EXPECT_NE(r.exit_code, 0) << set << ": " << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << set << ": " << r.output;
  };
  // ⌈0.2·4⌉ = 1: each client would share only with itself.
  refused("server_configs.secure_aggregation.num_shares=0.2",
          "server_configs.secure_aggregation.num_shares: 0.2 resolves to k = 1 with 4 clients a round");
  refused("server_configs.secure_aggregation.reconstruction_threshold=7",
          "server_configs.secure_aggregation.reconstruction_threshold: 7 resolves to t = 7 with k = 4 shares");
  refused("server_configs.secure_aggregation.reconstruction_threshold=0.25",
          "reconstruction_threshold: 0.25 resolves to t = 1 with k = 4 shares");
  refused("server_configs.num_clients=2", "secure aggregation needs at least 3 clients a round (2 selected)");
  Result ok = memfl_cli("validate " + cfg);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// k and t, as resolved, in the log of every round and in summary.json.
TEST(SecAggRun, SharesAndThresholdAreInTheLogAndTheSummary) {
  testing::TempDir tmp;
  Result r = memfl_cli("run " + write_config(tmp, "    num_shares: 3\n    reconstruction_threshold: 2\n") +
                       " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int round = 1; round <= kRounds; ++round) {
    EXPECT_NE(
        r.output.find(fmt::format("round {}: secure aggregation over 4 clients: k = 3 shares each, t = 2", round)),
        std::string::npos)
        << r.output;
  }
  const auto summary = nlohmann::json::parse(testing::read_file(tmp.file("run/summary.json")));
  ASSERT_TRUE(summary.contains("secure_aggregation")) << summary.dump(2);
  EXPECT_EQ(summary["secure_aggregation"]["k"], 3);
  EXPECT_EQ(summary["secure_aggregation"]["t"], 2);
  EXPECT_EQ(summary["secure_aggregation"]["clients_per_round"], 4);
}

}  // namespace
}  // namespace memfl
