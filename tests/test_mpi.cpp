// The MPI transport: `mpirun -np N+1 memfl mpi`, as root and with more ranks
// than cores (the test sets the variables CI needs).
#include <gtest/gtest.h>

#include <cstdlib>
#include <tuple>

#include "cli_util.h"
#include "test_util.h"

namespace memfl {
namespace {

constexpr const char* kCnn =
    " -q --set server_configs.num_global_epochs=2"
    " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1500"
    " --set client_configs.data_configs.dataset_kwargs.max_test_samples=300"
    " --set client_configs.train_configs.num_threads=1"
    " --set server_configs.comm_configs.grpc_configs.model_chunk_size=65536";

// Runs the CNN on 3 ranks (with `mpi_args`) and in process with `clients`
// clients; the global models must be the same bit for bit.
void expect_mpi_equals_in_process(testing::TempDir& tmp, const std::string& mpi_args, int clients) {
  Result m = mpirun(3, std::string(kCnn) + mpi_args + " --out " + tmp.file("mpi"));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  Result r = memfl_cli(std::string("run") + kCnn + " --set server_configs.num_clients=" + std::to_string(clients) +
                       " --out " + tmp.file("inproc"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("mpi/rank_0/global_model.safetensors")));
}

TEST(Mpi, ThreeRanksEqualTheInProcessRunBitForBit) {
  testing::TempDir tmp;
  expect_mpi_equals_in_process(tmp, "", 2);
  if (HasFatalFailure()) return;
  for (const char* rank : {"rank_0", "rank_1", "rank_2"}) {
    EXPECT_TRUE(std::filesystem::exists(tmp.file(std::string("mpi/") + rank + "/memory.json"))) << rank;
  }
  auto metrics = read_csv(tmp.file("mpi/rank_0/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_GT(std::stod(metrics[2][7]), 0.3) << "accuracy above chance";
  // The ranks' training accuracy reaches rank 0's metrics (column 3), as in process.
  EXPECT_GT(std::stod(metrics[2][3]), 0.3);
  EXPECT_EQ(metrics[2][3], read_csv(tmp.file("inproc/metrics.csv"))[2][3]);
  // memfl report reads every rank.
  Result rep = memfl_cli("report " + tmp.file("mpi"));
  ASSERT_EQ(rep.exit_code, 0) << rep.output;
  std::ifstream in(tmp.file("mpi/report/peaks.csv"));
  std::string all((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(all.find("rank_2"), std::string::npos) << all;
  // Client ranks train: they keep their heap between batches (memory/malloc_policy.h).
  std::ifstream rank_summary(tmp.file("mpi/rank_1/summary.json"));
  const std::string text((std::istreambuf_iterator<char>(rank_summary)), {});
  EXPECT_NE(text.find("\"malloc_policy\": \"training\""), std::string::npos) << text;
}

TEST(Mpi, SeveralVirtualClientsPerRank) {
  testing::TempDir tmp;
  expect_mpi_equals_in_process(tmp, " --set server_configs.clients_per_rank=3", 6);
  if (HasFatalFailure()) return;
  auto metrics = read_csv(tmp.file("mpi/rank_0/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[1][1], "6") << "2 ranks × 3 virtual clients";
}

TEST(Mpi, ADeadRankEndsTheJobAndTheCheckpointSurvives) {
  testing::TempDir tmp;
  setenv("MEMFL_FAULT", "die_after_round_1", 1);
  setenv("MEMFL_FAULT_RANK", "2", 1);
  Result m = mpirun(3, std::string(kCnn) + " --set server_configs.num_global_epochs=3 --out " + tmp.file("mpi"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_RANK");
  EXPECT_NE(m.exit_code, 0) << "the job must not hang or pretend to finish";
  // mpirun names the process that died: [[job,1],rank].
  EXPECT_NE(m.output.find(",2]"), std::string::npos) << m.output;
  // The checkpoint is a whole safetensors file of a completed round.
  auto f = SafetensorsFile::open(tmp.file("mpi/rank_0/global_model.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  // Round 1's if the server finished writing it before mpirun ended the job,
  // else round 0's: never a torn file (tmp + rename).
  const std::string round = (*f)->metadata().at("round");
  EXPECT_TRUE(round == "0" || round == "1") << round;
}

// Both ways chunks move: through the shared-memory ring (the default when
// every rank is on the server's node, as here) and as point-to-point messages.
TEST(Mpi, PointToPointChunksEqualTheInProcessRunBitForBit) {
  testing::TempDir tmp;
  expect_mpi_equals_in_process(tmp, " --set server_configs.mpi_shared_memory=false", 2);
}

}  // namespace
}  // namespace memfl
