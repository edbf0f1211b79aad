// One experiment on every client path: the simulator's clients, the C++ gRPC
// client with its chunks in the stream, on the data channel's TCP port and on
// its Unix socket, and MPI client ranks over the shared-memory ring and point
// to point. Every path runs the same client driver (client/client_driver.h),
// so with DP-SGD's noise on (σ > 0: the noise is drawn from seeds of the
// round and the client, not from the transport), FedAvg and a server
// optimizer give the same final model, bit for bit, and every client's
// privacy ledger is the same rows. (The Python client trains in Python: its
// paths are tests/python's.) Asynchronous rules depend on real arrival times
// over gRPC and MPI and are checked against their own logs instead
// (test_async.cpp).
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

class EveryClientPath : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryClientPath, GivesTheSameModelAndPrivacyLedger) {
  testing::TempDir tmp;
  const std::string cfg = std::string(MEMFL_SOURCE_DIR) + "/configs/dp_fmnist_cnn_gn.yaml";
  const std::string sets =
      std::string(" -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2") +
      " --set server_configs.aggregator=" + GetParam() + " --set client_configs.train_configs.dp.noise_multiplier=0.8" +
      " --set client_configs.train_configs.train_batch_size=64" +
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=640" +
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200" +
      " --set client_configs.train_configs.num_threads=1" +
      " --set server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:0";
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

INSTANTIATE_TEST_SUITE_P(Aggregators, EveryClientPath, ::testing::Values("FedAvgAggregator", "FedAdamAggregator"),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace memfl
