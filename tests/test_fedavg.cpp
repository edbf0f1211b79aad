#include <gtest/gtest.h>

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "test_util.h"

namespace memfl {
namespace {

// A layout with every dtype the aggregator handles, sizes that are not
// multiples of anything, and an integer buffer like BatchNorm's counter.
Layout mixed_layout(DType float_dtype) {
  LayoutBuilder b;
  b.add("conv1.weight", float_dtype, {8, 3, 3, 3})
      .add("conv1.bias", float_dtype, {7})
      .add("bn.num_batches_tracked", DType::kI64, {})
      .add("fc.weight", float_dtype, {13, 11})
      .add("fc.bias", float_dtype, {1});
  return std::move(b).build().value();
}

// The plain weighted mean, in double, of the client arenas.
double reference(const std::vector<Arena>& clients, const std::vector<double>& w, const LayoutEntry& e, size_t i) {
  double s = 0, ws = 0;
  for (size_t c = 0; c < clients.size(); ++c) {
    s += w[c] * testing::element_as_double(clients[c], e, i);
    ws += w[c];
  }
  return s / ws;
}

struct Case {
  DType dtype;
  size_t chunk;  // 0 = larger than the model
};

class FedAvgChunks : public ::testing::TestWithParam<Case> {};

TEST_P(FedAvgChunks, EqualsWeightedMeanForAnyChunkSize) {
  const Case c = GetParam();
  Layout layout = mixed_layout(c.dtype);
  const size_t chunk = c.chunk == 0 ? layout.total_bytes() + 1000 : c.chunk;
  for (auto mode : {ClientWeightsMode::kEqual, ClientWeightsMode::kSampleSize}) {
    std::vector<Arena> clients;
    const std::vector<double> samples = {100, 250, 37};
    for (int k = 0; k < 3; ++k) {
      clients.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
      testing::fill_random(layout, clients.back(), 11 + k);
    }
    FedAvgAggregator agg(layout, mode);
    // Two rounds: the second must not see the first's sum.
    for (int round = 1; round <= 2; ++round) {
      ASSERT_TRUE(agg.begin_round(round).ok());
      for (int k = 0; k < 3; ++k) {
        auto up = agg.open_update("client_" + std::to_string(k), samples[k]);
        ASSERT_TRUE(up.ok());
        auto sent = stream_arena(layout, clients[k], chunk, **up);
        ASSERT_TRUE(sent.ok()) << sent.status().to_string();
        ASSERT_TRUE((*up)->commit().ok());
      }
      Arena global(layout.total_bytes(), MemoryCategory::kModel);
      ASSERT_TRUE(agg.finalize(global).ok());
      EXPECT_EQ(agg.num_committed(), 3);
      std::vector<double> w = mode == ClientWeightsMode::kEqual ? std::vector<double>{1, 1, 1} : samples;
      for (const auto& e : layout.entries()) {
        for (size_t i = 0; i < e.numel(); ++i) {
          const double want = reference(clients, w, e, i);
          const double got = testing::element_as_double(global, e, i);
          double tol;
          switch (e.dtype) {
            case DType::kF32:
              tol = 1e-5 * (1 + std::abs(want));
              break;  // fp32 rounding
            case DType::kBF16:
              tol = std::abs(want) * 0x1p-8 + 1e-6;
              break;  // half a bf16 ulp + f32 sum
            case DType::kF16:
              tol = std::abs(want) * 0x1p-11 + 6e-8 + 1e-6;
              break;
            default:
              tol = 0.5 + 1e-9;
              break;  // rounded to an integer
          }
          ASSERT_NEAR(got, want, tol) << e.name << "[" << i << "] chunk " << chunk << " round " << round;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ChunkSizesAndDtypes, FedAvgChunks,
                         ::testing::Values(Case{DType::kF32, 1}, Case{DType::kF32, 7}, Case{DType::kF32, 6},
                                           Case{DType::kF32, 64}, Case{DType::kF32, 1000}, Case{DType::kF32, 0},
                                           Case{DType::kBF16, 1}, Case{DType::kBF16, 7}, Case{DType::kBF16, 3},
                                           Case{DType::kBF16, 0}, Case{DType::kF16, 7}, Case{DType::kF16, 0}),
                         [](const auto& p) {
                           return std::string(dtype_name(p.param.dtype)) + "_chunk_" +
                                  (p.param.chunk == 0 ? std::string("larger_than_model")
                                                      : std::to_string(p.param.chunk));
                         });

class FedAvgStreams : public ::testing::Test {
 protected:
  Layout layout = mixed_layout(DType::kF32);
  Arena model{layout.total_bytes(), MemoryCategory::kModel};
  FedAvgAggregator agg{layout, ClientWeightsMode::kEqual};
  void SetUp() override {
    testing::fill_random(layout, model, 3);
    ASSERT_TRUE(agg.begin_round(1).ok());
  }
  ChunkHeader header(size_t off, size_t len) {
    return {layout.hash(), off, len, chunk_checksum(model.bytes(off, len))};
  }
};

TEST_F(FedAvgStreams, RejectsBadChecksumHashOffsetAndLength) {
  auto up = agg.open_update("client_9", 10);
  ASSERT_TRUE(up.ok());
  ChunkHeader h = header(0, 16);
  h.checksum ^= 1;
  Status s = (*up)->accept(h, model.bytes(0, 16));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("client_9"), std::string::npos);
  EXPECT_NE(s.message().find("checksum"), std::string::npos);

  auto check = [&](ChunkHeader hh, std::span<const std::byte> p, const char* expect) {
    auto u = agg.open_update("client_8", 10);
    ASSERT_TRUE(u.ok());
    Status st = (*u)->accept(hh, p);
    ASSERT_FALSE(st.ok()) << expect;
    EXPECT_NE(st.message().find(expect), std::string::npos) << st.message();
  };
  ChunkHeader wrong_hash = header(0, 16);
  wrong_hash.layout_hash ^= 0xff;
  check(wrong_hash, model.bytes(0, 16), "layout hash");
  check(header(16, 16), model.bytes(16, 16), "offset 16 where 0 was expected");
  ChunkHeader len = header(0, 16);
  len.length = 17;
  check(len, model.bytes(0, 16), "header says 17 bytes but 16 arrived");
  ChunkHeader past{layout.hash(), 0, layout.total_bytes() + 8, 0};
  std::vector<std::byte> big(layout.total_bytes() + 8);
  check(past, big, "outside");
}

// An update handed over inside the process (open_local_update: the
// simulator's workers) carries no checksums: its chunks with checksum 0 fold
// to the same mean as the same bytes sent hashed, while the same chunks
// through open_update (any peer's) are refused; its header is checked all
// the same.
TEST_F(FedAvgStreams, ALocalUpdateSkipsOnlyTheChecksum) {
  Arena other(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, other, 4);
  auto hashed = agg.open_update("client_0", 10);
  ASSERT_TRUE(hashed.ok());
  ASSERT_TRUE(stream_arena(layout, model, 64, **hashed).ok());
  ASSERT_TRUE((*hashed)->commit().ok());
  auto local = agg.open_local_update("client_1", 10);
  ASSERT_TRUE(local.ok());
  for (size_t off = 0; off < layout.total_bytes(); off += 64) {
    const size_t len = std::min<size_t>(64, layout.total_bytes() - off);
    ASSERT_TRUE((*local)->accept(ChunkHeader{layout.hash(), off, len, 0}, other.bytes(off, len)).ok()) << off;
  }
  ASSERT_TRUE((*local)->commit().ok());
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(global).ok());
  // Equal weights: the element-wise mean of the two, computed here.
  for (const auto& e : layout.entries()) {
    if (e.dtype != DType::kF32) continue;
    const float* a = reinterpret_cast<const float*>(model.data() + e.offset);
    const float* b = reinterpret_cast<const float*>(other.data() + e.offset);
    const float* g = reinterpret_cast<const float*>(global.data() + e.offset);
    for (size_t i = 0; i < e.numel(); ++i) ASSERT_NEAR(g[i], 0.5f * (a[i] + b[i]), 1e-6f) << e.name << "[" << i << "]";
  }
  ASSERT_TRUE(agg.begin_round(2).ok());
  auto remote = agg.open_update("client_2", 10);
  Status refused = (*remote)->accept(ChunkHeader{layout.hash(), 0, 16, 0}, model.bytes(0, 16));
  EXPECT_NE(refused.message().find("checksum mismatch"), std::string::npos) << refused.message();
  auto misplaced = agg.open_local_update("client_3", 10);
  Status gap = (*misplaced)->accept(ChunkHeader{layout.hash(), 16, 16, 0}, model.bytes(16, 16));
  EXPECT_NE(gap.message().find("offset 16 where 0 was expected"), std::string::npos) << gap.message();
}

TEST_F(FedAvgStreams, BrokenStreamAfterCountedBytesForcesARedo) {
  auto ok = agg.open_update("client_0", 10);
  ASSERT_TRUE(stream_arena(layout, model, 64, **ok).ok());
  ASSERT_TRUE((*ok)->commit().ok());
  {
    auto broken = agg.open_update("client_1", 10);
    ASSERT_TRUE((*broken)->accept(header(0, 64), model.bytes(0, 64)).ok());
    Status s = (*broken)->commit();  // incomplete
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("ended after 64 of"), std::string::npos) << s.message();
  }
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  std::memset(global.data(), 0x5a, global.size());
  Status s = agg.finalize(global);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("client_1"), std::string::npos) << s.message();
  for (size_t i = 0; i < global.size(); ++i) ASSERT_EQ(global.data()[i], std::byte{0x5a});  // untouched
}

TEST_F(FedAvgStreams, StreamAbortedBeforeAnyByteLeavesTheAggregateClean) {
  { auto dropped = agg.open_update("client_1", 10); }  // peer vanished after its metadata
  auto up = agg.open_update("client_0", 10);
  ASSERT_TRUE(stream_arena(layout, model, 100, **up).ok());
  ASSERT_TRUE((*up)->commit().ok());
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(global).ok());
  for (const auto& e : layout.entries()) {
    EXPECT_EQ(std::memcmp(global.data() + e.offset, model.data() + e.offset, e.nbytes()), 0) << e.name;
  }
}

TEST_F(FedAvgStreams, FinalizeWithoutUpdatesFailsAndKeepsGlobal) {
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  Status s = agg.finalize(global);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no client update completed"), std::string::npos);
}

TEST_F(FedAvgStreams, RejectsBadSampleCounts) {
  FedAvgAggregator weighted(layout, ClientWeightsMode::kSampleSize);
  ASSERT_TRUE(weighted.begin_round(1).ok());
  EXPECT_FALSE(weighted.open_update("client_2", 0).ok());
  EXPECT_FALSE(weighted.open_update("client_2", -5).ok());
  EXPECT_FALSE(weighted.open_update("client_2", std::nan("")).ok());
}

TEST(ArenaWriter, ReceivesAModelAndRejectsAShortOne) {
  Layout layout = mixed_layout(DType::kBF16);
  Arena src(layout.total_bytes(), MemoryCategory::kModel), dst(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, src, 5);
  ArenaWriter w(layout, dst, "server");
  auto n = stream_arena(layout, src, 7, w);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, layout.total_bytes());
  ASSERT_TRUE(w.finish().ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), layout.total_bytes()), 0);
  ArenaWriter w2(layout, dst, "server");
  ASSERT_TRUE(w2.accept({layout.hash(), 0, 7, chunk_checksum(src.bytes(0, 7))}, src.bytes(0, 7)).ok());
  Status s = w2.finish();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("from server ended after 7"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace memfl

// chunk_checksum picks an AVX2 build of xxh3 at run time where the CPU has
// it; both ends of a transfer must agree with each other and with the
// library, for every length (xxh3 has separate paths for ≤ 16, ≤ 128, ≤ 240
// bytes and the long loop) and however a payload is cut into pieces.
TEST(ChunkChecksum, EqualsTheLibraryAtEveryLengthAndSplit) {
  std::vector<std::byte> bytes(3 * 1024 * 1024 + 13);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {1023ul, 1024ul, 1025ul, 65536ul + 7, size_t{1} << 20, bytes.size()}) lengths.push_back(n);
  for (size_t n : lengths) {
    const std::span<const std::byte> whole(bytes.data() + 3, std::min(n, bytes.size() - 3));
    const uint64_t expected = XXH3_64bits(whole.data(), whole.size());
    EXPECT_EQ(memfl::chunk_checksum(whole), expected) << "length " << whole.size();
    // The same bytes in three pieces, cut unevenly.
    const size_t a = whole.size() / 3, b = whole.size() / 2;
    const std::span<const std::byte> pieces[3] = {whole.subspan(0, a), whole.subspan(a, b - a), whole.subspan(b)};
    EXPECT_EQ(memfl::chunk_checksum(memfl::Payload(pieces, 3)), expected) << "length " << whole.size() << " in pieces";
  }
}

// copy_with_checksum copies exactly and hashes the side it is asked to,
// across block boundaries (32 KiB) and for lengths that are not multiples.
TEST(ChunkChecksum, CopyWithChecksumHashesTheNamedSide) {
  std::vector<std::byte> src(200 * 1024 + 77), dst(src.size()), before(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131 + 7) % 251);
  for (size_t n : {size_t{0}, size_t{1}, size_t{32 * 1024}, size_t{32 * 1024 + 1}, src.size()}) {
    std::fill(dst.begin(), dst.end(), std::byte{0xAB});
    const uint64_t s = memfl::copy_with_checksum(dst.data(), src.data(), n, memfl::ChecksumSide::kSource);
    EXPECT_EQ(s, XXH3_64bits(src.data(), n)) << n;
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0) << n;
    EXPECT_EQ(dst[n < dst.size() ? n : 0], n < dst.size() ? std::byte{0xAB} : src[0]) << "nothing past n is written";
    const uint64_t d = memfl::copy_with_checksum(dst.data(), src.data(), n, memfl::ChecksumSide::kDestination);
    EXPECT_EQ(d, s) << n;
  }
  // A shared-memory peer changes the *other* side right after each block is
  // copied: the checksum must be of the side named, i.e. of the bytes this
  // process keeps (sender: its source; receiver: its private copy).
  struct Scribble {
    std::byte* target;
    static void hit(void* ctx, size_t off, size_t len) {
      auto* t = static_cast<Scribble*>(ctx)->target;
      for (size_t i = off; i < off + len; i += 97) t[i] ^= std::byte{0x5A};
    }
  };
  const size_t n = src.size();
  const uint64_t original = XXH3_64bits(src.data(), n);
  std::vector<std::byte> shared(n), kept(n), peer(src);
  Scribble on_shared_dst{shared.data()};
  EXPECT_EQ(memfl::chunk_detail::copy_with_checksum(shared.data(), src.data(), n, memfl::ChecksumSide::kSource,
                                                    &Scribble::hit, &on_shared_dst),
            original);
  EXPECT_NE(XXH3_64bits(shared.data(), n), original) << "the peer did change the shared side";
  Scribble on_shared_src{peer.data()};
  EXPECT_EQ(memfl::chunk_detail::copy_with_checksum(kept.data(), peer.data(), n, memfl::ChecksumSide::kDestination,
                                                    &Scribble::hit, &on_shared_src),
            original);
  EXPECT_NE(XXH3_64bits(peer.data(), n), original);
}

// A payload that arrived in pieces (gRPC slices) is copied and hashed in one
// pass: the copy is exact, nothing past it is written, and the checksum is
// the library's xxh3 of the bytes in order, wherever the pieces are cut
// (inside a 32 KiB block, at its edge, empty pieces).
TEST(ChunkChecksum, CopyOfAPayloadInPiecesHashesWhatItWrote) {
  std::vector<std::byte> src(150 * 1024 + 31);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 167 + 3) % 253);
  const std::span<const std::byte> all(src);
  const size_t cuts[][3] = {{0, 0, 0}, {1, 32 * 1024, 32 * 1024}, {17, 40000, 100001}, {32 * 1024, 64 * 1024, 150000}};
  for (const auto& c : cuts) {
    const std::span<const std::byte> pieces[4] = {all.subspan(0, c[0]), all.subspan(c[0], c[1] - c[0]),
                                                  all.subspan(c[1], c[2] - c[1]), all.subspan(c[2])};
    std::vector<std::byte> dst(src.size() + 8, std::byte{0xCD});
    const uint64_t sum = memfl::copy_with_checksum(dst.data(), memfl::Payload(pieces, 4));
    EXPECT_EQ(sum, XXH3_64bits(src.data(), src.size())) << c[0] << "," << c[1] << "," << c[2];
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
    EXPECT_EQ(dst[src.size()], std::byte{0xCD}) << "nothing past the payload is written";
  }
}

namespace memfl {
namespace {

// The client's download copies and hashes in one pass: a chunk whose bytes
// do not match its checksum (one byte flipped in the second of three pieces)
// is refused, the stream goes no further, and the model is not complete.
TEST(ArenaWriter, RefusesAChunkInPiecesWhoseBytesWereChanged) {
  Layout layout = mixed_layout(DType::kF32);
  Arena src(layout.total_bytes(), MemoryCategory::kModel), dst(layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(layout, src, 9);
  const size_t len = std::min<size_t>(layout.total_bytes(), 1000);
  std::vector<std::byte> tampered(src.data(), src.data() + len);
  tampered[len / 2] ^= std::byte{0x01};
  const std::span<const std::byte> t(tampered);
  const std::span<const std::byte> pieces[3] = {t.subspan(0, len / 3), t.subspan(len / 3, len / 3),
                                                t.subspan(2 * (len / 3))};
  ArenaWriter w(layout, dst, "server 127.0.0.1:1");
  Status s = w.accept({layout.hash(), 0, len, chunk_checksum(src.bytes(0, len))}, Payload(pieces, 3));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("checksum mismatch for bytes [0, " + std::to_string(len) + ")"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("server 127.0.0.1:1"), std::string::npos) << s.message();
  EXPECT_EQ(w.received(), 0u);
  EXPECT_FALSE(w.finish().ok());
  // The same pieces untouched are taken.
  const std::span<const std::byte> good(src.data(), len);
  const std::span<const std::byte> ok_pieces[3] = {good.subspan(0, len / 3), good.subspan(len / 3, len / 3),
                                                   good.subspan(2 * (len / 3))};
  ArenaWriter w2(layout, dst, "server");
  ASSERT_TRUE(w2.accept({layout.hash(), 0, len, chunk_checksum(good)}, Payload(ok_pieces, 3)).ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), len), 0);
}

// The broadcast's shared checksums: each is the chunk's xxh3 (the last chunk
// shorter), computed once per key (a changed model under the same key keeps
// the first value, which is why the server resets on every round/version),
// and recomputed after reset() with a new key.
TEST(ChunkChecksums, OnePerChunkPerModelVersion) {
  std::vector<std::byte> model(10 * 1000 + 7);
  for (size_t i = 0; i < model.size(); ++i) model[i] = static_cast<std::byte>((i * 29 + 11) % 256);
  const size_t chunk = 1000;
  ChunkChecksums sums;
  sums.reset(1, model.size(), chunk);
  auto bytes = [&](size_t off) {
    return std::span<const std::byte>(model.data() + off, std::min(chunk, model.size() - off));
  };
  for (size_t off = 0; off < model.size(); off += chunk) {
    EXPECT_EQ(sums.get(off, bytes(off)), XXH3_64bits(bytes(off).data(), bytes(off).size())) << off;
  }
  const uint64_t first = XXH3_64bits(model.data(), chunk);
  model[5] ^= std::byte{0xFF};  // the model changes
  sums.reset(1, model.size(), chunk);
  EXPECT_EQ(sums.get(0, bytes(0)), first) << "same key: the cached value stays";
  sums.reset(2, model.size(), chunk);
  EXPECT_EQ(sums.get(0, bytes(0)), XXH3_64bits(model.data(), chunk));
  EXPECT_NE(sums.get(0, bytes(0)), first);
  // An offset that is not a chunk of this model is hashed, not looked up.
  EXPECT_EQ(sums.get(3, std::span<const std::byte>(model.data() + 3, 10)), XXH3_64bits(model.data() + 3, 10));
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// The round's first update to fold writes the sum instead of adding to a
// zeroed one (begin_round no longer clears it). In place, the sum is the
// global model, full of last round's values: round 2 must not see them,
// whichever update folds first (here the second to arrive: the first parks),
// and a product of -0 must come out +0 as 0 + (-0) does.
TEST(FedAvgInPlace, TheFirstUpdateToFoldWritesTheSumWhateverItHeld) {
  LayoutBuilder b;
  b.add("w", DType::kF32, {1000}).add("step", DType::kI64, {});
  Layout layout = std::move(b).build().value();
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  FedAvgAggregator agg(layout, ClientWeightsMode::kSampleSize, global);
  auto* g = reinterpret_cast<float*>(global.data() + layout.entries()[0].offset);
  for (size_t i = 0; i < 1000; ++i) g[i] = 1e6f + static_cast<float>(i);  // last round's model
  Arena a(layout.total_bytes(), MemoryCategory::kModel), c(layout.total_bytes(), MemoryCategory::kModel);
  auto* fa = reinterpret_cast<float*>(a.data() + layout.entries()[0].offset);
  auto* fc = reinterpret_cast<float*>(c.data() + layout.entries()[0].offset);
  for (size_t i = 0; i < 1000; ++i) {
    fa[i] = static_cast<float>(i % 7) - 3.0f;
    fc[i] = 0.5f * static_cast<float>(i % 11);
  }
  fa[0] = -0.0f;
  fc[0] = -0.0f;
  *reinterpret_cast<int64_t*>(a.data() + layout.entries()[1].offset) = 10;
  *reinterpret_cast<int64_t*>(c.data() + layout.entries()[1].offset) = 40;
  // Fold order: client_c first, but client_a's whole update arrives before
  // client_c opens (it parks in the spool and folds after client_c).
  ASSERT_TRUE(agg.begin_round(2, {"client_c", "client_a"}).ok());
  auto ua = agg.open_update("client_a", 3);
  ASSERT_TRUE(ua.ok());
  ASSERT_TRUE(stream_arena(layout, a, 1000, **ua).ok());
  ASSERT_TRUE((*ua)->commit().ok());
  auto uc = agg.open_update("client_c", 1);
  ASSERT_TRUE(uc.ok());
  ASSERT_TRUE(stream_arena(layout, c, 1000, **uc).ok());
  ASSERT_TRUE((*uc)->commit().ok());
  ASSERT_TRUE(agg.finalize(global).ok());
  for (size_t i = 0; i < 1000; ++i) {
    const double want = (3.0 * fa[i] + 1.0 * fc[i]) / 4.0;
    ASSERT_NEAR(g[i], want, 1e-6 * (1 + std::abs(want))) << i;
  }
  EXPECT_FALSE(std::signbit(g[0])) << "0 + (-0) is +0; the written sum must agree";
  EXPECT_EQ(*reinterpret_cast<int64_t*>(global.data() + layout.entries()[1].offset), 18);  // (3·10 + 40) / 4 = 17.5
  // Round 3: one client, which withdraws nothing: its values alone.
  ASSERT_TRUE(agg.begin_round(3).ok());
  auto u = agg.open_update("client_a", 5);
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE(stream_arena(layout, a, 333, **u).ok());
  ASSERT_TRUE((*u)->commit().ok());
  ASSERT_TRUE(agg.finalize(global).ok());
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(g[i], fa[i] + 0.0f) << i;
  EXPECT_EQ(*reinterpret_cast<int64_t*>(global.data() + layout.entries()[1].offset), 10);
}

}  // namespace
}  // namespace memfl

// gRPC moves chunks of at most 1 MiB whatever model_chunk_size says (APPFL
// users configure 1 GiB) and keeps a smaller configured size; chunking off
// means "the whole model", capped the same way. Expected values worked by
// hand.
TEST(GrpcChunkBytes, AtMostOneMiBWhateverTheConfigSays) {
  const uint64_t model = 3ull << 30;
  EXPECT_EQ(memfl::grpc_chunk_bytes(true, int64_t{1} << 30, model), 1u << 20);
  EXPECT_EQ(memfl::grpc_chunk_bytes(true, 64 << 20, model), 1u << 20);
  EXPECT_EQ(memfl::grpc_chunk_bytes(true, 300000, model), 300000u);
  EXPECT_EQ(memfl::grpc_chunk_bytes(false, 0, model), 1u << 20);
  EXPECT_EQ(memfl::grpc_chunk_bytes(false, 0, 777), 777u);
  // MPI keeps its own bound.
  EXPECT_EQ(memfl::transfer_chunk_bytes(true, 64 << 20, model), 4u << 20);
}
