// The MPI transport's chunk streams without libtorch (synthetic model,
// DummyTrainer), so that they also run in the ASan+UBSan build: both paths
// (shared-memory ring, point to point), chunks of 7 bytes and larger than the
// model, one and several virtual clients per rank.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <tuple>

#include "cli_util.h"
#include "test_util.h"

namespace memfl {
namespace {

// (chunk size, shared-memory ring allowed, virtual clients per rank)
class MpiChunks : public ::testing::TestWithParam<std::tuple<int64_t, bool, int>> {};

TEST_P(MpiChunks, SevenBytesAndLargerThanTheModel) {
  testing::TempDir tmp;
  const std::string cfg = tmp.file("synthetic.yaml");
  const int per_rank = std::get<2>(GetParam());
  std::ofstream(cfg) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n  model_configs:\n"
                        "    model_name: synthetic\n    model_kwargs:\n      num_params: 2500\n"
                        "server_configs:\n  num_global_epochs: 2\n  clients_per_rank: "
                     << per_rank << "\n  mpi_shared_memory: " << (std::get<1>(GetParam()) ? "true" : "false")
                     << "\n  comm_configs:\n    grpc_configs:\n      model_chunk_size: " << std::get<0>(GetParam())
                     << "\n";
  Result m = mpirun(3, cfg + " -q --out " + tmp.file("mpi"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  std::ifstream summary(tmp.file("mpi/rank_0/summary.json"));
  const std::string text((std::istreambuf_iterator<char>(summary)), {});
  // The ring's slots hold a chunk of up to 8 MiB: both sizes here take it when allowed.
  EXPECT_NE(text.find(std::get<1>(GetParam()) ? "\"shared_ring\"" : "\"point_to_point\""), std::string::npos) << text;
  Result r = memfl_cli("run " + cfg + " -q --set server_configs.num_clients=" + std::to_string(2 * per_rank) +
                       " --out " + tmp.file("inproc"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("mpi/rank_0/global_model.safetensors")));
}

INSTANTIATE_TEST_SUITE_P(Sizes, MpiChunks,
                         ::testing::Combine(::testing::Values(7, 1 << 20), ::testing::Bool(), ::testing::Values(1, 3)),
                         [](const auto& p) {
                           return "chunk_" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_shared_ring" : "_point_to_point") + "_" +
                                  std::to_string(std::get<2>(p.param)) + "_per_rank";
                         });

// Four clients whose updates are all announced when the server looks (it
// holds its upload back until they are, MEMFL_HOLD_COLLECT_MS) are received
// together through the ring, chunk by chunk in turn, each rank in its own
// share of the slots: the model is the in-process run's, bit for bit. Chunks
// of 7 bytes cut the f32 elements, and the ranks fold behind each other
// element by element; chunks of 1 MiB hold the whole model.
class MpiTogether : public ::testing::TestWithParam<int64_t> {};

TEST_P(MpiTogether, FourUpdatesReceivedTogetherEqualTheInProcessRun) {
  testing::TempDir tmp;
  const std::string cfg = tmp.file("synthetic.yaml");
  std::ofstream(cfg) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n  model_configs:\n"
                        "    model_name: synthetic\n    model_kwargs:\n      num_params: 2500\n"
                        "server_configs:\n  num_global_epochs: 2\n"
                        "  comm_configs:\n    grpc_configs:\n      model_chunk_size: "
                     << GetParam() << "\n";
  // Until all four have announced (at most a minute): a fixed 3 s was once
  // too short under ASan beside other tests.
  setenv("MEMFL_HOLD_COLLECT_MS", "60000", 1);
  Result m = mpirun(5, cfg + " -q --out " + tmp.file("mpi"));
  unsetenv("MEMFL_HOLD_COLLECT_MS");
  ASSERT_EQ(m.exit_code, 0) << m.output;
  std::ifstream summary(tmp.file("mpi/rank_0/summary.json"));
  const std::string text((std::istreambuf_iterator<char>(summary)), {});
  EXPECT_NE(text.find("\"shared_ring\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"updates_received_together\": 4"), std::string::npos) << text;
  Result r = memfl_cli("run " + cfg + " -q --set server_configs.num_clients=4 --out " + tmp.file("inproc"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("mpi/rank_0/global_model.safetensors")));
}

INSTANTIATE_TEST_SUITE_P(Ring, MpiTogether, ::testing::Values(7, 1 << 20),
                         [](const auto& p) { return "chunk_" + std::to_string(p.param); });

}  // namespace
}  // namespace memfl
