// N client sessions in one process against a running `memfl server`: each
// thread is a GrpcClientTransport that registers as its id, receives every
// round's model (checked chunk by chunk, then dropped: no client keeps a
// model, so a thousand fit in one process) and uploads an update of zeros,
// until the server says the run is over. What it measures is the server's
// memory per session (bench/server_sessions.sh), not training.
//
//   memfl_load_clients 127.0.0.1:50051 1000 [connect_timeout_s]
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/chunk.h"
#include "comm/client_transport.h"
#include "comm/grpc/grpc_client_transport.h"

namespace memfl {
namespace {

// Checks what arrives and keeps none of it; sends zeros.
class DiscardPlace final : public ModelPlace {
 public:
  std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) override {
    return std::make_unique<Writer>(layout, std::move(peer));
  }
  Status read(uint64_t, std::span<std::byte> into) override {
    std::memset(into.data(), 0, into.size());
    return Status::Ok();
  }

 private:
  class Writer final : public ModelWriter {
   public:
    Writer(const Layout& layout, std::string peer) : ModelWriter(layout, std::move(peer)) {}

   private:
    Status store(const ChunkHeader& h, Payload payload) override {
      if (chunk_checksum(payload) != h.checksum) return checksum_mismatch(h, peer());
      return Status::Ok();
    }
  };
};

Status run_client(const std::string& uri, int id, int timeout_s, int* rounds) {
  GrpcClientOptions options;
  options.server_uri = uri;
  options.client_id = static_cast<uint32_t>(id);
  options.connect_timeout_s = timeout_s;
  MEMFL_ASSIGN_OR_RETURN(auto t, GrpcClientTransport::connect(options));
  DiscardPlace place;
  while (true) {
    MEMFL_ASSIGN_OR_RETURN(auto offer, t->next_round());
    if (offer.finished()) break;
    MEMFL_RETURN_IF_ERROR(t->receive(place));
    UpdateMeta meta;
    meta.round = offer.round;
    meta.client = id;
    meta.sample_count = 1;
    MEMFL_RETURN_IF_ERROR(t->send(meta, place));
    ++*rounds;
  }
  return t->close();
}

}  // namespace
}  // namespace memfl

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s HOST:PORT CLIENTS [CONNECT_TIMEOUT_S]\n", argv[0]);
    return 2;
  }
  const std::string uri = argv[1];
  const int n = std::atoi(argv[2]);
  const int timeout_s = argc > 3 ? std::atoi(argv[3]) : 120;
  std::vector<int> rounds(static_cast<size_t>(n), 0);
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      const memfl::Status st = memfl::run_client(uri, i, timeout_s, &rounds[static_cast<size_t>(i)]);
      if (!st.ok()) {
        std::fprintf(stderr, "client %d: %s\n", i, std::string(st.message()).c_str());
        failed.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  int min_rounds = n > 0 ? rounds[0] : 0;
  for (int r : rounds) min_rounds = std::min(min_rounds, r);
  std::printf("{\"clients\": %d, \"failed\": %d, \"min_rounds\": %d}\n", n, failed.load(), min_rounds);
  return failed.load() == 0 ? 0 : 1;
}
