#include <gtest/gtest.h>

#include "memory/budget.h"

namespace memfl {
namespace {

TEST(Budget, ParsesSizesAndNamesTheKeyOnBadInput) {
  EXPECT_EQ(*parse_memory_budget("50%", 1000), 500);
  EXPECT_EQ(*parse_memory_budget("2GiB", 0), int64_t{2} << 30);
  EXPECT_EQ(*parse_memory_budget("512MiB", 0), int64_t{512} << 20);
  EXPECT_EQ(*parse_memory_budget("1000", 0), 1000);
  for (const char* bad : {"", "lots", "120%", "5TB", "-3GiB"}) {
    auto b = parse_memory_budget(bad, 1000);
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_NE(b.status().message().find("server_configs.memory_budget"), std::string::npos) << bad;
  }
}

TEST(Budget, MinusOnePicksTheWorkersThatFit) {
  const int64_t MiB = 1 << 20;
  EXPECT_EQ(choose_parallel_clients(1000 * MiB, 200 * MiB, 100 * MiB, 16), 8);
  EXPECT_EQ(choose_parallel_clients(1000 * MiB, 200 * MiB, 100 * MiB, 2), 2) << "never more than the cores";
  EXPECT_EQ(choose_parallel_clients(250 * MiB, 200 * MiB, 100 * MiB, 16), 1) << "at least one";
  EXPECT_EQ(choose_parallel_clients(100 * MiB, 200 * MiB, 100 * MiB, 16), 1) << "even when over budget";
}

TEST(Budget, GovernorWarnsOncePerCrossingAndShedsAtNinetyPercent) {
  WorkerGovernor g(1000, 3);
  EXPECT_EQ(g.observe(500), WorkerGovernor::Action::kNone);
  EXPECT_EQ(g.observe(860), WorkerGovernor::Action::kWarn);
  EXPECT_EQ(g.observe(870), WorkerGovernor::Action::kNone) << "once per crossing";
  EXPECT_EQ(g.observe(700), WorkerGovernor::Action::kNone);
  EXPECT_EQ(g.observe(860), WorkerGovernor::Action::kWarn) << "a new crossing warns again";
  // A test lowers the budget under the current use: workers are shed, one
  // per observation, never the last one.
  g.set_budget(500);
  EXPECT_EQ(g.observe(860), WorkerGovernor::Action::kShed);
  EXPECT_EQ(g.active(), 2);
  EXPECT_EQ(g.observe(860), WorkerGovernor::Action::kShed);
  EXPECT_EQ(g.active(), 1);
  EXPECT_NE(g.observe(860), WorkerGovernor::Action::kShed);
  EXPECT_EQ(g.active(), 1);
}

}  // namespace
}  // namespace memfl
