#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/un.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <grpcpp/impl/codegen/method_handler.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/grpc/data_channel.h"
#include "comm/grpc/grpc_client_transport.h"
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

// The TCP data channel (comm/grpc/data_channel.h) over a socket pair: what
// the writer sends, header and bytes, is what read_data_chunks hands on, in
// order and of the sizes sent; the bytes are the writer's own.
struct SocketPair {
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    writer = std::make_unique<DataSocket>(fds[0], "the writer");
    reader = std::make_unique<DataSocket>(fds[1], "client_3 (data channel)");
  }
  std::unique_ptr<DataSocket> writer, reader;
};

std::vector<std::byte> pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + static_cast<size_t>(seed)) & 0xff);
  return v;
}

TEST(DataChannel, ChunksArriveInOrderWithTheirHeadersAndBytes) {
  SocketPair p;
  const auto model = pattern(98, 5);
  const size_t sizes[] = {13, 64, 21};  // uneven: a wrong offset or length shows
  std::thread w([&] {
    size_t off = 0;
    for (size_t n : sizes) {
      std::span<const std::byte> b(model.data() + off, n);
      ASSERT_TRUE(p.writer->write_chunk(ChunkHeader{0x1234, off, n, chunk_checksum(b)}, b).ok());
      off += n;
    }
  });
  std::vector<std::byte> buffer(64), got(98);
  std::vector<std::pair<uint64_t, uint64_t>> seen;
  uint64_t received = 0;
  Status st = read_data_chunks(*p.reader, 98, buffer, &received, [&](const ChunkHeader& h, auto bytes) {
    EXPECT_EQ(h.layout_hash, 0x1234u);
    EXPECT_EQ(h.checksum, chunk_checksum(bytes));
    seen.emplace_back(h.offset, h.length);
    std::memcpy(got.data() + h.offset, bytes.data(), bytes.size());
    return Status::Ok();
  });
  w.join();
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(received, 98u);
  EXPECT_EQ(seen, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 13}, {13, 64}, {77, 21}}));
  EXPECT_EQ(got, model);
}

// A header is checked before a byte of its payload is read: a length above
// the receiver's buffer (or zero) is refused naming the peer, and the
// payload's bytes are still unread on the socket.
TEST(DataChannel, AHeaderLongerThanTheBufferIsRefusedBeforeItsPayloadIsRead) {
  for (uint64_t bad : {uint64_t{65}, uint64_t{0}, uint64_t{1} << 62}) {
    SocketPair p;
    const auto payload = pattern(80, 9);
    ChunkHeader h{1, 0, bad, 0};
    // write_chunk sends what it is given: the header lies about the length.
    ASSERT_TRUE(p.writer->write_chunk(h, payload).ok());
    std::vector<std::byte> buffer(64);
    uint64_t received = 0;
    int calls = 0;
    Status st = read_data_chunks(*p.reader, 80, buffer, &received, [&](const ChunkHeader&, auto) {
      ++calls;
      return Status::Ok();
    });
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << bad;
    EXPECT_NE(st.message().find("client_3 (data channel)"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(std::to_string(bad) + " bytes"), std::string::npos) << st.message();
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(received, 0u);
    std::vector<std::byte> next(80);
    ASSERT_TRUE(p.reader->read_exact(next).ok());
    EXPECT_EQ(next, payload) << "the payload was left unread";
  }
}

// A chunk cut short (the peer went away) is kUnavailable naming the peer; a
// chunk the consumer refuses ends the run with the consumer's status.
TEST(DataChannel, ATruncatedChunkIsUnavailableAndARefusedOneStopsTheRun) {
  {
    SocketPair p;
    const auto payload = pattern(4, 1);
    ASSERT_TRUE(p.writer->write_chunk(ChunkHeader{1, 0, 10, 0}, payload).ok());
    p.writer.reset();  // closes: 6 bytes never come
    std::vector<std::byte> buffer(64);
    uint64_t received = 0;
    Status st = read_data_chunks(*p.reader, 10, buffer, &received, [](const ChunkHeader&, auto) {
      ADD_FAILURE() << "no chunk is whole";
      return Status::Ok();
    });
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    EXPECT_NE(st.message().find("client_3 (data channel) closed the data channel"), std::string::npos) << st.message();
  }
  {
    SocketPair p;
    const auto model = pattern(40, 2);
    for (size_t off : {0, 20}) {
      std::span<const std::byte> b(model.data() + off, 20);
      ASSERT_TRUE(p.writer->write_chunk(ChunkHeader{1, off, 20, chunk_checksum(b)}, b).ok());
    }
    std::vector<std::byte> buffer(64);
    uint64_t received = 0;
    int calls = 0;
    Status st = read_data_chunks(*p.reader, 40, buffer, &received, [&](const ChunkHeader&, auto) {
      ++calls;
      return data_loss("refused by the test");
    });
    EXPECT_EQ(st.message(), "refused by the test");
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(received, 0u) << "a refused chunk is not counted";
  }
}

// shutdown() from another thread wakes a reader blocked on the channel (a
// deadline passed): what the server does to a stalled client.
TEST(DataChannel, ShutdownWakesABlockedReader) {
  SocketPair p;
  std::atomic<bool> returned{false};
  Status st;
  std::thread r([&] {
    std::vector<std::byte> b(16);
    st = p.reader->read_exact(b);
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(returned.load()) << "nothing was sent: the read waits";
  p.reader->shutdown();
  r.join();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
}

// A plain TCP connection to 127.0.0.1:port, as a stranger would open (-1
// if it cannot connect).
int connect_to_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The listener hands a connection to its session only with that session's
// ticket, once; a stranger that sends garbage is closed and the listener
// goes on serving.
TEST(DataChannel, OnlyTheSessionsTicketIsWelcomedAndOnlyOnce) {
  std::mutex mu;
  uint64_t ticket = draw_data_ticket();
  std::vector<std::unique_ptr<DataSocket>> attached;
  DataListener listener;
  ASSERT_TRUE(listener
                  .start("127.0.0.1:0", 0, false,
                         [&](int fd, const DataHello& h, const std::string& peer) {
                           std::lock_guard lock(mu);
                           if (h.client_id != 7 || ticket == 0 || h.ticket != ticket || !send_data_welcome(fd))
                             return false;
                           ticket = 0;  // used
                           attached.push_back(std::make_unique<DataSocket>(fd, peer));
                           return true;
                         })
                  .ok());
  ASSERT_GT(listener.port(), 0);
  uint64_t t = 0;
  {
    std::lock_guard lock(mu);
    t = ticket;
  }
  EXPECT_FALSE(dial_data_channel("127.0.0.1:1", listener.port(), "", 7, t ^ 1, 5).ok()) << "a wrong ticket";
  EXPECT_FALSE(dial_data_channel("127.0.0.1:1", listener.port(), "", 6, t, 5).ok()) << "another client's id";
  EXPECT_FALSE(dial_data_channel("127.0.0.1:1", listener.port(), "", 7, 0, 5).ok()) << "no ticket";
  {
    // A stranger: connects and says something that is not a hello; it is
    // closed without a welcome.
    const int fd = connect_to_loopback(listener.port());
    ASSERT_GE(fd, 0);
    const char junk[] = "GET / HTTP/1.1\r\nHost: memfl\r\n\r\n";
    ASSERT_EQ(::write(fd, junk, sizeof junk), static_cast<ssize_t>(sizeof junk));
    char c;
    // Closed with the junk unread: an end of stream or a reset, never a byte.
    EXPECT_LE(::read(fd, &c, 1), 0) << "closed, nothing said";
    ::close(fd);
  }
  auto ok = dial_data_channel("127.0.0.1:1", listener.port(), "", 7, t, 5);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  auto again = dial_data_channel("127.0.0.1:1", listener.port(), "", 7, t, 5);
  ASSERT_FALSE(again.ok()) << "a ticket is good once";
  EXPECT_NE(again.status().message().find("refused the data channel's ticket"), std::string::npos)
      << again.status().message();
  // The attached connection works both ways.
  const auto bytes = pattern(33, 4);
  ASSERT_TRUE((*ok)->write_chunk(ChunkHeader{9, 0, 33, chunk_checksum(bytes)}, bytes).ok());
  std::lock_guard lock(mu);
  ASSERT_EQ(attached.size(), 1u);
  ChunkHeader h;
  ASSERT_TRUE(attached[0]->read_header(&h, 64).ok());
  EXPECT_EQ(h.length, 33u);
  std::vector<std::byte> got(33);
  ASSERT_TRUE(attached[0]->read_exact(got).ok());
  EXPECT_EQ(got, bytes);
}

// An abstract Unix socket of the given name (-1 if it cannot connect): any
// local user can read the name in /proc/net/unix and dial it.
int connect_to_abstract(const std::string& name) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof(a.sun_path) - 2));
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Strangers that connect and say nothing, on the TCP port and on the Unix
// socket, more of them than the old one-at-a-time listener could wait out
// (25 × its 2 s): a client dialling behind them is welcomed at once, and the
// silent ones are closed when their own deadline passes.
TEST(DataChannel, SilentStrangersDoNotHoldUpAClientsHello) {
  const uint64_t ticket = draw_data_ticket();
  DataListener listener;
  listener.set_hello_timeout(std::chrono::milliseconds(1500));
  ASSERT_TRUE(listener
                  .start("127.0.0.1:0", 0, true,
                         [&](int fd, const DataHello& h, const std::string&) {
                           if (h.ticket != ticket || !send_data_welcome(fd)) return false;
                           ::close(fd);  // the test keeps only the client's end
                           return true;
                         })
                  .ok());
  ASSERT_FALSE(listener.unix_name().empty());
  std::vector<int> silent;
  for (int i = 0; i < 30; ++i) {
    silent.push_back(connect_to_loopback(listener.port()));
    silent.push_back(connect_to_abstract(listener.unix_name()));
    // One stranger that starts a hello and stops half-way.
    if (i == 0) {
      ASSERT_EQ(::write(silent.back(), kDataHelloMagic, 4), 4);
    }
  }
  for (int fd : silent) ASSERT_GE(fd, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all accepted first
  for (const bool unix_socket : {false, true}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto ok = dial_data_channel("127.0.0.1:1", listener.port(), unix_socket ? listener.unix_name() : "", 1, ticket, 10);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(ok.ok()) << ok.status().message();
    // The old listener read one hello at a time: this dial would have
    // waited 60 × 1.5 s.
    EXPECT_LT(waited, 1.0) << (unix_socket ? "unix socket" : "tcp");
  }
  // Each stranger is closed by the listener after its own 1.5 s.
  for (int fd : silent) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 10'000), 1) << "closed within the deadline";
    char c;
    EXPECT_LE(::read(fd, &c, 1), 0) << "closed, nothing said";
    ::close(fd);
  }
}

// More silent connections than the listener keeps waiting: the oldest are
// closed to make room, so its memory stays bounded and the newest (a
// client's) still gets its turn.
TEST(DataChannel, AFloodOfSilentConnectionsClosesTheOldestAndStillWelcomesAClient) {
  const uint64_t ticket = draw_data_ticket();
  DataListener listener;
  listener.set_hello_timeout(std::chrono::milliseconds(60'000));
  ASSERT_TRUE(listener
                  .start("127.0.0.1:0", 0, false,
                         [&](int fd, const DataHello& h, const std::string&) {
                           if (h.ticket != ticket || !send_data_welcome(fd)) return false;
                           ::close(fd);
                           return true;
                         })
                  .ok());
  std::vector<int> silent;
  for (size_t i = 0; i < DataListener::kMaxPendingHellos + 20; ++i) {
    silent.push_back(connect_to_loopback(listener.port()));
    ASSERT_GE(silent.back(), 0) << i;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto ok = dial_data_channel("127.0.0.1:1", listener.port(), "", 1, ticket, 10);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  // The first 20 (and the one evicted by the client) were closed long before
  // their 60 s: the cap, not the deadline.
  int closed = 0;
  for (int fd : silent) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) == 1) ++closed;
  }
  EXPECT_GE(closed, 20);
  EXPECT_LE(closed, 21);
  pollfd first{silent.front(), POLLIN, 0};
  EXPECT_EQ(::poll(&first, 1, 0), 1) << "the oldest went first";
  for (int fd : silent) ::close(fd);
}

// A listener that accepts and never answers is a timeout, said as one; a
// server that closes on the hello is a refusal, said as one.
TEST(DataChannel, TheClientSaysWhetherTheHelloTimedOutOrWasRefused) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  auto mute = dial_data_channel("127.0.0.1:1", ntohs(a.sin_port), "", 1, 42, 1);
  ASSERT_FALSE(mute.ok());
  EXPECT_NE(mute.status().message().find("did not answer the data channel's hello within 1 s"), std::string::npos)
      << mute.status().message();
  ::close(fd);

  DataListener listener;
  ASSERT_TRUE(
      listener.start("127.0.0.1:0", 0, false, [](int, const DataHello&, const std::string&) { return false; }).ok());
  auto refused = dial_data_channel("127.0.0.1:1", listener.port(), "", 1, 42, 5);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("refused the data channel's ticket"), std::string::npos)
      << refused.status().message();
}

// On one host the client reaches the server's Unix socket and uses it; a
// name it cannot reach (another host) sends it to the TCP port; the ticket
// is checked the same on both.
TEST(DataChannel, OnOneHostTheUnixSocketElseTheTcpPort) {
  std::mutex mu;
  std::vector<uint64_t> tickets = {draw_data_ticket(), draw_data_ticket()};
  std::vector<std::string> server_peers;
  std::vector<std::unique_ptr<DataSocket>> attached;
  DataListener listener;
  ASSERT_TRUE(listener
                  .start("127.0.0.1:0", 0, true,
                         [&](int fd, const DataHello& h, const std::string& peer) {
                           std::lock_guard lock(mu);
                           auto it = std::find(tickets.begin(), tickets.end(), h.ticket);
                           if (it == tickets.end() || !send_data_welcome(fd)) return false;
                           tickets.erase(it);
                           server_peers.push_back(peer);
                           attached.push_back(std::make_unique<DataSocket>(fd, peer));
                           return true;
                         })
                  .ok());
  ASSERT_FALSE(listener.unix_name().empty());
  const uint64_t t0 = tickets[0], t1 = tickets[1];
  EXPECT_FALSE(dial_data_channel("127.0.0.1:1", listener.port(), listener.unix_name(), 1, t0 ^ 1, 5).ok())
      << "a wrong ticket on the Unix socket";
  auto local = dial_data_channel("127.0.0.1:1", listener.port(), listener.unix_name(), 1, t0, 5);
  ASSERT_TRUE(local.ok()) << local.status().message();
  EXPECT_NE((*local)->peer().find("unix socket"), std::string::npos) << (*local)->peer();
  auto remote = dial_data_channel("127.0.0.1:1", listener.port(), "memfl-data-nobody-here", 1, t1, 5);
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  EXPECT_NE((*remote)->peer().find("data channel port " + std::to_string(listener.port())), std::string::npos)
      << (*remote)->peer();
  // Bytes go through both, whole.
  const auto bytes = pattern(4099, 8);
  ASSERT_TRUE((*local)->write_chunk(ChunkHeader{1, 0, 4099, chunk_checksum(bytes)}, bytes).ok());
  std::lock_guard lock(mu);
  ASSERT_EQ(server_peers.size(), 2u);
  EXPECT_EQ(server_peers[0], "unix socket");
  EXPECT_NE(server_peers[1].find("127.0.0.1:"), std::string::npos) << server_peers[1];
  ChunkHeader h;
  ASSERT_TRUE(attached[0]->read_header(&h, 1 << 20).ok());
  std::vector<std::byte> got(h.length);
  ASSERT_TRUE(attached[0]->read_exact(got).ok());
  EXPECT_EQ(got, bytes);
}

TEST(DataChannel, HostAndPortOfAGrpcTarget) {
  std::string host, port;
  ASSERT_TRUE(split_host_port("127.0.0.1:50051", &host, &port).ok());
  EXPECT_EQ(host + "|" + port, "127.0.0.1|50051");
  ASSERT_TRUE(split_host_port("[::1]:7", &host, &port).ok());
  EXPECT_EQ(host + "|" + port, "::1|7");
  ASSERT_TRUE(split_host_port("dns:///node-3.example:8080", &host, &port).ok());
  EXPECT_EQ(host + "|" + port, "node-3.example|8080");
  Status bad = split_host_port("nohost", &host, &port);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("server_uri"), std::string::npos) << bad.message();
}

// A server that speaks a session up to the round and then, in the first
// session only, ends the call with OK where the model should come (as a
// proxy or a server letting the session go would); the second session
// hears that the run is over.
class CleanEndService final : public grpc::Service {
 public:
  CleanEndService() {
    AddMethod(new grpc::internal::RpcServiceMethod(
        kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<CleanEndService, Frame, Frame>(
            [](CleanEndService* self, grpc::ServerContext*, grpc::ServerReaderWriter<Frame, Frame>* stream) {
              return self->session(stream);
            },
            this)));
  }
  std::atomic<int> sessions{0};

 private:
  grpc::Status session(grpc::ServerReaderWriter<Frame, Frame>* stream) {
    const int n = ++sessions;
    for (Frame f; stream->Read(&f);) {
      DecodedFrame d;
      wire::ClientMessage m;
      if (!decode_frame(f, kClientChunkField, "client", &d, &m).ok() || d.is_chunk) {
        return {grpc::StatusCode::INVALID_ARGUMENT, "bad frame"};
      }
      wire::ServerMessage r;
      if (m.has_register_()) {
        r.mutable_register_reply()->set_accepted(true);
      } else if (m.has_get_configuration()) {
        r.mutable_configuration()->set_config_yaml("server_configs:\n  num_clients: 1\n");
      } else if (m.has_custom_action()) {
        r.mutable_custom_action_reply()->set_payload(R"([{"name": "w", "dtype": "f32", "shape": [4]}])");
      } else if (m.has_get_global_model()) {
        if (n == 1) return grpc::Status::OK;
        r.mutable_model_begin()->set_finished(true);
      } else {
        return grpc::Status::OK;  // Bye
      }
      stream->Write(encode_message(r));
    }
    return grpc::Status::OK;
  }
};

// A call the server ends cleanly in the middle of a round is finished once
// and met with a new session, as a server that went away is.
TEST(GrpcClientTransport, ACallEndedCleanlyMidRoundIsMetWithANewSession) {
  CleanEndService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  {
    GrpcClientOptions options;
    options.server_uri = "127.0.0.1:" + std::to_string(port);
    options.connect_timeout_s = 10;
    auto t = GrpcClientTransport::connect(options);
    ASSERT_TRUE(t.ok()) << t.status().message();
    auto first = (*t)->next_round();
    ASSERT_FALSE(first.ok());
    EXPECT_EQ(first.status().code(), StatusCode::kUnavailable) << first.status().message();
    const Status back = (*t)->recover(first.status());
    EXPECT_TRUE(back.ok()) << back.message();
    EXPECT_EQ(service.sessions.load(), 2);
    if (back.ok()) {
      auto next = (*t)->next_round();
      ASSERT_TRUE(next.ok()) << next.status().message();
      EXPECT_TRUE(next->finished());
    }
    EXPECT_TRUE((*t)->close().ok());
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace memfl
