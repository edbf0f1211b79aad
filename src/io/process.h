// Child processes of this executable (a launched server and clients, the
// server's model worker), started with posix_spawn and logged to a file.
//
//   MEMFL_ASSIGN_OR_RETURN(pid_t pid, spawn_process({self_executable(), "server", …}, {.log_path = "server.log"}));
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

struct SpawnOptions {
  std::string log_path;  // where the child's output goes
  bool append = false;   // to the log, instead of starting it afresh
  int stdin_fd = -1;     // the child's stdin (a pipe), else inherited
  int stdout_fd = -1;    // the child's stdout (a pipe); else stdout and stderr both go to the log
};

// Starts argv[0] with argv; an error names what could not start.
StatusOr<pid_t> spawn_process(const std::vector<std::string>& argv, const SpawnOptions& opts);

// This executable's path (to start it again in another role).
std::string self_executable();

// The last `max_bytes` of a log file, for an error message about its writer.
std::string tail_of_file(const std::string& path, size_t max_bytes = 2000);

}  // namespace memfl
