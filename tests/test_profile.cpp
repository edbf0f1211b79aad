#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "memory/profile.h"
#include "test_util.h"

namespace memfl {
namespace {

[[maybe_unused]] std::string innermost_site(const Profile& p, uint32_t stack) {
  for (const auto& f : [&] {
         auto fr = p.frames_of(stack);
         return std::vector<std::string>(fr.rbegin(), fr.rend());
       }()) {
    if (f.find("memfl_test_site_") != std::string::npos) return f.substr(0, f.find(' '));
  }
  return "?";
}

#ifndef MEMFL_NO_ALLOC_HOOKS
int run_program(const std::string& mode, const std::string& path) {
  const std::string cmd = std::string(MEMFL_ALLOC_SITE_PROGRAM) + " " + mode + " " + path;
  return std::system(cmd.c_str());
}
#endif

#ifndef MEMFL_NO_ALLOC_HOOKS  // ASan owns malloc in the sanitizer build
TEST(Profiler, SeesExactlyTheKnownSitesAndSizes) {
  testing::TempDir tmp;
  ASSERT_EQ(run_program("sites", tmp.file("p.bin")), 0);
  auto p = read_profile(tmp.file("p.bin"));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->role, "test");
  EXPECT_FALSE(p->truncated);
  std::map<std::string, std::vector<int64_t>> allocs;
  for (const auto& e : p->events) {
    if (e.delta > 0) allocs[innermost_site(*p, e.stack)].push_back(e.delta);
  }
  EXPECT_EQ(allocs["memfl_test_site_a"], (std::vector<int64_t>{100000}));
  EXPECT_EQ(allocs["memfl_test_site_b"], (std::vector<int64_t>{200000, 200000, 200000}));
  EXPECT_EQ(allocs["memfl_test_site_c"], (std::vector<int64_t>{131072}));  // posix_memalign is seen
  EXPECT_EQ(allocs.size(), 3u) << "no other allocation ≥ 64 KiB happened in the program";

  auto a = analyse_profile(*p);
  EXPECT_EQ(a.peak_tracked_bytes, 100000 + 3 * 200000 + 131072);
  EXPECT_EQ(a.peak_phase, "train");
  ASSERT_EQ(a.live_at_peak.size(), 3u);
  EXPECT_EQ(a.live_at_peak[0].bytes, 600000);
  ASSERT_FALSE(p->small.empty());
  const std::string folded = folded_stacks(*p, a.live_at_peak);
  EXPECT_NE(folded.find("memfl_test_site_b"), std::string::npos);
  EXPECT_NE(folded.find(" 600000\n"), std::string::npos) << folded;
  ASSERT_EQ(p->marks.size(), 2u);
  EXPECT_EQ(p->marks[1].phase, "aggregate");
}

TEST(Profiler, ProfileOfAKilledProcessIsReadable) {
  testing::TempDir tmp;
  const int rc = run_program("killed", tmp.file("k.bin"));
  EXPECT_TRUE(WIFSIGNALED(rc) || (WIFEXITED(rc) && WEXITSTATUS(rc) != 0)) << rc;
  auto p = read_profile(tmp.file("k.bin"));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(analyse_profile(*p).peak_tracked_bytes, 100000 + 3 * 200000 + 131072);
  // Cut it in the middle of a record, as a kill during a write would.
  const auto size = std::filesystem::file_size(tmp.file("k.bin"));
  std::filesystem::resize_file(tmp.file("k.bin"), size - 3);
  auto cut = read_profile(tmp.file("k.bin"));
  ASSERT_TRUE(cut.ok()) << cut.status().to_string();
  EXPECT_TRUE(cut->truncated);
  EXPECT_GE(cut->events.size(), 4u);
}

#endif

TEST(Profiler, ReaderMatchesGoldenFile) {
  const std::string dir = std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/tests/golden/";
  auto p = read_profile(dir + "profile_v1.bin");
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  std::ifstream in(dir + "profile_v1.txt");
  const std::string expected((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(describe_profile(*p, analyse_profile(*p)), expected);
}

TEST(Profiler, RejectsOtherFilesAndVersions) {
  testing::TempDir tmp;
  std::ofstream(tmp.file("x.bin")) << "not a profile";
  auto p = read_profile(tmp.file("x.bin"));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("bad magic"), std::string::npos);
  std::ofstream(tmp.file("v.bin"), std::ios::binary) << std::string("MEMFLPRF\x09\0\0\0", 12) << std::string(20, '\0');
  auto v = read_profile(tmp.file("v.bin"));
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("version 9"), std::string::npos) << v.status().message();
}

}  // namespace
}  // namespace memfl
