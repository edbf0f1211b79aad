// memfl list-methods: the client selection methods.
#include "cli/commands.h"
#include "schedule/client_selection.h"

namespace memfl::cli {

CommandFn add_list_methods(CLI::App&, SharedOptions&) {
  return [](int&, char**&) {
    for (const auto& m : memfl::client_selection_methods()) fmt::print("{:<18} {}\n", m.name, m.description);
    return kExitOk;
  };
}

}  // namespace memfl::cli
