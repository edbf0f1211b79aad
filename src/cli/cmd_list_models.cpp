// memfl list-models: the models of the registry.
#include "cli/commands.h"

namespace memfl::cli {

CommandFn add_list_models(CLI::App&, SharedOptions&) {
  return [](int&, char**&) {
    for (const auto& n : memfl::known_model_names()) fmt::print("{}\n", n);
    return kExitOk;
  };
}

}  // namespace memfl::cli
