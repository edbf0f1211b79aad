// memfl server: the federated server over gRPC.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>

#include "cli/commands.h"
#include "io/run_dir.h"
#include "memory/alloc_tracker.h"
#include "roles/grpc_roles.h"

namespace memfl::cli {

namespace {

int server(SharedOptions& o) {
  if (!o.resume_dir.empty() && o.config_path.empty()) o.config_path = o.resume_dir + "/config.yaml";
  if (!o.resume_dir.empty()) o.out_dir = o.resume_dir;
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  if (!o.resume_dir.empty()) {
    if (memfl::Status c = check_resume(o.resume_dir + "/config.yaml", *cfg); !c.ok()) return fail(c);
  }
  std::string dir = o.out_dir;
  if (dir.empty()) dir = fmt::format("runs/server-{}", getpid());
  // A used run directory holds a run's committed state: starting afresh
  // there would overwrite its checkpoint and metrics. --resume continues it.
  if (o.resume_dir.empty() &&
      (std::filesystem::exists(dir + "/metrics.csv") || std::filesystem::exists(dir + "/state"))) {
    return fail(memfl::invalid_argument(
        "run directory {} already holds a server run (metrics.csv, state/); continue it with --resume {}, or "
        "choose another --out",
        dir, dir));
  }
  std::error_code dir_ec;
  std::filesystem::create_directories(dir, dir_ec);
  if (dir_ec) return fail(memfl::invalid_argument("--out {}: cannot create it: {}", dir, dir_ec.message()));
  auto lock = memfl::RunDirLock::acquire(dir);
  if (!lock.ok()) return fail(lock.status());
  spdlog::set_pattern("[%H:%M:%S.%e] [server] [%l] %v");
  memfl::Status st = memfl::write_text_file(dir + "/config.yaml", cfg->resolved_yaml);
  start_profiler(*cfg, dir, "server");
  cfg->colocated_model_copies = o.colocated_clients;
  auto http = start_http(o, "server", dir, cfg->server.use_ssl);
  if (!http.ok()) return fail(http.status());
  if (st.ok()) st = memfl::run_grpc_server(*cfg, {dir, !o.quiet, !o.resume_dir.empty()});
  stop_http(*http, dir);
  memfl::alloc_tracker_stop();
  if (!st.ok()) return fail(st);
  return kExitOk;
}

}  // namespace

CommandFn add_server(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--out", shared.out_dir, "run directory");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  cmd.add_flag("-q,--quiet", shared.quiet, "no per-round progress lines");
  cmd.add_option("--resume", shared.resume_dir, kResumeDoc);
  cmd.add_flag("--profile", shared.profile, "record allocations with stacks (profile.bin)");
  add_http_options(cmd, shared);
  cmd.add_option("--colocated-clients", shared.colocated_clients,
                 "client processes on this host, each holding a model (memfl launch passes it): the "
                 "accumulator's auto choice leaves room for them")
      ->check(CLI::NonNegativeNumber);
  return [&shared](int&, char**&) { return server(shared); };
}

}  // namespace memfl::cli
