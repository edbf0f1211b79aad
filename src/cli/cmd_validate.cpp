// memfl validate: check a config and print it with every default resolved.
#include <CLI/CLI.hpp>

#include "cli/commands.h"

namespace memfl::cli {

CommandFn add_validate(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  return [&shared](int&, char**&) {
    auto cfg = load(shared.config_path, shared.sets);
    if (!cfg.ok()) return fail(cfg.status());
    fmt::print("# {} — valid\n{}", cfg->source, cfg->resolved_yaml);
    return kExitOk;
  };
}

}  // namespace memfl::cli
