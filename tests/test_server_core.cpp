// The server core without transports: the aggregator's fold order (parking
// updates that arrive early), the committed state a server resumes from, and
// the scheduler registry.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "aggregate/fedavg_aggregator.h"
#include "aggregate/registry.h"
#include "aggregate/server_optimizer.h"
#include "common/parallel.h"
#include "config/config.h"
#include "model/synthetic.h"
#include "comm/chunk.h"
#include "schedule/scheduler.h"
#include "server/global_model.h"
#include "server/server_state.h"
#include "tensor/safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

namespace fs = std::filesystem;

Layout f32_layout() {
  LayoutBuilder b;
  b.add("a.weight", DType::kF32, {17, 5}).add("a.bias", DType::kF32, {3}).add("b.weight", DType::kF32, {41});
  return std::move(b).build().value();
}

struct Clients {
  Layout layout = f32_layout();
  std::vector<Arena> models;
  std::vector<double> samples = {3, 11, 7, 29};  // unequal: a wrong weight shows
  Clients() {
    for (int c = 0; c < 4; ++c) {
      models.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
      testing::fill_random(layout, models.back(), 100 + c);
    }
  }
  std::vector<std::string> order() const { return {"client_0", "client_1", "client_2", "client_3"}; }
  // The weighted mean as the aggregator must compute it: an f32 running sum
  // in client order (acc += w·x), then × (1/W) — written here from the
  // formula, not from the aggregator's code.
  std::vector<float> expected() const {
    std::vector<float> out;
    double total = 0;
    for (double w : samples) total += w;
    const float inv = static_cast<float>(1.0 / total);
    for (const auto& e : layout.entries()) {
      for (size_t i = 0; i < e.numel(); ++i) {
        float acc = 0;
        for (size_t c = 0; c < models.size(); ++c) {
          float x;
          std::memcpy(&x, models[c].data() + e.offset + 4 * i, 4);
          acc += static_cast<float>(samples[c]) * x;
        }
        out.push_back(acc * inv);
      }
    }
    return out;
  }
  std::vector<float> values(const Arena& a) const {
    std::vector<float> out;
    for (const auto& e : layout.entries()) {
      for (size_t i = 0; i < e.numel(); ++i) {
        float x;
        std::memcpy(&x, a.data() + e.offset + 4 * i, 4);
        out.push_back(x);
      }
    }
    return out;
  }
};

// Streams the clients' updates in `arrival` order; with `interleave`, one
// chunk of each open update in turn (as concurrent uploads would arrive).
Arena aggregate(const Clients& cl, const std::vector<int>& arrival, size_t chunk, bool interleave,
                const std::string& spool_dir) {
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(spool_dir);
  EXPECT_TRUE(agg.begin_round(1, cl.order()).ok());
  std::vector<std::unique_ptr<UpdateStream>> streams;
  for (int c : arrival) {
    auto u = agg.open_update("client_" + std::to_string(c), cl.samples[static_cast<size_t>(c)]);
    EXPECT_TRUE(u.ok());
    streams.push_back(std::move(*u));
  }
  const size_t total = cl.layout.total_bytes();
  auto send = [&](size_t k, size_t off) {
    const int c = arrival[k];
    const size_t len = std::min(chunk, total - off);
    auto bytes = cl.models[static_cast<size_t>(c)].bytes(off, len);
    EXPECT_TRUE(streams[k]->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes).ok());
  };
  if (interleave) {
    for (size_t off = 0; off < total; off += chunk) {
      for (size_t k = 0; k < arrival.size(); ++k) send(k, off);
    }
    for (auto& s : streams) EXPECT_TRUE(s->commit().ok());
  } else {
    for (size_t k = 0; k < arrival.size(); ++k) {
      for (size_t off = 0; off < total; off += chunk) send(k, off);
      EXPECT_TRUE(streams[k]->commit().ok());
    }
  }
  Arena global(total, MemoryCategory::kModel);
  EXPECT_TRUE(agg.finalize(global).ok());
  return global;
}

TEST(FoldOrder, SameBytesForEveryArrivalOrderAndChunkSize) {
  Clients cl;
  testing::TempDir tmp;
  const auto expected = cl.expected();
  std::vector<int> arrival = {0, 1, 2, 3};
  int permutations = 0;
  do {
    for (size_t chunk : {size_t{7}, size_t{64}, cl.layout.total_bytes()}) {
      for (bool interleave : {false, true}) {
        Arena g = aggregate(cl, arrival, chunk, interleave, tmp.path.string());
        const auto got = cl.values(g);
        ASSERT_EQ(got.size(), expected.size());
        for (size_t i = 0; i < got.size(); ++i) {
          // Bit for bit: the f32 mean in client order, whatever came first.
          ASSERT_EQ(std::memcmp(&got[i], &expected[i], 4), 0)
              << "element " << i << " arrival " << arrival[0] << arrival[1] << arrival[2] << arrival[3] << " chunk "
              << chunk << (interleave ? " interleaved" : "") << ": " << got[i] << " vs " << expected[i];
        }
      }
    }
    ++permutations;
  } while (std::next_permutation(arrival.begin(), arrival.end()));
  EXPECT_EQ(permutations, 24);
}

TEST(FoldOrder, ArrivalOrderWouldChangeTheBitsWithoutIt) {
  // The premise of the test above: summing these inputs in another order
  // gives other f32 bits somewhere, so an aggregator that folded in arrival
  // order would have failed it.
  Clients cl;
  const auto in_order = cl.expected();
  std::swap(cl.models[0], cl.models[3]);
  std::swap(cl.samples[0], cl.samples[3]);
  const auto reversed_first = cl.expected();
  EXPECT_NE(std::memcmp(in_order.data(), reversed_first.data(), 4 * in_order.size()), 0);
}

TEST(FoldOrder, ConcurrentUploadsWithDelaysGiveTheSameBytes) {
  Clients cl;
  testing::TempDir tmp;
  const auto expected = cl.expected();
  for (int trial = 0; trial < 6; ++trial) {
    FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
    agg.set_spool_dir(tmp.path.string());
    ASSERT_TRUE(agg.begin_round(1, cl.order()).ok());
    std::vector<std::thread> threads;
    std::vector<Status> results(4, Status::Ok());
    for (int c = 0; c < 4; ++c) {
      threads.emplace_back([&, c] {
        // Client (trial mod 4) starts last: it holds up everyone's turn.
        if (c == trial % 4) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::mt19937 rng(static_cast<unsigned>(trial * 10 + c));
        auto u = agg.open_update("client_" + std::to_string(c), cl.samples[static_cast<size_t>(c)]);
        if (!u.ok()) {
          results[static_cast<size_t>(c)] = u.status();
          return;
        }
        const size_t total = cl.layout.total_bytes();
        for (size_t off = 0; off < total; off += 13) {
          const size_t len = std::min<size_t>(13, total - off);
          auto bytes = cl.models[static_cast<size_t>(c)].bytes(off, len);
          Status s = (*u)->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes);
          if (!s.ok()) {
            results[static_cast<size_t>(c)] = s;
            return;
          }
          if (rng() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        }
        results[static_cast<size_t>(c)] = (*u)->commit();
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.to_string();
    Arena g(cl.layout.total_bytes(), MemoryCategory::kModel);
    ASSERT_TRUE(agg.finalize(g).ok());
    const auto got = cl.values(g);
    ASSERT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0) << "trial " << trial;
  }
}

TEST(FoldOrder, AParkedUpdateThatBreaksLeavesNoTrace) {
  Clients cl;
  testing::TempDir tmp;
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(tmp.path.string());
  ASSERT_TRUE(agg.begin_round(1, {"client_0", "client_1", "client_2"}).ok());
  const size_t total = cl.layout.total_bytes();
  auto stream_all = [&](UpdateStream& u, int c, size_t upto) {
    for (size_t off = 0; off < upto; off += 32) {
      const size_t len = std::min<size_t>(32, upto - off);
      auto bytes = cl.models[static_cast<size_t>(c)].bytes(off, len);
      ASSERT_TRUE(u.accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes).ok());
    }
  };
  auto u0 = agg.open_update("client_0", cl.samples[0]);
  auto u1 = agg.open_update("client_1", cl.samples[1]);
  auto u2 = agg.open_update("client_2", cl.samples[2]);
  // client_1 and client_2 arrive before client_0 has folded: both park.
  stream_all(**u2, 2, total);
  ASSERT_TRUE((*u2)->commit().ok());
  stream_all(**u1, 1, total / 2);
  EXPECT_FALSE((*u1)->commit().ok());  // broke half way, while parked
  stream_all(**u0, 0, total);
  ASSERT_TRUE((*u0)->commit().ok());
  EXPECT_EQ(agg.num_committed(), 2);
  Arena g(total, MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(g).ok()) << "a parked update never touched the sum: no redo";
  // The mean of clients 0 and 2 only, in that order.
  Clients two;
  two.models.erase(two.models.begin() + 3);
  two.models.erase(two.models.begin() + 1);
  two.samples = {cl.samples[0], cl.samples[2]};
  const auto expected = two.expected();
  const auto got = cl.values(g);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0);
}

TEST(FoldOrder, AWithdrawnClientDoesNotHoldUpTheOthers) {
  Clients cl;
  testing::TempDir tmp;
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(tmp.path.string());
  ASSERT_TRUE(agg.begin_round(1, cl.order()).ok());
  ASSERT_TRUE(agg.withdraw("client_0").ok());
  ASSERT_TRUE(agg.withdraw("client_3").ok());
  for (int c : {2, 1}) {
    auto u = agg.open_update("client_" + std::to_string(c), cl.samples[static_cast<size_t>(c)]);
    ASSERT_TRUE(u.ok());
    ASSERT_TRUE(stream_arena(cl.layout, cl.models[static_cast<size_t>(c)], 50, **u).ok());
    ASSERT_TRUE((*u)->commit().ok());
  }
  EXPECT_FALSE(agg.open_update("client_7", 1).ok()) << "not in the round's fold order";
  Arena g(cl.layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(g).ok());
  Clients two;
  two.models.erase(two.models.begin() + 3);
  two.models.erase(two.models.begin());
  two.samples = {cl.samples[1], cl.samples[2]};
  const auto expected = two.expected();
  const auto got = cl.values(g);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0);
}

TEST(FoldOrder, RunningMeanIsTheSameForEveryArrivalOrder) {
  LayoutBuilder b;
  b.add("w", DType::kBF16, {257}).add("step", DType::kI64, {});
  Layout layout = std::move(b).build().value();
  std::vector<Arena> models;
  const std::vector<double> w = {2, 5, 9};
  for (int c = 0; c < 3; ++c) {
    models.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(layout, models.back(), 7 + c);
  }
  testing::TempDir tmp;
  std::vector<std::vector<std::byte>> results;
  std::vector<int> arrival = {0, 1, 2};
  do {
    Arena global(layout.total_bytes(), MemoryCategory::kModel);
    FedAvgAggregator agg(layout, ClientWeightsMode::kSampleSize, global, Accumulation::kRunningMean);
    agg.set_spool_dir(tmp.path.string());
    ASSERT_TRUE(agg.begin_round(1, {"client_0", "client_1", "client_2"}).ok());
    std::vector<std::unique_ptr<UpdateStream>> open;
    for (int c : arrival)
      open.push_back(std::move(*agg.open_update("client_" + std::to_string(c), w[static_cast<size_t>(c)])));
    for (size_t k = 0; k < arrival.size(); ++k) {
      ASSERT_TRUE(stream_arena(layout, models[static_cast<size_t>(arrival[k])], 9, *open[k]).ok());
      ASSERT_TRUE(open[k]->commit().ok());
    }
    ASSERT_TRUE(agg.finalize(global).ok());
    results.emplace_back(global.data(), global.data() + layout.total_bytes());
    // Within (N − 1)/2 ulp of bf16 of the weighted mean (the documented bound).
    const auto& e = layout.entries()[0];
    for (size_t i = 0; i < e.numel(); ++i) {
      double ref = 0, largest = 0;
      for (int c = 0; c < 3; ++c) {
        const double x = testing::element_as_double(models[static_cast<size_t>(c)], e, i);
        ref += w[static_cast<size_t>(c)] * x;
        largest = std::max(largest, std::abs(x));
      }
      ref /= 16;  // Σ w
      const double got = testing::element_as_double(global, e, i);
      EXPECT_NEAR(got, ref, largest / 128 + 1e-30) << i;  // (3 − 1)/2 ulp of bf16 (2⁻⁷ relative)
    }
  } while (std::next_permutation(arrival.begin(), arrival.end()));
  for (const auto& r : results) EXPECT_EQ(r, results.front());
}

// Uploads that stream at the same time, each on its own thread (as gRPC's
// sessions do), fold chunk by chunk behind the one before them in fold
// order: each has taken all its bytes before the one ahead of it commits,
// nothing goes to the spool, and the bytes are the fold-order sum.
TEST(FoldOrder, UpdatesStreamingTogetherTrailEachOtherWithoutTheSpool) {
  Clients cl;
  testing::TempDir tmp;
  const auto expected = cl.expected();
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(tmp.path.string());
  // Long enough that a busy machine's scheduling never makes a stream look paused.
  agg.set_live_idle(std::chrono::seconds(10));
  ASSERT_TRUE(agg.begin_round(1, cl.order()).ok());
  const size_t sizes[4] = {13, 64, 21, 40};  // unequal chunks, some cutting f32 elements
  std::atomic<int> accepted[4] = {0, 0, 0, 0};
  std::atomic<bool> all_accepted[4] = {false, false, false, false};
  bool overlapped[3] = {false, false, false};
  std::vector<Status> results(4, Status::Ok());
  std::vector<std::thread> threads;
  for (int c = 0; c < 4; ++c) {
    threads.emplace_back([&, c] {
      // Each starts once the one before it has folded a chunk: it finds it streaming.
      while (c > 0 && accepted[c - 1].load() == 0) std::this_thread::yield();
      auto u = agg.open_update("client_" + std::to_string(c), cl.samples[static_cast<size_t>(c)]);
      if (!u.ok()) {
        results[static_cast<size_t>(c)] = u.status();
        return;
      }
      const size_t total = cl.layout.total_bytes(), chunk = sizes[c];
      for (size_t off = 0; off < total; off += chunk) {
        const size_t len = std::min(chunk, total - off);
        auto bytes = cl.models[static_cast<size_t>(c)].bytes(off, len);
        Status s = (*u)->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes);
        if (!s.ok()) {
          results[static_cast<size_t>(c)] = s;
          return;
        }
        accepted[c]++;
      }
      all_accepted[c] = true;
      // Commit only once the next one has taken every chunk (5 s at most):
      // an aggregator that held it until this one's commit times out here.
      if (c < 3) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (!all_accepted[c + 1].load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        overlapped[c] = all_accepted[c + 1].load();
      }
      results[static_cast<size_t>(c)] = (*u)->commit();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.to_string();
  for (int c = 0; c < 3; ++c) EXPECT_TRUE(overlapped[c]) << "client_" << c + 1 << " waited for client_" << c;
  EXPECT_EQ(agg.parked_bytes(), 0u) << "every update trailed the one before it";
  Arena g(cl.layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(g).ok());
  const auto got = cl.values(g);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0);
}

// One thread feeding the round's updates chunk by chunk in turn, in fold
// order (MPI's ring takes its ranks' chunks so): each chunk folds behind the
// same chunk of the update before it, nothing goes to the spool, and the
// bytes are the fold-order sum. Chunks of 13 bytes cut f32 elements: each
// update folds an element once the chunk that completes it comes.
TEST(FoldOrder, OneThreadFeedingUpdatesInTurnFoldsThemWithoutTheSpool) {
  Clients cl;
  testing::TempDir tmp;
  const auto expected = cl.expected();
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(tmp.path.string());
  ASSERT_TRUE(agg.begin_round(1, cl.order()).ok());
  // Opened out of fold order (as announcements may come): the feed is in it.
  std::vector<std::unique_ptr<UpdateStream>> open(4);
  for (int c : {2, 0, 3, 1}) {
    auto u = agg.open_update("client_" + std::to_string(c), cl.samples[static_cast<size_t>(c)]);
    ASSERT_TRUE(u.ok()) << u.status().to_string();
    open[static_cast<size_t>(c)] = std::move(*u);
  }
  const size_t total = cl.layout.total_bytes(), chunk = 13;
  for (size_t off = 0; off < total; off += chunk) {
    const size_t len = std::min(chunk, total - off);
    for (size_t c = 0; c < 4; ++c) {
      auto bytes = cl.models[c].bytes(off, len);
      Status s = open[c]->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    EXPECT_EQ(agg.parked_bytes(), 0u) << "chunk at " << off << " went to the spool";
  }
  for (auto& u : open) ASSERT_TRUE(u->commit().ok());
  Arena g(total, MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(g).ok());
  const auto got = cl.values(g);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0);
}

// A trailing update whose predecessor pauses parks the rest of its bytes
// (it does not wait on a stalled client), and they fold from the spool,
// after the part it folded live, once the predecessor is done.
TEST(FoldOrder, ATrailingUpdateParksWhatArrivesWhileTheOneAheadPauses) {
  Clients cl;
  cl.models.erase(cl.models.begin() + 2, cl.models.end());
  cl.samples.resize(2);
  testing::TempDir tmp;
  const auto expected = cl.expected();
  FedAvgAggregator agg(cl.layout, ClientWeightsMode::kSampleSize);
  agg.set_spool_dir(tmp.path.string());
  agg.set_live_idle(std::chrono::milliseconds(300));
  ASSERT_TRUE(agg.begin_round(1, {"client_0", "client_1"}).ok());
  const size_t total = cl.layout.total_bytes();
  std::atomic<uint64_t> second_bytes{0};  // what client_1 has handed over
  std::atomic<bool> first_started{false};
  Status r0 = Status::Ok(), r1 = Status::Ok();
  std::thread t0([&] {
    auto u = agg.open_update("client_0", cl.samples[0]);
    ASSERT_TRUE(u.ok());
    bool paused = false;
    for (size_t off = 0; off < total; off += 16) {
      // At most 64 bytes ahead of client_1, so that it trails closely …
      while (second_bytes.load() + 64 < off) std::this_thread::yield();
      // … until it has folded three chunks: then a pause longer than live_idle.
      if (!paused && second_bytes.load() >= 3 * 24) {
        paused = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      }
      const size_t len = std::min<size_t>(16, total - off);
      auto bytes = cl.models[0].bytes(off, len);
      r0 = (*u)->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes);
      if (!r0.ok()) return;
      first_started = true;
    }
    r0 = (*u)->commit();
  });
  std::thread t1([&] {
    while (!first_started.load()) std::this_thread::yield();
    auto u = agg.open_update("client_1", cl.samples[1]);
    ASSERT_TRUE(u.ok());
    for (size_t off = 0; off < total; off += 24) {
      const size_t len = std::min<size_t>(24, total - off);
      auto bytes = cl.models[1].bytes(off, len);
      r1 = (*u)->accept({cl.layout.hash(), off, len, chunk_checksum(bytes)}, bytes);
      if (!r1.ok()) return;
      second_bytes = off + len;
    }
    r1 = (*u)->commit();
  });
  t0.join();
  t1.join();
  ASSERT_TRUE(r0.ok()) << r0.to_string();
  ASSERT_TRUE(r1.ok()) << r1.to_string();
  EXPECT_GT(agg.parked_bytes(), 0u) << "what arrived during the pause was parked";
  EXPECT_LE(agg.parked_bytes(), total - 3 * 24) << "the first three chunks folded live";
  Arena g(total, MemoryCategory::kModel);
  ASSERT_TRUE(agg.finalize(g).ok());
  const auto got = cl.values(g);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), 4 * got.size()), 0);
}

// The committed state: a round trip, then a torn and a corrupt newest commit.
struct StateFixture {
  testing::TempDir tmp;
  Layout layout = f32_layout();
  Arena model{layout.total_bytes(), MemoryCategory::kModel};
  Status commit(int round, uint64_t seed, int keep = 2) {
    testing::fill_random(layout, model, seed);
    const std::string ckpt = tmp.file("global_model.safetensors");
    MEMFL_RETURN_IF_ERROR(write_safetensors(ckpt, layout, model, {{"round", std::to_string(round)}}));
    CommittedState st;
    st.round = round;
    st.scheduler = {{"round", round}};
    st.extra = {{"metrics", {round * 10}}};
    return commit_state(tmp.path.string(), ckpt, layout, model, st, keep);
  }
  // The rounds whose files are under state/, by kind.
  std::vector<int> rounds_with(const std::string& suffix) const {
    std::vector<int> out;
    for (const auto& e : fs::directory_iterator(tmp.path / "state")) {
      const std::string name = e.path().filename().string();
      int r = 0;
      if (name.size() > suffix.size() && name.ends_with(suffix) &&
          std::sscanf(name.c_str() + name.find("round-"), "round-%d", &r) == 1) {
        out.push_back(r);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

TEST(ServerState, ResumesFromTheNewestCommitWithItsModel) {
  StateFixture f;
  ASSERT_TRUE(f.commit(1, 1).ok());
  ASSERT_TRUE(f.commit(2, 2).ok());
  ASSERT_TRUE(f.commit(3, 3).ok());
  EXPECT_FALSE(fs::exists(f.tmp.file("state/round-000001.json"))) << "only the last two commits are kept";
  Arena expect(f.layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(f.layout, expect, 3);
  Arena loaded(f.layout.total_bytes(), MemoryCategory::kModel);
  auto st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->round, 3);
  EXPECT_EQ(st->scheduler["round"], 3);
  EXPECT_EQ(st->extra["metrics"][0], 30);
  EXPECT_EQ(std::memcmp(loaded.data(), expect.data(), f.layout.total_bytes()), 0);
}

TEST(ServerState, ATornOrCorruptNewestCommitFallsBackToThePreviousOne) {
  StateFixture f;
  ASSERT_TRUE(f.commit(4, 4).ok());
  ASSERT_TRUE(f.commit(5, 5).ok());
  Arena round4(f.layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(f.layout, round4, 4);
  const std::string newest = f.tmp.file("state/round-000005.json");
  std::string text;
  {
    std::ifstream in(newest);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Torn: half the file.
  std::ofstream(newest, std::ios::trunc) << text.substr(0, text.size() / 2);
  Arena loaded(f.layout.total_bytes(), MemoryCategory::kModel);
  auto st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->round, 4);
  EXPECT_EQ(std::memcmp(loaded.data(), round4.data(), f.layout.total_bytes()), 0);
  // Whole text, one digit of the round changed: the text checksum catches it.
  std::string flipped = text;
  const size_t at = flipped.find("\\\"round\\\": 5");
  ASSERT_NE(at, std::string::npos) << text;
  flipped[at + 11] = '6';
  std::ofstream(newest, std::ios::trunc) << flipped;
  st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->round, 4);
  // Intact text, but the model file's bytes changed: the model checksum catches it.
  std::ofstream(newest, std::ios::trunc) << text;
  {
    auto file = SafetensorsFile::open(f.tmp.file("state/round-000005.safetensors"));
    ASSERT_TRUE(file.ok());
    const size_t data_at = fs::file_size(f.tmp.file("state/round-000005.safetensors")) - f.layout.payload_bytes();
    std::fstream io(f.tmp.file("state/round-000005.safetensors"), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(data_at + 8));
    io.put('\x7f');
  }
  st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->round, 4);
  EXPECT_EQ(std::memcmp(loaded.data(), round4.data(), f.layout.total_bytes()), 0);
}

TEST(ServerState, NoCommitIsAClearError) {
  StateFixture f;
  Arena loaded(f.layout.total_bytes(), MemoryCategory::kModel);
  auto st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("no committed server state"), std::string::npos) << st.status().message();
}

// server_configs.checkpoint_keep: the newest N commits stay, counted as
// commits (rounds with a JSON), not as round numbers.
TEST(CheckpointPolicy, KeepOneLeavesExactlyOneCheckpointFile) {
  StateFixture f;
  for (int r = 1; r <= 3; ++r) ASSERT_TRUE(f.commit(r, r, /*keep=*/1).ok());
  EXPECT_EQ(f.rounds_with(".safetensors"), std::vector<int>{3});
  EXPECT_EQ(f.rounds_with(".json"), std::vector<int>{3});
  Arena loaded(f.layout.total_bytes(), MemoryCategory::kModel);
  auto st = load_committed_state(f.tmp.path.string(), f.layout, loaded);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->round, 3);
}

TEST(CheckpointPolicy, KeepCountsCommitsNotRoundNumbers) {
  StateFixture f;
  // checkpoint_every: 3 commits rounds 3, 6, 9; a server optimizer's state
  // file of each round sits beside them and goes with its commit.
  for (int r : {3, 6, 9}) {
    std::ofstream(f.tmp.file(fmt::format("state/aggregator-round-{:06d}.bin", r))) << "m";
    ASSERT_TRUE(f.commit(r, r, /*keep=*/2).ok());
  }
  EXPECT_EQ(f.rounds_with(".safetensors"), (std::vector<int>{6, 9})) << "round 6 is the previous commit";
  EXPECT_EQ(f.rounds_with(".json"), (std::vector<int>{6, 9}));
  EXPECT_EQ(f.rounds_with(".bin"), (std::vector<int>{6, 9}));
}

TEST(CheckpointPolicy, EveryKCommitsRoundsKTwoKAndTheLast) {
  const auto committed = [](CheckpointPolicy p, int last) {
    std::vector<int> out;
    for (int r = 1; r <= last; ++r) {
      if (p.commits(r, last)) out.push_back(r);
    }
    return out;
  };
  EXPECT_EQ(committed({2, 1, false}, 4), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(committed({2, 3, false}, 10), (std::vector<int>{3, 6, 9, 10}));
  EXPECT_EQ(committed({2, 5, false}, 10), (std::vector<int>{5, 10}));
  EXPECT_EQ(committed({2, 3, true}, 10), std::vector<int>{10});
}

// Before a byte is written: model bytes x (kept + 1 being written [+ 1
// undo of an uncommitted round]) less what is already there, against the
// free bytes, which the test states.
TEST(CheckpointPolicy, TooLittleFreeDiskIsRefusedNamingTheDirectoryAndTheBytes) {
  const std::string dir = "/runs/exp-7";
  // keep 2, every round: 3 files of 1000 bytes, 1000 already there → 2000.
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 1, false}, 1000, 1000, 2000).ok());
  Status s = check_checkpoint_disk(dir, {2, 1, false}, 1000, 1000, 1999);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find(dir), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("2000 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("1999 bytes are free"), std::string::npos) << s.message();
  // keep 1, every 4th round: 1 kept + 1 written + 1 undo = 3000, none there.
  s = check_checkpoint_disk(dir, {1, 4, false}, 1000, 0, 2999);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("3000 bytes"), std::string::npos) << s.message();
  EXPECT_TRUE(check_checkpoint_disk(dir, {1, 4, false}, 1000, 0, 3000).ok());
  // keep 5: 6000.
  EXPECT_FALSE(check_checkpoint_disk(dir, {5, 1, false}, 1000, 0, 5999).ok());
  EXPECT_TRUE(check_checkpoint_disk(dir, {5, 1, false}, 1000, 0, 6000).ok());
  // A run of few rounds keeps no more than it commits before its last round:
  // 1 round → the file being written only; 2 rounds, keep 5 → 1 kept + 1.
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 1, false}, 1000, 0, 1000, /*last_round=*/1).ok());
  s = check_checkpoint_disk(dir, {2, 1, false}, 1000, 0, 999, /*last_round=*/1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("x 1 checkpoint files: 0 kept"), std::string::npos) << s.message();
  EXPECT_FALSE(check_checkpoint_disk(dir, {5, 1, false}, 1000, 0, 1999, /*last_round=*/2).ok());
  EXPECT_TRUE(check_checkpoint_disk(dir, {5, 1, false}, 1000, 0, 2000, /*last_round=*/2).ok());
  // A server optimizer's state (here 2 × 1000 bytes of moments) beside each
  // commit kept and the one written: keep 2, every round → 3000 + 3 × 2000.
  s = check_checkpoint_disk(dir, {2, 1, false}, 1000, 0, 8999, 0, 2000);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("9000 bytes more"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("2000 bytes of server optimizer state x 3 commits"), std::string::npos) << s.message();
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 1, false}, 1000, 0, 9000, 0, 2000).ok());
  // With the peak on disk already, the next commit still needs its model and state.
  EXPECT_FALSE(check_checkpoint_disk(dir, {2, 1, false}, 1000, 9000, 2999, 0, 2000).ok());
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 1, false}, 1000, 9000, 3000, 0, 2000).ok());
  // Every 3rd of 10 rounds, keep 2: commits 3, 6, 9 come before the last →
  // 2 kept + 1 written + 1 undo = 4000; over 3 rounds only round 3 commits
  // (none before it) → 1 written + 1 undo.
  EXPECT_FALSE(check_checkpoint_disk(dir, {2, 3, false}, 1000, 0, 3999, /*last_round=*/10).ok());
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 3, false}, 1000, 0, 4000, /*last_round=*/10).ok());
  EXPECT_TRUE(check_checkpoint_disk(dir, {2, 3, false}, 1000, 0, 2000, /*last_round=*/3).ok());
  EXPECT_FALSE(check_checkpoint_disk(dir, {2, 3, false}, 1000, 0, 1999, /*last_round=*/3).ok());
}

TEST(CheckpointPolicy, CheckpointBytesOnDiskCountAHardLinkOnce) {
  testing::TempDir tmp;
  fs::create_directories(tmp.path / "state");
  std::ofstream(tmp.file("global_model.safetensors")) << std::string(8192, 'x');
  fs::create_hard_link(tmp.file("global_model.safetensors"), tmp.file("state/round-000001.safetensors"));
  std::ofstream(tmp.file("state/round-000000.safetensors")) << std::string(8192, 'y');
  // Allocated blocks: at least the bytes, at most a few blocks more each.
  const uint64_t on_disk = checkpoint_bytes_on_disk(tmp.path.string());
  EXPECT_GE(on_disk, 2u * 8192);
  EXPECT_LT(on_disk, 3u * 8192);
}

// accumulator: auto for a bf16 model in memory: the f32 running sum (2 x the
// model) when the budget holds global + sum + the spool block, else a
// running mean in the model's bytes.
TEST(Accumulator, AutoPicksF32WhenTheBudgetHoldsThreeModelsElseModelDtype) {
  LayoutBuilder b;
  b.add("w", DType::kBF16, {int64_t{16} << 20});  // 16 Mi elements: M = 32 MiB, f32 sum 64 MiB
  const Layout layout = std::move(b).build().value();
  const int64_t MiB = int64_t{1} << 20;
  ASSERT_EQ(static_cast<int64_t>(layout.total_bytes()), 32 * MiB);
  ExperimentConfig cfg;
  ASSERT_EQ(cfg.server.accumulator, "auto");
  // 3 x M + the 4 MiB spool block = 100 MiB fits in 104 MiB.
  cfg.server.memory_budget = "104MiB";
  EXPECT_EQ(resolve_accumulation(cfg, layout), Accumulation::kSum);
  AccumulationChoice c = choose_accumulation(cfg, layout, 104 * MiB);
  EXPECT_EQ(c.accumulation, Accumulation::kSum);
  EXPECT_NE(c.reason.find("fits"), std::string::npos) << c.reason;
  // ~1.5 x M: a running mean in the model's dtype.
  cfg.server.memory_budget = "48MiB";
  EXPECT_EQ(resolve_accumulation(cfg, layout), Accumulation::kRunningMean);
  c = choose_accumulation(cfg, layout, 48 * MiB);
  EXPECT_NE(c.reason.find("does not fit"), std::string::npos) << c.reason;
  // Just below 100 MiB: does not fit.
  EXPECT_EQ(choose_accumulation(cfg, layout, 100 * MiB - 1).accumulation, Accumulation::kRunningMean);
  EXPECT_EQ(choose_accumulation(cfg, layout, 100 * MiB).accumulation, Accumulation::kSum);
  // A stated accumulator is not second-guessed.
  cfg.server.accumulator = "f32";
  EXPECT_EQ(resolve_accumulation(cfg, layout), Accumulation::kSum);
  // Under file backing auto stays model_dtype, whatever the budget.
  cfg.server.accumulator = "auto";
  cfg.memory.arena_backing = "file";
  EXPECT_EQ(choose_accumulation(cfg, layout, int64_t{1} << 40).accumulation, Accumulation::kRunningMean);
}

// Clients on the server's host (memfl launch, MPI ranks on one node) hold a
// model each out of the same memory: 2 clients of 32 MiB leave 104 - 64 =
// 40 MiB, less than the 100 MiB the f32 sum needs; 164 MiB leaves 100.
TEST(Accumulator, AutoLeavesRoomForTheClientsOnTheServersHost) {
  LayoutBuilder b;
  b.add("w", DType::kBF16, {int64_t{16} << 20});
  const Layout layout = std::move(b).build().value();
  const int64_t MiB = int64_t{1} << 20;
  ExperimentConfig cfg;
  cfg.colocated_model_copies = 2;
  AccumulationChoice c = choose_accumulation(cfg, layout, 104 * MiB);
  EXPECT_EQ(c.accumulation, Accumulation::kRunningMean);
  EXPECT_NE(c.reason.find("for the 2 clients on this host"), std::string::npos) << c.reason;
  EXPECT_EQ(choose_accumulation(cfg, layout, 164 * MiB - 1).accumulation, Accumulation::kRunningMean);
  EXPECT_EQ(choose_accumulation(cfg, layout, 164 * MiB).accumulation, Accumulation::kSum);
}

// The config's schema lists the names a config may give; the registries
// build them. The two lists are written apart (config/ depends on nothing
// above model/), so this keeps them equal.
std::vector<std::string> schema_choices(const std::string& key) {
  std::istringstream keys(describe_config_keys());
  for (std::string line; std::getline(keys, line);) {
    if (line.rfind(key + " ", 0) != 0) continue;
    const size_t a = line.find("one of [");
    const size_t b = line.find(']', a);
    std::vector<std::string> out;
    std::istringstream items(line.substr(a + 8, b - a - 8));
    for (std::string item; std::getline(items, item, ',');) {
      item.erase(0, item.find_first_not_of(' '));
      out.push_back(item);
    }
    return out;
  }
  return {};
}

// Server optimizers (aggregate/server_optimizer.h). First one step worked by
// hand: FedAdam, Δ = 0.5, η = 0.1, β1 = 0.9, β2 = 0.99, τ = 1e-3, from
// m = v = 0: m = 0.1·0.5 = 0.05, v = 0.01·0.25 = 0.0025, √v = 0.05,
// x = 1 + 0.1·0.05 / 0.051 = 1.0980392…
TEST(ServerOptimizers, OneFedAdamStepWorkedByHand) {
  float x = 1.5f, prev = 1.0f, m = 0, v = 0;
  server_opt_step(ServerOptKind::kAdam, {0.1, 0.9, 0.99, 1e-3}, &x, &prev, &m, &v, 1);
  EXPECT_NEAR(m, 0.05, 1e-7);
  EXPECT_NEAR(v, 0.0025, 1e-8);
  EXPECT_NEAR(x, 1.0980392, 1e-6);
}

// Several steps of each optimizer on a small vector, against the formulas
// written out here in double (Reddi et al. 2021, Algorithm 2; FedAvgM as
// Hsu et al. 2019), with pseudo-gradients of both signs and sizes.
TEST(ServerOptimizers, EveryOptimizerFollowsItsFormulaOverSeveralSteps) {
  const ServerOptParams p{0.1, 0.9, 0.99, 1e-3};
  const std::vector<std::vector<double>> means = {{1.2, -0.5, 3.0}, {0.9, -0.1, 2.0}, {1.5, 0.4, 2.5}};
  for (ServerOptKind kind :
       {ServerOptKind::kAvgM, ServerOptKind::kAdagrad, ServerOptKind::kAdam, ServerOptKind::kYogi}) {
    std::vector<float> x = {1.0f, 0.0f, 2.5f}, m(3, 0), v(3, 0);
    std::vector<double> xd = {1.0, 0.0, 2.5}, md(3, 0), vd(3, 0);
    for (const auto& mean : means) {
      std::vector<float> prev = x;
      for (size_t i = 0; i < 3; ++i) x[i] = static_cast<float>(mean[i]);
      server_opt_step(kind, p, x.data(), prev.data(), m.data(), v.data(), 3);
      for (size_t i = 0; i < 3; ++i) {
        const double d = mean[i] - xd[i];
        if (kind == ServerOptKind::kAvgM) {
          md[i] = 0.9 * md[i] + d;
          xd[i] += 0.1 * md[i];
          continue;
        }
        md[i] = 0.9 * md[i] + 0.1 * d;
        if (kind == ServerOptKind::kAdagrad) vd[i] = vd[i] + d * d;
        if (kind == ServerOptKind::kAdam) vd[i] = 0.99 * vd[i] + 0.01 * d * d;
        if (kind == ServerOptKind::kYogi) {
          const double sgn = vd[i] > d * d ? 1 : (vd[i] < d * d ? -1 : 0);
          vd[i] = vd[i] - 0.01 * d * d * sgn;
        }
        xd[i] += 0.1 * md[i] / (std::sqrt(vd[i]) + 1e-3);
      }
      for (size_t i = 0; i < 3; ++i) {
        ASSERT_NEAR(x[i], xd[i], 2e-5 * (1 + std::abs(xd[i]))) << "kind " << static_cast<int>(kind) << " i " << i;
        ASSERT_NEAR(m[i], md[i], 2e-5 * (1 + std::abs(md[i])));
      }
    }
  }
}

// The aggregator streams: client updates in chunks of 7 bytes (splitting
// floats and tensors), 64 bytes and whole, two rounds, the pre-round model
// read from the checkpoint file; every chunk size gives the model that the
// FedAvg mean (the Clients oracle) and one optimizer step give.
TEST(ServerOptimizers, StreamingEqualsTheWholeModelStepAtEveryChunkSize) {
  Clients cl;
  testing::TempDir tmp;
  const ServerOptParams p{0.1, 0.9, 0.99, 1e-3};
  for (size_t chunk : {size_t{7}, size_t{64}, cl.layout.total_bytes()}) {
    Arena global(cl.layout.total_bytes(), MemoryCategory::kModel);
    testing::fill_random(cl.layout, global, 7);
    const std::string ckpt = tmp.file("ckpt_" + std::to_string(chunk) + ".safetensors");
    AggregatorContext ctx;
    ctx.layout = &cl.layout;
    ctx.weights = ClientWeightsMode::kSampleSize;
    ctx.in_place = &global;
    ctx.server_opt = p;
    ctx.previous_model = ckpt;
    ctx.make_state_arena = [](size_t n) { return StatusOr<Arena>(Arena(n, MemoryCategory::kAggregation)); };
    auto agg = make_aggregator("FedYogiAggregator", ctx);
    ASSERT_TRUE(agg.ok()) << agg.status().to_string();
    std::vector<float> want = cl.values(global), m(want.size(), 0), v(want.size(), 0);
    for (int round = 1; round <= 2; ++round) {
      ASSERT_TRUE(write_safetensors(ckpt, cl.layout, global, {}).ok());  // the commit of the round before
      const std::vector<float> prev = cl.values(global);
      ASSERT_TRUE((*agg)->begin_round(round, cl.order()).ok());
      for (int c = 3; c >= 0; --c) {  // arrival against fold order: updates park
        auto u = (*agg)->open_update(client_id(c), cl.samples[static_cast<size_t>(c)]);
        ASSERT_TRUE(u.ok());
        ASSERT_TRUE(stream_arena(cl.layout, cl.models[static_cast<size_t>(c)], chunk, **u).ok());
        ASSERT_TRUE((*u)->commit().ok());
      }
      ASSERT_TRUE((*agg)->finalize(global).ok());
      // The oracle: the mean the FedAvg test checks, then one Yogi step.
      want = cl.expected();
      server_opt_step(ServerOptKind::kYogi, p, want.data(), prev.data(), m.data(), v.data(), want.size());
      EXPECT_EQ(cl.values(global), want) << "chunk " << chunk << ", round " << round;
    }
  }
}

// A bf16 tensor would not step (it would silently take the mean): refused,
// naming the key and the tensor.
TEST(ServerOptimizers, AModelWithBf16TensorsIsRefusedNamingTheTensor) {
  LayoutBuilder b;
  b.add("w", DType::kF32, {8}).add("h", DType::kBF16, {4});
  Layout layout = std::move(b).build().value();
  AggregatorContext ctx;
  ctx.layout = &layout;
  ctx.previous_model = "unused.safetensors";
  ctx.make_state_arena = [](size_t n) { return StatusOr<Arena>(Arena(n, MemoryCategory::kAggregation)); };
  auto made = make_aggregator("FedAdamAggregator", ctx);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("server_configs.aggregator"), std::string::npos) << made.status().message();
  EXPECT_NE(made.status().message().find("'h'"), std::string::npos) << made.status().message();
}

// The moments are committed state: saved, then loaded into a fresh
// aggregator, they give the same next step; a corrupted file is refused.
TEST(ServerOptimizers, MomentsSurviveSaveAndLoadAndACorruptFileIsRefused) {
  Clients cl;
  testing::TempDir tmp;
  Arena global(cl.layout.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(cl.layout, global, 3);
  const std::string ckpt = tmp.file("ckpt.safetensors");
  AggregatorContext ctx;
  ctx.layout = &cl.layout;
  ctx.in_place = &global;
  ctx.previous_model = ckpt;
  ctx.make_state_arena = [](size_t n) { return StatusOr<Arena>(Arena(n, MemoryCategory::kAggregation)); };
  auto agg = make_aggregator("FedAdamAggregator", ctx);
  ASSERT_TRUE(agg.ok());
  ASSERT_TRUE(write_safetensors(ckpt, cl.layout, global, {}).ok());
  ASSERT_TRUE((*agg)->begin_round(1, cl.order()).ok());
  for (int c = 0; c < 4; ++c) {
    auto u = (*agg)->open_update(client_id(c), 1);
    ASSERT_TRUE(stream_arena(cl.layout, cl.models[static_cast<size_t>(c)], 64, **u).ok());
    ASSERT_TRUE((*u)->commit().ok());
  }
  ASSERT_TRUE((*agg)->finalize(global).ok());
  std::string record;
  ASSERT_TRUE((*agg)->save_state(tmp.file("state"), 1, &record).ok());
  ASSERT_FALSE(record.empty());
  auto fresh = make_aggregator("FedAdamAggregator", ctx);
  ASSERT_TRUE((*fresh)->load_state(tmp.file("state"), record).ok());
  // Same round 2 through both: the same model.
  ASSERT_TRUE(write_safetensors(ckpt, cl.layout, global, {}).ok());
  Arena copy(global.size(), MemoryCategory::kModel);
  std::memcpy(copy.data(), global.data(), global.size());
  for (auto* a : {&*agg, &*fresh}) {
    Arena& g = a == &*agg ? global : copy;
    ASSERT_TRUE((*a)->retarget(g).ok());
    ASSERT_TRUE((*a)->begin_round(2, cl.order()).ok());
    for (int c = 0; c < 4; ++c) {
      auto u = (*a)->open_update(client_id(c), 1);
      ASSERT_TRUE(stream_arena(cl.layout, cl.models[static_cast<size_t>(3 - c)], 64, **u).ok());
      ASSERT_TRUE((*u)->commit().ok());
    }
    ASSERT_TRUE((*a)->finalize(g).ok());
  }
  EXPECT_EQ(cl.values(global), cl.values(copy));
  // A flipped byte in the moments file is caught by the checksum.
  const std::string file = tmp.file("state/aggregator-round-000001.bin");
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(40);
  f.put('\x7f');
  f.close();
  auto third = make_aggregator("FedAdamAggregator", ctx);
  Status bad = (*third)->load_state(tmp.file("state"), record);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("checksum"), std::string::npos) << bad.message();
}

TEST(Registries, TheConfigAcceptsExactlyTheRegisteredNames) {
  EXPECT_EQ(schema_choices("server_configs.aggregator"), aggregator_names());
  EXPECT_EQ(schema_choices("server_configs.scheduler"), scheduler_names());
  EXPECT_FALSE(aggregator_names().empty());
  auto unknown = load_config_text("server_configs:\n  aggregator: FedNovaAggregator\n", "t.yaml");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("FedAvgAggregator"), std::string::npos) << unknown.status().message();
  Layout layout = f32_layout();
  AggregatorContext ctx;
  ctx.layout = &layout;
  ctx.make_state_arena = [](size_t n) { return StatusOr<Arena>(Arena(n, MemoryCategory::kAggregation)); };
  auto made = make_aggregator("FedNovaAggregator", ctx);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("server_configs.aggregator"), std::string::npos);
  EXPECT_NE(made.status().message().find("FedAvgAggregator"), std::string::npos);
  // An asynchronous rule has no round to finalize: the message says where it runs.
  auto async = make_aggregator("FedCompassAggregator", ctx);
  ASSERT_FALSE(async.ok());
  EXPECT_NE(async.status().message().find("CompassScheduler"), std::string::npos) << async.status().message();
  EXPECT_TRUE(make_aggregator("FedAvgAggregator", ctx).ok());
}

TEST(Scheduler, UnknownNameIsRefusedListingTheKnownOnes) {
  auto s = make_scheduler("RoundRobinScheduler", SchedulerOptions{});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("server_configs.scheduler"), std::string::npos);
  EXPECT_NE(s.status().message().find("SyncScheduler"), std::string::npos);
  EXPECT_NE(s.status().message().find("CompassScheduler"), std::string::npos);
  // The asynchronous ones are known, and have no rounds to select for.
  auto a = make_scheduler("AsyncScheduler", SchedulerOptions{});
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("asynchronous"), std::string::npos) << a.status().message();
}

TEST(Scheduler, ARestoredSchedulerSelectsAsTheUninterruptedOne) {
  SchedulerOptions o;
  o.num_clients = 20;
  o.clients_per_round = 4;
  o.seed = 5;
  o.client_selection = "topk_loss";  // learns from losses and draws from its RNG
  for (int c = 0; c < 20; ++c) o.client_samples.push_back(10 + c);
  auto a = std::move(*make_scheduler("SyncScheduler", o));
  auto feed = [](Scheduler& s, int round, const std::vector<int>& chosen) {
    for (int c : chosen) s.record(round, c, 1.0 / (1 + c + round), 3, 0.01);
  };
  for (int r = 1; r <= 3; ++r) feed(*a, r, a->select(r));
  auto b = std::move(*make_scheduler("SyncScheduler", o));
  ASSERT_TRUE(b->load(a->save()).ok());
  for (int r = 4; r <= 8; ++r) {
    const auto sa = a->select(r);
    EXPECT_EQ(sa, b->select(r)) << "round " << r;
    feed(*a, r, sa);
    feed(*b, r, sa);
  }
}

namespace parallel_tests {

// Every index once, whoever calls: four threads at once (as four client
// streams folding), each over its own array, with pieces small enough that
// the pool's workers and the callers share the work.
TEST(ParallelFor, EveryIndexOnceFromConcurrentCallers) {
  constexpr size_t n = 1'000'003;
  std::vector<std::vector<int>> hits(4, std::vector<int>(n, 0));
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      parallel_for(n, 1000, [&](size_t a, size_t b) {
        for (size_t i = a; i < b; ++i) hits[c][i] += 1;
      });
    });
  }
  for (auto& t : callers) t.join();
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(std::count(hits[c].begin(), hits[c].end(), 1), static_cast<std::ptrdiff_t>(n)) << "caller " << c;
  }
  // Below two pieces' worth: one call on the caller's thread.
  int calls = 0;
  parallel_for(1999, 1000, [&](size_t a, size_t b) {
    ++calls;
    EXPECT_EQ(a, 0u);
    EXPECT_EQ(b, 1999u);
  });
  EXPECT_EQ(calls, 1);
}

// The seeded values, worked out here from their definition (model/synthetic.cpp):
// tensor t's seed s_t = splitmix64(seed · φ + t) << 20 (φ = 0x9e3779b97f4a7c15);
// block b of 4096 elements starts xorshift64 (13, 7, 17) from
// splitmix64(s_t + b) | 1; each step gives (x >> 40) − 2^23, over 2^23. The
// first tensor spans 600 blocks, enough for the fill to split it over threads.
uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

float seeded_value(uint64_t seed, size_t tensor, size_t i) {
  const uint64_t ts = splitmix(seed * 0x9e3779b97f4a7c15ULL + tensor) << 20;
  uint64_t s = splitmix(ts + i / 4096) | 1;
  float v = 0;
  for (size_t k = 0; k <= i % 4096; ++k) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    v = static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
  }
  return v;
}

TEST(Synthetic, ValuesFollowTheSeededBlockGeneratorWhateverTheSplit) {
  LayoutBuilder b;
  b.add("big", DType::kF32, {600 * 4096 + 17});
  b.add("small", DType::kBF16, {5000});
  const Layout layout = std::move(b).build().value();
  Arena arena(layout.total_bytes(), MemoryCategory::kModel);
  fill_synthetic(layout, arena, 7);
  const auto& big = layout.entries()[0];
  const auto* f = reinterpret_cast<const float*>(arena.data() + big.offset);
  for (size_t i : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{300 * 4096 + 5}, big.numel() - 1}) {
    EXPECT_EQ(f[i], seeded_value(7, 0, i)) << "element " << i;
  }
  const auto& small = layout.entries()[1];
  const auto* h = reinterpret_cast<const uint16_t*>(arena.data() + small.offset);
  for (size_t i : {size_t{0}, size_t{4097}, small.numel() - 1}) {
    EXPECT_EQ(h[i], f32_to_bf16(seeded_value(7, 1, i))) << "element " << i;
  }
  // In (-1, 1), and another seed gives other values.
  EXPECT_TRUE(std::all_of(f, f + big.numel(), [](float v) { return v > -1.0f && v < 1.0f; }));
  Arena other(layout.total_bytes(), MemoryCategory::kModel);
  fill_synthetic(layout, other, 8);
  EXPECT_NE(std::memcmp(arena.data(), other.data(), big.nbytes()), 0);
}

// A 4 MiB chunk of bf16 folds on several threads; the running mean of two
// equal-weight updates is, element by element, bf16(a + ½ (b − a)) with a
// the first update (copied) and b the second — the same bits as 64 KiB
// chunks, which fold on one thread.
TEST(FedAvgRunningMean, LargeChunksFoldInParallelToTheElementWiseMean) {
  LayoutBuilder b;
  b.add("w", DType::kBF16, {3 << 20});  // 6 MiB
  const Layout layout = std::move(b).build().value();
  const size_t n = layout.entries()[0].numel();
  Arena u1(layout.total_bytes(), MemoryCategory::kModel), u2(layout.total_bytes(), MemoryCategory::kModel);
  auto* p1 = reinterpret_cast<uint16_t*>(u1.data());
  auto* p2 = reinterpret_cast<uint16_t*>(u2.data());
  for (size_t i = 0; i < n; ++i) {
    p1[i] = f32_to_bf16(static_cast<float>(i % 1000) * 0.01f - 5.0f);
    p2[i] = f32_to_bf16(static_cast<float>((i * 7) % 997) * -0.02f + 3.0f);
  }
  std::vector<uint16_t> want(n);
  for (size_t i = 0; i < n; ++i) {
    const float a = bf16_to_f32(p1[i]);
    want[i] = f32_to_bf16(a + 0.5f * (bf16_to_f32(p2[i]) - a));
  }
  for (size_t chunk : {size_t{4} << 20, size_t{64} << 10}) {
    Arena global(layout.total_bytes(), MemoryCategory::kModel);
    FedAvgAggregator agg(layout, ClientWeightsMode::kSampleSize, global, Accumulation::kRunningMean);
    ASSERT_TRUE(agg.begin_round(1, {"a", "b"}).ok());
    for (auto [id, u] : {std::pair<const char*, Arena*>{"a", &u1}, {"b", &u2}}) {
      auto up = agg.open_update(id, 50);
      ASSERT_TRUE(up.ok());
      ASSERT_TRUE(stream_arena(layout, *u, chunk, **up).ok());
      ASSERT_TRUE((*up)->commit().ok());
    }
    ASSERT_TRUE(agg.finalize(global).ok());
    const auto* got = reinterpret_cast<const uint16_t*>(global.data());
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) wrong += got[i] != want[i] ? 1 : 0;
    EXPECT_EQ(wrong, 0u) << "chunk " << chunk;
  }
}

// A synthetic model's first round needs no round-0 file: none is written,
// and a round that breaks after folding part of an update gets the seed's
// model back.
TEST(GlobalModelSeededStart, NoRoundZeroFileAndABrokenFirstRoundRegeneratesTheSeedsModel) {
  testing::TempDir tmp;
  auto cfg = load_config_text(R"(
client_configs:
  train_configs: {trainer: DummyTrainer}
  model_configs: {model_name: synthetic, model_kwargs: {num_params: 300000, dtype: bf16}}
server_configs:
  num_clients: 2
  seed: 5
  aggregator: FedAvgAggregator
  aggregator_kwargs: {accumulator: model_dtype}
)",
                              "test");
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  auto global = GlobalModel::create(*cfg, InputSpec{}, tmp.path.string(), /*naive=*/false);
  ASSERT_TRUE(global.ok()) << global.status().message();
  EXPECT_FALSE(fs::exists(tmp.file("global_model.safetensors")));
  const Layout& layout = (*global)->layout();
  Arena seeded(layout.total_bytes(), MemoryCategory::kModel);
  fill_synthetic(layout, seeded, 5);
  ASSERT_EQ(std::memcmp((*global)->arena().data(), seeded.data(), layout.total_bytes()), 0);
  // Client a's first chunk folds (the running mean copies it over the
  // global model), then its stream breaks.
  Arena update(layout.total_bytes(), MemoryCategory::kModel);
  std::memset(update.data(), 0x3c, update.size());
  ASSERT_TRUE((*global)->begin_round(1, {"a", "b"}).ok());
  {
    auto up = (*global)->aggregator().open_update("a", 10);
    ASSERT_TRUE(up.ok());
    const std::span<const std::byte> part(update.data(), 65536);
    const std::span<const std::byte> pieces[] = {part};
    ChunkHeader h{layout.hash(), 0, part.size(), chunk_checksum(part)};
    ASSERT_TRUE((*up)->accept(h, Payload(pieces)).ok());
    ASSERT_NE(std::memcmp((*global)->arena().data(), seeded.data(), 65536), 0);
  }  // dropped uncommitted: the stream breaks
  Status s = (*global)->finish_round(1);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(std::memcmp((*global)->arena().data(), seeded.data(), layout.total_bytes()), 0);
  // After a committed round the file is the undo, as for any model.
  ASSERT_TRUE((*global)->write_checkpoint(1).ok());
  EXPECT_TRUE(fs::exists(tmp.file("global_model.safetensors")));
}

}  // namespace parallel_tests

}  // namespace
}  // namespace memfl
