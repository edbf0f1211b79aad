// memfl run: an in-process federated simulation (server + virtual clients).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <cmath>

#include "cli/commands.h"
#include "io/run_dir.h"
#include "memory/alloc_tracker.h"
#include "roles/simulation.h"
#include "tensor/layout.h"

namespace memfl::cli {

namespace {

int run(SharedOptions& o) {
  const bool resume = !o.resume_dir.empty();
  if (resume && o.config_path.empty()) o.config_path = o.resume_dir + "/config.yaml";
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  if (resume) {
    if (memfl::Status c = check_resume(o.resume_dir + "/config.yaml", *cfg); !c.ok()) return fail(c);
  }
  auto dir = resume ? memfl::StatusOr<std::string>(o.resume_dir) : memfl::prepare_run_dir(o.out_dir, *cfg);
  if (!dir.ok()) return fail(dir.status());
  auto lock = memfl::RunDirLock::acquire(*dir);
  if (!lock.ok()) return fail(lock.status());
  memfl::Status st = resume ? memfl::Status::Ok()
                            : memfl::write_text_file(*dir + "/config.yaml",
                                                     "# resolved from " + cfg->source + "\n" + cfg->resolved_yaml);
  if (!st.ok()) return fail(st);
  spdlog::set_pattern("[%H:%M:%S.%e] [%l] %v");
  spdlog::info("run directory {}", *dir);
  start_profiler(*cfg, *dir, "simulation");
  auto http = start_http(o, "simulation", *dir);
  if (!http.ok()) return fail(http.status());
  auto result = memfl::run_simulation(*cfg, {*dir, !o.quiet, resume});
  stop_http(*http, *dir);  // the loop is over: freeze the page, stop serving before the summary
  memfl::alloc_tracker_stop();
  if (!result.ok()) {
    fmt::print(stderr, "memfl: run failed; what was measured so far is in {}\n", *dir);
    return fail(result.status());
  }
  // An asynchronous run whose virtual time ends before its first evaluation
  // has no rounds to report.
  const double last_accuracy = result->rounds.empty() ? std::nan("") : result->rounds.back().test_accuracy;
  fmt::print("done: {} rounds, test accuracy {:.4f}, peak RSS {} ({:.1f}× the {} model), {:.1f} s — {}\n",
             result->rounds.size(), last_accuracy, memfl::format_bytes(static_cast<double>(result->peak_rss_bytes)),
             static_cast<double>(result->peak_rss_bytes) / static_cast<double>(result->model_bytes),
             memfl::format_bytes(static_cast<double>(result->model_bytes)), result->wall_seconds, *dir);
  return kExitOk;
}

}  // namespace

CommandFn add_run(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded configs/fedavg_fmnist_cnn.yaml)");
  cmd.add_option("--out", shared.out_dir, "run directory (default: <logging_output_dirname>/<timestamp>-<pid>)");
  cmd.add_option("--set", shared.sets, "override a config key: --set server_configs.num_global_epochs=2 (repeatable)");
  cmd.add_flag("-q,--quiet", shared.quiet, "no per-round progress lines");
  cmd.add_option("--resume", shared.resume_dir, kResumeDoc);
  cmd.add_flag("--profile", shared.profile, "record allocations with stacks (profile.bin; see memfl report)");
  add_http_options(cmd, shared);
  return [&shared](int&, char**&) { return run(shared); };
}

}  // namespace memfl::cli
