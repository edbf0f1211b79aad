// One experiment on every client path: the simulator's clients, the C++ gRPC
// client with its chunks in the stream, on the data channel's TCP port and on
// its Unix socket, and MPI client ranks over the shared-memory ring and point
// to point. Every path runs the same client driver (client/client_driver.h),
// so with DP-SGD's noise on (σ > 0: the noise is drawn from seeds of the
// round and the client, not from the transport), FedAvg and a server
// optimizer give the same final model, bit for bit, and every client's
// privacy ledger is the same rows. The Python client speaks the C++
// client's gRPC protocol (one GrpcClientTransport) but trains in Python: its
// path is checked bit for bit against C++ clients in tests/python
// (test_the_python_client_path_gives_the_cpp_clients_model_bit_for_bit).
// Asynchronous rules: with one client the arrival order is the same on every
// transport, so FedAsync with DP-SGD's noise must give one model too; with
// several, arrival order is real time over gRPC and MPI and each run is
// checked against its own log instead (test_async.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "cli_util.h"
#include "test_util.h"

namespace memfl {
namespace {

namespace fs = std::filesystem;

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

// DP-SGD with noise on a small slice of Fashion-MNIST, one thread per
// process, a server on a free port: what every path below runs.
constexpr const char* kSmallDpRun =
    " --set client_configs.train_configs.dp.noise_multiplier=0.8"
    " --set client_configs.train_configs.train_batch_size=64"
    " --set client_configs.data_configs.dataset_kwargs.max_train_samples=640"
    " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
    " --set client_configs.train_configs.num_threads=1"
    " --set server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:0";

class EveryClientPath : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryClientPath, GivesTheSameModelAndPrivacyLedger) {
  testing::TempDir tmp;
  const std::string cfg = std::string(MEMFL_SOURCE_DIR) + "/configs/dp_fmnist_cnn_gn.yaml";
  const std::string sets =
      std::string(" -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2") +
      " --set server_configs.aggregator=" + GetParam() + kSmallDpRun;
  const std::string g = " --set server_configs.comm_configs.grpc_configs.";
  struct Path {
    std::string name, command, model;
  };
  const std::vector<Path> paths = {
      {"in-process", "run " + cfg + sets, "global_model.safetensors"},
      {"grpc-stream", "launch " + cfg + " --clients 2" + sets + g + "data_channel=grpc",
       "server/global_model.safetensors"},
      {"grpc-tcp", "launch " + cfg + " --clients 2" + sets + g + "data_channel=tcp" + g + "data_channel_unix=false",
       "server/global_model.safetensors"},
      {"grpc-unix", "launch " + cfg + " --clients 2" + sets + g + "data_channel=tcp",
       "server/global_model.safetensors"},
  };
  for (const auto& p : paths) {
    Result r = memfl_cli(p.command + " --out " + tmp.file(p.name));
    ASSERT_EQ(r.exit_code, 0) << p.name << "\n" << r.output;
  }
  Result ring = mpirun(3, cfg + sets + " --out " + tmp.file("mpi-ring"));
  ASSERT_EQ(ring.exit_code, 0) << ring.output;
  Result p2p = mpirun(3, cfg + sets + " --set server_configs.mpi_shared_memory=false --out " + tmp.file("mpi-p2p"));
  ASSERT_EQ(p2p.exit_code, 0) << p2p.output;

  const std::string reference = tmp.file("in-process/global_model.safetensors");
  const auto ledger = privacy_rows(tmp.file("in-process"));
  ASSERT_EQ(ledger.size(), 4u) << "2 clients × 2 rounds";
  EXPECT_NE(ledger[0][5], ledger[2][5]) << "client 0's ε grows from round 1 to round 2";
  for (const auto& [name, model] :
       std::vector<std::pair<std::string, std::string>>{{"grpc-stream", "server/global_model.safetensors"},
                                                        {"grpc-tcp", "server/global_model.safetensors"},
                                                        {"grpc-unix", "server/global_model.safetensors"},
                                                        {"mpi-ring", "rank_0/global_model.safetensors"},
                                                        {"mpi-p2p", "rank_0/global_model.safetensors"}}) {
    EXPECT_TRUE(same_model(reference, tmp.file(name + "/" + model))) << name;
    EXPECT_EQ(privacy_rows(tmp.file(name)), ledger) << name;
  }
  // The noise is there: the same run without it ends elsewhere.
  Result quiet = memfl_cli("run " + cfg + sets + " --set client_configs.train_configs.dp.noise_multiplier=0 --out " +
                           tmp.file("quiet"));
  ASSERT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_FALSE(same_model(reference, tmp.file("quiet/global_model.safetensors")));
}

// FedAsync with one client and DP-SGD's noise: each trip trains with its own
// seed (its number) on the version it was sent, on every transport, so the
// versions — and the final model — are the same bit for bit; so are the
// privacy rows of the trips that were sent. The simulator also trains the
// trip it dispatches as the last update lands (its clock is virtual: a trip
// is trained when it is dispatched), which real clients never receive: that
// one extra row is the only difference the test allows.
TEST(EveryClientPathAsync, FedAsyncGivesTheSameModelAndPrivacyLedger) {
  testing::TempDir tmp;
  const std::string cfg = std::string(MEMFL_SOURCE_DIR) + "/configs/dp_fmnist_cnn_gn.yaml";
  const std::string sets =
      std::string(" -q --set server_configs.num_clients=1 --set server_configs.num_global_epochs=3") +
      " --set server_configs.scheduler=AsyncScheduler --set server_configs.aggregator=FedAsyncAggregator" + kSmallDpRun;
  const std::string g = " --set server_configs.comm_configs.grpc_configs.";
  Result sim = memfl_cli("run " + cfg + sets + " --out " + tmp.file("in-process"));
  ASSERT_EQ(sim.exit_code, 0) << sim.output;
  for (const auto& [name, how] : std::vector<std::pair<std::string, std::string>>{
           {"grpc-stream", g + "data_channel=grpc"}, {"grpc-unix", g + "data_channel=tcp"}}) {
    Result r = memfl_cli("launch " + cfg + " --clients 1" + sets + how + " --out " + tmp.file(name));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  }
  Result ring = mpirun(2, cfg + sets + " --out " + tmp.file("mpi-ring"));
  ASSERT_EQ(ring.exit_code, 0) << ring.output;

  const std::string reference = tmp.file("in-process/global_model.safetensors");
  auto ledger = privacy_rows(tmp.file("in-process"));
  ASSERT_EQ(ledger.size(), 4u) << "3 trips sent and applied, and the one dispatched as the last landed";
  ledger.pop_back();  // sorted by version: the unsent trip's row is last
  for (const auto& [name, model] :
       std::vector<std::pair<std::string, std::string>>{{"grpc-stream", "server/global_model.safetensors"},
                                                        {"grpc-unix", "server/global_model.safetensors"},
                                                        {"mpi-ring", "rank_0/global_model.safetensors"}}) {
    EXPECT_TRUE(same_model(reference, tmp.file(name + "/" + model))) << name;
    EXPECT_EQ(privacy_rows(tmp.file(name)), ledger) << name;
  }
  // Three updates moved the model: the run with one ends elsewhere.
  Result one = memfl_cli("run " + cfg + sets + " --set server_configs.num_global_epochs=1 --out " + tmp.file("one"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_FALSE(same_model(reference, tmp.file("one/global_model.safetensors")));
}

INSTANTIATE_TEST_SUITE_P(Aggregators, EveryClientPath, ::testing::Values("FedAvgAggregator", "FedAdamAggregator"),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace memfl
