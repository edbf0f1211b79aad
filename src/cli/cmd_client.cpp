// memfl client: one federated client over gRPC.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "io/run_dir.h"
#include "memory/alloc_tracker.h"
#include "roles/grpc_roles.h"

namespace memfl::cli {

namespace {

int client(SharedOptions& o, int client_id) {
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  const std::string role = "client_" + std::to_string(client_id);
  std::string dir = o.out_dir;
  if (dir.empty()) dir = fmt::format("runs/{}-{}", role, getpid());
  std::error_code dir_ec;
  std::filesystem::create_directories(dir, dir_ec);
  if (dir_ec) return fail(memfl::invalid_argument("--out {}: cannot create it: {}", dir, dir_ec.message()));
  spdlog::set_pattern(fmt::format("[%H:%M:%S.%e] [{}] [%l] %v", role));
  memfl::Status st = memfl::write_text_file(dir + "/config.yaml", cfg->resolved_yaml);
  start_profiler(*cfg, dir, role);
  if (st.ok()) st = memfl::run_grpc_client(*cfg, client_id, {dir, !o.quiet});
  memfl::alloc_tracker_stop();
  if (!st.ok()) return fail(st);
  return kExitOk;
}

}  // namespace

CommandFn add_client(CLI::App& cmd, SharedOptions& shared) {
  auto client_id = std::make_shared<int>(-1);
  cmd.add_option("CONFIG", shared.config_path,
                 "YAML config: how to reach the server (the server sends the experiment)");
  cmd.add_option("--client-id", *client_id, "this client's id, 0..num_clients-1")->required();
  cmd.add_option("--out", shared.out_dir, "run directory");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  cmd.add_flag("-q,--quiet", shared.quiet, "quiet");
  cmd.add_flag("--profile", shared.profile, "record allocations with stacks (profile.bin)");
  return [&shared, client_id](int&, char**&) { return client(shared, *client_id); };
}

}  // namespace memfl::cli
