// Runs the memfl CLI as users do, for end-to-end tests.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>

#include "tensor/safetensors.h"

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
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
