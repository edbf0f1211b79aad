// Child processes of this executable (a launched server and clients, the
// server's model worker), started with posix_spawn and logged to a file.
//
//   MEMFL_ASSIGN_OR_RETURN(pid_t pid, spawn_process({self_executable(), "server", …}, {.log_path = "server.log"}));
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace memfl {

struct SpawnOptions {
  std::string log_path;  // where the child's output goes
  bool append = false;   // to the log, instead of starting it afresh
  int stdin_fd = -1;     // the child's stdin (a pipe), else inherited
  int stdout_fd = -1;    // the child's stdout (a pipe); else stdout and stderr both go to the log
  std::vector<std::pair<std::string, std::string>> env = {};  // set (or replaced) in the child's environment
};

// Starts argv[0] with argv; an error names what could not start.
StatusOr<pid_t> spawn_process(const std::vector<std::string>& argv, const SpawnOptions& opts);

// A port the kernel had free on 127.0.0.1 a moment ago (for a server or
// rank 0's store to bind).
StatusOr<int> free_loopback_port();

// The environment a rank of a sharded job reads (train/sharded_dp.h):
// MEMFL_RANK, MEMFL_LOCAL_RANK, MEMFL_WORLD_SIZE, MEMFL_MASTER_PORT.
std::vector<std::pair<std::string, std::string>> rank_env(int rank, int world, int port);

// Starts `ranks` copies of this executable with argv, rank r with
// MEMFL_RANK=r, MEMFL_LOCAL_RANK=r, MEMFL_WORLD_SIZE=ranks and
// MEMFL_MASTER_PORT (a port that was free on 127.0.0.1) in its environment;
// rank 0's stdout is this process's, every rank's stderr (and the others'
// stdout) goes to log_prefix + "<r>.log". Waits for all of them. When one
// fails the others are stopped, and the error names the rank and ends with
// the tail of its log.
Status launch_ranks(int ranks, int argc, char** argv, const std::string& log_prefix);

// This executable's path (to start it again in another role).
std::string self_executable();

// The last `max_bytes` of a log file, for an error message about its writer.
std::string tail_of_file(const std::string& path, size_t max_bytes = 2000);

}  // namespace memfl
