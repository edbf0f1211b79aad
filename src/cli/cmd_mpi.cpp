// memfl mpi: a rank of an MPI job (mpirun -np N+1 memfl mpi CONFIG; rank 0 is
// the server).
#include <CLI/CLI.hpp>
#include <unistd.h>

#include "cli/commands.h"
#include "roles/mpi_roles.h"

namespace memfl::cli {

namespace {

int mpi(SharedOptions& o, int& argc, char**& argv) {
  if (!o.resume_dir.empty() && o.config_path.empty()) o.config_path = o.resume_dir + "/rank_0/config.yaml";
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  if (!o.resume_dir.empty()) {
    if (memfl::Status c = check_resume(o.resume_dir + "/rank_0/config.yaml", *cfg); !c.ok()) return fail(c);
  }
  std::string dir = !o.resume_dir.empty() ? o.resume_dir
                    : o.out_dir.empty()   ? fmt::format("runs/mpi-{}", getpid())
                                          : o.out_dir;
  // The live endpoint lives on rank 0 (the server) only, until the job ends.
  std::unique_ptr<memfl::LiveEndpoint> http;
  std::string http_dir;
  memfl::MpiOptions mo{dir, !o.quiet, !o.resume_dir.empty(), {}};
  if (!o.http.empty()) {
    mo.on_server_start = [&](const std::string& rank0_dir) -> memfl::Status {
      http_dir = rank0_dir;
      MEMFL_ASSIGN_OR_RETURN(http, start_http(o, "server", rank0_dir, cfg->server.use_ssl));
      return memfl::Status::Ok();
    };
  }
  memfl::Status st = memfl::run_mpi(&argc, &argv, *cfg, mo);
  stop_http(http, http_dir);
  if (!st.ok()) return fail(st);
  return kExitOk;
}

}  // namespace

CommandFn add_mpi(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--out", shared.out_dir, "run directory (rank_0/, rank_1/, ...)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  cmd.add_flag("-q,--quiet", shared.quiet, "no per-round progress lines");
  cmd.add_option("--resume", shared.resume_dir,
                 "continue the MPI run in DIR (config: DIR/rank_0/config.yaml unless CONFIG is given)");
  cmd.add_flag("--profile", shared.profile, "record allocations with stacks (profile.bin per rank)");
  add_http_options(cmd, shared);  // rank 0's endpoint
  return [&shared](int& argc, char**& argv) { return mpi(shared, argc, argv); };
}

}  // namespace memfl::cli
