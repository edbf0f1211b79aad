#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "aggregate/fedavg_aggregator.h"
#include "comm/grpc/wire.h"
#include "model/synthetic.h"

namespace memfl {
namespace {

TEST(Wire, ChunkFrameRoundTripsWithoutCopyingThePayload) {
  std::vector<std::byte> model(10000);
  for (size_t i = 0; i < model.size(); ++i) model[i] = static_cast<std::byte>(i * 7);
  std::atomic<int64_t> inflight{0};
  std::span<const std::byte> part(model.data() + 1000, 4321);
  ChunkHeader h{0xabcdef, 1000, 4321, chunk_checksum(part)};
  {
    Frame f = encode_chunk_frame(kClientChunkField, h, part, &inflight);
    EXPECT_EQ(inflight.load(), 1) << "gRPC holds a reference to the arena bytes";
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(f.buffer.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(reinterpret_cast<const std::byte*>(slices[1].begin()), part.data()) << "the payload slice is the arena";
    DecodedFrame d;
    wire::ClientMessage msg;
    ASSERT_TRUE(decode_frame(f, kClientChunkField, "peer", &d, &msg).ok());
    ASSERT_TRUE(d.is_chunk);
    EXPECT_EQ(d.header.layout_hash, h.layout_hash);
    EXPECT_EQ(d.header.offset, 1000u);
    EXPECT_EQ(d.header.length, 4321u);
    EXPECT_EQ(d.header.checksum, h.checksum);
    EXPECT_EQ(payload_size(d.payload()), 4321u);
    EXPECT_EQ(chunk_checksum(d.payload()), h.checksum);
  }
  EXPECT_EQ(inflight.load(), 0) << "released when gRPC lets go";
}

TEST(Wire, ChunkFrameIsPlainProtobuf) {
  std::vector<std::byte> data(100, std::byte{9});
  Frame f = encode_chunk_frame(kServerChunkField, {1, 2, 100, 3}, data, nullptr);
  grpc::Slice flat;
  ASSERT_TRUE(f.buffer.DumpToSingleSlice(&flat).ok());
  wire::ServerMessage msg;
  ASSERT_TRUE(msg.ParseFromArray(flat.begin(), static_cast<int>(flat.size())));
  ASSERT_TRUE(msg.has_chunk());
  EXPECT_EQ(msg.chunk().header().offset(), 2u);
  EXPECT_EQ(msg.chunk().data().size(), 100u);
}

TEST(Wire, ControlMessagesAndLiesAreTold) {
  wire::ClientMessage reg;
  reg.mutable_register_()->set_client_id("4");
  Frame f = encode_message(reg);
  DecodedFrame d;
  wire::ClientMessage msg;
  ASSERT_TRUE(decode_frame(f, kClientChunkField, "peer", &d, &msg).ok());
  EXPECT_FALSE(d.is_chunk);
  EXPECT_EQ(msg.register_().client_id(), "4");

  // A chunk whose data field claims more bytes than arrived.
  std::vector<std::byte> data(50, std::byte{1});
  Frame c = encode_chunk_frame(kClientChunkField, {1, 0, 50, 2}, data, nullptr);
  grpc::Slice flat;
  ASSERT_TRUE(c.buffer.DumpToSingleSlice(&flat).ok());
  std::vector<uint8_t> bytes(flat.begin(), flat.end());
  bytes.resize(bytes.size() - 10);  // truncated in flight
  Status s = decode_bytes(bytes, kClientChunkField, "client_7", &d, &msg);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("client_7"), std::string::npos) << s.message();
  EXPECT_FALSE(decode_bytes({}, kClientChunkField, "client_7", &d, &msg).ok());
}

// Replays the fuzz corpus (seeds and any input that once crashed) the way
// fuzz/chunk_decoder_fuzzer.cpp runs it: every file must decode to a status;
// a zero layout hash or checksum in a decoded chunk stands for the right one
// (the corpus cannot know the layout's hash), and the chunk goes on to a
// fresh ArenaWriter and a FedAvg update stream, which must take it exactly
// when it is valid for them. Then a repaired copy of every chunk that fits
// the model (the real hash and checksum), sent between the rest of a known
// model, must be written where it says and folded into the mean.
TEST(Wire, ReplaysTheFuzzCorpus) {
  const Layout layout = synthetic_layout(48, DType::kBF16).value();
  const size_t total = layout.total_bytes();
  Arena base(total, MemoryCategory::kModel);
  fill_synthetic(layout, base, 11);
  // Sends the chunk (h, payload) to `sink` between the base model's
  // bytes before and after it.
  auto send_within_base = [&](ChunkSink& sink, const ChunkHeader& h, Payload payload) -> Status {
    if (h.offset > 0) {
      auto head = base.bytes(0, h.offset);
      MEMFL_RETURN_IF_ERROR(sink.accept({layout.hash(), 0, h.offset, chunk_checksum(head)}, head));
    }
    MEMFL_RETURN_IF_ERROR(sink.accept(h, payload));
    const uint64_t end = h.offset + h.length;
    if (end < total) {
      auto tail = base.bytes(end, total - end);
      MEMFL_RETURN_IF_ERROR(sink.accept({layout.hash(), end, total - end, chunk_checksum(tail)}, tail));
    }
    return Status::Ok();
  };
  int files = 0, chunks = 0, accepted_as_is = 0, written = 0, folded = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/fuzz/corpus")) {
    const std::string name = entry.path().filename().string();
    std::ifstream in(entry.path(), std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
    for (int field : {kClientChunkField, kServerChunkField}) {
      DecodedFrame d;
      wire::ClientMessage client_msg;
      wire::ServerMessage server_msg;
      google::protobuf::MessageLite* control =
          field == kClientChunkField ? static_cast<google::protobuf::MessageLite*>(&client_msg) : &server_msg;
      if (!decode_bytes(bytes, field, "corpus", &d, control).ok() || !d.is_chunk) continue;
      ++chunks;
      const std::string what = name + " (field " + std::to_string(field) + ")";
      std::vector<std::byte> payload;
      for (auto part : d.payload()) payload.insert(payload.end(), part.begin(), part.end());
      ASSERT_EQ(payload.size(), payload_size(d.payload())) << what;

      // 1. As the fuzzer sends it.
      ChunkHeader h = d.header;
      if (h.layout_hash == 0) h.layout_hash = layout.hash();
      if (h.checksum == 0) h.checksum = chunk_checksum(d.payload());
      const bool fits = h.length == payload.size() && h.length > 0 && h.offset <= total && h.length <= total - h.offset;
      // A fresh receiver expects offset 0; the rest is verify_chunk's list.
      const bool valid =
          fits && h.layout_hash == layout.hash() && h.offset == 0 && h.checksum == chunk_checksum(payload);
      {
        Arena arena(total, MemoryCategory::kModel);
        ArenaWriter w(layout, arena, "corpus");
        Status s = w.accept(h, d.payload());
        EXPECT_EQ(s.ok(), valid) << what << ": " << s.message();
        if (s.ok()) {
          ++accepted_as_is;
          EXPECT_EQ(std::memcmp(arena.data() + h.offset, payload.data(), h.length), 0) << what;
          EXPECT_EQ(w.received(), h.length) << what;
        }
        FedAvgAggregator agg(layout, ClientWeightsMode::kEqual);
        ASSERT_TRUE(agg.begin_round(1).ok());
        auto update = agg.open_update("corpus", 1);
        ASSERT_TRUE(update.ok()) << update.status().message();
        Status u = (*update)->accept(h, d.payload());
        EXPECT_EQ(u.ok(), valid) << what << ": " << u.message();
        // Whatever came before, these must end in a status, not a crash.
        (void)(*update)->commit();
        (void)agg.finalize(arena);
      }
      if (!fits) continue;

      // 2. A repaired copy, in its place within the base model.
      const ChunkHeader r{layout.hash(), h.offset, h.length, chunk_checksum(d.payload())};
      std::vector<std::byte> expected(base.data(), base.data() + total);
      std::memcpy(expected.data() + r.offset, payload.data(), r.length);
      {
        Arena arena(total, MemoryCategory::kModel);
        ArenaWriter w(layout, arena, "corpus");
        Status s = send_within_base(w, r, d.payload());
        ASSERT_TRUE(s.ok()) << what << ": " << s.message();
        ASSERT_TRUE(w.finish().ok()) << what;
        EXPECT_EQ(std::memcmp(arena.data() + r.offset, payload.data(), r.length), 0)
            << what << ": the chunk's bytes at [" << r.offset << ", " << r.offset + r.length << ")";
        EXPECT_EQ(std::memcmp(arena.data(), expected.data(), total), 0) << what << ": the whole model";
        ++written;
      }
      {
        // One client of weight 1: the mean is its model, bf16 -> f32 -> bf16
        // exactly (the corpus payloads hold no NaN).
        FedAvgAggregator agg(layout, ClientWeightsMode::kEqual);
        ASSERT_TRUE(agg.begin_round(1).ok());
        auto update = agg.open_update("corpus", 1);
        ASSERT_TRUE(update.ok()) << update.status().message();
        Status s = send_within_base(**update, r, d.payload());
        ASSERT_TRUE(s.ok()) << what << ": " << s.message();
        ASSERT_TRUE((*update)->commit().ok()) << what;
        EXPECT_EQ(agg.num_committed(), 1) << what;
        Arena global(total, MemoryCategory::kModel);
        Status f = agg.finalize(global);
        ASSERT_TRUE(f.ok()) << what << ": " << f.message();
        EXPECT_EQ(std::memcmp(global.data(), expected.data(), total), 0) << what << ": the folded mean";
        if (std::memcmp(global.data(), expected.data(), total) == 0) ++folded;
      }
    }
    ++files;
  }
  EXPECT_GE(files, 4);
  // client_chunk and server_chunk name a layout that is not this one;
  // fold_head, fold_tail and fold_unaligned stand for it; lying_length does
  // not decode. Only fold_head starts where a fresh receiver expects.
  EXPECT_GE(chunks, 5);
  EXPECT_GE(accepted_as_is, 1) << "fold_head is accepted as the fuzzer sends it";
  EXPECT_GE(written, 5);
  EXPECT_GE(folded, 5) << "client_chunk, server_chunk, fold_head, fold_tail and fold_unaligned fold when repaired";
}

// A run of chunk frames ended by UpdateEnd, as a client's upload sends it.
struct ChunkRun {
  std::vector<std::byte> model = std::vector<std::byte>(4000);
  std::vector<Frame> frames;
  static constexpr size_t kChunk = 100;
  ChunkRun() {
    for (size_t i = 0; i < model.size(); ++i) model[i] = static_cast<std::byte>(i * 13 + 5);
    for (size_t off = 0; off < model.size(); off += kChunk) {
      std::span<const std::byte> part(model.data() + off, kChunk);
      frames.push_back(encode_chunk_frame(kClientChunkField, {7, off, kChunk, chunk_checksum(part)}, part, nullptr));
    }
    wire::ClientMessage end;
    end.mutable_update_end();
    frames.push_back(encode_message(end));
  }
};

// Runs read_chunk_run over `run` with a consumer slower than the reader;
// returns the most frames whose Read had begun beyond the one being folded.
int most_read_ahead(ChunkRun& run, size_t read_ahead, std::atomic<int>* budget) {
  std::atomic<size_t> begun{0};
  int most = 0;
  size_t next = 0;
  wire::ClientMessage msg;
  bool broke = false;
  Status st = read_chunk_run(
      [&](Frame* f) {
        const size_t i = begun++;
        if (i >= run.frames.size()) return false;
        *f = run.frames[i];
        return true;
      },
      [] {}, kClientChunkField, "peer", ChunkRunOptions{.read_ahead = read_ahead, .budget = budget},
      [&](const DecodedFrame& d) {
        // In order, whole and intact, whatever was read ahead.
        EXPECT_EQ(d.header.offset, next * ChunkRun::kChunk);
        std::vector<std::byte> got;
        for (auto p : d.payload()) got.insert(got.end(), p.begin(), p.end());
        EXPECT_EQ(std::memcmp(got.data(), run.model.data() + next * ChunkRun::kChunk, ChunkRun::kChunk), 0);
        ++next;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the reader gets ahead meanwhile
        most = std::max(most, static_cast<int>(begun.load()) - static_cast<int>(next));
        return Status::Ok();
      },
      &msg, &broke);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_FALSE(broke);
  EXPECT_TRUE(msg.has_update_end());
  EXPECT_EQ(next, run.frames.size() - 1) << "every chunk, once";
  return most;
}

TEST(ReadChunkRun, ReadsAheadOfTheFoldAsFarAsItsDepth) {
  ChunkRun run;
  EXPECT_EQ(most_read_ahead(run, 2, nullptr), 2);
  EXPECT_EQ(most_read_ahead(run, 1, nullptr), 1);
}

TEST(ReadChunkRun, ASharedBudgetBoundsTheReadAheadAndIsGivenBack) {
  ChunkRun run;
  std::atomic<int> budget{1};
  EXPECT_EQ(most_read_ahead(run, 2, &budget), 1) << "one token: one frame ahead, though the depth is 2";
  EXPECT_EQ(budget.load(), 1) << "every token given back";
  budget = 0;
  EXPECT_EQ(most_read_ahead(run, 2, &budget), 0) << "no token: a frame is read only when the fold asks for it";
  EXPECT_EQ(budget.load(), 0);
}

TEST(ReadChunkRun, ARefusedChunkEndsTheRunOnceTheRestIsReadOrTheStreamCancelled) {
  ChunkRun run;
  std::atomic<int> budget{2};
  // Drained: the peer goes on sending; every frame is read, the refusal returned.
  size_t reads = 0;
  wire::ClientMessage msg;
  bool broke = false;
  int folded = 0;
  Status st = read_chunk_run(
      [&](Frame* f) {
        if (reads >= run.frames.size()) return false;
        *f = run.frames[reads++];
        return true;
      },
      [] { ADD_FAILURE() << "a peer that keeps sending is not cancelled"; }, kClientChunkField, "peer",
      ChunkRunOptions{.budget = &budget},
      [&](const DecodedFrame&) { return ++folded == 5 ? data_loss("chunk 4 refused") : Status::Ok(); }, &msg, &broke);
  EXPECT_EQ(st.message(), "chunk 4 refused");
  EXPECT_EQ(folded, 5) << "nothing folds after the refusal";
  EXPECT_EQ(reads, run.frames.size()) << "the rest of the run was read and dropped";
  EXPECT_EQ(budget.load(), 2);
  // A peer that stalls after the refusal: cancelled once `drain` has passed.
  std::mutex mu;
  std::condition_variable cv;
  bool cancelled = false;
  size_t served = 0;
  folded = 0;
  st = read_chunk_run(
      [&](Frame* f) {
        std::unique_lock lock(mu);
        if (served == 10) {  // stalls here until cancelled
          cv.wait(lock, [&] { return cancelled; });
          return false;
        }
        *f = run.frames[served++];
        return true;
      },
      [&] {
        std::lock_guard lock(mu);
        cancelled = true;
        cv.notify_all();
      },
      kClientChunkField, "peer", ChunkRunOptions{.drain = std::chrono::milliseconds(50), .budget = &budget},
      [&](const DecodedFrame&) { return ++folded == 3 ? data_loss("chunk 2 refused") : Status::Ok(); }, &msg, &broke);
  EXPECT_EQ(st.message(), "chunk 2 refused");
  EXPECT_TRUE(cancelled);
  EXPECT_EQ(budget.load(), 2);
}

}  // namespace
}  // namespace memfl
