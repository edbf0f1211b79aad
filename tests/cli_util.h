// Runs the memfl CLI as users do, for end-to-end tests.
#pragma once

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "common/status.h"
#include "tensor/safetensors.h"

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace memfl {

struct Result {
  int exit_code;
  std::string output;
};

// Runs `command` through the shell; stdout and stderr together.
inline Result run_shell(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline Result memfl_cli(const std::string& args) { return run_shell(std::string(MEMFL_BINARY) + " " + args); }

// `mpirun -np RANKS memfl mpi ARGS`, as root and with more ranks than cores
// (CI runs as root on 2 cores). Under AddressSanitizer the ranks skip the
// leak check: OpenMPI keeps allocations to its exit that LSan cannot name.
inline Result mpirun(int ranks, const std::string& args) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
#if defined(__SANITIZE_ADDRESS__)
  const std::string env = "ASAN_OPTIONS=detect_leaks=0 ";
#else
  const std::string env;
#endif
  return run_shell(env + "mpirun -np " + std::to_string(ranks) + " --oversubscribe " + std::string(MEMFL_BINARY) +
                   " mpi " + args);
}

// Runs `load` in a child process that an alarm ends if it does not return:
// a call that would wait on a FIFO forever fails this test, not the suite.
// Gives the refusal's message, or what went wrong instead ("accepted",
// "killed by signal N").
inline std::string refusal_of(const std::function<Status()>& load) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    alarm(60);
#if !defined(__SANITIZE_ADDRESS__)
    // An unbounded read (of /dev/zero) ends at this ceiling instead of
    // taking the machine's memory; ASan's shadow needs more address space.
    struct rlimit lim {
      size_t{4} << 30, size_t{4} << 30
    };
    setrlimit(RLIMIT_AS, &lim);
#endif
    const Status s = load();
    const std::string msg = s.ok() ? std::string("accepted") : s.message();
    (void)!write(fds[1], msg.data(), msg.size());
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status)) + " " + out;
  return out;
}

inline std::vector<std::vector<std::string>> read_csv(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> row;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) row.push_back(cell);
    rows.push_back(row);
  }
  return rows;
}

// The tensors of two safetensors files, byte for byte.
inline ::testing::AssertionResult same_model(const std::string& a, const std::string& b) {
  auto fa = SafetensorsFile::open(a);
  auto fb = SafetensorsFile::open(b);
  if (!fa.ok()) return ::testing::AssertionFailure() << fa.status().to_string();
  if (!fb.ok()) return ::testing::AssertionFailure() << fb.status().to_string();
  if ((*fa)->tensors().size() != (*fb)->tensors().size())
    return ::testing::AssertionFailure() << "tensor counts differ";
  for (const auto& t : (*fa)->tensors()) {
    const auto* u = (*fb)->find(t.name);
    if (u == nullptr) return ::testing::AssertionFailure() << t.name << " missing in " << b;
    if (t.data.size() != u->data.size() || std::memcmp(t.data.data(), u->data.data(), t.data.size()) != 0) {
      return ::testing::AssertionFailure() << t.name << " differs between " << a << " and " << b;
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace memfl
