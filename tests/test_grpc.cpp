// Integration tests over gRPC on 127.0.0.1: real server and client processes
// started through `memfl launch`, as users run them.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "cli_util.h"
#include "dummy_oracle.h"
#include "compress/frame.h"
#include "model/llama.h"
#include "model/synthetic.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

namespace fs = std::filesystem;

std::string synthetic_config(const testing::TempDir& tmp, int clients, int64_t params, int64_t chunk,
                             const std::string& extra = "") {
  const std::string path = tmp.file("synthetic.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n"
                      << "  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: " << params
                      << "\nserver_configs:\n  num_clients: " << clients
                      << "\n  num_global_epochs: 2\n  round_timeout_s: 30\n"
                      << extra
                      << "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:0\n      model_chunk_size: "
                      << chunk << "\n";
  return path;
}

// The port a server started in the background writes to DIR/port once it
// listens ("" if it has not within 10 s).
std::string port_of_server(const std::string& server_dir) {
  std::string port;
  for (int i = 0; i < 200 && port.empty(); ++i) {
    std::ifstream in(server_dir + "/port");
    if (in) std::getline(in, port);
    if (port.empty()) usleep(50000);
  }
  return port;
}

int rows(const std::string& csv) { return static_cast<int>(read_csv(csv).size()) - 1; }

TEST(Grpc, CnnRunEqualsTheInProcessRunBitForBit) {
  testing::TempDir tmp;
  const std::string sets =
      " --set server_configs.num_clients=3 --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1500"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=500"
      " --set client_configs.train_configs.num_threads=1"
      " --set server_configs.comm_configs.grpc_configs.model_chunk_size=100000 -q";
  Result inproc = memfl_cli("run" + sets + " --out " + tmp.file("inproc"));
  ASSERT_EQ(inproc.exit_code, 0) << inproc.output;
  Result grpc = memfl_cli("launch --clients 3" + sets + " --out " + tmp.file("grpc"));
  ASSERT_EQ(grpc.exit_code, 0) << grpc.output;
  EXPECT_TRUE(
      same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("grpc/server/global_model.safetensors")));
  // Each role wrote its own files into the run directory.
  for (const char* role : {"server", "client_0", "client_1", "client_2"}) {
    EXPECT_TRUE(fs::exists(tmp.file(std::string("grpc/") + role + "/memory.json"))) << role;
  }
  EXPECT_EQ(rows(tmp.file("grpc/server/metrics.csv")), 2);
  auto acc = std::stod(read_csv(tmp.file("grpc/server/metrics.csv"))[2][7]);
  EXPECT_GT(acc, 0.3);
  // Server-side evaluation ran in the model worker, on the same model bytes:
  // the same test accuracy as in process; the server never mapped libtorch.
  EXPECT_EQ(read_csv(tmp.file("grpc/server/metrics.csv"))[2][7], read_csv(tmp.file("inproc/metrics.csv"))[2][7]);
  // The clients' training accuracy reaches the server's metrics (column 3),
  // weighted as in process: the same figure.
  const auto train_acc = read_csv(tmp.file("grpc/server/metrics.csv"))[2][3];
  EXPECT_GT(std::stod(train_acc), 0.3);
  EXPECT_EQ(train_acc, read_csv(tmp.file("inproc/metrics.csv"))[2][3]);
  std::ifstream summary(tmp.file("grpc/server/summary.json"));
  const std::string text((std::istreambuf_iterator<char>(summary)), {});
  EXPECT_NE(text.find("\"maps_libtorch\": false"), std::string::npos) << text;
  // A client that trains keeps its heap between batches (memory/malloc_policy.h).
  std::ifstream client_summary(tmp.file("grpc/client_0/summary.json"));
  const std::string client_text((std::istreambuf_iterator<char>(client_summary)), {});
  EXPECT_NE(client_text.find("\"malloc_policy\": \"training\""), std::string::npos) << client_text;
}

// DP-SGD over gRPC: each client process writes its own privacy.csv, and the
// ε for the same steps equals the in-process run's.
TEST(Grpc, DpClientsWriteTheirEpsilon) {
  testing::TempDir tmp;
  const std::string sets =
      std::string(" -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2") +
      " --set client_configs.train_configs.train_batch_size=64" +
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=640" +
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200" +
      " --set client_configs.train_configs.num_threads=1" +
      " --set server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:0";
  const std::string cfg = std::string(MEMFL_SOURCE_DIR) + "/configs/dp_fmnist_cnn_gn.yaml";
  Result g = memfl_cli("launch " + cfg + " --clients 2" + sets + " --out " + tmp.file("grpc"));
  ASSERT_EQ(g.exit_code, 0) << g.output;
  Result i = memfl_cli("run " + cfg + sets + " --out " + tmp.file("inproc"));
  ASSERT_EQ(i.exit_code, 0) << i.output;
  auto grpc_rows = read_csv(tmp.file("grpc/client_1/privacy.csv"));
  auto inproc_rows = read_csv(tmp.file("inproc/privacy.csv"));
  ASSERT_EQ(grpc_rows.size(), 3u);  // header + 2 rounds
  EXPECT_EQ(grpc_rows[2][1], "1");
  EXPECT_EQ(grpc_rows[2][2], inproc_rows[4][2]);  // steps of client 1 after round 2
  EXPECT_EQ(grpc_rows[2][5], inproc_rows[4][5]);  // and its ε
}

class GrpcChunks : public ::testing::TestWithParam<int64_t> {};

TEST_P(GrpcChunks, SyntheticRunEqualsInProcessAndNaive) {
  testing::TempDir tmp;
  const int64_t params = 2500;  // 10 000 bytes: 7-byte chunks are ~1 430 messages per transfer
  const std::string cfg = synthetic_config(tmp, 2, params, GetParam());
  ASSERT_EQ(memfl_cli("run " + cfg + " -q --out " + tmp.file("inproc")).exit_code, 0);
  // The chunks inside the stream (the default, auto, puts them on the data
  // channel: GrpcDataChannel below).
  const std::string stream = " --set server_configs.comm_configs.grpc_configs.data_channel=grpc";
  Result g = memfl_cli("launch " + cfg + " --clients 2 -q" + stream + " --out " + tmp.file("grpc"));
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_TRUE(
      same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("grpc/server/global_model.safetensors")));
  Result n = memfl_cli("launch " + cfg + " --clients 2 -q --set server_configs.memory_mode=naive" + stream + " --out " +
                       tmp.file("naive"));
  ASSERT_EQ(n.exit_code, 0) << n.output;
  EXPECT_TRUE(
      same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("naive/server/global_model.safetensors")));
}

INSTANTIATE_TEST_SUITE_P(SevenBytesAndLargerThanModel, GrpcChunks, ::testing::Values(7, 4096, 1 << 20),
                         [](const auto& p) { return "chunk_" + std::to_string(p.param); });

// Every fault of a hostile or broken client: the faulty client is dropped,
// the round is redone from the pre-round checkpoint (or completes without it,
// when nothing of its update was counted), and the global model is not
// corrupted. The healthy clients' DummyTrainer updates differ per client and
// round (dummy_update_scale), so the model is the FedAvg of exactly those
// two in every round, computed here (tests/dummy_oracle.h): an aggregator
// that dropped, double-counted or half-counted an update would miss it.
class GrpcFaults : public ::testing::TestWithParam<std::string> {};

void expect_faulty_client_never_corrupts_the_model(const std::string& fault, const std::string& sets) {
  testing::TempDir tmp;
  const int64_t params = 3000;
  const double scale = 0.01;
  const std::string cfg =
      synthetic_config(tmp, 3, params, 1000, "  aggregator_kwargs:\n    client_weights_mode: sample_size\n");
  setenv("MEMFL_FAULT", fault.c_str(), 1);
  setenv("MEMFL_FAULT_CLIENT", "2", 1);
  Result r = memfl_cli("launch " + cfg + " --clients 3 -q --set client_configs.train_configs.dummy_update_scale=" +
                       std::to_string(scale) + sets + " --out " + tmp.file("run"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_CLIENT");
  EXPECT_NE(r.exit_code, 0) << "the faulty client fails";
  EXPECT_NE(r.output.find("client_2 exited"), std::string::npos) << r.output;
  auto metrics = read_csv(tmp.file("run/server/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u) << "both rounds completed";
  EXPECT_EQ(metrics[1][1], "2") << "round 1 aggregated the two healthy clients";
  EXPECT_EQ(metrics[2][1], "2");
  EXPECT_TRUE(testing::model_equals(tmp.file("run/server/global_model.safetensors"),
                                    testing::dummy_fedavg_model(params, scale, {{0, 1}, {0, 1}})));
}

TEST_P(GrpcFaults, FaultyClientNeverCorruptsTheGlobalModel) {
  expect_faulty_client_never_corrupts_the_model(GetParam(),
                                                " --set server_configs.comm_configs.grpc_configs.data_channel=grpc");
}

// The same faults with the chunks on the TCP data channel (its headers are
// checked as the stream's frames are), and a client that opens the channel
// with a ticket that is not its session's.
class GrpcDataChannelFaults : public ::testing::TestWithParam<std::string> {};

TEST_P(GrpcDataChannelFaults, FaultyClientNeverCorruptsTheGlobalModel) {
  expect_faulty_client_never_corrupts_the_model(GetParam(),
                                                " --set server_configs.comm_configs.grpc_configs.data_channel=tcp");
}

INSTANTIATE_TEST_SUITE_P(Injected, GrpcDataChannelFaults,
                         ::testing::Values("disconnect_mid_upload", "bad_checksum", "wrong_layout_hash",
                                           "offset_past_end", "extra_bytes", "wrong_data_ticket"),
                         [](const auto& p) { return p.param; });

// grpc_configs.data_channel: tcp gives the in-process run's model bit for
// bit, streaming and naive, at chunk sizes that split the model unevenly
// (7 bytes: ~1 430 chunks a transfer) and one larger than the model; the
// server says it served the channel and each client that it used it.
class GrpcDataChannel : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(GrpcDataChannel, RunEqualsInProcessAndNaive) {
  testing::TempDir tmp;
  const auto [chunk, unix_socket] = GetParam();
  const std::string cfg = synthetic_config(tmp, 2, 2500, chunk);
  const std::string tcp =
      std::string(" --set server_configs.comm_configs.grpc_configs.data_channel=tcp") +
      (unix_socket ? "" : " --set server_configs.comm_configs.grpc_configs.data_channel_unix=false");
  ASSERT_EQ(memfl_cli("run " + cfg + " -q --out " + tmp.file("inproc")).exit_code, 0);
  Result g = memfl_cli("launch " + cfg + " --clients 2 -q" + tcp + " --out " + tmp.file("grpc"));
  ASSERT_EQ(g.exit_code, 0) << g.output;
  auto log = [&](const std::string& name) {
    std::ifstream in(tmp.file("grpc/" + name + ".log"));
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_NE(log("server").find("TCP data channel on port"), std::string::npos) << log("server");
  for (const char* c : {"client_0", "client_1"}) {
    EXPECT_NE(log(c).find("chunks travel on the data channel (server 127.0.0.1:"), std::string::npos) << log(c);
    EXPECT_NE(log(c).find(unix_socket ? "(data channel, unix socket)" : "(data channel port "), std::string::npos)
        << log(c);
    // A client that only moves a synthetic model streams: its heap is
    // trimmed above a few chunks (memory/malloc_policy.h).
    std::ifstream in(tmp.file(std::string("grpc/") + c + "/summary.json"));
    const std::string summary((std::istreambuf_iterator<char>(in)), {});
    EXPECT_NE(summary.find("\"malloc_policy\": \"streaming\""), std::string::npos) << summary;
  }
  EXPECT_TRUE(
      same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("grpc/server/global_model.safetensors")));
  Result n = memfl_cli("launch " + cfg + " --clients 2 -q --set server_configs.memory_mode=naive" + tcp + " --out " +
                       tmp.file("naive"));
  ASSERT_EQ(n.exit_code, 0) << n.output;
  EXPECT_TRUE(
      same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("naive/server/global_model.safetensors")));
}

INSTANTIATE_TEST_SUITE_P(SevenBytesAndLargerThanModel, GrpcDataChannel,
                         ::testing::Combine(::testing::Values(7, 4096, 1 << 20), ::testing::Bool()), [](const auto& p) {
                           return "chunk_" + std::to_string(std::get<0>(p.param)) +
                                  (std::get<1>(p.param) ? "_unix_socket" : "_tcp_port");
                         });

// The LLM path: a bf16 llama whose arenas are files (the server's global
// model is its checkpoint file, mapped; each round folds a running mean into
// the next round's file). The same faults leave the checkpoint whole: the
// next file is dropped and the round redone; nothing is left behind.
TEST_P(GrpcFaults, FileBackedLlamaCheckpointSurvivesTheFault) {
  testing::TempDir tmp;
  const std::string path = tmp.file("llama.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n"
                      << "  model_configs:\n    model_name: llama-tiny\n    model_kwargs:\n      dtype: bf16\n"
                      << "server_configs:\n  num_clients: 3\n  num_global_epochs: 2\n  round_timeout_s: 30\n"
                      << "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:0\n"
                      << "      model_chunk_size: 7777\nmemory_configs:\n  arena_backing: file\n";
  setenv("MEMFL_FAULT", GetParam().c_str(), 1);
  setenv("MEMFL_FAULT_CLIENT", "2", 1);
  Result r = memfl_cli("launch " + path + " --clients 3 -q --out " + tmp.file("run"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_CLIENT");
  EXPECT_NE(r.exit_code, 0) << "the faulty client fails";
  auto metrics = read_csv(tmp.file("run/server/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u) << "both rounds completed";
  EXPECT_EQ(metrics[2][1], "2");
  ModelConfig m;
  m.model_name = "llama-tiny";
  m.dtype = "bf16";
  auto layout = layout_without_network(m);
  ASSERT_TRUE(layout.ok());
  Arena initial(layout->total_bytes(), MemoryCategory::kModel);
  fill_synthetic(*layout, initial, 42);
  ASSERT_TRUE(write_safetensors(tmp.file("initial.safetensors"), *layout, initial).ok());
  EXPECT_TRUE(same_model(tmp.file("initial.safetensors"), tmp.file("run/server/global_model.safetensors")));
  auto file = SafetensorsFile::open(tmp.file("run/server/global_model.safetensors"));
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->metadata().at("round"), "2");
  EXPECT_FALSE(fs::exists(tmp.file("run/server/global_model.safetensors.next")));
  for (const char* d : {"server", "client_0", "client_1", "client_2"}) {
    for (const auto& f : fs::directory_iterator(tmp.file(std::string("run/") + d))) {
      EXPECT_EQ(f.path().string().find("memfl-arena"), std::string::npos) << "scratch file left: " << f.path();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Injected, GrpcFaults,
                         ::testing::Values("disconnect_mid_upload", "bad_checksum", "wrong_layout_hash",
                                           "offset_past_end", "extra_bytes"),
                         [](const auto& p) { return p.param; });

TEST(GrpcSecurity, WrongTokenIsRefusedAndTheRoundGoesOn) {
  testing::TempDir tmp;
  const std::string cfg2 = synthetic_config(tmp, 2, 1000, 1000);
  setenv("MEMFL_FAULT", "wrong_token", 1);
  setenv("MEMFL_FAULT_CLIENT", "1", 1);
  Result r = memfl_cli("launch " + cfg2 +
                       " --clients 2 -q --set server_configs.round_timeout_s=3"
                       " --set server_configs.comm_configs.grpc_configs.auth_token=s3cret --out " +
                       tmp.file("run"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_CLIENT");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("wrong token"), std::string::npos) << r.output;
  auto metrics = read_csv(tmp.file("run/server/metrics.csv"));
  ASSERT_EQ(metrics.size(), 3u) << r.output;
  EXPECT_EQ(metrics[1][1], "1") << "the round went on with the client that presented the token";
}

// With a token per client, holding one client's token does not let a peer
// register as another id; the owners of both ids then run the whole job.
TEST(GrpcSecurity, PerClientTokensKeepEachIdToItsOwner) {
  testing::TempDir tmp;
  const std::string tokens = tmp.file("tokens"), stolen = tmp.file("stolen");
  std::ofstream(tokens) << "# id token\n0 aaaaaaaaaaaaaaaa0000\n1 bbbbbbbbbbbbbbbb1111   # client 1\n";
  // The attacker holds client 1's token and claims id 0 with it.
  std::ofstream(stolen) << "0 bbbbbbbbbbbbbbbb1111\n";
  ASSERT_EQ(::chmod(tokens.c_str(), 0600), 0);
  const std::string cfg = synthetic_config(tmp, 2, 1000, 1000);
  const std::string key = " --set server_configs.comm_configs.grpc_configs.client_tokens_file=";
  const std::string server_dir = tmp.file("server");
  ASSERT_EQ(std::system((std::string(MEMFL_BINARY) + " server " + cfg + key + tokens +
                         " -q --set server_configs.round_timeout_s=20 --out " + server_dir + " > " +
                         tmp.file("server.log") + " 2>&1 & echo $! > " + tmp.file("server.pid"))
                            .c_str()),
            0);
  const std::string port = port_of_server(server_dir);
  ASSERT_FALSE(port.empty());
  const std::string uri = " --set server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:" + port;
  Result thief = memfl_cli("client " + cfg + " --client-id 0 -q" + key + stolen + uri + " --out " + tmp.file("thief"));
  EXPECT_NE(thief.exit_code, 0) << thief.output;
  EXPECT_NE(thief.output.find("client 0 from"), std::string::npos) << thief.output;
  EXPECT_NE(thief.output.find("wrong token"), std::string::npos) << thief.output;
  // A client whose file has no line for it is stopped before it connects.
  Result lineless = memfl_cli("client " + cfg + " --client-id 1 -q" + key + stolen + uri + " --out " + tmp.file("nl"));
  EXPECT_NE(lineless.exit_code, 0);
  EXPECT_NE(lineless.output.find("no line gives client 1 a token"), std::string::npos) << lineless.output;
  Result owners = run_shell(std::string(MEMFL_BINARY) + " client " + cfg + " --client-id 0 -q" + key + tokens + uri +
                            " --out " + tmp.file("c0") + " & " + MEMFL_BINARY + " client " + cfg + " --client-id 1 -q" +
                            key + tokens + uri + " --out " + tmp.file("c1") + "; wait; pid=$(cat " +
                            tmp.file("server.pid") + "); while kill -0 $pid 2>/dev/null; do sleep 0.1; done");
  EXPECT_EQ(owners.exit_code, 0) << owners.output;
  const std::string log = testing::read_file(tmp.file("server.log"));
  auto metrics = read_csv(server_dir + "/metrics.csv");
  ASSERT_EQ(metrics.size(), 3u) << log;
  EXPECT_EQ(metrics[1][1], "2") << "both owners took part: " << log;
  EXPECT_EQ(metrics[2][1], "2") << log;
  EXPECT_NE(log.find("client 0 from"), std::string::npos) << log;
  // The shared token still works, with a warning that it does not tell clients apart.
  Result both =
      memfl_cli("validate " + cfg + key + tokens + " --set server_configs.comm_configs.grpc_configs.auth_token=x");
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("auth_token' and 'client_tokens_file' are both set"), std::string::npos) << both.output;
}

TEST(GrpcSecurity, ASharedTokenIsWarnedAbout) {
  testing::TempDir tmp;
  const std::string cfg = synthetic_config(tmp, 1, 1000, 1000);
  Result r = memfl_cli("launch " + cfg +
                       " --clients 1 --set server_configs.num_global_epochs=1"
                       " --set server_configs.comm_configs.grpc_configs.auth_token=s3cret --out " +
                       tmp.file("run"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string log = testing::read_file(tmp.file("run/server.log"));
  EXPECT_NE(log.find("whoever holds it can register as any client id"), std::string::npos) << log;
}

// A gRPC server's bound includes its pool of chunk buffers for uploads
// (8 × (chunk + frame overhead)), 64 KiB per client session, and on the
// stream (data_channel: grpc) one chunk + 1 KiB per session more (the
// HTTP/2 window an upload may hold); memory_budget is checked against it,
// and the refusal says so, where the in-process server of the same config
// has no such term.
TEST(GrpcServerBound, TheUploadPoolAndTheSessionsCountAgainstTheMemoryBudget) {
  testing::TempDir tmp;
  const int64_t chunk = 1 << 20;
  const int clients = 3;
  const std::string cfg = synthetic_config(tmp, clients, 1 << 20, chunk);
  const std::string budget = " --set server_configs.memory_budget=1MiB";
  Result grpc = memfl_cli("server " + cfg + " -q" + budget + " --out " + tmp.file("s"));
  EXPECT_NE(grpc.exit_code, 0) << grpc.output;
  const int64_t pool = 8 * (chunk + static_cast<int64_t>(kMaxFrameOverhead));
  const std::string held = format_bytes(static_cast<double>(pool + clients * (64 << 10)));
  EXPECT_NE(grpc.output.find("with the transport's chunk buffers and sessions (" + held + ")"), std::string::npos)
      << grpc.output;
  EXPECT_FALSE(fs::exists(tmp.file("s/port"))) << "refused before it listened";
  Result stream = memfl_cli("server " + cfg + " -q" + budget +
                            " --set server_configs.comm_configs.grpc_configs.data_channel=grpc --out " + tmp.file("g"));
  EXPECT_NE(stream.exit_code, 0) << stream.output;
  const std::string on_stream = format_bytes(static_cast<double>(pool + clients * ((64 << 10) + chunk + 1024)));
  EXPECT_NE(stream.output.find("chunk buffers and sessions (" + on_stream + ")"), std::string::npos) << stream.output;
  Result inproc = memfl_cli("run " + cfg + " -q" + budget + " --out " + tmp.file("r"));
  EXPECT_NE(inproc.exit_code, 0) << inproc.output;
  EXPECT_NE(inproc.output.find("server_configs.memory_budget"), std::string::npos) << inproc.output;
  EXPECT_EQ(inproc.output.find("chunk buffers"), std::string::npos) << inproc.output;
}

TEST(GrpcSecurity, TlsWithASelfSignedPair) {
  testing::TempDir tmp;
  const std::string cert = tmp.file("server.pem"), key = tmp.file("server.key");
  const std::string openssl =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
      " -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
      key + " -out " + cert + " 2>/dev/null";
  ASSERT_EQ(std::system(openssl.c_str()), 0) << "openssl (Debian package openssl) makes the test pair";
  const std::string cfg = synthetic_config(tmp, 2, 5000, 4096);
  const std::string tls =
      " --set server_configs.comm_configs.grpc_configs.use_ssl=true"
      " --set server_configs.comm_configs.grpc_configs.server_cert=" +
      cert + " --set server_configs.comm_configs.grpc_configs.server_key=" + key +
      " --set server_configs.comm_configs.grpc_configs.root_cert=" + cert;
  Result r = memfl_cli("launch " + cfg + " --clients 2 -q" + tls + " --out " + tmp.file("tls"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(rows(tmp.file("tls/server/metrics.csv")), 2);
  ASSERT_EQ(memfl_cli("run " + cfg + " -q --out " + tmp.file("inproc")).exit_code, 0);
  EXPECT_TRUE(same_model(tmp.file("inproc/global_model.safetensors"), tmp.file("tls/server/global_model.safetensors")));
  // Under TLS the default (data_channel: auto) takes the chunks off the
  // encrypted stream only where they never leave the kernel: the Unix
  // socket of a client on the server's host. Each side's log says so.
  EXPECT_NE(testing::read_file(tmp.file("tls/server.log")).find("data channel on a Unix socket"), std::string::npos)
      << testing::read_file(tmp.file("tls/server.log"));
  for (const char* c : {"client_0", "client_1"}) {
    const std::string log = testing::read_file(tmp.file(std::string("tls/") + c + ".log"));
    EXPECT_NE(log.find("chunks travel on the data channel (server"), std::string::npos) << log;
    EXPECT_NE(log.find("(data channel, unix socket)"), std::string::npos) << log;
  }
  // A client that trusts another root cannot talk to this server.
  const std::string other = tmp.file("other.pem"), other_key = tmp.file("other.key");
  ASSERT_EQ(std::system(("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -keyout " + other_key +
                         " -out " + other + " 2>/dev/null")
                            .c_str()),
            0);
  const std::string server_dir = tmp.file("server");
  ASSERT_EQ(std::system((std::string(MEMFL_BINARY) + " server " + cfg + " -q" + tls +
                         " --set server_configs.num_clients=1 --set server_configs.round_timeout_s=4 --out " +
                         server_dir + " > " + tmp.file("server.log") + " 2>&1 &")
                            .c_str()),
            0);
  const std::string port = port_of_server(server_dir);
  ASSERT_FALSE(port.empty());
  Result bad = memfl_cli("client " + cfg + " --client-id 0 -q" + tls +
                         " --set server_configs.comm_configs.grpc_configs.root_cert=" + other +
                         " --set server_configs.comm_configs.grpc_configs.connect_timeout_s=2"
                         " --set server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:" +
                         port + " --out " + tmp.file("bad"));
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("cannot connect"), std::string::npos) << bad.output;
  Result missing = memfl_cli("client " + cfg + " --client-id 0 -q" + tls +
                             " --set server_configs.comm_configs.grpc_configs.root_cert=/nonexistent.pem --out " +
                             tmp.file("missing"));
  EXPECT_EQ(missing.exit_code, 3) << missing.output;
  EXPECT_NE(missing.output.find("root_cert"), std::string::npos) << missing.output;
  // The server gives up on the client that never came, with a message.
  for (int i = 0; i < 200 && !fs::exists(server_dir + "/summary.json"); ++i) usleep(50000);
  EXPECT_TRUE(fs::exists(server_dir + "/summary.json"));
}

}  // namespace
}  // namespace memfl
