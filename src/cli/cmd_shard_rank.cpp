// memfl shard-rank (hidden): a rank > 0 of a sharded client, started by rank 0
// (train_configs.num_gpus).
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "memory/malloc_policy.h"
#include "train/trainer_backend.h"

namespace memfl::cli {

CommandFn add_shard_rank(CLI::App& cmd, SharedOptions&) {
  cmd.group("");  // hidden: only a sharded client starts it
  return [](int&, char**&) {
    memfl::tune_malloc_for_training();  // a shard rank trains its cut of the model
    auto backend = memfl::load_trainer_backend();
    if (!backend.ok()) return fail(backend.status());
    memfl::Status st = (*backend)->run_shard_rank();
    if (!st.ok()) return fail(st);
    return kExitOk;
  };
}

}  // namespace memfl::cli
