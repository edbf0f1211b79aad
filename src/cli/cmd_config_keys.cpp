// memfl config-keys: every config key with its type, default and meaning.
#include "cli/commands.h"

namespace memfl::cli {

CommandFn add_config_keys(CLI::App&, SharedOptions&) {
  return [](int&, char**&) {
    fmt::print("{}", memfl::describe_config_keys());
    return kExitOk;
  };
}

}  // namespace memfl::cli
