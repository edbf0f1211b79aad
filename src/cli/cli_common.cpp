#include "cli/cli_common.h"

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "default_config.h"
#include "io/run_dir.h"
#include "memory/alloc_tracker.h"

namespace memfl::cli {

int exit_code_for(const memfl::Status& s) {
  switch (s.code()) {
    case memfl::StatusCode::kOk:
      return kExitOk;
    case memfl::StatusCode::kInvalidArgument:
      return kExitUsage;
    case memfl::StatusCode::kNotFound:
      return kExitMissing;
    default:
      return kExitRunFailed;
  }
}

int fail(const memfl::Status& s) {
  fmt::print(stderr, "memfl: error: {}\n", s.message());
  return exit_code_for(s);
}

void start_profiler(const memfl::ExperimentConfig& cfg, const std::string& dir, const std::string& role) {
  if (!cfg.memory.profile) return;
  if (!memfl::alloc_tracker_start(dir + "/profile.bin", role, static_cast<size_t>(cfg.memory.profile_threshold))) {
    fmt::print(stderr,
               "memfl: warning: the allocation tracker is not available in this build (sanitizers?) or {} "
               "cannot be written; running without it\n",
               dir + "/profile.bin");
  }
}

memfl::StatusOr<memfl::ExperimentConfig> load(const std::string& path, const std::vector<std::string>& sets) {
  if (path.empty()) return memfl::load_config_text(memfl::kDefaultConfigYaml, memfl::kDefaultConfigName, sets);
  return memfl::load_config_file(path, sets);
}

memfl::Status make_out_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return memfl::invalid_argument("--out {}: cannot create it: {}", dir,
                                   ec ? ec.message() : std::string("not a directory"));
  }
  return memfl::Status::Ok();
}

memfl::Status check_target(double t, const std::string& text) {
  if (std::isfinite(t) && t > 0 && t <= 1) return memfl::Status::Ok();
  return memfl::invalid_argument("--target: '{}' is not an accuracy in (0, 1]", text);
}

memfl::Status check_resume(const std::string& committed_path, const memfl::ExperimentConfig& cfg) {
  auto committed = memfl::load_config_file(committed_path);
  if (!committed.ok()) return committed.status().with_context("--resume");
  return memfl::check_resume_config(committed->resolved_yaml, committed_path, cfg);
}

void add_http_options(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("--http", shared.http,
                 "serve /metrics (Prometheus), /healthz and a live page on ADDR:PORT (a bare PORT: 127.0.0.1; port 0 "
                 "picks a free one, logged and written to RUN_DIR/http_address)");
  cmd.add_option("--http-token", shared.http_token,
                 "require `Authorization: Bearer TOKEN` on --http (default: $MEMFL_HTTP_TOKEN; /healthz stays open)");
  cmd.add_flag("--http-insecure-bind", shared.http_insecure_bind,
               "allow --http on an address off loopback without --http-token (anyone who reaches it reads the "
               "metrics and the live page)");
}

namespace {
// The host part of --http's ADDR:PORT (a bare PORT means 127.0.0.1).
bool http_on_loopback(const std::string& addr) {
  const auto colon = addr.rfind(':');
  std::string host = colon == std::string::npos ? "" : addr.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host.empty() || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// --http-token, or the environment's, so a token need not sit on a command line (ps).
std::string http_token(const SharedOptions& o) {
  if (const char* env = std::getenv("MEMFL_HTTP_TOKEN"); o.http_token.empty() && env != nullptr) return env;
  return o.http_token;
}
}  // namespace

memfl::Status check_http_exposure(const SharedOptions& o) {
  if (o.http.empty() || o.http_insecure_bind || http_on_loopback(o.http) || !http_token(o).empty()) {
    return memfl::Status::Ok();
  }
  return memfl::invalid_argument(
      "--http {}: an address off loopback with no token lets anyone who can reach this host read the run's "
      "metrics and live page; give --http-token (or $MEMFL_HTTP_TOKEN), bind 127.0.0.1 and reach it through an "
      "SSH tunnel, or pass --http-insecure-bind if an open endpoint is meant",
      o.http);
}

memfl::StatusOr<std::unique_ptr<memfl::LiveEndpoint>> start_http(const SharedOptions& o, const std::string& role,
                                                                 const std::string& dir, bool tls) {
  if (o.http.empty()) return std::unique_ptr<memfl::LiveEndpoint>();
  if (tls && !http_on_loopback(o.http)) {
    return memfl::invalid_argument(
        "--http {}: the gRPC transport uses TLS (server_configs.comm_configs.grpc_configs.use_ssl) and the live "
        "endpoint speaks plain HTTP; bind it to 127.0.0.1 and reach it through an SSH tunnel or a TLS proxy",
        o.http);
  }
  MEMFL_RETURN_IF_ERROR(check_http_exposure(o));
  const std::string token = http_token(o);
  MEMFL_ASSIGN_OR_RETURN(auto ep, memfl::LiveEndpoint::start({o.http, token, role}));
  spdlog::info("live: http://{}/ (metrics at /metrics, health at /healthz{})", ep->address(),
               token.empty() ? "" : "; needs the bearer token");
  MEMFL_RETURN_IF_ERROR(memfl::write_text_file(dir + "/http_address", ep->address() + "\n"));
  return ep;
}

void stop_http(std::unique_ptr<memfl::LiveEndpoint>& endpoint, const std::string& dir) {
  if (!endpoint) return;
  if (memfl::Status st = endpoint->freeze(dir); !st.ok()) spdlog::warn("live page not frozen: {}", st.message());
  endpoint.reset();
}

}  // namespace memfl::cli
