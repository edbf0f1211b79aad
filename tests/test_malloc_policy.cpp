// Each role's malloc policy (memory/malloc_policy.h), measured by the
// kernel's page-fault count. Each case runs in a forked child: mallopt is
// process-wide and would outlive the test in this process.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "memory/malloc_policy.h"
#include "test_util.h"

namespace memfl {
namespace {

// A misspelt value would run the A/B's "glibc" side under memfl's policy
// without a word: the CLI refuses it before any role starts, naming the
// variable and the value, and writes no run directory.
TEST(MallocPolicy, AnUnknownValueIsRefusedNamingTheVariable) {
  testing::TempDir tmp;
  const Result r = run_shell("MEMFL_MALLOC_POLICY=glibcc " + std::string(MEMFL_BINARY) + " run -q --out " +
                             tmp.file("run") + " --set server_configs.num_global_epochs=1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("MEMFL_MALLOC_POLICY is 'glibcc'"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("run")));
  // The one value it takes passes the same check.
  const Result ok = run_shell("MEMFL_MALLOC_POLICY=glibc " + std::string(MEMFL_BINARY) + " list-methods");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// ASan's allocator replaces glibc's: mallopt has nothing to act on there, so
// this file is compiled out of the sanitizer build rather than run without a
// subject.
#if !defined(__SANITIZE_ADDRESS__)

constexpr size_t kBlock = 1u << 20;
// 96 MiB: above the streaming policy's 64 MiB trim threshold, so what a
// training step frees at its end is more than a streaming heap keeps.
constexpr size_t kBlocks = 96;
constexpr int64_t kPages = static_cast<int64_t>(kBlock * kBlocks / 4096);

int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// A training step's pattern: activations allocated and written block by
// block in the forward pass, all freed at the end of the step.
void one_step() {
  // Reserved first: a small live allocation above the blocks (the vector
  // growing) would pin the heap below it, and no policy would trim.
  std::vector<char*> blocks;
  blocks.reserve(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) {
    auto* p = static_cast<char*>(std::malloc(kBlock));
    ASSERT_NE(p, nullptr);
    std::memset(p, static_cast<int>(i), kBlock);
    blocks.push_back(p);
  }
  // Compiler barrier: the writes must happen.
  asm volatile("" : : "r"(blocks.data()) : "memory");
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(*it);
}

struct Child {
  std::string policy;
  int64_t second_step_faults = -1;
};

// Runs `setup` and two steps in a child; returns the policy it reported
// and the page faults of the second step.
template <class F>
Child in_child(F setup) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    setup();
    one_step();
    const int64_t f0 = minor_faults();
    one_step();
    const int64_t faults = minor_faults() - f0;
    const std::string out = std::string(malloc_policy()) + " " + std::to_string(faults);
    (void)!write(fds[1], out.data(), out.size());
    _exit(0);
  }
  close(fds[1]);
  char buf[128] = {};
  const ssize_t n = read(fds[0], buf, sizeof(buf) - 1);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  Child c;
  if (n > 0) {
    const std::string s(buf, static_cast<size_t>(n));
    const size_t sp = s.find(' ');
    c.policy = s.substr(0, sp);
    c.second_step_faults = std::stoll(s.substr(sp + 1));
  }
  return c;
}

TEST(MallocPolicy, TrainingKeepsAStepsMemoryForTheNext) {
  const Child c = in_child([] {
    unsetenv("MEMFL_MALLOC_POLICY");
    tune_malloc_for_training();
  });
  EXPECT_EQ(c.policy, "training");
  // Every page of the second step was the first step's: almost no faults
  // (a few for the vector and the stack), against kPages (24 576) if the
  // heap had been handed back.
  EXPECT_GE(c.second_step_faults, 0);
  EXPECT_LT(c.second_step_faults, kPages / 50) << "the heap went back to the kernel between steps";
}

TEST(MallocPolicy, StreamingHandsBackMoreThanAFewChunks) {
  // The server's policy trims a heap above 64 MiB: the same steps fault
  // their pages in again. This is also what shows the steps above measure
  // the heap's fate and not something else.
  const Child c = in_child([] {
    unsetenv("MEMFL_MALLOC_POLICY");
    tune_malloc_for_streaming();
  });
  EXPECT_EQ(c.policy, "streaming");
  EXPECT_GT(c.second_step_faults, kPages / 2);
}

TEST(MallocPolicy, GlibcWhenTheUserAsksForIt) {
  const Child c = in_child([] {
    setenv("MEMFL_MALLOC_POLICY", "glibc", 1);
    tune_malloc_for_training();
  });
  EXPECT_EQ(c.policy, "glibc");
  // glibc's dynamic thresholds: 1 MiB blocks come from the heap after the
  // first frees, and the heap is trimmed above twice that.
  EXPECT_GT(c.second_step_faults, kPages / 2);
}

#endif  // !__SANITIZE_ADDRESS__

}  // namespace
}  // namespace memfl
