#include <gtest/gtest.h>

#include <set>

#include "schedule/client_selection.h"

namespace memfl {
namespace {

std::vector<ClientStats> population(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<ClientStats> c(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    c[i].samples = 10 + static_cast<double>(rng() % 500);
    if (i % 3 != 0) c[i].last_loss = static_cast<double>(rng() % 1000) / 500.0;  // a third never trained
    c[i].times_picked = static_cast<int>(rng() % 5);
  }
  return c;
}

class Selection : public ::testing::TestWithParam<std::string> {};

TEST_P(Selection, PicksValidDistinctClientsDeterministically) {
  auto method = make_client_selection(GetParam(), {});
  ASSERT_TRUE(method.ok()) << method.status().to_string();
  for (int n : {1, 7, 100, 1000}) {
    for (int k : {1, 5, 10}) {
      auto clients = population(n, 3);
      std::mt19937_64 a(42), b(42);
      for (int round = 1; round <= 3; ++round) {
        auto pick = (*method)->select(round, k, clients, a);
        auto again = (*method)->select(round, k, clients, b);
        EXPECT_EQ(pick, again) << GetParam() << " must be deterministic under a seed";
        ASSERT_EQ(pick.size(), static_cast<size_t>(std::min(n, k))) << GetParam() << " n=" << n << " k=" << k;
        EXPECT_EQ(std::set<int>(pick.begin(), pick.end()).size(), pick.size()) << "distinct";
        for (int c : pick) ASSERT_TRUE(c >= 0 && c < n);
        EXPECT_TRUE(std::is_sorted(pick.begin(), pick.end()));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllMethods, Selection,
                         ::testing::Values("random", "round_robin", "proportional_data", "topk_loss", "oort",
                                           "fairness"),
                         [](const auto& p) { return p.param; });

TEST(Selection, EveryListedMethodExistsAndUnknownNamesAreListed) {
  for (const auto& m : client_selection_methods()) EXPECT_TRUE(make_client_selection(m.name, {}).ok()) << m.name;
  auto bad = make_client_selection("greedy", {});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("known: random, round_robin"), std::string::npos);
}

TEST(Selection, MethodsFollowTheirSignal) {
  std::vector<ClientStats> c(10);
  for (int i = 0; i < 10; ++i) {
    c[i].samples = 100;
    c[i].last_loss = i;  // client 9 has the highest loss
  }
  std::mt19937_64 rng(1);
  auto topk = *make_client_selection("topk_loss", {10, 0.2, 1.0});
  EXPECT_EQ(topk->select(1, 2, c, rng), (std::vector<int>{8, 9}));
  auto fair = *make_client_selection("fairness", {});
  c[9].times_picked = 100;  // picked far too often: it makes way
  EXPECT_EQ(fair->select(1, 1, c, rng), (std::vector<int>{8}));
  auto rr = *make_client_selection("round_robin", {});
  EXPECT_EQ(rr->select(1, 3, c, rng), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(rr->select(4, 3, c, rng), (std::vector<int>{0, 1, 9}));
}

}  // namespace
}  // namespace memfl
