// `memfl bench transfer`: a server and N DummyTrainer clients of a synthetic
// model, 2 rounds, and what each role's peak RSS and each direction's
// throughput were. Measures transfer and aggregation memory with no training
// in the way.
#include "experiments/bench_transfer.h"

#include "io/process.h"

#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "roles/grpc_roles.h"
#include "tensor/dtype.h"
#include "io/run_dir.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {
nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}
}  // namespace

StatusOr<std::string> run_bench_transfer(const TransferBenchOptions& o) {
  if (o.transport != "grpc" && o.transport != "mpi") {
    return invalid_argument("--transport must be grpc or mpi, got '{}'", o.transport);
  }
  const auto dtype = dtype_from_name(o.dtype);
  if (!dtype || !dtype_is_float(*dtype)) return invalid_argument("--dtype must be f32, bf16 or f16, got '{}'", o.dtype);
  if (o.mpi_path != "shared_ring" && o.mpi_path != "point_to_point") {
    return invalid_argument("--mpi-path must be shared_ring or point_to_point, got '{}'", o.mpi_path);
  }
  if (o.data_channel != "auto" && o.data_channel != "grpc" && o.data_channel != "tcp" && o.data_channel != "unix") {
    return invalid_argument("--data-channel must be auto, grpc, tcp or unix, got '{}'", o.data_channel);
  }
  if (o.model_mb <= 0 || o.clients < 1 || o.chunk_mb <= 0) {
    return invalid_argument("--model-mb, --clients and --chunk-mb must be positive");
  }
  const int64_t model_bytes = static_cast<int64_t>(o.model_mb * (1 << 20));
  const int64_t num_params = model_bytes / static_cast<int64_t>(dtype_size(*dtype));
  const int64_t chunk = static_cast<int64_t>(o.chunk_mb * (1 << 20));
  const std::string dir = o.run_dir.empty() ? fmt::format("/tmp/memfl_bench_transfer_{}", getpid()) : o.run_dir;
  std::error_code ec;
  if (!o.run_dir.empty() && fs::exists(dir) && !fs::is_empty(dir, ec)) {
    // --keep names where to keep this run, not what to delete.
    return invalid_argument("--keep {}: the directory is not empty; name a new or empty one", dir);
  }
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return invalid_argument("--keep {}: cannot create it: {}", dir, ec.message());
  const std::string config = (fs::path(dir) / "bench.yaml").string();
  MEMFL_RETURN_IF_ERROR(
      write_text_file(config, fmt::format(R"(client_configs:
  train_configs:
    trainer: DummyTrainer
    dummy_delay_s: "{}"
  model_configs:
    model_name: synthetic
    model_kwargs:
      num_params: {}
      dtype: {}
server_configs:
  num_clients: {}
  num_global_epochs: 2
  do_server_eval: false
  memory_mode: {}
  aggregator: {}
  round_timeout_s: 600
  mpi_shared_memory: {}
  comm_configs:
    grpc_configs:
      server_uri: 127.0.0.1:0
      model_chunk_size: {}
      data_channel: {}
      data_channel_unix: {}
memory_configs:
  arena_backing: {}
)",
                                          o.dummy_delays, num_params, o.dtype, o.clients, o.memory_mode, o.aggregator,
                                          o.mpi_path == "shared_ring", chunk,
                                          o.data_channel == "grpc" || o.data_channel == "auto" ? o.data_channel : "tcp",
                                          o.data_channel == "unix" || o.data_channel == "auto", o.arena_backing)));
  std::string server_dir = (fs::path(dir) / "server").string();
  std::string client_prefix = "client_";
  int client_base = 0;
  auto client_dir = [&](int i) {
    return (fs::path(dir) / fmt::format("{}{}", client_prefix, i + client_base)).string();
  };
  if (o.transport == "grpc") {
    MEMFL_RETURN_IF_ERROR(run_launch(config, {}, o.clients, dir, false));
  } else {
    // mpirun as root and with more ranks than cores needs saying so. Ranks
    // are not bound to cores: with as many ranks as cores OpenMPI binds each
    // to one, and the server's fold worker would share its MPI thread's core.
    const std::string exe = self_executable();
    const std::string cmd = fmt::format(
        "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np {} --oversubscribe --bind-to none {} mpi "
        "{} -q --out {} "
        "> {}/mpirun.log 2>&1",
        o.clients + 1, exe, config, dir, dir);
    if (std::system(cmd.c_str()) != 0) {
      return internal_error("mpirun failed; see {}/mpirun.log", dir);
    }
    server_dir = (fs::path(dir) / "rank_0").string();
    client_prefix = "rank_";
    client_base = 1;
  }

  auto server = read_json(fs::path(server_dir) / "summary.json");
  nlohmann::ordered_json j;
  j["transport"] = o.transport;
  j["memory_mode"] = o.memory_mode;
  j["aggregator"] = o.aggregator;
  j["arena_backing"] = o.arena_backing;
  if (o.transport == "grpc") j["data_channel"] = o.data_channel;
  j["dtype"] = o.dtype;
  j["model_bytes"] = server["model_bytes"];
  j["clients"] = o.clients;
  j["chunk_bytes"] = chunk;
  if (!o.dummy_delays.empty()) j["dummy_delay_s"] = o.dummy_delays;
  if (server.contains("chunk_path")) j["chunk_path"] = server["chunk_path"];  // MPI: shared_ring | point_to_point
  j["server_peak_rss_bytes"] = server["peak_rss_bytes"];
  // At the peak, how much was anonymous memory and how much file pages (a
  // file-backed server's model and optimizer state are mapped files).
  if (fs::exists(fs::path(server_dir) / "memory.json")) {
    auto mem = read_json(fs::path(server_dir) / "memory.json");
    j["server_peak_anon_bytes"] = mem.value("peak_rss_anon_bytes", int64_t{0});
    j["server_peak_file_bytes"] = mem.value("peak_rss_file_bytes", int64_t{0});
  }
  j["server_baseline_rss_bytes"] = server["baseline_rss_bytes"];
  int64_t client_peak = 0, client_baseline = 0;
  for (int i = 0; i < o.clients; ++i) {
    auto c = read_json(fs::path(client_dir(i)) / "summary.json");
    client_peak = std::max(client_peak, c["peak_rss_bytes"].get<int64_t>());
    client_baseline = std::max(client_baseline, c["baseline_rss_bytes"].get<int64_t>());
  }
  j["client_peak_rss_bytes"] = client_peak;
  j["client_baseline_rss_bytes"] = client_baseline;
  // Rounds from the server's metrics.csv.
  std::ifstream csv(fs::path(server_dir) / "metrics.csv");
  std::string line;
  std::getline(csv, line);
  double round_s = 0, down_gbps = 0, up_gbps = 0, commit_s = 0;
  int n = 0;
  nlohmann::json rounds = nlohmann::json::array();
  while (std::getline(csv, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) f.push_back(cell);
    if (f.size() < 15) continue;
    const double rs = std::stod(f[9]), ds = std::stod(f[11]), us = std::stod(f[12]);
    const double bd = std::stod(f[13]), bu = std::stod(f[14]);
    const double dg = ds > 0 ? bd / ds / 1e9 : 0, ug = us > 0 ? bu / us / 1e9 : 0;
    const double cs = f.size() > 16 ? std::stod(f[16]) : 0.0;  // the state commit, outside round_seconds
    rounds.push_back({{"round_seconds", rs}, {"download_gbps", dg}, {"upload_gbps", ug}, {"commit_seconds", cs}});
    round_s += rs;
    commit_s += cs;
    down_gbps += dg;
    up_gbps += ug;
    ++n;
  }
  if (n == 0) return internal_error("{}: the server recorded no round", dir);
  j["round_seconds"] = round_s / n;
  j["commit_seconds"] = commit_s / n;
  j["download_gbps"] = down_gbps / n;
  j["upload_gbps"] = up_gbps / n;
  j["rounds"] = rounds;
  const double m = j["model_bytes"].get<double>();
  const double slack = 64.0 * (1 << 20);
  j["server_peak_over_model"] = j["server_peak_rss_bytes"].get<double>() / m;
  j["client_peak_over_model"] = static_cast<double>(client_peak) / m;
  // The goal: peak ≤ 1.05 × model + 64 MiB per role.
  j["server_within_bound"] = j["server_peak_rss_bytes"].get<double>() <= 1.05 * m + slack;
  j["client_within_bound"] = static_cast<double>(client_peak) <= 1.05 * m + slack;
  j["run_dir"] = dir;
  const std::string text = j.dump(2) + "\n";
  if (!o.json_out.empty()) MEMFL_RETURN_IF_ERROR(write_text_file(o.json_out, text));
  if (o.run_dir.empty()) fs::remove_all(dir, ec);
  return text;
}

}  // namespace memfl
