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

inline Result memfl_cli(const std::string& args) {
  const std::string cmd = std::string(MEMFL_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
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
