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

// The memory a budget in % is of: the cgroup's limit where there is one,
// else MemTotal. The inputs are written by hand as the kernel writes them.
TEST(Budget, RamSizeComesFromTheCgroupLimitWhereThereIsOne) {
  const std::string meminfo = "MemTotal:        4194304 kB\nMemFree:         1000000 kB\n";  // 4 GiB
  const std::optional<std::string> none;
  // cgroup v2 with a limit: 8 GiB, although MemTotal says 4 GiB (it grows).
  RamSize r = choose_ram_size(std::string("8589934592\n"), none, meminfo, 1);
  EXPECT_EQ(r.bytes, int64_t{8} << 30);
  EXPECT_EQ(r.source, "cgroup v2 memory.max");
  // cgroup v2 without one ("max"): MemTotal.
  r = choose_ram_size(std::string("max\n"), none, meminfo, 1);
  EXPECT_EQ(r.bytes, int64_t{4} << 30);
  EXPECT_EQ(r.source, "MemTotal");
  // cgroup v1 with a limit of 1 GiB.
  r = choose_ram_size(none, std::string("1073741824\n"), meminfo, 1);
  EXPECT_EQ(r.bytes, int64_t{1} << 30);
  EXPECT_EQ(r.source, "cgroup v1 memory.limit_in_bytes");
  // cgroup v1's "no limit" is PAGE_COUNTER_MAX pages: absurdly large, so none.
  r = choose_ram_size(none, std::string("9223372036854771712\n"), meminfo, 1);
  EXPECT_EQ(r.source, "MemTotal");
  // More than int64 holds, garbage, zero: none either.
  EXPECT_FALSE(parse_cgroup_memory_limit("99999999999999999999999"));
  EXPECT_FALSE(parse_cgroup_memory_limit("12 GiB"));
  EXPECT_FALSE(parse_cgroup_memory_limit("0"));
  EXPECT_EQ(parse_cgroup_memory_limit(" 536870912 \n"), int64_t{512} << 20);
  // Nothing readable: the fallback.
  r = choose_ram_size(none, none, std::string("MemFree: 5 kB\n"), 12345);
  EXPECT_EQ(r.bytes, 12345);
  EXPECT_EQ(r.source, "sysconf(_SC_PHYS_PAGES)");
  EXPECT_EQ(parse_meminfo_total("MemTotal:       16384 kB\n"), int64_t{16} << 20);
}

TEST(Budget, PercentIsOfTheCgroupLimitAndAnExplicitBudgetIgnoresIt) {
  const RamSize r = choose_ram_size(std::string("2147483648"), std::nullopt, "MemTotal: 1048576 kB\n", 1);
  EXPECT_EQ(*parse_memory_budget("50%", r.bytes), int64_t{1} << 30);
  EXPECT_EQ(*parse_memory_budget("3GiB", r.bytes), int64_t{3} << 30) << "a stated budget is taken as stated";
  EXPECT_GT(total_ram_bytes(), 0);
}

}  // namespace
}  // namespace memfl
