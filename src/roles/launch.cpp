// `memfl launch`: one server and N client processes on this machine, as
// APPFL's run_*_experiment.sh scripts start them, gathered into one run dir.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "roles/grpc_roles.h"
#include "io/process.h"
#include "io/run_dir.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return nullptr;
  try {
    return nlohmann::json::parse(in);
  } catch (...) {
    return nullptr;
  }
}

}  // namespace

Status run_launch(const std::string& config_path, const std::vector<std::string>& sets, int num_clients,
                  const std::string& run_dir, bool progress, const std::vector<std::string>& server_args) {
  if (num_clients < 1) return invalid_argument("--clients must be at least 1, got {}", num_clients);
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return invalid_argument("cannot create run directory {}: {}", run_dir, ec.message());
  const std::string exe = self_executable();
  std::vector<std::string> common = {config_path};
  bool uri_set = false;
  for (const auto& s : sets) {
    common.push_back("--set");
    common.push_back(s);
    // A fixed address is the user's; port 0 means "any free port", which the
    // clients then learn from the server like the default.
    if (s.rfind("server_configs.comm_configs.grpc_configs.server_uri=", 0) == 0 && !s.ends_with(":0")) uri_set = true;
  }
  common.push_back("--set");
  common.push_back(fmt::format("server_configs.num_clients={}", num_clients));
  if (!progress) common.push_back("-q");

  std::vector<std::string> server_argv = {exe, "server"};
  server_argv.insert(server_argv.end(), common.begin(), common.end());
  if (!uri_set) {
    // Any free port on loopback, so runs never collide; clients learn it below.
    server_argv.insert(server_argv.end(), {"--set", "server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:0"});
  }
  const fs::path server_dir = fs::path(run_dir) / "server";
  server_argv.insert(server_argv.end(), {"--out", server_dir.string()});
  // Every client runs here beside the server, a model each.
  server_argv.insert(server_argv.end(), {"--colocated-clients", std::to_string(num_clients)});
  server_argv.insert(server_argv.end(), server_args.begin(), server_args.end());
  MEMFL_ASSIGN_OR_RETURN(pid_t server,
                         spawn_process(server_argv, {.log_path = (fs::path(run_dir) / "server.log").string()}));

  // The server writes the port it bound once it listens.
  std::string port;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (port.empty()) {
    std::ifstream in(server_dir / "port");
    if (in) std::getline(in, port);
    int status = 0;
    if (port.empty() && waitpid(server, &status, WNOHANG) == server) {
      return internal_error("the server exited with code {} before listening; its log ({}):\n{}", exit_code(status),
                            (fs::path(run_dir) / "server.log").string(),
                            tail_of_file((fs::path(run_dir) / "server.log").string()));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(server, SIGTERM);
      return internal_error("the server did not listen within 120 s");
    }
    if (port.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The server starts its live endpoint before it listens for clients.
  if (std::ifstream http(server_dir / "http_address"); http) {
    std::string address;
    std::getline(http, address);
    fmt::print("launch: live page http://{}/ (metrics: http://{}/metrics)\n", address, address);
    std::fflush(stdout);
  }
  std::vector<pid_t> clients;
  for (int i = 0; i < num_clients; ++i) {
    std::vector<std::string> argv = {exe, "client"};
    argv.insert(argv.end(), common.begin(), common.end());
    if (!uri_set) {
      argv.insert(argv.end(), {"--set", "server_configs.comm_configs.grpc_configs.server_uri=127.0.0.1:" + port});
    }
    argv.insert(argv.end(), {"--client-id", std::to_string(i), "--out",
                             (fs::path(run_dir) / fmt::format("client_{}", i)).string()});
    auto pid = spawn_process(argv, {.log_path = (fs::path(run_dir) / fmt::format("client_{}.log", i)).string()});
    if (!pid.ok()) {
      kill(server, SIGTERM);
      for (pid_t c : clients) kill(c, SIGTERM);
      return pid.status();
    }
    clients.push_back(*pid);
  }
  nlohmann::ordered_json summary;
  summary["run_dir"] = run_dir;
  summary["clients"] = num_clients;
  std::string failures;
  for (int i = 0; i < num_clients; ++i) {
    int status = 0;
    waitpid(clients[static_cast<size_t>(i)], &status, 0);
    const int code = exit_code(status);
    const std::string name = fmt::format("client_{}", i);
    summary["roles"][name]["exit_code"] = code;
    auto s = read_json(fs::path(run_dir) / name / "summary.json");
    if (!s.is_null()) summary["roles"][name]["peak_rss_bytes"] = s["peak_rss_bytes"];
    if (code != 0) {
      failures += fmt::format("\n{} exited with code {}: {}", name, code,
                              tail_of_file((fs::path(run_dir) / (name + ".log")).string()));
    }
  }
  int status = 0;
  waitpid(server, &status, 0);
  const int server_code = exit_code(status);
  summary["roles"]["server"]["exit_code"] = server_code;
  auto s = read_json(server_dir / "summary.json");
  if (!s.is_null()) {
    summary["roles"]["server"]["peak_rss_bytes"] = s["peak_rss_bytes"];
    summary["model_bytes"] = s["model_bytes"];
    summary["final_test_accuracy"] = s["final_test_accuracy"];
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  if (server_code != 0) {
    return internal_error("the server exited with code {}: {}{}", server_code,
                          tail_of_file((fs::path(run_dir) / "server.log").string()), failures);
  }
  if (!failures.empty()) return internal_error("some clients failed (the server finished):{}", failures);
  return Status::Ok();
}

}  // namespace memfl
