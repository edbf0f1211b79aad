#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "data/dataset.h"
#include "data/partition.h"
#include "memory/sampler.h"
#include "test_util.h"

namespace memfl {
namespace {

std::vector<uint8_t> labels(size_t n, int classes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> l(n);
  for (auto& x : l) x = static_cast<uint8_t>(rng() % static_cast<uint64_t>(classes));
  return l;
}

void expect_exact_cover(const std::vector<std::vector<uint32_t>>& parts, size_t n) {
  std::vector<int> seen(n, 0);
  for (const auto& p : parts) {
    EXPECT_FALSE(p.empty());
    for (uint32_t i : p) {
      ASSERT_LT(i, n);
      seen[i]++;
    }
  }
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "sample " << i;
}

class Partitions : public ::testing::TestWithParam<PartitionStrategy> {};

TEST_P(Partitions, CoverEverySampleExactlyOnce) {
  for (int clients : {1, 3, 10, 37}) {
    auto l = labels(5003, 10, 1);
    PartitionSpec spec{GetParam(), clients, 0.3, 2, 99};
    auto parts = partition_indices(l, 10, spec);
    ASSERT_TRUE(parts.ok()) << parts.status().to_string();
    ASSERT_EQ(parts->size(), static_cast<size_t>(clients));
    expect_exact_cover(*parts, l.size());
    // And after the train/validation split too.
    auto split = split_train_val(*parts, 0.1, 5);
    std::vector<std::vector<uint32_t>> flat;
    for (auto& c : split) {
      EXPECT_FALSE(c.train.empty());
      flat.push_back(c.train);
      flat.back().insert(flat.back().end(), c.val.begin(), c.val.end());
    }
    expect_exact_cover(flat, l.size());
  }
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, Partitions,
                         ::testing::Values(PartitionStrategy::kIid, PartitionStrategy::kDirichlet,
                                           PartitionStrategy::kClassShards, PartitionStrategy::kLognormal,
                                           PartitionStrategy::kPowerLaw),
                         [](const auto& p) { return std::string(partition_strategy_name(p.param)); });

std::set<int> classes_of(const std::vector<uint32_t>& idx, const std::vector<uint8_t>& l) {
  std::set<int> s;
  for (uint32_t i : idx) s.insert(l[i]);
  return s;
}

TEST(Partition, ClassShardsGiveFewClassesPerClient) {
  auto l = labels(6000, 10, 2);
  auto parts = partition_indices(l, 10, {PartitionStrategy::kClassShards, 10, 0, 2, 3});
  ASSERT_TRUE(parts.ok());
  for (const auto& p : *parts) EXPECT_LE(classes_of(p, l).size(), 4u);  // 2 shards, each spans ≤2 classes
}

TEST(Partition, SmallDirichletAlphaSkewsLabels) {
  auto l = labels(10000, 10, 3);
  auto skewed = partition_indices(l, 10, {PartitionStrategy::kDirichlet, 10, 0.05, 2, 4});
  auto iid = partition_indices(l, 10, {PartitionStrategy::kIid, 10, 0, 2, 4});
  ASSERT_TRUE(skewed.ok() && iid.ok());
  // Largest share of one class in a client, averaged over clients.
  auto dominance = [&](const std::vector<std::vector<uint32_t>>& parts) {
    double sum = 0;
    for (const auto& p : parts) {
      std::vector<int> count(10);
      for (uint32_t i : p) count[l[i]]++;
      sum += static_cast<double>(*std::max_element(count.begin(), count.end())) / static_cast<double>(p.size());
    }
    return sum / static_cast<double>(parts.size());
  };
  EXPECT_GT(dominance(*skewed), 0.5);
  EXPECT_LT(dominance(*iid), 0.2);
}

TEST(Partition, QuantitySkewGivesUnequalSizes) {
  auto l = labels(20000, 10, 6);
  for (auto strategy : {PartitionStrategy::kLognormal, PartitionStrategy::kPowerLaw}) {
    PartitionSpec spec{strategy, 50, 0.5, 2, 8};
    auto parts = partition_indices(l, 10, spec);
    ASSERT_TRUE(parts.ok());
    size_t mn = SIZE_MAX, mx = 0;
    for (const auto& p : *parts) {
      mn = std::min(mn, p.size());
      mx = std::max(mx, p.size());
    }
    EXPECT_GE(mx, 4 * mn) << partition_strategy_name(strategy);
  }
}

// The same seed gives the same partition, and the seed is what decides it:
// another seed (everything else equal) gives another one, for every
// strategy that draws at random.
TEST(Partition, IsDeterministicForASeed) {
  auto l = labels(1000, 10, 4);
  for (auto strategy : {PartitionStrategy::kIid, PartitionStrategy::kDirichlet}) {
    PartitionSpec spec{strategy, 5, 0.5, 2, 17};
    PartitionSpec other = spec;
    other.seed = 18;
    const auto a = partition_indices(l, 10, spec), again = partition_indices(l, 10, spec);
    const auto b = partition_indices(l, 10, other);
    ASSERT_TRUE(a.ok() && again.ok() && b.ok());
    EXPECT_EQ(*a, *again);
    EXPECT_NE(*a, *b) << "the seed is ignored";
  }
}

TEST(Partition, RejectsMoreClientsThanSamples) {
  auto l = labels(5, 10, 5);
  auto parts = partition_indices(l, 10, {PartitionStrategy::kIid, 6, 0, 2, 1});
  ASSERT_FALSE(parts.ok());
  EXPECT_NE(parts.status().message().find("5 training samples cannot be split among 6 clients"), std::string::npos);
}

TEST(Dataset, SyntheticCifarIsSeededAndShaped) {
  auto a = make_synthetic_cifar10(50, 10, 7), b = make_synthetic_cifar10(50, 10, 7);
  EXPECT_EQ(a.train.pixels, b.train.pixels);
  EXPECT_EQ(a.train.pixels.size(), 50u * 3 * 32 * 32);
  EXPECT_EQ(a.test.size(), 10u);
  EXPECT_NE(make_synthetic_cifar10(50, 10, 8).train.pixels, a.train.pixels);
}

TEST(Dataset, MissingFashionMnistNamesThePackage) {
  auto d = load_fashion_mnist("/nonexistent/fmnist");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("dataset-fashion-mnist"), std::string::npos);
}

TEST(Dataset, ReadsTheDebianPackagesGzippedFiles) {
  auto d = load_fashion_mnist("", 1000, 500);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->train.size(), 1000u);
  EXPECT_EQ(d->test.size(), 500u);
  EXPECT_EQ(d->train.height, 28);
  std::set<int> cls(d->train.labels.begin(), d->train.labels.end());
  EXPECT_EQ(cls.size(), 10u);
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// A header that claims 16 GiB (1048576 × 128 × 128 bytes) over 38 bytes of
// data: the reader must fail on what the file holds, without allocating
// what the header claims.
void write_lying_idx(const std::string& path) {
  const unsigned char header[] = {0, 0, 0x08, 3, 0x00, 0x10, 0x00, 0x00, 0, 0, 0, 128, 0, 0, 0, 128};
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  for (int i = 0; i < 38; ++i) out.put(static_cast<char>(i));
}

TEST(IdxReader, AHeaderClaimingGigabytesCostsNoMemory) {
  testing::TempDir tmp;
  const std::string plain = tmp.file("lying-idx3-ubyte");
  write_lying_idx(plain);
  ASSERT_EQ(std::filesystem::file_size(plain), 54u);
  ASSERT_EQ(std::system(("gzip -c " + plain + " > " + plain + ".gz").c_str()), 0);
  const int64_t before = read_peak_rss_bytes();
  for (const std::string& path : {plain, plain + ".gz"}) {
    std::vector<int64_t> dims;
    auto r = read_idx_file(path, 3, &dims);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("17179869184"), std::string::npos) << r.status().message();
  }
  // The kernel's high-water mark: 16 GiB zeroed would show; 16 MiB may.
  EXPECT_LT(read_peak_rss_bytes() - before, int64_t{64} << 20);
}

}  // namespace
}  // namespace memfl
