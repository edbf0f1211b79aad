// memory_mode: naive on the gRPC server (server_agent.h says which file
// holds what). It does on purpose what typical frameworks do, so that
// reports can show, on the same run, what streaming saves: a send
// serialises the whole model into one buffer first, every client's update
// is held whole until the end of the upload phase, and then they are
// averaged.
#include "comm/grpc/server_agent.h"

#include <cstring>

namespace memfl::grpc_detail {

namespace {

// A client's whole update, copied as it arrives: each chunk is checked
// (verify_chunk) before its bytes are kept.
class NaiveUpdateCopy final : public UpdateStream {
 public:
  NaiveUpdateCopy(const Layout& layout, std::string peer)
      : layout_(layout), peer_(std::move(peer)), bytes_(layout.total_bytes()) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& header, Payload payload) override {
    MEMFL_RETURN_IF_ERROR(verify_chunk(header, payload, layout_, received_, peer_));
    size_t at = header.offset;
    for (auto p : payload) {
      std::memcpy(bytes_.data() + at, p.data(), p.size());
      at += p.size();
    }
    received_ += header.length;
    return Status::Ok();
  }
  Status commit() override {
    if (received_ != layout_.total_bytes())
      return data_loss("update from {} ended after {} of {} bytes", peer_, received_, layout_.total_bytes());
    return Status::Ok();
  }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  const Layout& layout_;
  std::string peer_;
  std::vector<std::byte> bytes_;
  uint64_t received_ = 0;
};

}  // namespace

const std::byte* NaiveSerialised::copy(const std::byte* model, size_t total) {
  bytes.assign(model, model + total);
  return bytes.data();
}

NaiveSerialised::~NaiveSerialised() {
  while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

std::unique_ptr<UpdateStream> ServerAgent::naive_open_update(const std::string& peer) {
  return std::make_unique<NaiveUpdateCopy>(layout_, peer);
}

void ServerAgent::naive_keep_locked(int id, double sample_count, std::unique_ptr<UpdateStream> copy) {
  naive_updates_.emplace_back(id, std::make_pair(sample_count, static_cast<NaiveUpdateCopy&>(*copy).take()));
}

void ServerAgent::naive_average_locked() {
  // Naive: every client's model was held whole; average them now.
  for (auto& [id, update] : naive_updates_) {
    auto& [w, bytes] = update;
    auto u = aggregator_->open_update(client_id(id), w);
    if (!u.ok()) continue;
    std::span<const std::byte> all(bytes.data(), bytes.size());
    ChunkHeader h{layout_.hash(), 0, bytes.size(), chunk_checksum(all)};
    (void)(*u)->accept(h, all);
    (void)(*u)->commit();
  }
  naive_updates_.clear();
}

}  // namespace memfl::grpc_detail
