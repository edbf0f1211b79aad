#include <gtest/gtest.h>

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

// Replays the fuzz corpus (seeds and any input that once crashed): every one
// must decode to a status, and feeding decoded chunks on must not crash.
TEST(Wire, ReplaysTheFuzzCorpus) {
  const Layout layout = synthetic_layout(48, DType::kBF16).value();
  int files = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/fuzz/corpus")) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
    for (int field : {kClientChunkField, kServerChunkField}) {
      DecodedFrame d;
      wire::ClientMessage msg;
      if (!decode_bytes(bytes, field, "corpus", &d, &msg).ok() || !d.is_chunk) continue;
      Arena arena(layout.total_bytes(), MemoryCategory::kModel);
      ArenaWriter w(layout, arena, "corpus");
      Status s = w.accept(d.header, d.payload());
      EXPECT_FALSE(s.ok()) << entry.path() << ": corpus chunks name no real layout";
    }
    ++files;
  }
  EXPECT_GE(files, 4);
}

}  // namespace
}  // namespace memfl
