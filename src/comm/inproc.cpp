#include "comm/inproc.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "comm/chunk.h"
#include "common/parallel.h"

namespace memfl {

namespace {

// Counts bytes and forwards: what "bytes moved" in metrics.csv measures.
class CountingSink final : public ChunkSink {
 public:
  explicit CountingSink(ChunkSink& inner) : inner_(inner) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload p) override {
    MEMFL_RETURN_IF_ERROR(inner_.accept(h, p));
    bytes_ += payload_size(p);
    return Status::Ok();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  ChunkSink& inner_;
  uint64_t bytes_ = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A worker's model and update move inside this process: handed over, not
// sent. The broadcast is a copy on every core; the upload goes in chunks of
// at least this many bytes without checksums (open_local_update), so that
// each chunk folds on every core (FedAvgAggregator::fold) and nothing hashes
// bytes that never left memory the process owns. A model of many GB was
// held to one core's hashing and folding speed by the transports' chunking.
constexpr size_t kLocalChunkBytes = size_t{64} << 20;

uint64_t copy_model(const Layout& layout, const Arena& from, Arena& to) {
  parallel_copy(to.data(), from.data(), layout.total_bytes());
  return layout.total_bytes();
}

}  // namespace

Status InProcessTransport::collect(int round, const std::vector<int>& selected, const Arena& global,
                                   UpdateOpener& aggregator, CollectResult* out) {
  std::mutex mu;
  std::atomic<size_t> next{0};
  Status first_error = Status::Ok();
  auto work = [&](int w) {
    Arena& arena = *workers_[static_cast<size_t>(w)].arena;
    while (true) {
      if (keep_worker_ && !keep_worker_(w)) return;  // shed: the others take its clients
      const size_t i = next.fetch_add(1);
      if (i >= selected.size()) return;
      const int c = selected[i];
      const std::string peer = client_id(c);
      ClientUpdateInfo info;
      info.client = c;
      // Broadcast: the global model into the worker's arena.
      auto t = std::chrono::steady_clock::now();
      StatusOr<uint64_t> down = arena.size() >= layout_.total_bytes()
                                    ? StatusOr<uint64_t>(copy_model(layout_, global, arena))
                                    : StatusOr<uint64_t>(failed_precondition(
                                          "{}: a worker's arena of {} bytes is smaller than the model's {}", peer,
                                          arena.size(), layout_.total_bytes()));
      Status st = down.status();
      const double down_s = seconds_since(t);
      if (st.ok()) st = local_update_(w, c, round, &info).with_context(fmt::format("round {}, {}", round, peer));
      // Upload: the update folds as it streams (or parks until its turn).
      uint64_t up_bytes = 0;
      double up_s = 0;
      if (st.ok()) {
        t = std::chrono::steady_clock::now();
        // Frames (compressed, masked) go as any transport sends them; the
        // arena's bytes are handed over.
        auto update = upload_ ? aggregator.open_update(peer, info.sample_count)
                              : aggregator.open_local_update(peer, info.sample_count);
        if (!update.ok()) {
          st = update.status();
        } else {
          CountingSink counted(**update);
          StatusOr<uint64_t> up = uint64_t{0};
          if (upload_) {
            auto place = upload_(w, c, global);
            up = place.ok() ? stream_place(layout_, **place, chunk_, counted) : StatusOr<uint64_t>(place.status());
          } else {
            up = stream_arena(layout_, arena, std::max(chunk_, kLocalChunkBytes), counted, /*hashed=*/false);
          }
          st = up.ok() ? (*update)->commit()
                       : up.status().with_context(fmt::format("round {}, upload from {}", round, peer));
          up_bytes = counted.bytes();
        }
        up_s = seconds_since(t);
      }
      std::lock_guard lock(mu);
      if (!st.ok()) {
        // A refused update (non-finite values or loss, an absurd sample
        // count) is that client's alone: the round goes on with the others.
        if (st.code() == StatusCode::kRejected) {
          spdlog::warn("{}", st.message());
        } else if (first_error.ok()) {
          first_error = st;
        }
        out->failed.push_back(c);
        continue;
      }
      out->download_seconds += down_s;
      out->bytes_down += *down;
      out->upload_seconds += up_s;
      out->bytes_up += up_bytes;
      info.bytes_down = *down;
      info.bytes_up = up_bytes;
      out->committed.push_back(info);
    }
  };
  std::vector<std::thread> threads;
  for (size_t k = 1; k < workers_.size(); ++k) threads.emplace_back([&, k] { work(static_cast<int>(k)); });
  work(0);
  for (auto& th : threads) th.join();
  // Otherwise a client of the simulator fails only through a bug or a bad
  // config (its data, its model): that ends the run.
  return first_error;
}

}  // namespace memfl
