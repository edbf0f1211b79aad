// memfl command line. Exit codes (also in `memfl --help`):
//   0 success, 1 the run failed, 2 bad usage or config, 3 missing data set,
//   file or plugin.
// Each command lives in its own file (cmd_<name>.cpp); this one holds the
// usage text and hands the parsed line to the command given.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "memory/malloc_policy.h"

namespace {

using memfl::cli::AddCommandFn;

struct Command {
  const char* name;
  const char* help;  // the line in `memfl --help`
  AddCommandFn add;
};

// In the order `memfl --help` lists them.
const Command kCommands[] = {
    {"run", "Run an in-process federated simulation (server + virtual clients)", memfl::cli::add_run},
    {"model-worker", "", memfl::cli::add_model_worker},  // internal: no help line
    {"validate", "Check a config and print it with every default resolved", memfl::cli::add_validate},
    {"config-keys", "List every config key with its type, default and meaning", memfl::cli::add_config_keys},
    {"list-models", "List the models of the registry", memfl::cli::add_list_models},
    {"list-methods", "List the client selection methods", memfl::cli::add_list_methods},
    {"privacy", "Epsilon of DP-SGD / DP-FedAvg: RDP accountant of the Poisson-subsampled Gaussian mechanism",
     memfl::cli::add_privacy},
    {"compare-algorithms",
     "Run FL algorithms (FedAvg, FedAsync, FedBuff, FedCompass, ...) on the same clients and compare them",
     memfl::cli::add_compare_algorithms},
    {"compare-methods", "Run client selection methods one after another and compare them",
     memfl::cli::add_compare_methods},
    {"bench", "Benchmarks", memfl::cli::add_bench},
    {"shard-rank", "", memfl::cli::add_shard_rank},  // internal: hidden from the help
#ifdef MEMFL_HAVE_GRPC
    {"server", "Run the federated server over gRPC", memfl::cli::add_server},
    {"client", "Run one federated client over gRPC", memfl::cli::add_client},
    {"launch", "Start a server and N client processes here, gather their run dirs", memfl::cli::add_launch},
#endif
#ifdef MEMFL_HAVE_MPI
    {"mpi", "Run as a rank of an MPI job: mpirun -np N+1 memfl mpi CONFIG (rank 0 = server)", memfl::cli::add_mpi},
#endif
    {"report", "Write RUN_DIR/report/index.html (+ summary.txt, CSV, folded stacks)", memfl::cli::add_report},
    {"compare", "Compare runs: peaks with % change, timelines, differential flamegraphs", memfl::cli::add_compare},
    {"inspect", "Describe a model preset (llama-1b, llama-70b, ...) or a safetensors checkpoint (one file or shards)",
     memfl::cli::add_inspect},
};

}  // namespace

int main(int argc, char** argv) {
  using memfl::cli::fail;
  using memfl::cli::kExitUsage;

  CLI::App app{
      "memfl — memory-efficient federated learning\n\n"
      "Exit codes: 0 success, 1 run failed, 2 bad usage or config, 3 missing data set, file or plugin."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "memfl 0.1.0");

  memfl::cli::SharedOptions shared;
  std::vector<std::pair<CLI::App*, memfl::cli::CommandFn>> commands;
  for (const Command& c : kCommands) {
    CLI::App* cmd = app.add_subcommand(c.name, c.help);
    commands.emplace_back(cmd, c.add(*cmd, shared));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  // Before any role starts, so a misspelt value loses nothing.
  if (auto st = memfl::check_malloc_policy_env(); !st.ok()) return fail(st);
  if (shared.profile) shared.sets.push_back("memory_configs.profile=true");
  for (auto& [cmd, run] : commands) {
    if (cmd->parsed()) return run(argc, argv);
  }
  return kExitUsage;  // not reached: the parse requires one command
}
