// libFuzzer target for the wire decoder: whatever bytes a peer sends, the
// decoder and the receivers behind it (ArenaWriter, the FedAvg update stream)
// must reject them with a status, never crash, never write out of bounds.
//   make fuzz        (clang, ASan+UBSan; corpus in fuzz/corpus, replayed by the tests)
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/grpc/wire.h"
#include "model/synthetic.h"

// Protobuf logs a warning for every malformed message the fuzzer makes up:
// millions of lines that drown the fuzzer's own. Our decoder reports what
// is wrong through its Status; protobuf's log says nothing more.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memfl;
  static const Layout layout = synthetic_layout(48, DType::kBF16).value();
  for (int field : {kClientChunkField, kServerChunkField}) {
    DecodedFrame d;
    wire::ClientMessage client_msg;
    wire::ServerMessage server_msg;
    google::protobuf::MessageLite* control =
        field == kClientChunkField ? static_cast<google::protobuf::MessageLite*>(&client_msg) : &server_msg;
    if (!decode_bytes({data, size}, field, "fuzz", &d, control).ok() || !d.is_chunk) continue;
    // A zero hash stands for the right one, so the fuzzer reaches the folding
    // code behind the hash check (offsets, lengths, element carries).
    if (d.header.layout_hash == 0) d.header.layout_hash = layout.hash();
    // Likewise a zero checksum stands for the right checksum.
    if (d.header.checksum == 0) d.header.checksum = chunk_checksum(d.payload());
    Arena arena(layout.total_bytes(), MemoryCategory::kModel);
    ArenaWriter writer(layout, arena, "fuzz");
    (void)writer.accept(d.header, d.payload());
    FedAvgAggregator agg(layout, ClientWeightsMode::kEqual);
    (void)agg.begin_round(1);
    auto update = agg.open_update("fuzz", 1);
    (void)(*update)->accept(d.header, d.payload());
    (void)(*update)->commit();
    (void)agg.finalize(arena);
  }
  return 0;
}
