#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {
namespace {

Layout make(std::vector<std::tuple<std::string, DType, std::vector<int64_t>>> spec) {
  LayoutBuilder b;
  for (auto& [n, d, s] : spec) b.add(n, d, s);
  auto l = std::move(b).build();
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return std::move(l).value();
}

TEST(Layout, EntriesAreAlignedAndSized) {
  Layout l =
      make({{"a", DType::kF32, {3, 5}}, {"b", DType::kBF16, {7}}, {"c", DType::kI64, {}}, {"d", DType::kU8, {3}}});
  ASSERT_EQ(l.size(), 4u);
  EXPECT_EQ(l.entries()[0].offset, 0u);
  EXPECT_EQ(l.entries()[0].nbytes(), 60u);
  EXPECT_EQ(l.entries()[1].offset, 64u);
  EXPECT_EQ(l.entries()[1].nbytes(), 14u);
  EXPECT_EQ(l.entries()[2].offset, 128u);
  EXPECT_EQ(l.entries()[2].numel(), 1u);  // a scalar has one element
  EXPECT_EQ(l.entries()[3].offset, 192u);
  EXPECT_EQ(l.total_bytes(), 256u);
  EXPECT_EQ(l.payload_bytes(), 60u + 14u + 8u + 3u);
  EXPECT_EQ(l.num_params(), 15u + 7u + 1u + 3u);
  for (const auto& e : l.entries()) EXPECT_EQ(e.offset % kEntryAlignment, 0u);
}

TEST(Layout, HashIsStableAndSeesEveryField) {
  auto base = make({{"w", DType::kF32, {4, 4}}, {"b", DType::kF32, {4}}});
  EXPECT_EQ(base.hash(), make({{"w", DType::kF32, {4, 4}}, {"b", DType::kF32, {4}}}).hash());
  EXPECT_NE(base.hash(), make({{"w2", DType::kF32, {4, 4}}, {"b", DType::kF32, {4}}}).hash());
  EXPECT_NE(base.hash(), make({{"w", DType::kBF16, {4, 4}}, {"b", DType::kF32, {4}}}).hash());
  EXPECT_NE(base.hash(), make({{"w", DType::kF32, {2, 8}}, {"b", DType::kF32, {4}}}).hash());
  EXPECT_NE(base.hash(), make({{"b", DType::kF32, {4}}, {"w", DType::kF32, {4, 4}}}).hash());
  // Name boundaries count: ("ab","c") must not collide with ("a","bc").
  EXPECT_NE(make({{"ab", DType::kF32, {1}}, {"c", DType::kF32, {1}}}).hash(),
            make({{"a", DType::kF32, {1}}, {"bc", DType::kF32, {1}}}).hash());
}

TEST(Layout, RejectsDuplicateNamesAndNegativeDims) {
  LayoutBuilder b;
  b.add("x", DType::kF32, {2}).add("x", DType::kF32, {2});
  auto l = std::move(b).build();
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("duplicate tensor name 'x'"), std::string::npos);
  LayoutBuilder b2;
  b2.add("y", DType::kF32, {2, -1});
  auto l2 = std::move(b2).build();
  ASSERT_FALSE(l2.ok());
  EXPECT_NE(l2.status().message().find("'y'"), std::string::npos);
}

TEST(Layout, FindsEntryAtOrAfterOffset) {
  Layout l = make({{"a", DType::kF32, {3}}, {"b", DType::kF32, {3}}});
  EXPECT_EQ(l.entry_at_or_after(0), 0u);
  EXPECT_EQ(l.entry_at_or_after(11), 0u);
  EXPECT_EQ(l.entry_at_or_after(12), 1u);  // padding before b
  EXPECT_EQ(l.entry_at_or_after(64), 1u);
  EXPECT_EQ(l.entry_at_or_after(76), 2u);  // past the end
  EXPECT_NE(l.find("b"), nullptr);
  EXPECT_EQ(l.find("zz"), nullptr);
}

TEST(Arena, IsAlignedZeroedAndCountedInTheLedger) {
  auto& ledger = Ledger::instance();
  const int64_t before = ledger.current(MemoryCategory::kAggregation);
  {
    Arena small(100, MemoryCategory::kAggregation);
    Arena big(3u << 20, MemoryCategory::kAggregation);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % 64, 0u);
    for (size_t i = 0; i < small.size(); ++i) ASSERT_EQ(small.data()[i], std::byte{0});
    EXPECT_EQ(big.data()[big.size() - 1], std::byte{0});
    EXPECT_EQ(ledger.current(MemoryCategory::kAggregation), before + 100 + (3 << 20));
    Arena moved = std::move(big);
    EXPECT_EQ(big.size(), 0u);
    EXPECT_EQ(moved.size(), 3u << 20);
  }
  EXPECT_EQ(ledger.current(MemoryCategory::kAggregation), before);
}

// The /proc/self/smaps block of the mapping that holds `p`: its VmFlags
// line and its Rss and AnonHugePages, in bytes.
struct MappingInfo {
  std::string flags;
  uint64_t rss = 0, anon_huge = 0;
  bool found = false;
};
MappingInfo mapping_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  MappingInfo info;
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      if (inside) break;  // the next mapping's header
      inside = lo <= at && at < hi;
      info.found = info.found || inside;
      continue;
    }
    if (!inside) continue;
    unsigned long kb = 0;
    if (std::sscanf(line.c_str(), "Rss: %lu kB", &kb) == 1) info.rss = kb << 10;
    if (std::sscanf(line.c_str(), "AnonHugePages: %lu kB", &kb) == 1) info.anon_huge = kb << 10;
    if (line.rfind("VmFlags:", 0) == 0) info.flags = line;
  }
  return info;
}

// Model-sized arenas ask for transparent huge pages (VmFlags "hg", from
// MADV_HUGEPAGE), and one asked to be populated is resident before its first
// write — in huge pages wherever the kernel's THP setting is not `never`.
TEST(Arena, AModelSizedArenaAsksForHugePagesAndIsResidentWhenPopulated) {
  constexpr size_t kSize = 16u << 20;
  {
    Arena populated(kSize, MemoryCategory::kModel, /*populate=*/true);
    const MappingInfo m = mapping_of(populated.data());
    ASSERT_TRUE(m.found);
    EXPECT_NE(m.flags.find(" hg"), std::string::npos) << m.flags;
    EXPECT_GE(m.rss, kSize) << "populated: every page resident before a write";
    std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string setting;
    std::getline(thp, setting);
    // At least all but the two partial 2 MiB ends of the mapping are huge.
    if (!setting.empty() && setting.find("[never]") == std::string::npos) {
      EXPECT_GE(m.anon_huge, kSize - (4u << 20)) << setting;
    }
    EXPECT_EQ(populated.data()[kSize - 1], std::byte{0});
  }
  Arena lazy(kSize, MemoryCategory::kModel);
  const MappingInfo m = mapping_of(lazy.data());
  ASSERT_TRUE(m.found);
  EXPECT_NE(m.flags.find(" hg"), std::string::npos) << m.flags;
  EXPECT_LT(m.rss, kSize / 2) << "not populated: pages come as they are written";
}

TEST(DType, HalfConversionsRoundTrip) {
  for (float f : {0.f, 1.f, -2.5f, 0.1f, 65504.f, 6.1035156e-05f, 5.9604645e-08f, -1e-3f}) {
    EXPECT_NEAR(f16_to_f32(f32_to_f16(f)), f, std::abs(f) * 1e-3 + 6e-8) << f;
    EXPECT_NEAR(bf16_to_f32(f32_to_bf16(f)), f, std::abs(f) * 8e-3) << f;
  }
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);  // overflow to +inf
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // Ties round to even: 1 + 2^-8 is halfway between two bf16 values.
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
}

}  // namespace
}  // namespace memfl
