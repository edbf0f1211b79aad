// memfl model-worker (internal): the server's model worker
// (server/model_worker.h), started by a gRPC or MPI server for what needs the
// network, so the server never maps libtorch.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>

#include "cli/commands.h"
#include "server/model_worker.h"

namespace memfl::cli {

CommandFn add_model_worker(CLI::App& cmd, SharedOptions& shared) {
  auto write_initial = std::make_shared<std::string>();
  cmd.add_option("CONFIG", shared.config_path, "the run's config.yaml")->required();
  cmd.add_option("--write-initial", *write_initial, "write the initial model here and exit");
  return [&shared, write_initial](int&, char**&) {
    spdlog::set_default_logger(spdlog::stderr_color_mt("model-worker"));
    memfl::Status st = memfl::run_model_worker(shared.config_path, *write_initial);
    if (!st.ok()) return fail(st);
    return kExitOk;
  };
}

}  // namespace memfl::cli
