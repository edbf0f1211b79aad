#include "io/process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
  // The parent's environment, with opts.env's variables set or replaced.
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    const bool replaced = std::any_of(opts.env.begin(), opts.env.end(), [&](const auto& kv) {
      return v.size() > kv.first.size() && v.substr(0, kv.first.size()) == kv.first && v[kv.first.size()] == '=';
    });
    if (!replaced) vars.emplace_back(v);
  }
  for (const auto& [k, val] : opts.env) vars.push_back(k + "=" + val);
  std::vector<char*> cenv;
  for (auto& v : vars) cenv.push_back(v.data());
  cenv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, cargv[0], &fa, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return internal_error("cannot start {}: {}", argv[0], std::strerror(rc));
  return pid;
}

StatusOr<int> free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return internal_error("socket: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) return internal_error("no free port on 127.0.0.1: {}", std::strerror(errno));
  return static_cast<int>(ntohs(a.sin_port));
}

std::vector<std::pair<std::string, std::string>> rank_env(int rank, int world, int port) {
  return {{"MEMFL_RANK", std::to_string(rank)},
          {"MEMFL_LOCAL_RANK", std::to_string(rank)},
          {"MEMFL_WORLD_SIZE", std::to_string(world)},
          {"MEMFL_MASTER_PORT", std::to_string(port)}};
}

Status launch_ranks(int ranks, int argc, char** argv, const std::string& log_prefix) {
  MEMFL_ASSIGN_OR_RETURN(int port, free_loopback_port());
  if (auto dir = std::filesystem::path(log_prefix).parent_path(); !dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return internal_error("cannot create {} for the ranks' logs: {}", dir.string(), ec.message());
  }
  // argv[0] as this process was started, when it still names it: behind a
  // bind mount /proc/self/exe may give a path that does not exist here.
  std::vector<std::string> args{argc > 0 && ::access(argv[0], X_OK) == 0 ? std::string(argv[0]) : self_executable()};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<pid_t> pids;
  auto stop_all = [&] {
    for (pid_t p : pids) ::kill(p, SIGTERM);
    for (pid_t p : pids) ::waitpid(p, nullptr, 0);
  };
  for (int r = 0; r < ranks; ++r) {
    SpawnOptions o;
    o.env = rank_env(r, ranks, port);
    o.log_path = log_prefix + std::to_string(r) + ".log";
    if (r == 0) o.stdout_fd = 1;
    auto pid = spawn_process(args, o);
    if (!pid.ok()) {
      stop_all();
      return pid.status();
    }
    pids.push_back(*pid);
  }
  size_t running = pids.size();
  while (running > 0) {
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, 0);
    if (done < 0) {
      if (errno == EINTR) continue;
      break;
    }
    size_t rank = 0;
    while (rank < pids.size() && pids[rank] != done) ++rank;
    if (rank == pids.size()) continue;  // not one of ours
    pids[rank] = -1;
    --running;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::vector<pid_t> rest;
      for (pid_t p : pids) {
        if (p > 0) rest.push_back(p);
      }
      pids = rest;
      stop_all();
      const std::string log = log_prefix + std::to_string(rank) + ".log";
      return internal_error("rank {} of {} failed ({}); its log {} ends:\n{}", rank, ranks,
                            WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                              : "signal " + std::to_string(WTERMSIG(status)),
                            log, tail_of_file(log));
    }
  }
  return Status();
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
