// Compressed updates on every client path — the simulator (one and two
// workers), the gRPC stream, the data channel's TCP port and Unix socket,
// MPI's ring and point to point — through the one client driver and the
// server's decoding decorator. DummyTrainer's updates are known
// (tests/dummy_oracle.h), so the test knows the model an uncompressed run
// gives and how far each codec's bound lets a compressed one stray from it;
// every path must give the same bytes (the same frames rebuild the same
// chunks), fewer of them on the wire, and a bad frame is refused naming the
// client and the chunk while the round goes on with the others.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "comm/chunk.h"
#include "dummy_oracle.h"
#include "test_util.h"

namespace memfl {
namespace {

constexpr int kClients = 3;
constexpr int kRounds = 3;
constexpr int64_t kParams = 3001;
constexpr double kScale = 0.001;

std::string write_config(const testing::TempDir& tmp, const std::string& name, const std::string& compressor,
                         int64_t chunk) {
  const std::string path = tmp.file(name + ".yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: "
                      << kScale
                      << "\n  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: "
                      << kParams << "\n  comm_configs:\n    compressor_configs:\n"
                      << compressor << "server_configs:\n  num_clients: " << kClients
                      << "\n  num_global_epochs: " << kRounds
                      << "\n  aggregator_kwargs:\n    client_weights_mode: sample_size\n  round_timeout_s: 60\n"
                         "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:0\n"
                         "      connect_timeout_s: 60\n      model_chunk_size: "
                      << chunk << "\n";
  return path;
}

// Whether the f32 model at `path` is within `tol` of `want`, element by
// element (f32 rounding of the values aside).
::testing::AssertionResult model_near(const std::string& path, const std::vector<double>& want, double tol,
                                      bool* differs) {
  auto f = SafetensorsFile::open(path);
  if (!f.ok()) return ::testing::AssertionFailure() << f.status().to_string();
  size_t k = 0;
  *differs = false;
  for (const auto& t : (*f)->tensors()) {
    for (size_t i = 0; i < t.data.size() / 4; ++i, ++k) {
      float v;
      std::memcpy(&v, t.data.data() + 4 * i, 4);
      const double err = std::fabs(v - want[k]);
      if (err > tol + 4e-6 * (1 + std::fabs(want[k]))) {
        return ::testing::AssertionFailure() << "element " << k << ": " << v << " where " << want[k] << " ± " << tol;
      }
      if (err > 4e-6 * (1 + std::fabs(want[k]))) *differs = true;
    }
  }
  return ::testing::AssertionSuccess();
}

struct Path {
  std::string name, command, dir;  // dir: where the server's files are
};

std::vector<Path> every_path(const std::string& cfg, const std::string& out) {
  const std::string g = " --set server_configs.comm_configs.grpc_configs.";
  const std::string n = std::to_string(kClients);
  std::vector<Path> paths = {
      {"in-process", "run " + cfg + " -q --out " + out + "/in-process", out + "/in-process"},
      {"in-process-x2", "run " + cfg + " -q --set server_configs.parallel_clients=2 --out " + out + "/x2", out + "/x2"},
  };
#ifdef MEMFL_TEST_GRPC
  paths.push_back({"grpc-stream", "launch " + cfg + " -q --clients " + n + g + "data_channel=grpc --out " + out + "/gs",
                   out + "/gs/server"});
  paths.push_back({"grpc-tcp",
                   "launch " + cfg + " -q --clients " + n + g + "data_channel=tcp" + g +
                       "data_channel_unix=false --out " + out + "/gt",
                   out + "/gt/server"});
  paths.push_back({"grpc-unix", "launch " + cfg + " -q --clients " + n + g + "data_channel=tcp --out " + out + "/gu",
                   out + "/gu/server"});
#endif
  return paths;
}

// Column `name` (bytes_up, bytes_down) of every round in a run's metrics.csv.
std::vector<double> bytes_column(const std::string& dir, const std::string& name) {
  auto rows = read_csv(dir + "/metrics.csv");
  std::vector<double> out;
  if (rows.empty()) return out;
  size_t col = 0;
  while (col < rows[0].size() && rows[0][col] != name) ++col;
  for (size_t r = 1; r < rows.size(); ++r) out.push_back(std::stod(rows[r].at(col)));
  return out;
}
std::vector<double> bytes_up(const std::string& dir) { return bytes_column(dir, "bytes_up"); }

struct CompressedCase {
  std::string name, compressor;
  // The most an element of the final model may stray from the uncompressed
  // one: per round, the weighted mean of errors each within its client's
  // tolerance, so at most the largest; over the rounds, their sum.
  double tolerance;
  bool lossy_broadcast = false;  // broadcast_compression: lossy
};

void PrintTo(const CompressedCase& c, std::ostream* os) { *os << c.name; }

class CompressedUpdates : public ::testing::TestWithParam<CompressedCase> {};

TEST_P(CompressedUpdates, EveryPathGivesTheSameModelWithinTheBound) {
  const CompressedCase& c = GetParam();
  testing::TempDir tmp;
  // 1000 + 7 bytes: chunk edges inside elements and inside the tensor.
  const std::string cfg = write_config(tmp, c.name, c.compressor, 1007);
  const std::string plain = write_config(tmp, "plain", "      enable_compression: false\n", 1007);
  Result raw = memfl_cli("run " + plain + " -q --out " + tmp.file("plain"));
  ASSERT_EQ(raw.exit_code, 0) << raw.output;
  const std::vector<double> raw_up = bytes_up(tmp.file("plain"));
  ASSERT_EQ(raw_up.size(), static_cast<size_t>(kRounds));

  std::vector<Path> paths = every_path(cfg, tmp.path.string());
#ifdef MEMFL_TEST_MPI
  const std::vector<std::pair<std::string, std::string>> mpi = {
      {"mpi-ring", ""}, {"mpi-p2p", " --set server_configs.mpi_shared_memory=false"}};
#endif
  for (const auto& p : paths) {
    Result r = memfl_cli(p.command);
    ASSERT_EQ(r.exit_code, 0) << p.name << "\n" << r.output;
  }
#ifdef MEMFL_TEST_MPI
  for (const auto& [name, sets] : mpi) {
    Result r = mpirun(kClients + 1, cfg + " -q" + sets + " --out " + tmp.file(name));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    paths.push_back({name, "", tmp.file(name + "/rank_0")});
  }
#endif
  const std::vector<double> want =
      testing::dummy_fedavg_model(kParams, kScale, std::vector<std::vector<int>>(kRounds, {0, 1, 2}));
  const std::string reference = paths.front().dir + "/global_model.safetensors";
  bool differs = false;
  EXPECT_TRUE(model_near(reference, want, c.tolerance, &differs)) << c.name;
  if (c.tolerance > 0) {
    EXPECT_TRUE(differs) << "a lossy run that rebuilt every element exactly compressed nothing";
  } else {
    EXPECT_TRUE(testing::model_equals(reference, want)) << "lossless compression must change nothing";
  }
  const std::vector<double> raw_down = bytes_column(tmp.file("plain"), "bytes_down");
  for (const auto& p : paths) {
    EXPECT_TRUE(same_model(reference, p.dir + "/global_model.safetensors")) << p.name;
    if (c.lossy_broadcast && p.name.starts_with("grpc")) {
      // The first broadcast goes as its bytes; each later one as frames of
      // its change, which every client rebuilt to the server's bits (or the
      // models above would differ).
      const std::vector<double> down = bytes_column(p.dir, "bytes_down");
      ASSERT_EQ(down.size(), static_cast<size_t>(kRounds)) << p.name;
      EXPECT_GE(down[0], raw_down[0]) << p.name;
      for (int r = 1; r < kRounds; ++r) {
        EXPECT_LT(down[static_cast<size_t>(r)], raw_down[static_cast<size_t>(r)] / 2)
            << p.name << " round " << r + 1 << ": bytes_down counts the frames on the wire";
      }
    }
    const std::vector<double> up = bytes_up(p.dir);
    ASSERT_EQ(up.size(), static_cast<size_t>(kRounds)) << p.name;
    for (int r = 0; r < kRounds; ++r) {
      const double got = up[static_cast<size_t>(r)], raw_bytes = raw_up[static_cast<size_t>(r)];
      if (c.tolerance > 0) {
        EXPECT_LT(got, raw_bytes / 2) << p.name << " round " << r + 1 << ": bytes_up counts the frames on the wire";
      } else {
        // Seeded random weights do not compress: each frame is its chunk
        // and a header, never more than the bound.
        const double chunks = std::ceil(static_cast<double>(kParams * 4) / 1007.0);
        EXPECT_LE(got, raw_bytes + kClients * chunks * static_cast<double>(kMaxFrameOverhead)) << p.name;
        EXPECT_GT(got, raw_bytes * 0.9) << p.name;
      }
    }
  }
}

// DummyTrainer's change for client c is s·(c+1)·(1 + (i + r) mod 5): its
// range over the tensor is 4·s·(c+1), largest for the last client.
constexpr double kRange = 4 * kScale * kClients;

INSTANTIATE_TEST_SUITE_P(
    Codecs, CompressedUpdates,
    ::testing::Values(CompressedCase{"sz3_rel",
                                     "      enable_compression: true\n      lossy_compressor: SZ3Compressor\n"
                                     "      lossless_compressor: zstd\n      error_bounding_mode: REL\n"
                                     "      error_bound: 0.01\n",
                                     kRounds * 0.01 * kRange},
                      // Error feedback: what each round lost comes back in the
                      // next, so the final model is off by the last round's
                      // residuals only — one round's bound, not kRounds' (its
                      // range grows by the residual: 1 + 2 × 0.01, rounded up).
                      CompressedCase{"sz3_rel_feedback",
                                     "      enable_compression: true\n      lossy_compressor: SZ3Compressor\n"
                                     "      error_bound: 0.01\n      error_feedback: true\n",
                                     1.05 * 0.01 * kRange},
                      // The broadcast as its change too: each of rounds 2 and 3
                      // starts from a model within the bound of the aggregate
                      // (the change's range is the mean update's, at most
                      // kRange, grown by the codec's error: 1.05), on top of
                      // the uploads' kRounds bounds.
                      CompressedCase{"sz3_rel_lossy_broadcast",
                                     "      enable_compression: true\n      lossy_compressor: SZ3Compressor\n"
                                     "      error_bound: 0.01\n      broadcast_compression: lossy\n",
                                     1.05 * (2 * kRounds - 1) * 0.01 * kRange, true},
                      CompressedCase{"zfp_abs",
                                     "      enable_compression: true\n      lossy_compressor: ZFPCompressor\n"
                                     "      lossless_compressor: blosc\n      error_bounding_mode: ABS\n"
                                     "      error_bound: 1e-4\n",
                                     kRounds * 1e-4},
                      CompressedCase{"lossless",
                                     "      enable_compression: true\n      lossy_compressor: none\n"
                                     "      lossless_compressor: zstd\n",
                                     0.0}),
    [](const auto& p) { return p.param.name; });

// A frame damaged on the way (its checksum no longer matches) is refused
// naming the client and the chunk's offset; that client is out and the
// rounds complete with the others, whose model is what the decoded frames
// give — the same as a run of those two clients alone.
TEST(CompressedUpdates, ABadFrameIsRefusedNamingClientAndChunkAndTheRoundGoesOn) {
#ifndef MEMFL_TEST_GRPC
  GTEST_SKIP() << "needs the gRPC transport";
#else
  testing::TempDir tmp;
  const std::string compressor =
      "      enable_compression: true\n      lossy_compressor: SZ3Compressor\n      error_bound: 0.01\n";
  const std::string cfg = write_config(tmp, "bad", compressor, 1007);
  setenv("MEMFL_FAULT", "bad_checksum", 1);
  setenv("MEMFL_FAULT_CLIENT", "2", 1);
  Result r = memfl_cli("launch " + cfg + " --clients 3 -q --out " + tmp.file("run"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_CLIENT");
  EXPECT_NE(r.exit_code, 0) << "the faulty client fails";
  std::ifstream in(tmp.file("run/server.log"));
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  // The fault alters the header of the upload's second chunk: offset 1007.
  EXPECT_NE(log.find("compressed frame from client_2 for the chunk at model offset 1007: checksum mismatch"),
            std::string::npos)
      << log;
  auto metrics = read_csv(tmp.file("run/server/metrics.csv"));
  ASSERT_EQ(metrics.size(), static_cast<size_t>(kRounds + 1)) << "every round completed";
  for (int round = 1; round <= kRounds; ++round) EXPECT_EQ(metrics[static_cast<size_t>(round)][1], "2");
  // The two healthy clients alone, over the same transport and codec.
  const std::string two = write_config(tmp, "two", compressor, 1007);
  std::string text = testing::read_file(two);
  text.replace(text.find("num_clients: 3"), 14, "num_clients: 2");
  std::ofstream(two) << text;
  Result alone = memfl_cli("launch " + two + " --clients 2 -q --out " + tmp.file("alone"));
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_TRUE(
      same_model(tmp.file("run/server/global_model.safetensors"), tmp.file("alone/server/global_model.safetensors")));
#endif
}

}  // namespace
}  // namespace memfl
