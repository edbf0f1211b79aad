// The memfl commands, one per file (cmd_<name>.cpp). Each adds its options
// to the subcommand main created for it and returns what runs it.
#pragma once

#include "cli/cli_common.h"

namespace memfl::cli {

CommandFn add_run(CLI::App& cmd, SharedOptions& shared);
CommandFn add_model_worker(CLI::App& cmd, SharedOptions& shared);
CommandFn add_validate(CLI::App& cmd, SharedOptions& shared);
CommandFn add_config_keys(CLI::App& cmd, SharedOptions& shared);
CommandFn add_list_models(CLI::App& cmd, SharedOptions& shared);
CommandFn add_list_methods(CLI::App& cmd, SharedOptions& shared);
CommandFn add_privacy(CLI::App& cmd, SharedOptions& shared);
CommandFn add_compare_algorithms(CLI::App& cmd, SharedOptions& shared);
CommandFn add_compare_methods(CLI::App& cmd, SharedOptions& shared);
CommandFn add_bench(CLI::App& cmd, SharedOptions& shared);
CommandFn add_shard_rank(CLI::App& cmd, SharedOptions& shared);
#ifdef MEMFL_HAVE_GRPC
CommandFn add_server(CLI::App& cmd, SharedOptions& shared);
CommandFn add_client(CLI::App& cmd, SharedOptions& shared);
CommandFn add_launch(CLI::App& cmd, SharedOptions& shared);
#endif
#ifdef MEMFL_HAVE_MPI
CommandFn add_mpi(CLI::App& cmd, SharedOptions& shared);
#endif
CommandFn add_report(CLI::App& cmd, SharedOptions& shared);
CommandFn add_compare(CLI::App& cmd, SharedOptions& shared);
CommandFn add_inspect(CLI::App& cmd, SharedOptions& shared);

}  // namespace memfl::cli
