// memfl validate: check a config and print it with every default resolved.
#include <filesystem>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "comm/client_tokens.h"
#include "data/experiment_data.h"

namespace memfl::cli {

CommandFn add_validate(CLI::App& cmd, SharedOptions& shared) {
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  return [&shared](int&, char**&) {
    auto cfg = load(shared.config_path, shared.sets);
    if (!cfg.ok()) return fail(cfg.status());
    // What the server would refuse at start, where this machine has the file.
    if (const auto& path = cfg->server.client_tokens_file; !path.empty() && std::filesystem::exists(path)) {
      auto tokens = load_client_tokens(path, kClientTokensFileKey, cfg->server.num_clients);
      if (!tokens.ok()) return fail(tokens.status());
    }
    // The data's files, read as a client would read them (a config load
    // checks only their kinds and sizes).
    if (auto data = check_experiment_data(*cfg); !data.ok()) return fail(data);
    fmt::print("# {} — valid\n{}", cfg->source, cfg->resolved_yaml);
    return kExitOk;
  };
}

}  // namespace memfl::cli
