#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "memory/sampler.h"
#include "roles/simulation.h"
#include "tensor/arena.h"
#include "test_util.h"

namespace memfl {
namespace {

TEST(Sampler, SeesAnAllocationAndMarksPhases) {
  testing::TempDir tmp;
  MemorySampler s("test", 1);
  s.start();
  s.mark(1, "train");
  const int64_t before = read_rss_bytes();
  {
    Arena a(64u << 20, MemoryCategory::kModel);
    std::memset(a.data(), 1, a.size());  // touch every page
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    s.mark(1, "aggregate");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s.stop();
  EXPECT_GE(s.peak_rss(), before + (60 << 20));
  EXPECT_GT(s.num_samples(), 5u);
  ASSERT_TRUE(s.write(tmp.path.string()).ok());

  std::ifstream in(tmp.file("memory.json"));
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["format"], "memfl.memory");
  EXPECT_EQ(j["peak_rss_bytes"].get<int64_t>(), s.peak_rss());
  ASSERT_EQ(j["phases"].size(), 3u);  // setup, train, aggregate
  EXPECT_EQ(j["phases"][1]["phase"], "train");
  EXPECT_GE(j["phases"][1]["peak_rss_bytes"].get<int64_t>(), before + (60 << 20));
  EXPECT_GE(j["ledger"]["model"]["at_rss_peak_bytes"].get<int64_t>(), 64 << 20);
  EXPECT_EQ(j["samples"]["t_ms"].size(), j["samples"]["rss_bytes"].size());
  std::ifstream csv(tmp.file("memory.csv"));
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "t_ms,rss_bytes,rss_file_bytes,round,phase");
  EXPECT_GE(j["peak_rss_anon_bytes"].get<int64_t>(), 60 << 20) << "the arena is anonymous memory";
}

TEST(Sampler, RecordsTheGpuProbeWhenGiven) {
  testing::TempDir tmp;
  MemorySampler s("test", 1);
  std::atomic<int64_t> allocated{100};
  s.set_gpu_probe([&](int64_t* a, int64_t* r, int64_t* p) {
    *a = allocated.load();
    *r = 4096;
    *p = allocated.load();
    return true;
  });
  s.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  allocated = 5000;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s.stop();
  ASSERT_TRUE(s.write(tmp.path.string()).ok());
  std::ifstream in(tmp.file("memory.json"));
  auto j = nlohmann::json::parse(in);
  ASSERT_TRUE(j.contains("gpu"));
  EXPECT_EQ(j["gpu"]["peak_allocated_bytes"], 5000);
  EXPECT_EQ(j["gpu"]["peak_reserved_bytes"], 4096);
  EXPECT_EQ(j["gpu"]["allocated_bytes"].size(), j["samples"]["t_ms"].size());
}

TEST(Sampler, StaysBoundedOnLongRuns) {
  MemorySampler s("test", 1, /*max_samples=*/64);
  s.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  s.stop();
  EXPECT_LE(s.num_samples(), 65u);
  EXPECT_GT(s.interval_ms(), 1);  // it slowed down instead of growing
}

TEST(Scheduler, SelectsAllOrASeededSubset) {
  EXPECT_EQ(select_clients(4, 0, 1, 1), (std::vector<int>{0, 1, 2, 3}));
  auto a = select_clients(100, 10, 7, 3);
  EXPECT_EQ(a.size(), 10u);
  EXPECT_EQ(a, select_clients(100, 10, 7, 3));
  EXPECT_NE(a, select_clients(100, 10, 7, 4));
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::adjacent_find(a.begin(), a.end()), a.end());
}

}  // namespace
}  // namespace memfl
