// memfl launch: a server and N client processes started here, their run
// directories gathered under one.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "default_config.h"
#include "io/run_dir.h"
#include "roles/grpc_roles.h"

namespace memfl::cli {

namespace {

int launch(SharedOptions& o, int num_clients) {
  if (memfl::Status st = check_http_exposure(o); !st.ok()) return fail(st);  // before any process starts
  std::string path = o.config_path;
  std::string dir = o.out_dir.empty() ? fmt::format("runs/launch-{}", getpid()) : o.out_dir;
  // A second launch into one --out would find the first run's port file and
  // state: refuse it rather than mix two runs.
  if (std::filesystem::exists(dir + "/server/metrics.csv") || std::filesystem::exists(dir + "/server/state")) {
    return fail(memfl::invalid_argument(
        "run directory {} already holds a launched run; choose another --out (or resume its server with "
        "`memfl server --resume {}/server`)",
        dir, dir));
  }
  if (path.empty()) {  // the clients and server read the embedded default from a file
    std::error_code dir_ec;
    std::filesystem::create_directories(dir, dir_ec);
    if (dir_ec) return fail(memfl::invalid_argument("--out {}: cannot create it: {}", dir, dir_ec.message()));
    path = dir + "/config.yaml";
    memfl::Status w = memfl::write_text_file(path, memfl::kDefaultConfigYaml);
    if (!w.ok()) return fail(w);
  }
  auto cfg = load(path, o.sets);  // fail before starting any process
  if (!cfg.ok()) return fail(cfg.status());
  std::vector<std::string> server_args;
  if (!o.http.empty()) server_args = {"--http", o.http};
  if (o.http_insecure_bind) server_args.push_back("--http-insecure-bind");
  // The token reaches the server through its environment, not its command line.
  if (!o.http_token.empty()) setenv("MEMFL_HTTP_TOKEN", o.http_token.c_str(), 1);
  memfl::Status st = memfl::run_launch(path, o.sets, num_clients, dir, !o.quiet, server_args);
  if (!st.ok()) return fail(st);
  fmt::print("launch: server and {} clients finished — {}\n", num_clients, dir);
  return kExitOk;
}

}  // namespace

CommandFn add_launch(CLI::App& cmd, SharedOptions& shared) {
  auto num_clients = std::make_shared<int>(0);
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--clients", *num_clients, "number of client processes")->required();
  cmd.add_option("--out", shared.out_dir, "run directory (server/, client_0/, ...)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  cmd.add_flag("-q,--quiet", shared.quiet, "no per-round progress lines");
  cmd.add_flag("--profile", shared.profile, "profile every process (profile.bin in each run dir)");
  add_http_options(cmd, shared);  // the server's endpoint
  return [&shared, num_clients](int&, char**&) { return launch(shared, *num_clients); };
}

}  // namespace memfl::cli
