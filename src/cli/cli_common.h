// What the memfl commands (src/cli/cmd_*.cpp) share: the exit codes, error
// printing, config loading and the checks of options several commands take.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "live/http_endpoint.h"

namespace CLI {
class App;  // <CLI/CLI.hpp>, in the commands that add options
}  // namespace CLI

namespace memfl::cli {

// Exit codes (also in `memfl --help`).
constexpr int kExitOk = 0;
constexpr int kExitRunFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMissing = 3;

int exit_code_for(const memfl::Status& s);

// Prints "memfl: error: ..." and returns the exit code for `s`.
int fail(const memfl::Status& s);

// --profile / memory_configs.profile: the tracker streams into DIR/profile.bin.
void start_profiler(const memfl::ExperimentConfig& cfg, const std::string& dir, const std::string& role);

// CONFIG, or the embedded default when none is given, with the --set overrides.
memfl::StatusOr<memfl::ExperimentConfig> load(const std::string& path, const std::vector<std::string>& sets);

// An --out directory, created now: a path that cannot be one is an error
// naming it, before any work is done (not an exception from deep inside).
memfl::Status make_out_dir(const std::string& dir);

// An accuracy to reach: a number in (0, 1].
memfl::Status check_target(double t, const std::string& text);

// --resume: the config must be the run's own experiment (committed in
// `committed_path`), checked before anything is written or listened on.
memfl::Status check_resume(const std::string& committed_path, const memfl::ExperimentConfig& cfg);

// The options several commands take. Each command binds its own flags to
// these; only the command given on the line writes them.
struct SharedOptions {
  std::string config_path, out_dir, resume_dir;
  std::vector<std::string> sets;
  bool quiet = false;
  bool profile = false;             // main turns it into --set memory_configs.profile=true
  int colocated_clients = 0;        // `memfl server`: client processes on this host (launch passes it)
  std::string http;                 // --http ADDR:PORT: the live endpoint (empty: none)
  std::string http_token;           // --http-token (or $MEMFL_HTTP_TOKEN)
  bool http_insecure_bind = false;  // --http-insecure-bind: off loopback without a token is meant
};

// Adds --http, --http-token and --http-insecure-bind to a long-running command.
void add_http_options(CLI::App& cmd, SharedOptions& shared);

// --http's address is off loopback with no token (none given, none in
// $MEMFL_HTTP_TOKEN): refused, naming the address and the flags, unless
// --http-insecure-bind says it is meant. Checked where the endpoint starts,
// and by `memfl launch` before it starts any process.
memfl::Status check_http_exposure(const SharedOptions& o);

// --http: starts the live endpoint for `role` (null when --http is not
// given), logs its address and writes it to DIR/http_address, where
// `memfl launch` and tests find a port 0 turned into a real one. `tls`: the
// role's gRPC uses TLS; the endpoint speaks plain HTTP, so it must then stay
// on loopback (an address elsewhere is refused, naming --http and use_ssl).
memfl::StatusOr<std::unique_ptr<memfl::LiveEndpoint>> start_http(const SharedOptions& o, const std::string& role,
                                                                 const std::string& dir, bool tls = false);
// The role's loop is over: leaves DIR/live.html (the live page as it ended,
// with DIR/live_state.json) and stops serving. A failed write is a warning:
// the run's own results are already on disk.
void stop_http(std::unique_ptr<memfl::LiveEndpoint>& endpoint, const std::string& dir);

inline constexpr const char* kResumeDoc =
    "continue the run in DIR after its newest committed round (config: DIR's config.yaml unless CONFIG is given)";

// Runs a command once the line is parsed; returns the exit code. argc and
// argv are main's: mpi hands them to MPI_Init, bench dp to the ranks it starts.
using CommandFn = std::function<int(int& argc, char**& argv)>;

// Adds a command's options to its subcommand `cmd` (main creates it, with its
// help line) and returns what runs it.
using AddCommandFn = CommandFn (*)(CLI::App& cmd, SharedOptions& shared);

}  // namespace memfl::cli
