// MPI ranks on hosts of their own, simulated: the server rank and each client
// rank in a network namespace (tests/netem/netns.sh) under a host name of its
// own, started by mpirun through tests/netem/mpi_netns_agent.sh in place of
// ssh. Every rank is then a node to OpenMPI, so chunks travel point to point
// over TCP through the namespaces' veth links (shaped as a WAN is) rather
// than through the shared-memory ring, and a client's link can be cut as a
// cable is. Skipped where namespaces cannot be made (root or CAP_SYS_ADMIN).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "dummy_oracle.h"
#include "test_util.h"

namespace memfl {
namespace {

constexpr int kClients = 4;
constexpr double kScale = 0.001;

const std::string kNetns = std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/tests/netem/netns.sh";
const std::string kAgent = std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/tests/netem/mpi_netns_agent.sh";

std::string write_config(const testing::TempDir& tmp, int64_t params, int rounds, int64_t chunk,
                         const std::string& delays) {
  const std::string path = tmp.file("netns.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: "
                      << kScale << "\n    dummy_delay_s: \"" << delays
                      << "\"\n  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: "
                      << params << "\nserver_configs:\n  num_global_epochs: " << rounds
                      << "\n  aggregator_kwargs:\n    client_weights_mode: sample_size\n  comm_configs:\n"
                         "    grpc_configs:\n      model_chunk_size: "
                      << chunk << "\n";
  return path;
}

// The server's namespace and kClients clients' (client i at 10.77.0.(10+i)),
// every link shaped; all of it removed when the object dies, also when an
// assertion ends the test early. The tag ("mp…") is used by no other test.
class Hosts {
 public:
  explicit Hosts(char salt) : tag_("mp" + std::to_string(getpid() % 100000) + salt) {}
  ~Hosts() { (void)run_shell(kNetns + " down " + tag_ + " " + std::to_string(kClients)); }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  // netem (delay, jitter, loss, rate) where the kernel has sch_netem, else a
  // tbf rate limit: both at 1 Gbit/s, as the gRPC test's links.
  Result up() {
    const bool netem = run_shell(kNetns + " check-netem").exit_code == 0;
    if (!netem) {
      std::printf(
          "[   NOTE   ] this kernel has no sch_netem: links are rate-limited (tbf, 1 Gbit/s), "
          "without delay, jitter or loss\n");
    }
    const std::string qdisc =
        netem ? "netem delay 20ms 5ms loss 0.5% rate 1gbit" : "tbf rate 1gbit burst 256kb latency 50ms";
    return run_shell(kNetns + " up " + tag_ + " " + std::to_string(kClients) + " && " + kNetns + " shape " + tag_ +
                     " " + std::to_string(kClients) + " '" + qdisc + "'");
  }

  // `memfl mpi ARGS` with rank 0 in the server's namespace and rank i in
  // client i−1's, from mpirun in the server's namespace. TCP only, on the
  // namespaces' subnet (the daemons' own links as well as the ranks').
  std::string mpirun(const testing::TempDir& tmp, const std::string& args, const std::string& options = "") const {
    const std::string hosts = tmp.file("hosts");
    std::ofstream h(hosts);
    h << "10.77.0.1 slots=1\n";
    for (int c = 0; c < kClients; ++c) h << "10.77.0." << 10 + c << " slots=1\n";
    h.close();
#if defined(__SANITIZE_ADDRESS__)
    const std::string env = "ASAN_OPTIONS=detect_leaks=0 ";  // OpenMPI's allocations to its exit
#else
    const std::string env;
#endif
    return env + "MEMFL_NETNS_TAG=" + tag_ + " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 " +
           kNetns + " exec " + tag_ + " server mpirun --mca plm_rsh_agent " + kAgent +
           " --mca plm_rsh_no_tree_spawn 1 --hostfile " + hosts + " -np " + std::to_string(kClients + 1) +
           " --bind-to none --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24"
           " --mca oob_tcp_if_include 10.77.0.0/24 " +
           options + " " + std::string(MEMFL_BINARY) + " mpi " + args;
  }

  // Bytes the kernel counted on client c's end of its link ("rx" or "tx").
  int64_t link_bytes(int c, const std::string& dir) const {
    const std::string dev = "mf" + tag_ + "c" + std::to_string(c) + "a";
    Result r = run_shell(kNetns + " exec " + tag_ + " " + std::to_string(c) + " cat /sys/class/net/" + dev +
                         "/statistics/" + dir + "_bytes");
    return r.exit_code == 0 ? std::stoll(r.output) : -1;
  }

  const std::string& tag() const { return tag_; }

 private:
  std::string tag_;
};

bool namespaces_can_be_made() { return run_shell(kNetns + " check-ns").exit_code == 0; }

// Four client ranks, each on its own shaped link: the run takes the
// point-to-point path, every client's link carries its downloads and
// uploads (the kernel's byte counts, at least the model each way per
// round), and the model is the FedAvg computed here — and the same bytes
// as the same job on one host through the shared-memory ring.
TEST(MpiNetns, RanksOnSeparateHostsMoveChunksPointToPointOverShapedLinks) {
  if (!namespaces_can_be_made()) {
    GTEST_SKIP() << "network namespaces cannot be made here (ip netns add needs root or CAP_SYS_ADMIN)";
  }
  constexpr int64_t kParams = 262144;  // 1 MiB of f32: far above what OpenMPI's own messages take
  constexpr int kRounds = 3;
  Hosts hosts('a');
  Result up = hosts.up();
  ASSERT_EQ(up.exit_code, 0) << up.output;
  testing::TempDir tmp;
  const std::string cfg = write_config(tmp, kParams, kRounds, 65536, "");
  std::vector<int64_t> rx0(kClients), tx0(kClients);
  for (int c = 0; c < kClients; ++c) {
    rx0[c] = hosts.link_bytes(c, "rx");
    tx0[c] = hosts.link_bytes(c, "tx");
  }
  Result r = run_shell(hosts.mpirun(tmp, cfg + " -q --out " + tmp.file("netns")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string summary = testing::read_file(tmp.file("netns/rank_0/summary.json"));
  EXPECT_NE(summary.find("\"chunk_path\": \"point_to_point\""), std::string::npos) << summary;
  const int64_t model_bytes = kParams * 4;
  for (int c = 0; c < kClients; ++c) {
    EXPECT_GE(hosts.link_bytes(c, "rx") - rx0[c], kRounds * model_bytes) << "client " << c << "'s downloads";
    EXPECT_GE(hosts.link_bytes(c, "tx") - tx0[c], kRounds * model_bytes) << "client " << c << "'s uploads";
  }
  const std::vector<std::vector<int>> all(kRounds, std::vector<int>{0, 1, 2, 3});
  EXPECT_TRUE(testing::model_equals(tmp.file("netns/rank_0/global_model.safetensors"),
                                    testing::dummy_fedavg_model(kParams, kScale, all)));
  Result ring = memfl::mpirun(kClients + 1, cfg + " -q --out " + tmp.file("ring"));
  ASSERT_EQ(ring.exit_code, 0) << ring.output;
  EXPECT_NE(testing::read_file(tmp.file("ring/rank_0/summary.json")).find("\"chunk_path\": \"shared_ring\""),
            std::string::npos);
  EXPECT_TRUE(
      same_model(tmp.file("ring/rank_0/global_model.safetensors"), tmp.file("netns/rank_0/global_model.safetensors")));
}

// Client 2's link (rank 3's) is cut in the middle of a round, while it
// trains, for longer than both deadlines: that round and every later one
// completes with the other three, rank 3 is excluded and named in
// summary.json, and the model is the FedAvg (computed here) of the clients
// that finished each round. MPI cannot take a rank back, so the cut client
// stays out once excluded. The link is healed before the job ends: OpenMPI's
// MPI_Finalize waits for every rank of the job, through the daemons' links,
// and the server's notice that lets the excluded rank go travels on that
// link too (a link cut for good: the next test).
TEST(MpiNetns, AClientCutOffMidRoundIsExcludedAndTheOthersFinishEveryRound) {
  if (!namespaces_can_be_made()) {
    GTEST_SKIP() << "network namespaces cannot be made here (ip netns add needs root or CAP_SYS_ADMIN)";
  }
  constexpr int64_t kParams = 3001;
  constexpr int kRounds = 10;
  Hosts hosts('b');
  Result up = hosts.up();
  ASSERT_EQ(up.exit_code, 0) << up.output;
  testing::TempDir tmp;
  // 0.3 s of training a round: the cut, made as round 2 is committed, falls
  // in round 3's training or at the latest in the round after.
  const std::string cfg = write_config(tmp, kParams, kRounds, 1000, "0.3");
  const std::string dir = tmp.file("netns");
  const std::string metrics = dir + "/rank_0/metrics.csv";
  const std::string cut = "( for i in $(seq 1200); do grep -q '^2,' " + metrics +
                          " 2>/dev/null && break; sleep 0.1; done; " + kNetns + " partition " + hosts.tag() +
                          " 2; sleep 8; " + kNetns + " heal " + hosts.tag() + " 2 ) & ";
  const std::string args = cfg +
                           " -q --set server_configs.broadcast_timeout_s=3 --set server_configs.upload_timeout_s=4"
                           " --out " +
                           dir;
  Result r = run_shell(cut + hosts.mpirun(tmp, args) + " 2>&1; rc=$?; wait; exit $rc");
  ASSERT_EQ(r.exit_code, 0) << (r.exit_code == 124 ? "the job did not end within 300 s\n" : "") << r.output;
  const auto rows = read_csv(metrics);
  ASSERT_EQ(rows.size(), static_cast<size_t>(kRounds + 1)) << r.output;
  std::vector<std::vector<int>> in;
  int without = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const bool all = rows[i][1] == "4";
    if (!all) ++without;
    EXPECT_TRUE(all || rows[i][1] == "3") << "round " << i << ": " << rows[i][1] << " clients";
    EXPECT_FALSE(all && without > 0) << "round " << i << ": an excluded rank is out for good";
    in.emplace_back();
    for (int c = 0; c < kClients; ++c) {
      if (all || c != 2) in.back().push_back(c);
    }
  }
  EXPECT_GE(without, 1) << "client 2 was left out while its link was cut\n" << r.output;
  EXPECT_EQ(rows[1][1], "4") << "round 1, before the cut";
  EXPECT_EQ(rows[2][1], "4") << "round 2, committed before the cut";
  EXPECT_TRUE(testing::model_equals(dir + "/rank_0/global_model.safetensors",
                                    testing::dummy_fedavg_model(kParams, kScale, in)));
  const std::string summary = testing::read_file(dir + "/rank_0/summary.json");
  EXPECT_NE(summary.find("\"chunk_path\": \"point_to_point\""), std::string::npos) << summary;
  EXPECT_NE(summary.find("\"excluded_ranks\": [\n    3\n  ]"), std::string::npos) << summary;
  // The cut rank runs under another host name than the server's, so the
  // server does not signal it (a pid names no process on another host): it
  // left on the server's message.
  EXPECT_NE(r.output.find("rank 3: the server excluded this rank (a stall, or an update it refused); leaving the job"), std::string::npos)
      << r.output;
}

// A link cut for good: the rounds still complete with the others, but the
// job cannot end normally (MPI_Finalize waits for the cut rank). mpirun
// ends it once its keepalive on the daemon's out-of-band link gives up —
// after about 8 minutes by default (oob_tcp_keepalive_time 300 s, then 9
// probes 20 s apart), here after 20 s and 3 probes 5 s apart — with
// OpenMPI's message naming the lost host, and the committed rounds stay.
TEST(MpiNetns, ALinkCutForGoodEndsTheJobWhenOpenMpiLosesTheHostsDaemon) {
  if (!namespaces_can_be_made()) {
    GTEST_SKIP() << "network namespaces cannot be made here (ip netns add needs root or CAP_SYS_ADMIN)";
  }
  constexpr int64_t kParams = 3001;
  constexpr int kRounds = 10;
  Hosts hosts('c');
  Result up = hosts.up();
  ASSERT_EQ(up.exit_code, 0) << up.output;
  testing::TempDir tmp;
  const std::string cfg = write_config(tmp, kParams, kRounds, 1000, "0.3");
  const std::string dir = tmp.file("netns");
  const std::string metrics = dir + "/rank_0/metrics.csv";
  const std::string cut = "( for i in $(seq 1200); do grep -q '^2,' " + metrics +
                          " 2>/dev/null && break; sleep 0.1; done; " + kNetns + " partition " + hosts.tag() + " 2 ) & ";
  const std::string args = cfg +
                           " -q --set server_configs.broadcast_timeout_s=3 --set server_configs.upload_timeout_s=4"
                           " --out " +
                           dir;
  const std::string keepalive =
      "--mca oob_tcp_keepalive_time 20 --mca oob_tcp_keepalive_intvl 5 --mca oob_tcp_keepalive_probes 3";
  Result r = run_shell(cut + hosts.mpirun(tmp, args, keepalive) + " 2>&1; rc=$?; wait; exit $rc");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the job did not end within 300 s\n" << r.output;
  EXPECT_NE(r.output.find("ORTE has lost communication with a remote daemon"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on node 10.77.0.12"), std::string::npos) << "client 2's host\n" << r.output;
  // Every round was played before the keepalive gave up (the last at most
  // a few seconds after the cut's deadline), without client 2 from the cut.
  const auto rows = read_csv(metrics);
  ASSERT_EQ(rows.size(), static_cast<size_t>(kRounds + 1)) << r.output;
  EXPECT_EQ(rows[kRounds][1], "3") << r.output;
  const std::string summary = testing::read_file(dir + "/rank_0/summary.json");
  EXPECT_NE(summary.find("\"excluded_ranks\": [\n    3\n  ]"), std::string::npos) << summary;
}

}  // namespace
}  // namespace memfl
