#include "io/process.h"

#include <fcntl.h>
#include <spawn.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

extern char** environ;

namespace memfl {

StatusOr<pid_t> spawn_process(const std::vector<std::string>& argv, const SpawnOptions& opts) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  const int log_flags = O_WRONLY | O_CREAT | (opts.append ? O_APPEND : O_TRUNC);
  if (opts.stdin_fd >= 0) posix_spawn_file_actions_adddup2(&fa, opts.stdin_fd, 0);
  if (opts.stdout_fd >= 0) {
    posix_spawn_file_actions_adddup2(&fa, opts.stdout_fd, 1);
    posix_spawn_file_actions_addopen(&fa, 2, opts.log_path.c_str(), log_flags, 0644);
  } else {
    posix_spawn_file_actions_addopen(&fa, 1, opts.log_path.c_str(), log_flags, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  }
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, cargv[0], &fa, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return internal_error("cannot start {}: {}", argv[0], std::strerror(rc));
  return pid;
}

std::string self_executable() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("memfl") : p.string();
}

std::string tail_of_file(const std::string& path, size_t max_bytes) {
  std::ifstream in(path);
  std::string all((std::istreambuf_iterator<char>(in)), {});
  return all.size() > max_bytes ? all.substr(all.size() - max_bytes) : all;
}

}  // namespace memfl
