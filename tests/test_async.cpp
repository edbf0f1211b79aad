// Asynchronous FL: the staleness functions, FedAsync / FedBuff / FedCompass
// steps against values worked by hand, the COMPASS planner's groups worked
// by hand, and the simulator end to end — its final model is recomputed by
// the test from the async log alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "aggregate/async_aggregator.h"
#include "cli_util.h"
#include "config/config.h"
#include "schedule/compass.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

using testing::TempDir;

Layout vector_layout(std::vector<std::pair<std::string, size_t>> tensors, bool with_counter = false) {
  LayoutBuilder b;
  for (const auto& [name, n] : tensors) b.add(name, DType::kF32, {static_cast<int64_t>(n)});
  if (with_counter) b.add("num_batches_tracked", DType::kI64, {1});
  return *std::move(b).build();
}

void set_floats(const Layout& layout, Arena& a, const std::vector<float>& v) {
  ASSERT_EQ(layout.entries()[0].numel(), v.size());
  std::memcpy(a.data() + layout.entries()[0].offset, v.data(), v.size() * sizeof(float));
}

std::vector<float> floats(const Layout& layout, const Arena& a, size_t entry = 0) {
  const auto& e = layout.entries()[entry];
  std::vector<float> v(e.numel());
  std::memcpy(v.data(), a.data() + e.offset, v.size() * sizeof(float));
  return v;
}

std::unique_ptr<AsyncAggregator> make(const std::string& name, AsyncAggregatorOptions o, const Layout& layout) {
  auto agg = AsyncAggregator::create(
      name, o, layout, [](size_t bytes) -> StatusOr<Arena> { return Arena(bytes, MemoryCategory::kAggregation); });
  EXPECT_TRUE(agg.ok()) << agg.status().to_string();
  return std::move(*agg);
}

TEST(Staleness, EachFunctionMatchesItsFormulaByHand) {
  auto constant = make_staleness_fn("constant", 0.5, 4);
  ASSERT_TRUE(constant.ok());
  EXPECT_DOUBLE_EQ((*constant)(0), 1.0);
  EXPECT_DOUBLE_EQ((*constant)(7), 1.0);
  auto poly = make_staleness_fn("polynomial", 0.5, 4);  // (t+1)^-0.5
  ASSERT_TRUE(poly.ok());
  EXPECT_DOUBLE_EQ((*poly)(0), 1.0);
  EXPECT_DOUBLE_EQ((*poly)(3), 0.5);
  EXPECT_NEAR((*poly)(8), 1.0 / 3.0, 1e-15);
  auto hinge = make_staleness_fn("hinge", 10, 4);  // 1 up to 4, then 1/(10(t-4)+1)
  ASSERT_TRUE(hinge.ok());
  EXPECT_DOUBLE_EQ((*hinge)(4), 1.0);
  EXPECT_DOUBLE_EQ((*hinge)(5), 1.0 / 11.0);
  EXPECT_DOUBLE_EQ((*hinge)(6), 1.0 / 21.0);
  auto bad = make_staleness_fn("exponential", 1, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("staleness_fn"), std::string::npos) << bad.status().message();
}

TEST(AsyncAggregators, FedAsyncStepsWorkedByHand) {
  Layout layout = vector_layout({{"w", 3}});
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel);
  set_floats(layout, x, {1, 2, 3});
  AsyncAggregatorOptions o;
  o.alpha = 0.5;
  o.staleness = *make_staleness_fn("polynomial", 1.0, 0);
  auto agg = make("FedAsyncAggregator", o, layout);
  ArenaUpdateSource src(y);
  // α = 0.5 · (1+1)^-1 · 0.5 = 0.125; x + 0.125 (y − x) = [1.25, 2, 2.75].
  set_floats(layout, y, {3, 2, 1});
  AsyncContribution c1{&src, 0.5, 1};
  EXPECT_DOUBLE_EQ(agg->alpha_t(c1), 0.125);
  auto moved = agg->apply(x, std::span(&c1, 1));
  ASSERT_TRUE(moved.ok());
  EXPECT_TRUE(*moved);
  EXPECT_EQ(floats(layout, x), (std::vector<float>{1.25f, 2.0f, 2.75f}));
  // α = 0.5 · 1 · 1 = 0.5 toward zeros: halves it.
  set_floats(layout, y, {0, 0, 0});
  AsyncContribution c2{&src, 1.0, 0};
  ASSERT_TRUE(agg->apply(x, std::span(&c2, 1)).ok());
  EXPECT_EQ(floats(layout, x), (std::vector<float>{0.625f, 1.0f, 1.375f}));
  // gradient_based: x − α g with g = x_base − y.
  o.gradient_based = true;
  auto grad = make("FedAsyncAggregator", o, layout);
  set_floats(layout, y, {0.5f, -1.0f, 0.0f});
  AsyncContribution c3{&src, 1.0, 0};  // α = 0.5
  ASSERT_TRUE(grad->apply(x, std::span(&c3, 1)).ok());
  EXPECT_EQ(floats(layout, x), (std::vector<float>{0.375f, 1.5f, 1.375f}));
}

TEST(AsyncAggregators, FedBuffMovesEveryKUpdatesAgainstTheModelAsItIs) {
  Layout layout = vector_layout({{"w", 2}});
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y(layout.total_bytes(), MemoryCategory::kModel);
  set_floats(layout, x, {2, 4});
  AsyncAggregatorOptions o;
  o.alpha = 1.0;
  o.buffer_size = 2;
  auto agg = make("FedBuffAggregator", o, layout);
  ArenaUpdateSource src(y);
  // Δ = 0.5 ([4,8] − [2,4]) = [1,2]; the model waits.
  set_floats(layout, y, {4, 8});
  AsyncContribution c{&src, 0.5, 0};
  auto moved = agg->apply(x, std::span(&c, 1));
  ASSERT_TRUE(moved.ok());
  EXPECT_FALSE(*moved);
  EXPECT_EQ(agg->buffered(), 1);
  EXPECT_EQ(floats(layout, x), (std::vector<float>{2, 4}));
  // Δ += 0.5 ([2,0] − [2,4]) = [0,−2] → Δ = [1,0]; K = 2: x = [3,4].
  set_floats(layout, y, {2, 0});
  moved = agg->apply(x, std::span(&c, 1));
  ASSERT_TRUE(moved.ok());
  EXPECT_TRUE(*moved);
  EXPECT_EQ(agg->buffered(), 0);
  EXPECT_EQ(floats(layout, x), (std::vector<float>{3, 4}));
  // A new buffer starts from zero: one more update leaves x alone.
  set_floats(layout, y, {5, 5});
  moved = agg->apply(x, std::span(&c, 1));
  ASSERT_TRUE(moved.ok());
  EXPECT_FALSE(*moved);
  EXPECT_EQ(floats(layout, x), (std::vector<float>{3, 4}));
  EXPECT_EQ(agg->state_bytes(), layout.total_bytes());
}

TEST(AsyncAggregators, FedCompassGroupMovesOnceByTheSumOfItsTerms) {
  Layout layout = vector_layout({{"w", 2}});
  Arena x(layout.total_bytes(), MemoryCategory::kModel), y1(layout.total_bytes(), MemoryCategory::kModel),
      y2(layout.total_bytes(), MemoryCategory::kModel);
  set_floats(layout, x, {1, 1});
  set_floats(layout, y1, {3, 1});
  set_floats(layout, y2, {1, 5});
  AsyncAggregatorOptions o;
  o.alpha = 1.0;
  o.staleness = *make_staleness_fn("polynomial", 1.0, 0);
  auto agg = make("FedCompassAggregator", o, layout);
  ArenaUpdateSource s1(y1), s2(y2);
  // α1 = 1 · 1 · 0.25; α2 = 1 · (3+1)^-1 · 0.5 = 0.125, both against x:
  // x + 0.25 [2,0] + 0.125 [0,4] = [1.5, 1.5]. (One after the other, as
  // FedAsync would, gives [1.4375, 1.5].)
  std::vector<AsyncContribution> group{{&s1, 0.25, 0}, {&s2, 0.5, 3}};
  auto moved = agg->apply(x, group);
  ASSERT_TRUE(moved.ok());
  EXPECT_TRUE(*moved);
  EXPECT_EQ(floats(layout, x), (std::vector<float>{1.5f, 1.5f}));
}

TEST(AsyncAggregators, AModelWithBf16TensorsIsRefusedNamingTheTensor) {
  LayoutBuilder b;
  b.add("w", DType::kF32, {4});
  b.add("lm_head.weight", DType::kBF16, {4});
  Layout layout = *std::move(b).build();
  auto agg = AsyncAggregator::create("FedBuffAggregator", {}, layout, [](size_t n) -> StatusOr<Arena> {
    return Arena(n, MemoryCategory::kAggregation);
  });
  ASSERT_FALSE(agg.ok());
  EXPECT_NE(agg.status().message().find("lm_head.weight"), std::string::npos) << agg.status().message();
}

// Three updates of different staleness and weight over two tensors (one
// longer than every block size but the last) and a counter: every block
// size gives the same bytes, and they match a double-precision whole-model
// computation written here.
TEST(AsyncAggregators, StreamingEqualsTheWholeModelAtEveryBlockSize) {
  Layout layout = vector_layout({{"a", 1000}, {"b", 37}}, /*with_counter=*/true);
  Arena x0(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, x0, 1);
  std::vector<Arena> ys;
  for (int i = 0; i < 3; ++i) {
    ys.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(layout, ys.back(), 10 + static_cast<uint64_t>(i));
  }
  const std::vector<double> weights = {0.2, 0.5, 0.3};
  const std::vector<int64_t> staleness = {0, 2, 5};
  for (const char* name : {"FedAsyncAggregator", "FedBuffAggregator", "FedCompassAggregator"}) {
    SCOPED_TRACE(name);
    const std::string rule = name;
    // The expected model, whole, in double.
    std::vector<std::vector<double>> want;
    for (size_t t = 0; t < 2; ++t) {
      const auto& e = layout.entries()[t];
      std::vector<double> x(e.numel()), step(e.numel(), 0.0), acc(e.numel(), 0.0);
      for (size_t k = 0; k < x.size(); ++k) x[k] = x0.as<float>(e.offset)[k];
      for (size_t i = 0; i < 3; ++i) {
        const double a = 0.8 * std::pow(staleness[i] + 1.0, -0.5) * weights[i];
        for (size_t k = 0; k < x.size(); ++k) {
          const double d = a * (ys[i].as<float>(e.offset)[k] - x[k]);
          if (rule == "FedAsyncAggregator") x[k] += d;
          if (rule == "FedBuffAggregator") step[k] += d;
          if (rule == "FedCompassAggregator") acc[k] += d;
        }
        if (rule == "FedBuffAggregator" && i == 1)  // K = 2: the second update moves the model
          for (size_t k = 0; k < x.size(); ++k) x[k] += std::exchange(step[k], 0.0);
      }
      if (rule == "FedCompassAggregator")
        for (size_t k = 0; k < x.size(); ++k) x[k] += acc[k];
      want.push_back(x);
    }
    std::vector<std::vector<std::byte>> results;
    for (size_t block : {size_t{7}, size_t{64}, size_t{1} << 16}) {
      AsyncAggregatorOptions o;
      o.alpha = 0.8;
      o.staleness = *make_staleness_fn("polynomial", 0.5, 0);
      o.buffer_size = 2;
      o.block_elements = block;
      auto agg = make(name, o, layout);
      Arena x(layout.total_bytes(), MemoryCategory::kModel);
      std::memcpy(x.data(), x0.data(), x.size());
      std::vector<ArenaUpdateSource> src;
      std::vector<AsyncContribution> cs;
      for (int i = 0; i < 3; ++i) src.emplace_back(ys[static_cast<size_t>(i)]);
      for (size_t i = 0; i < 3; ++i) cs.push_back({&src[i], weights[i], staleness[i]});
      if (rule == "FedCompassAggregator") {
        ASSERT_TRUE(agg->apply(x, cs).ok());
      } else {
        for (const auto& c : cs) ASSERT_TRUE(agg->apply(x, std::span(&c, 1)).ok());
      }
      for (size_t t = 0; t < 2; ++t) {
        const auto got = floats(layout, x, t);
        for (size_t k = 0; k < got.size(); ++k) ASSERT_NEAR(got[k], want[t][k], 1e-5) << "block " << block;
      }
      // Counters: the newest update's value.
      const auto& counter = layout.entries()[2];
      EXPECT_EQ(*x.as<int64_t>(counter.offset), *ys[2].as<int64_t>(counter.offset));
      results.emplace_back(x.data(), x.data() + x.size());
    }
    EXPECT_EQ(results[0], results[1]);
    EXPECT_EQ(results[1], results[2]);
  }
}

// Worked by hand with max 20, min 2, speed_momentum 0.5, latest_time_factor 1.5.
TEST(CompassPlanner, GroupsAndStepsWorkedByHand) {
  CompassPlanner plan({/*max*/ 20, /*min*/ 2, /*momentum*/ 0.5, /*factor*/ 1.5});
  plan.start(0, 0.0);
  plan.start(1, 0.0);
  // Client 0: 20 steps in 20 s → 1 s/step. No group yet: alone, then a new
  // group g0 of 20 steps: expected 40, latest 50.
  plan.observe_arrival(0, 20.0);
  EXPECT_DOUBLE_EQ(plan.speed(0), 1.0);
  EXPECT_EQ(plan.group_of(0), -1);
  std::optional<int> opened;
  EXPECT_EQ(plan.assign(0, 20.0, &opened), 20);
  ASSERT_TRUE(opened.has_value());
  const int g0 = *opened;
  EXPECT_DOUBLE_EQ(plan.latest_arrival_time(g0), 50.0);
  // Client 1: 20 steps in 40 s → 2 s/step. g0 is due now, so it cannot
  // join; a new group aims at g0's latest arrival + the fastest member's 20
  // steps: 50 + 20 = 70 → floor((70 − 40) / 2) = 15 steps; latest 40 + 45.
  plan.observe_arrival(1, 40.0);
  EXPECT_DOUBLE_EQ(plan.speed(1), 2.0);
  EXPECT_EQ(plan.assign(1, 40.0, &opened), 15);
  ASSERT_TRUE(opened.has_value());
  const int g1 = *opened;
  EXPECT_DOUBLE_EQ(plan.latest_arrival_time(g1), 85.0);
  // Client 0 comes back at 50, in time for g0 (latest 50): speed
  // 0.5·1 + 0.5·(30/20) = 1.25; g0 is complete and closes.
  plan.observe_arrival(0, 50.0);
  EXPECT_DOUBLE_EQ(plan.speed(0), 1.25);
  EXPECT_EQ(plan.group_of(0), g0);
  EXPECT_FALSE(plan.is_late(g0, 50.0));
  EXPECT_TRUE(plan.arrive(0, g0));
  EXPECT_EQ(plan.close_group(g0), std::vector<int>{0});
  EXPECT_FALSE(plan.has_group(g0));
  // It joins g1 (expected 70): floor((70 − 50) / 1.25) = 16 steps, so both
  // arrive together.
  EXPECT_EQ(plan.assign(0, 50.0, &opened), 16);
  EXPECT_FALSE(opened.has_value());
  EXPECT_EQ(plan.group_of(0), g1);
  EXPECT_EQ(plan.group_of(1), g1);
  // Client 1 arriving after g1's latest time (85) is late.
  EXPECT_TRUE(plan.is_late(g1, 90.0));
  EXPECT_FALSE(plan.is_late(g1, 80.0));
}

// ---- the simulator, end to end ----

std::string async_config(const std::string& aggregator, int clients, int updates, double scale,
                         bool gradient_based = true) {
  const std::string scheduler = aggregator == "FedCompassAggregator" ? "CompassScheduler" : "AsyncScheduler";
  return "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: " +
         std::to_string(scale) +
         "\n    mode: step\n    num_local_steps: 10\n"
         "  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: 3000\n"
         "server_configs:\n  num_clients: " +
         std::to_string(clients) + "\n  num_global_epochs: " + std::to_string(updates) + "\n  scheduler: " + scheduler +
         "\n  scheduler_kwargs:\n    max_local_steps: 10\n    min_local_steps: 2\n"
         "  aggregator: " +
         aggregator +
         "\n  aggregator_kwargs:\n    alpha: 0.9\n    staleness_fn: polynomial\n    staleness_fn_kwargs:\n      a: "
         "0.5\n"
         "    K: 3\n    gradient_based: " +
         (gradient_based ? std::string("true") : std::string("false")) +
         "\n"
         "  client_speed_distribution: lognormal\n  client_step_time_s: 0.1\n  client_speed_sigma: 0.7\n";
}

std::map<std::string, std::vector<float>> read_model(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  if (!f.ok()) return out;
  for (const auto& t : (*f)->tensors()) {
    if (t.dtype != DType::kF32) continue;
    std::vector<float> v(t.data.size() / 4);
    std::memcpy(v.data(), t.data.data(), t.data.size());
    out[t.name] = v;
  }
  return out;
}

// (transport, aggregator, form): the simulator's virtual clock, or six
// client processes in real time with a gRPC server or as MPI ranks.
class AsyncSimulation : public ::testing::TestWithParam<std::tuple<std::string, std::string, bool>> {};

// The final model is the initial one plus, for every update the log says
// was applied, α·d — d being DummyTrainer's known change for that client and
// trip, α the test's own alpha · (τ+1)^-0.5 / N. The log's clock and versions
// are checked against client_speeds.csv and each other.
TEST_P(AsyncSimulation, TheModelIsTheReplayOfTheAsyncLog) {
  const auto& [transport, aggregator, gradient_based] = GetParam();
  const bool grpc = transport != "simulator";  // real processes, real time
  const int n = 6, updates = 40;
  const double scale = 0.01;
  TempDir tmp;
  {
    std::ofstream(tmp.file("init.yaml")) << async_config(aggregator, n, 1, 0.0, /*gradient_based=*/true);
    std::ofstream(tmp.file("run.yaml")) << async_config(aggregator, n, updates, scale, gradient_based)
                                        << "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:0\n";
  }
  // With no change (scale 0) the gradient is 0: the model stays the initial one.
  Result init = memfl_cli("run " + tmp.file("init.yaml") + " -q --out " + tmp.file("init"));
  ASSERT_EQ(init.exit_code, 0) << init.output;
  // grpc_tcp: the same sessions with the chunks on the TCP data channel.
  const bool over_grpc = transport == "grpc" || transport == "grpc_tcp";
  const std::string channel = " --set server_configs.comm_configs.grpc_configs.data_channel=" +
                              std::string(transport == "grpc_tcp" ? "tcp" : "grpc");
  Result r =
      over_grpc
          ? memfl_cli("launch " + tmp.file("run.yaml") + " --clients 6 -q" + channel + " --out " + tmp.file("out"))
      : transport == "mpi" ? mpirun(n + 1, tmp.file("run.yaml") + " -q --out " + tmp.file("out"))
                           : memfl_cli("run " + tmp.file("run.yaml") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (over_grpc) std::filesystem::rename(tmp.file("out/server"), tmp.file("run"));
  if (transport == "mpi") std::filesystem::rename(tmp.file("out/rank_0"), tmp.file("run"));

  std::vector<double> step_time(n);
  if (!grpc) {
    auto speeds = read_csv(tmp.file("run/client_speeds.csv"));
    ASSERT_EQ(speeds.size(), static_cast<size_t>(n + 1));
    for (int c = 0; c < n; ++c) step_time[static_cast<size_t>(c)] = std::stod(speeds[static_cast<size_t>(c + 1)][1]);
    EXPECT_NE(step_time[0], step_time[1]);  // lognormal: the clients differ
  }

  struct Row {
    int64_t update;
    int client;
    int64_t base, staleness;
    double alpha;
    int64_t steps;
    double dispatched, arrived, applied;
    int64_t version;
    std::string how;
  };
  std::vector<Row> rows;
  auto log = read_csv(tmp.file("run/async_log.csv"));
  ASSERT_GT(log.size(), 1u);
  EXPECT_EQ(log[0][0], "update");
  for (size_t i = 1; i < log.size(); ++i) {
    const auto& c = log[i];
    ASSERT_EQ(c.size(), 11u);
    rows.push_back({std::stoll(c[0]), std::stoi(c[1]), std::stoll(c[2]), std::stoll(c[3]), std::stod(c[4]),
                    std::stoll(c[5]), std::stod(c[6]), std::stod(c[7]), std::stod(c[8]), std::stoll(c[9]), c[10]});
  }
  if (aggregator == "FedAsyncAggregator") {
    ASSERT_EQ(rows.size(), static_cast<size_t>(updates));
  }
  ASSERT_GE(rows.size(), static_cast<size_t>(updates) / 2);

  std::map<int64_t, int> per_version;
  for (const auto& row : rows) per_version[row.version]++;
  for (const auto& row : rows) {
    SCOPED_TRACE("update " + std::to_string(row.update));
    // Staleness: the versions made between its base model and its application.
    EXPECT_EQ(row.staleness, row.version - 1 - row.base);
    EXPECT_GE(row.staleness, 0);
    EXPECT_NEAR(row.alpha, 0.9 * std::pow(row.staleness + 1.0, -0.5) / n, 1e-12);
    // The clock: in the simulator its trip lasted its steps × its time per
    // step; in real time it at least came after it left.
    if (!grpc) {
      EXPECT_NEAR(row.arrived - row.dispatched, row.steps * step_time[static_cast<size_t>(row.client)], 1e-5);
    } else {
      EXPECT_GE(row.arrived, row.dispatched);
    }
    EXPECT_GE(row.applied + 1e-9, row.arrived);
    if (aggregator == "FedAsyncAggregator") {
      EXPECT_EQ(row.steps, 10);
    }
    if (aggregator == "FedAsyncAggregator") {
      EXPECT_EQ(per_version[row.version], 1);
    }
    if (aggregator == "FedBuffAggregator") {
      EXPECT_EQ(per_version[row.version], 3);  // K
    }
    if (aggregator == "FedCompassAggregator") {
      EXPECT_GE(row.steps, 2);
      EXPECT_LE(row.steps, 10);
    }
  }
  if (aggregator == "FedCompassAggregator" && !grpc) {
    // Groups formed: some version took more than one update.
    int biggest = 0;
    for (const auto& [v, k] : per_version) biggest = std::max(biggest, k);
    EXPECT_GE(biggest, 2);
  }
  // FedAsync: each trip starts from the model its previous update made.
  if (aggregator == "FedAsyncAggregator") {
    std::map<int, int64_t> last_version;
    std::map<int, double> last_applied;
    std::vector<Row> by_update = rows;
    std::sort(by_update.begin(), by_update.end(), [](const Row& a, const Row& b) { return a.update < b.update; });
    for (const auto& row : by_update) {
      // (In real time others may be applied before it asks for the model.)
      const int64_t made = last_version.count(row.client) ? last_version[row.client] : 0;
      if (!grpc) {
        EXPECT_EQ(row.base, made) << "update " << row.update;
      } else {
        EXPECT_GE(row.base, made) << "update " << row.update;
      }
      // …and leaves the moment its update was applied (in real time: after).
      const double left = last_applied.count(row.client) ? last_applied[row.client] : 0.0;
      if (!grpc) {
        EXPECT_NEAR(row.dispatched, left, 1e-5);
      } else {
        EXPECT_GE(row.dispatched, left);
      }
      last_version[row.client] = row.version;
      last_applied[row.client] = row.applied;
    }
  }

  // The replay: trips numbered per client in arrival order. An update is
  // d (gradient_based: the change, −g), or the model it trained from plus d;
  // each version is the one before plus Σ α (update − model before).
  auto x = read_model(tmp.file("init/global_model.safetensors"));
  auto got = read_model(tmp.file("run/global_model.safetensors"));
  ASSERT_FALSE(x.empty());
  std::vector<Row> by_update = rows;
  std::sort(by_update.begin(), by_update.end(), [](const Row& a, const Row& b) { return a.update < b.update; });
  std::map<int64_t, int> trip_of;  // update → its client's trip number
  {
    std::map<int, int> trips;
    for (const auto& row : by_update) trip_of[row.update] = ++trips[row.client];
  }
  std::vector<std::map<std::string, std::vector<float>>> versions{x};
  const int64_t last = rows.empty() ? 0 : std::max_element(rows.begin(), rows.end(), [](auto& a, auto& b) {
                                            return a.version < b.version;
                                          })->version;
  for (int64_t v = 1; v <= last; ++v) {
    auto next = versions.back();
    for (const auto& row : by_update) {
      if (row.version != v) continue;
      ASSERT_LT(row.base, v);
      for (auto& [name, w] : next) {
        const auto& before = versions[static_cast<size_t>(v - 1)].at(name);
        const auto& base = versions[static_cast<size_t>(row.base)].at(name);
        for (size_t i = 0; i < w.size(); ++i) {
          const double d = scale * (row.client + 1) * (1 + (i + static_cast<size_t>(trip_of[row.update])) % 5);
          const double update = gradient_based ? d : base[i] + d - before[i];
          w[i] = static_cast<float>(w[i] + row.alpha * update);
        }
      }
    }
    versions.push_back(std::move(next));
  }
  x = versions.back();
  double max_change = 0;
  const auto initial = read_model(tmp.file("init/global_model.safetensors"));
  for (const auto& [name, v] : x) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto& first = initial.at(name);
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_NEAR(got[name][i], v[i], 2e-5) << name << "[" << i << "]";
      max_change = std::max(max_change, std::abs(static_cast<double>(got[name][i]) - first[i]));
    }
  }
  EXPECT_GT(max_change, 1e-3);  // the updates did move the model
}

// An asynchronous run over MPI whose rank 3 (client_2) says a NaN train_loss,
// another version than it was sent, or another client's id, in its first update's metadata: the
// update is refused before a byte counts, naming the client, the rank is out
// and let go at the end, and the run takes all its updates from the other
// three (none of client_2's is in the log, and the log holds numbers only).
class AsyncMpiLyingMetadata : public ::testing::TestWithParam<std::string> {};

TEST_P(AsyncMpiLyingMetadata, IsRefusedTheRankIsOutAndTheRunGoesOn) {
  TempDir tmp;
  const int n = 4, updates = 12;
  // 50 ms of real time per trip: every rank is in before the run's updates are.
  std::string cfg = async_config("FedAsyncAggregator", n, updates, 0.01);
  cfg.replace(cfg.find("    mode: step"), 0, "    dummy_delay_s: \"0.05\"\n");
  std::ofstream(tmp.file("run.yaml")) << cfg;
  setenv("MEMFL_FAULT", GetParam().c_str(), 1);
  setenv("MEMFL_FAULT_RANK", "3", 1);
  Result r = mpirun(n + 1, tmp.file("run.yaml") + " -q --out " + tmp.file("out"));
  unsetenv("MEMFL_FAULT");
  unsetenv("MEMFL_FAULT_RANK");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string why =
      GetParam() == "nan_train_loss" ? "the update of client_2 is refused: its metric train_loss is nan"
      : GetParam() == "wrong_round"  ? "the update of client_2 is refused: it says it is for round 1"
                                     : "the update from rank 3 is refused: it names client_3; the rank hosts client_2";
  EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 3 sent metadata that was refused"), std::string::npos) << r.output;
  const auto log = read_csv(tmp.file("out/rank_0/async_log.csv"));
  ASSERT_EQ(log.size(), static_cast<size_t>(updates + 1)) << r.output;
  std::set<std::string> clients;
  for (size_t i = 1; i < log.size(); ++i) {
    clients.insert(log[i][1]);
    EXPECT_NE(log[i][1], "2") << "update " << log[i][0];
    for (const auto& cell : log[i]) EXPECT_EQ(cell.find("nan"), std::string::npos) << "update " << log[i][0];
  }
  EXPECT_EQ(clients, (std::set<std::string>{"0", "1", "3"}));  // the others all took part
  const std::string summary = testing::read_file(tmp.file("out/rank_0/summary.json"));
  EXPECT_NE(summary.find("\"excluded_ranks\": [\n    3\n  ]"), std::string::npos) << summary;
}

INSTANTIATE_TEST_SUITE_P(Faults, AsyncMpiLyingMetadata,
                         ::testing::Values("nan_train_loss", "wrong_round", "wrong_client"));

// An asynchronous simulation whose virtual time ends before its first
// evaluation has no rounds: the run ends normally and says so (the summary
// line read the last round of an empty list before).
TEST(AsyncSimulationLog, ARunThatEndsBeforeItsFirstEvaluationReportsNoRounds) {
  TempDir tmp;
  std::ofstream(tmp.file("run.yaml")) << async_config("FedAsyncAggregator", 4, 1000, 0.01)
                                      << "  async_virtual_seconds: 0.001\n";
  Result r = memfl_cli("run " + tmp.file("run.yaml") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("done: 0 rounds"), std::string::npos) << r.output;
}

// A run killed with SIGKILL keeps the log of the updates it applied: rows
// are handed to the kernel as they are written (before, the log was 0 bytes
// while metrics.csv had rows).
TEST(AsyncSimulationLog, ARunKilledInTheMiddleKeepsItsAsyncLog) {
  TempDir tmp;
  // Slow DummyTrainer steps (50 ms of real time per trip) so the run is
  // still going when it is killed.
  std::string cfg = async_config("FedAsyncAggregator", 4, 100000, 0.01);
  cfg.replace(cfg.find("    mode: step"), 0, "    dummy_delay_s: \"0.05\"\n");
  std::ofstream(tmp.file("run.yaml")) << cfg << "  async_eval_every: 4\n";
  const std::string dir = tmp.file("run");
  Result r =
      run_shell(std::string(MEMFL_BINARY) + " run " + tmp.file("run.yaml") + " -q --out " + dir +
                " > /dev/null 2>&1 & pid=$!; for i in $(seq 300); do [ \"$(wc -l < " + dir +
                "/metrics.csv 2>/dev/null || echo 0)\" -ge 4 ] && break; sleep 0.1; done; kill -9 $pid; wait $pid; "
                "exit 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto metrics = read_csv(dir + "/metrics.csv");
  ASSERT_GE(metrics.size(), 4u) << "the run was evaluated three times before it was killed";
  const auto log = read_csv(dir + "/async_log.csv");
  ASSERT_FALSE(log.empty());
  EXPECT_EQ(log[0][0], "update");
  // At least the updates behind the evaluations metrics.csv has (4 each).
  EXPECT_GE(log.size() - 1, 4 * (metrics.size() - 1));
  for (size_t i = 1; i < log.size(); ++i) EXPECT_EQ(log[i].size(), 11u) << "row " << i << " is whole";
}

#ifdef MEMFL_HAVE_GRPC
// A client that asks for the model and stops reading it (SIGSTOP after its
// first chunk, with a model far larger than gRPC's and the kernel's buffers)
// holds its send open. Applying an update waits for senders, so before the
// send had a deadline every other client's update waited with it (75 s
// seen). Now the stalled send is cancelled at broadcast_timeout_s and the
// other clients' updates are applied: the run ends with all its updates.
TEST(AsyncGrpc, AClientThatStopsReadingTheModelDoesNotFreezeTheOthers) {
  // Either bound ends the stalled send: the broadcast deadline from the
  // send's start, or — with the broadcast deadline at its default of 600 s —
  // connect_timeout_s without a chunk taken while an update waits.
  const std::vector<std::pair<std::string, std::string>> bounds = {
      {"--set server_configs.broadcast_timeout_s=3", "did not take the model within 3 s"},
      {"--set server_configs.comm_configs.grpc_configs.connect_timeout_s=3", "took no chunk of the model for 3 s"},
  };
  for (const auto& [sets, said] : bounds) {
    SCOPED_TRACE(sets);
    TempDir tmp;
    const int updates = 8;
    std::string cfg = async_config("FedAsyncAggregator", 3, updates, 0.01);
    // 16 M parameters: 64 MiB, many times what the transport buffers.
    cfg.replace(cfg.find("num_params: 3000"), std::string("num_params: 3000").size(), "num_params: 16000000");
    std::ofstream(tmp.file("run.yaml")) << cfg
                                        << "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:17391\n";
    const std::string bin = MEMFL_BINARY, dir = tmp.file("out");
    std::filesystem::create_directories(dir);
    std::string clients;
    for (int c = 0; c < 3; ++c) {
      clients += std::string(c == 1 ? "MEMFL_FAULT=stop_in_broadcast MEMFL_FAULT_CLIENT=1 " : "") + bin + " client " +
                 tmp.file("run.yaml") + " --client-id " + std::to_string(c) + " -q --out " + dir + "/client_" +
                 std::to_string(c) + " > " + dir + "/client_" + std::to_string(c) + ".log 2>&1 & echo $! >> " + dir +
                 "/pids; ";
    }
    const auto t0 = std::chrono::steady_clock::now();
    // `timeout` ends a frozen server instead of the test; the stopped client
    // never ends by itself.
    Result r = run_shell(clients + "timeout -s KILL 150 " + bin + " server " + tmp.file("run.yaml") + " -q " + sets +
                         " --out " + dir + "/server > " + dir + "/server.log 2>&1; rc=$?; kill -9 $(cat " + dir +
                         "/pids) 2>/dev/null; wait; exit $rc");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ifstream log(dir + "/server.log");
    const std::string text((std::istreambuf_iterator<char>(log)), {});
    ASSERT_EQ(r.exit_code, 0) << r.output << text;
    auto rows = read_csv(dir + "/server/async_log.csv");
    ASSERT_EQ(rows.size(), static_cast<size_t>(updates + 1)) << text;
    for (size_t i = 1; i < rows.size(); ++i) EXPECT_NE(rows[i][1], "1") << "the stopped client sent nothing";
    EXPECT_NE(text.find(said), std::string::npos) << text;
    EXPECT_LT(seconds, 140) << "not ended by the timeout";
  }
}
#endif

std::vector<std::string> async_transports() {
  std::vector<std::string> t = {"simulator"};
#ifdef MEMFL_HAVE_GRPC
  t.push_back("grpc");
  t.push_back("grpc_tcp");
#endif
#ifdef MEMFL_TEST_MPI
  t.push_back("mpi");
#endif
  return t;
}

INSTANTIATE_TEST_SUITE_P(Rules, AsyncSimulation,
                         ::testing::Combine(::testing::ValuesIn(async_transports()),
                                            ::testing::Values("FedAsyncAggregator", "FedBuffAggregator",
                                                              "FedCompassAggregator"),
                                            ::testing::Bool()),
                         [](const auto& which) {
                           return std::get<0>(which.param) + "_" + std::get<1>(which.param) +
                                  (std::get<2>(which.param) ? "_change" : "_model");
                         });

TEST(AsyncSimulationScale, AThousandClientsInOneProcessInVirtualTime) {
  TempDir tmp;
  std::string cfg = async_config("FedAsyncAggregator", 1000, 3000, 0.001);
  std::ofstream(tmp.file("c.yaml")) << cfg << "  async_eval_every: 1000\n";
  Result r = memfl_cli("run " + tmp.file("c.yaml") + " -q --out " + tmp.file("run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto log = read_csv(tmp.file("run/async_log.csv"));
  ASSERT_EQ(log.size(), 3001u);
  std::vector<int> seen(1000, 0);
  for (size_t i = 1; i < log.size(); ++i) seen[static_cast<size_t>(std::stoi(log[i][1]))]++;
  // Fast clients come back more often than slow ones; most have come once.
  EXPECT_GT(*std::max_element(seen.begin(), seen.end()), 3);
  EXPECT_GT(std::count_if(seen.begin(), seen.end(), [](int k) { return k > 0; }), 900);
  auto metrics = read_csv(tmp.file("run/metrics.csv"));
  ASSERT_EQ(metrics.size(), 4u);  // header + every 1000 updates
  const size_t clock =
      static_cast<size_t>(std::find(metrics[0].begin(), metrics[0].end(), "virtual_seconds") - metrics[0].begin());
  ASSERT_LT(clock, metrics[0].size()) << "metrics.csv has a virtual_seconds column";
  EXPECT_GT(std::stod(metrics[3][clock]), std::stod(metrics[1][clock]));
}

// compare-algorithms on the same clients: a synchronous round lasts as long
// as its slowest client (10 steps × the largest time per step in the
// speeds the asynchronous run wrote), asynchronous clients do not wait.
TEST(CompareAlgorithms, SyncRoundsWaitForTheSlowestClientAsyncOnesDoNot) {
  TempDir tmp;
  std::ofstream(tmp.file("c.yaml")) << async_config("FedAsyncAggregator", 4, 3, 0.01);
  Result r =
      memfl_cli("compare-algorithms " + tmp.file("c.yaml") + " --algorithms FedAvg,FedAsync --out " + tmp.file("cmp"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto speeds = read_csv(tmp.file("cmp/FedAsync/client_speeds.csv"));
  ASSERT_EQ(speeds.size(), 5u);
  double slowest = 0;
  for (size_t i = 1; i < speeds.size(); ++i) slowest = std::max(slowest, std::stod(speeds[i][1]));
  auto results = read_csv(tmp.file("cmp/results.csv"));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[1][0], "FedAvg");
  EXPECT_EQ(results[2][0], "FedAsync");
  const double sync_time = std::stod(results[1][4]), async_time = std::stod(results[2][4]);
  EXPECT_NEAR(sync_time, 3 * 10 * slowest, 1e-3);
  EXPECT_LT(async_time, sync_time);  // 12 updates, without waiting for the slowest
  auto log = read_csv(tmp.file("cmp/FedAsync/async_log.csv"));
  EXPECT_EQ(log.size(), 13u);  // 3 rounds × 4 clients of updates
  for (const char* f : {"compare.html", "accuracy_vs_time.svg", "accuracy_vs_rounds.svg", "curves.csv"})
    EXPECT_TRUE(std::filesystem::exists(tmp.file(std::string("cmp/") + f))) << f;
  // --equal-time: FedAsync runs until FedAvg's virtual time, and takes more
  // updates in it than FedAvg did.
  Result eq = memfl_cli("compare-algorithms " + tmp.file("c.yaml") +
                        " --algorithms FedAsync,FedAvg --equal-time --out " + tmp.file("eq"));
  ASSERT_EQ(eq.exit_code, 0) << eq.output;
  auto eq_results = read_csv(tmp.file("eq/results.csv"));
  ASSERT_EQ(eq_results.size(), 3u);
  EXPECT_EQ(eq_results[1][0], "FedAvg");  // the synchronous one runs first: its time is the budget
  EXPECT_NEAR(std::stod(eq_results[2][4]), sync_time, 1e-3);
  auto eq_log = read_csv(tmp.file("eq/FedAsync/async_log.csv"));
  EXPECT_GT(eq_log.size(), 13u);
  for (size_t i = 1; i < eq_log.size(); ++i)
    EXPECT_LE(std::stod(eq_log[i][7]), sync_time + 1e-3);  // (results.csv rounds to ms)
}

// APPFL's example server_configs blocks for the asynchronous algorithms
// (examples/resources/configs/mnist/server_fed{async,buff,compass}.yaml), as
// APPFL writes them.
TEST(Config, AppflAsyncServerConfigsLoadAsWritten) {
  const std::string common =
      "  device: \"cpu\"\n  num_global_epochs: 20\n  logging_output_dirname: \"./output\"\n"
      "  logging_output_filename: \"result\"\n  comm_configs:\n    grpc_configs:\n"
      "      server_uri: localhost:50051\n      max_message_size: 1048576\n      use_ssl: False\n";
  const std::string fedasync =
      "server_configs:\n  num_clients: 2\n  scheduler: \"AsyncScheduler\"\n  scheduler_kwargs:\n"
      "    same_init_model: True\n  aggregator: \"FedAsyncAggregator\"\n  aggregator_kwargs:\n"
      "    client_weights_mode: \"equal\"\n    staleness_fn: \"polynomial\"\n    staleness_fn_kwargs:\n      a: 0.5\n"
      "    alpha: 0.9\n    gradient_based: True\n" +
      common;
  const std::string fedbuff =
      "server_configs:\n  num_clients: 2\n  scheduler: \"AsyncScheduler\"\n  scheduler_kwargs:\n"
      "    same_init_model: True\n  aggregator: \"FedBuffAggregator\"\n  aggregator_kwargs:\n"
      "    client_weights_mode: \"equal\"\n    staleness_fn: \"polynomial\"\n    staleness_fn_kwargs:\n      a: 0.5\n"
      "    alpha: 0.9\n    gradient_based: True\n    K: 3\n" +
      common;
  const std::string fedcompass =
      "server_configs:\n  num_clients: 2\n  scheduler: \"CompassScheduler\"\n  scheduler_kwargs:\n"
      "    same_init_model: True\n    max_local_steps: 100\n    min_local_steps: 20\n    speed_momentum: 0.9\n"
      "    latest_time_factor: 1.5\n  aggregator: \"FedCompassAggregator\"\n  aggregator_kwargs:\n"
      "    weights: \"sample_size\"\n    staleness_fn: \"polynomial\"\n    staleness_fn_kwargs:\n      a: 0.5\n"
      "    alpha: 0.9\n    gradient_based: True\n" +
      common;
  auto a = load_config_text(fedasync, "server_fedasync.yaml");
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->server.scheduler, "AsyncScheduler");
  EXPECT_DOUBLE_EQ(a->server.staleness_a, 0.5);
  EXPECT_TRUE(a->server.gradient_based);
  auto b = load_config_text(fedbuff, "server_fedbuff.yaml");
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(b->server.buffer_size, 3);
  auto c = load_config_text(fedcompass, "server_fedcompass.yaml");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->server.max_local_steps, 100);
  EXPECT_EQ(c->server.min_local_steps, 20);
  EXPECT_EQ(c->server.client_weights_mode, "sample_size");  // FedCompass's `weights`

  // What cannot be honoured is named.
  auto mismatch = load_config_text(fedbuff, "x.yaml", {"server_configs.scheduler=CompassScheduler"});
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("FedBuffAggregator"), std::string::npos);
  EXPECT_NE(mismatch.status().message().find("CompassScheduler"), std::string::npos);
  auto count = load_config_text(fedasync, "x.yaml", {"server_configs.aggregator_kwargs.num_clients=5"});
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("aggregator_kwargs.num_clients"), std::string::npos);
  auto init = load_config_text(fedasync, "x.yaml", {"server_configs.scheduler_kwargs.same_init_model=false"});
  ASSERT_FALSE(init.ok());
  EXPECT_NE(init.status().message().find("same_init_model"), std::string::npos);
  auto fn = load_config_text(fedasync, "x.yaml", {"server_configs.aggregator_kwargs.staleness_fn=linear"});
  ASSERT_FALSE(fn.ok());
  EXPECT_NE(fn.status().message().find("staleness_fn"), std::string::npos);
}

}  // namespace
}  // namespace memfl
