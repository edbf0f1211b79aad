// The server's value checks on client updates (comm/update_check.h): a NaN
// or Inf anywhere in a float tensor, cut by chunk edges anywhere, is found and
// named; integers and padding are not read as floats; an update refused at
// its first chunk leaves the round to the others.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "comm/update_check.h"
#include "comm/update_report.h"
#include "test_util.h"

namespace memfl {
namespace {

Layout mixed_layout() {
  LayoutBuilder b;
  b.add("embed.weight", DType::kBF16, {37, 3})
      .add("bn.num_batches_tracked", DType::kI64, {3})
      .add("conv.weight", DType::kF32, {5, 7})
      .add("head.weight", DType::kF16, {11})
      .add("fc.bias", DType::kF32, {13});
  return std::move(b).build().value();
}

// Writes a non-finite value of the entry's dtype at element i.
void poison(Arena& arena, const LayoutEntry& e, size_t i, bool nan) {
  std::byte* p = arena.data() + e.offset + i * dtype_size(e.dtype);
  if (e.dtype == DType::kF32) {
    const float v = nan ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
    std::memcpy(p, &v, 4);
  } else {
    // bf16 NaN 0x7fc0, -Inf 0xff80; f16 NaN 0x7e00, -Inf 0xfc00 (IEEE 754 encodings).
    const uint16_t bits = e.dtype == DType::kBF16 ? (nan ? 0x7fc0 : 0xff80) : (nan ? 0x7e00 : 0xfc00);
    std::memcpy(p, &bits, 2);
  }
}

// Feeds `arena` to a FiniteValueCheck in chunks of `chunk` bytes, each cut
// again into pieces of `piece` bytes (a gRPC chunk arrives in slices).
Status check_in_chunks(const Layout& layout, const Arena& arena, size_t chunk, size_t piece) {
  FiniteValueCheck check(layout);
  for (size_t off = 0; off < layout.total_bytes(); off += chunk) {
    const size_t len = std::min(chunk, layout.total_bytes() - off);
    std::vector<std::span<const std::byte>> pieces;
    for (size_t p = 0; p < len; p += piece) pieces.push_back(arena.bytes(off + p, std::min(piece, len - p)));
    MEMFL_RETURN_IF_ERROR(check.check(off, Payload(pieces.data(), pieces.size()), "client_4", 7));
  }
  return Status::Ok();
}

TEST(UpdateCheck, ANonFiniteElementIsFoundAndNamedWhereverChunkEdgesCutIt) {
  const Layout layout = mixed_layout();
  Arena clean(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, clean, 5);
  // Odd chunk and piece sizes put edges inside 2- and 4-byte elements.
  for (size_t chunk : {size_t{3}, size_t{7}, size_t{64}, size_t{1000}, layout.total_bytes()}) {
    for (size_t piece : {size_t{1}, size_t{5}, size_t{4096}}) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << " piece " << piece);
      EXPECT_TRUE(check_in_chunks(layout, clean, chunk, piece).ok());
      for (const auto& e : layout.entries()) {
        if (!dtype_is_float(e.dtype)) continue;
        for (size_t i : {size_t{0}, e.numel() / 2, e.numel() - 1}) {
          for (bool nan : {true, false}) {
            Arena bad(layout.total_bytes(), MemoryCategory::kModel);
            std::memcpy(bad.data(), clean.data(), layout.total_bytes());
            poison(bad, e, i, nan);
            const Status st = check_in_chunks(layout, bad, chunk, piece);
            ASSERT_FALSE(st.ok()) << e.name << " " << i;
            EXPECT_EQ(st.code(), StatusCode::kRejected);
            const std::string want = "round 7: the update of client_4 is refused: tensor '" + e.name + "' element " +
                                     std::to_string(i) + " is " + (nan ? "NaN" : "-Inf");
            EXPECT_EQ(st.message(), want);
          }
        }
      }
    }
  }
}

// A 16 MiB run is checked in pieces (of at least 1 MiB, one a thread) at
// once: the element named is still the first bad one (here a NaN that ends
// the first half and an Inf early in the second, in a later piece whatever
// the number of threads, which a pool thread may find first).
TEST(UpdateCheck, AParallelCheckNamesTheFirstBadElement) {
  constexpr size_t n = size_t{8} << 20;  // bf16: 16 MiB
  std::vector<uint16_t> v(n, 0x3f80);    // 1.0
  EXPECT_EQ(first_non_finite_parallel(DType::kBF16, reinterpret_cast<const std::byte*>(v.data()), n), n);
  v[n - 1] = 0x7f80;  // +Inf, the last element
  EXPECT_EQ(first_non_finite_parallel(DType::kBF16, reinterpret_cast<const std::byte*>(v.data()), n), n - 1);
  v[n / 2 + 5] = 0xff80;  // -Inf
  v[n / 2 - 1] = 0x7fc0;  // NaN
  EXPECT_EQ(first_non_finite_parallel(DType::kBF16, reinterpret_cast<const std::byte*>(v.data()), n), n / 2 - 1);
  // The serial check agrees.
  EXPECT_EQ(first_non_finite(DType::kBF16, reinterpret_cast<const std::byte*>(v.data()), n), n / 2 - 1);
}

TEST(UpdateCheck, IntegerTensorsAndPaddingAreNotReadAsFloats) {
  const Layout layout = mixed_layout();
  Arena a(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, a, 9);
  // A counter whose bytes would be NaN as floats, and NaN bytes in the
  // padding between entries: neither is a float element of the model.
  const LayoutEntry& counter = *layout.find("bn.num_batches_tracked");
  const int64_t looks_nan = 0x7fc000007fc00000LL;
  for (size_t i = 0; i < 3; ++i) std::memcpy(a.data() + counter.offset + 8 * i, &looks_nan, 8);
  const LayoutEntry& embed = *layout.find("embed.weight");
  ASSERT_LT(embed.end(), counter.offset) << "the layout pads between these entries";
  for (size_t at = embed.end(); at + 4 <= counter.offset; at += 4) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(a.data() + at, &nan, 4);
  }
  for (size_t chunk : {size_t{3}, size_t{64}, layout.total_bytes()}) {
    EXPECT_TRUE(check_in_chunks(layout, a, chunk, 4096).ok()) << chunk;
  }
}

TEST(UpdateCheck, SampleCountsMustBeFinitePositiveAndBounded) {
  const UpdateLimits limits{1e6};
  EXPECT_TRUE(check_sample_count(1, limits, "client_0", 1).ok());
  EXPECT_TRUE(check_sample_count(1e6, limits, "client_0", 1).ok());
  for (double bad : {0.0, -3.0, 1e6 * 1.0000001, 1e308, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    const Status st = check_sample_count(bad, limits, "client_2", 4);
    ASSERT_FALSE(st.ok()) << bad;
    EXPECT_EQ(st.code(), StatusCode::kRejected);
    EXPECT_NE(st.message().find("round 4: the update of client_2 is refused"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("server_configs.max_num_samples"), std::string::npos) << st.message();
  }
}

// Through the aggregator: client_1's update carries an Inf in its first
// chunk and client_3 reports 1e308 samples; both are refused, and the round
// is the weighted mean of clients 0 and 2 alone, computed here.
TEST(UpdateCheck, AnUpdateForAnotherRoundIsRefusedNamingTheClient) {
  EXPECT_TRUE(check_update_round(3, 3, "client_1").ok());
  for (int claimed : {2, 4, 0, -1}) {
    const Status st = check_update_round(claimed, 3, "client_1");
    EXPECT_EQ(st.code(), StatusCode::kRejected) << claimed;
    EXPECT_NE(st.message().find("round 3: the update of client_1 is refused: it says it is for round " +
                                std::to_string(claimed)),
              std::string::npos)
        << st.message();
  }
}

TEST(UpdateCheck, MetricsMustBeFiniteAndTheBadOneIsNamed) {
  std::map<std::string, double> metrics{{"train_loss", 0.5}, {"val_accuracy", 1.0}, {"local_steps", 10}};
  EXPECT_TRUE(check_update_metrics(metrics, "client_0", 2).ok());
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    metrics["val_accuracy"] = bad;
    const Status st = check_update_metrics(metrics, "client_3", 2);
    EXPECT_EQ(st.code(), StatusCode::kRejected) << bad;
    EXPECT_NE(st.message().find("round 2: the update of client_3 is refused: its metric val_accuracy is"),
              std::string::npos)
        << st.message();
  }
  // DP-SGD without noise spends ε = +∞: reported, not refused; a NaN ε is.
  metrics["val_accuracy"] = 1.0;
  metrics["epsilon"] = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(check_update_metrics(metrics, "client_0", 2).ok());
  metrics["epsilon"] = std::nan("");
  EXPECT_EQ(check_update_metrics(metrics, "client_0", 2).code(), StatusCode::kRejected);
}

// The one report every transport sends (comm/update_report.h): what is
// encoded decodes to the same numbers, the validation weighs by its own
// samples (not the training count), and a count is checked before any cast.
TEST(UpdateReport, WhatIsEncodedDecodesAndTheValidationWeighsByItsSamples) {
  UpdateReport r;
  r.sample_count = 120;
  r.train_loss = 1.25;
  r.train_accuracy = 0.5;
  r.val_samples = 30;
  r.val_loss = 2.5;
  r.val_accuracy = 0.375;
  r.local_steps = 17;
  r.dp_steps = 17;
  r.dp_sample_rate = 0.0625;
  r.has_epsilon = true;
  r.epsilon = 3.5;
  auto back = decode_update_report(r.sample_count, encode_update_report(r), "client_3", 2);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->val_samples, 30);
  EXPECT_EQ(back->val_loss, 2.5);
  EXPECT_EQ(back->val_accuracy, 0.375);
  EXPECT_EQ(back->local_steps, 17);
  EXPECT_EQ(back->dp_steps, 17);
  EXPECT_EQ(back->dp_sample_rate, 0.0625);
  EXPECT_TRUE(back->has_epsilon);
  const ClientUpdateInfo info = update_info(3, *back);
  EXPECT_TRUE(info.has_validation);
  EXPECT_EQ(info.val_weight, 30.0) << "weighed by the held-out samples, not the 120 trained on";
  EXPECT_EQ(info.dp_steps, 17);

  // No validation run: none reported, none counted.
  UpdateReport plain;
  plain.sample_count = 5;
  plain.train_loss = 0.75;
  const auto m = encode_update_report(plain);
  EXPECT_EQ(m.count("val_loss"), 0u);
  auto p = decode_update_report(5, m, "client_0", 1);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(update_info(0, *p).has_validation);

  // A Python client's own metric names pass if they are numbers.
  EXPECT_TRUE(decode_update_report(5, std::map<std::string, double>{{"my_metric", 4.0}}, "client_0", 1).ok());
}

TEST(UpdateReport, ACountThatIsNotAWholeNumberInRangeIsRefusedBeforeItIsCast) {
  auto refused = [](const std::map<std::string, double>& m) {
    auto r = decode_update_report(10, m, "client_7", 4);
    EXPECT_FALSE(r.ok());
    if (r.ok()) return std::string();
    EXPECT_EQ(r.status().code(), StatusCode::kRejected);
    EXPECT_NE(r.status().message().find("client_7"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("round 4"), std::string::npos) << r.status().message();
    return r.status().message();
  };
  EXPECT_NE(refused({{"local_steps", 1e300}}).find("local_steps"), std::string::npos);
  EXPECT_NE(refused({{"local_steps", 2.5}}).find("whole number"), std::string::npos);
  EXPECT_NE(refused({{"dp_steps", -1}}).find("dp_steps"), std::string::npos);
  EXPECT_NE(refused({{"val_samples", 9007199254740994.0}, {"val_loss", 1}, {"val_accuracy", 0}}).find("val_samples"),
            std::string::npos);
  EXPECT_NE(refused({{"dp_sample_rate", 1.5}}).find("[0, 1]"), std::string::npos);
  EXPECT_NE(refused({{"val_samples", 3}}).find("without val_loss"), std::string::npos);
  EXPECT_NE(refused({{"val_loss", std::nan("")}}).find("val_loss"), std::string::npos);
  EXPECT_NE(refused({{"their_own", INFINITY}}).find("their_own"), std::string::npos);
}

TEST(UpdateCheck, RefusedUpdatesLeaveTheRoundToTheOthers) {
  LayoutBuilder b;
  b.add("w", DType::kF32, {1000}).add("b", DType::kF32, {10});
  const Layout layout = std::move(b).build().value();
  std::vector<Arena> clients;
  for (int k = 0; k < 4; ++k) {
    clients.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(layout, clients.back(), 30 + k);
  }
  poison(clients[1], layout.entries()[0], 17, false);
  const std::vector<double> samples = {10, 20, 30, 1e308};
  FedAvgAggregator agg(layout, ClientWeightsMode::kSampleSize);
  ASSERT_TRUE(agg.begin_round(3, {"client_0", "client_1", "client_2", "client_3"}).ok());
  CheckedUpdateOpener checked(agg, layout, 3, UpdateLimits{1e12});
  std::vector<Status> outcome;
  for (int k = 0; k < 4; ++k) {
    const std::string id = "client_" + std::to_string(k);
    auto up = checked.open_update(id, samples[static_cast<size_t>(k)]);
    if (!up.ok()) {
      outcome.push_back(up.status());
      ASSERT_TRUE(agg.withdraw(id).ok());
      continue;
    }
    auto sent = stream_arena(layout, clients[static_cast<size_t>(k)], 1024, **up);
    outcome.push_back(sent.ok() ? (*up)->commit() : sent.status());
    if (!outcome.back().ok()) {
      up->reset();
      ASSERT_TRUE(agg.withdraw(id).ok());
    }
  }
  EXPECT_TRUE(outcome[0].ok());
  EXPECT_TRUE(outcome[2].ok());
  EXPECT_EQ(outcome[1].code(), StatusCode::kRejected);
  EXPECT_EQ(outcome[1].message(), "round 3: the update of client_1 is refused: tensor 'w' element 17 is -Inf");
  EXPECT_EQ(outcome[3].code(), StatusCode::kRejected);
  EXPECT_NE(outcome[3].message().find("client_3"), std::string::npos);
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(global).ok());
  EXPECT_EQ(agg.num_committed(), 2);
  for (const auto& e : layout.entries()) {
    for (size_t i = 0; i < e.numel(); ++i) {
      const double want =
          (10 * testing::element_as_double(clients[0], e, i) + 30 * testing::element_as_double(clients[2], e, i)) / 40;
      EXPECT_NEAR(testing::element_as_double(global, e, i), want, 1e-6 * (1 + std::abs(want))) << e.name << i;
    }
  }
}

// A chunk damaged on the way that happens to hold a NaN is a checksum
// error, as it would be without the value check.
TEST(UpdateCheck, ADamagedChunkIsAChecksumErrorNotARefusal) {
  LayoutBuilder b;
  b.add("w", DType::kF32, {64});
  const Layout layout = std::move(b).build().value();
  Arena a(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, a, 1);
  FedAvgAggregator agg(layout, ClientWeightsMode::kEqual);
  ASSERT_TRUE(agg.begin_round(1).ok());
  CheckedUpdateOpener checked(agg, layout, 1, UpdateLimits{});
  auto up = checked.open_update("client_0", 1);
  ASSERT_TRUE(up.ok());
  const ChunkHeader h{layout.hash(), 0, layout.total_bytes(), chunk_checksum(a.bytes(0, layout.total_bytes()))};
  poison(a, layout.entries()[0], 3, true);
  const Status st = (*up)->accept(h, a.bytes(0, layout.total_bytes()));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.message();
}

}  // namespace
}  // namespace memfl
