// The MPI transport's control plane (comm/mpi/mpi_transport.h): aborting the
// job, the quiet waits, and the server core's transport (MpiServerTransport).
#include "comm/mpi/mpi_transport.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/mpi/mpi_detail.h"

namespace memfl {

[[noreturn]] void abort_job(const std::string& why) {
  spdlog::critical("{}", why);
  std::fflush(nullptr);
  MPI_Abort(MPI_COMM_WORLD, 4);
  std::abort();
}

void quiet_recv(void* buf, int bytes, int source, int tag) {
  MPI_Request req;
  MPI_Irecv(buf, bytes, MPI_BYTE, source, tag, MPI_COMM_WORLD, &req);
  mpi_detail::quiet_waitall(1, &req, MPI_STATUS_IGNORE, mpi_detail::kIdle);
}

int rank_of_client(int client, int per_rank) { return 1 + client / per_rank; }

namespace mpi_detail {

void quiet_waitall(int n, MPI_Request* reqs, MPI_Status* statuses, WaitStyle style) {
  int done = 0;
  for (int i = 0; i < 32; ++i) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return;
  }
  const auto yield_until = Clock::now() + std::chrono::microseconds(style.yield_us);
  for (int sleep_us = 5;;) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return;
    if (Clock::now() < yield_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(2 * sleep_us, style.max_sleep_us);
    }
  }
}

int quiet_probe_first(const std::vector<int>& sources, int tag, std::chrono::microseconds grace) {
  MPI_Status status;
  int flag = 0;
  std::optional<Clock::time_point> others_ready;
  for (int sleep_us = 5;;) {
    for (size_t i = 0; i < sources.size(); ++i) {
      MPI_Iprobe(sources[i], tag, MPI_COMM_WORLD, &flag, &status);
      if (!flag) continue;
      if (i == 0) return sources[0];
      // A later source is ready: the first gets `grace` to follow (ranks
      // that finish together arrive a few µs apart), then the ready one goes.
      if (!others_ready) others_ready = Clock::now();
      if (Clock::now() - *others_ready >= grace) return sources[i];
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(2 * sleep_us, others_ready ? 200 : kIdle.max_sleep_us);
  }
}

size_t chunks_in_flight(size_t chunk) {
  return std::clamp<size_t>((size_t{8} << 20) / std::max<size_t>(chunk, 1), 2, 8);
}

}  // namespace mpi_detail

using mpi_detail::Clock;
using mpi_detail::quiet_probe_first;
using mpi_detail::since;

Status MpiServerTransport::broadcast(int round, const std::vector<int>& selected, const Arena& global,
                                     BroadcastResult* out) {
  const int k = cfg_.server.clients_per_rank;
  std::vector<int> ranks;
  for (int c : selected) {
    if (ranks.empty() || ranks.back() != rank_of_client(c, k)) ranks.push_back(rank_of_client(c, k));
  }
  const auto t = Clock::now();
  for (int r = 1; r < world_; ++r) {
    WireModelBegin b{
        round, 0, std::find(ranks.begin(), ranks.end(), r) != ranks.end(), 0, layout_.hash(), layout_.total_bytes()};
    MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
  }
  streams_.broadcast(ranks, global);
  for (int r : ranks) {
    int32_t ok = 0;
    quiet_recv(&ok, sizeof ok, r, kTagModelReceived);
    out->bytes +=
        layout_.total_bytes() * static_cast<uint64_t>(std::count_if(selected.begin(), selected.end(),
                                                                    [&](int c) { return rank_of_client(c, k) == r; }));
  }
  out->seconds = since(t);
  return Status::Ok();
}

Status MpiServerTransport::collect(int round, const std::vector<int>& selected, const Arena&, UpdateOpener& agg,
                                   CollectResult* out) {
  const int k = cfg_.server.clients_per_rank;
  // Upload time runs from the first update's first message to the last
  // byte folded, as for gRPC (the clients' training is not in it).
  std::optional<Clock::time_point> t_up;
  std::vector<bool> done(static_cast<size_t>(cfg_.server.num_clients), false);
  // A rank's clients send in client order, so its next update is the first
  // of its clients not yet received.
  auto waiting_ranks = [&] {
    std::vector<int> ranks;  // in fold order of their next update
    for (int c : selected) {
      const int r = rank_of_client(c, k);
      if (!done[static_cast<size_t>(c)] && std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
    }
    return ranks;
  };
  for (size_t n = 0; n < selected.size(); ++n) {
    // Whichever rank is ready, earliest in fold order first: no update waits
    // for one that has not come, and of those ready, the one whose turn is
    // nearest goes first (fewer updates park).
    const int r = quiet_probe_first(waiting_ranks(), kTagUpdateMeta, std::chrono::milliseconds(20));
    WireUpdateMeta md{};
    quiet_recv(&md, sizeof md, r, kTagUpdateMeta);
    if (!t_up) t_up = Clock::now();
    const bool expected = md.round == round && md.client >= 0 && md.client < cfg_.server.num_clients &&
                          rank_of_client(md.client, k) == r &&
                          std::find(selected.begin(), selected.end(), md.client) != selected.end() &&
                          !done[static_cast<size_t>(md.client)];
    if (!expected) {
      abort_job(fmt::format("rank {} sent an update of client {} round {}, which round {} did not ask of it", r,
                            md.client, md.round, round));
    }
    done[static_cast<size_t>(md.client)] = true;
    const std::string peer = fmt::format("client_{} (rank {})", md.client, r);
    auto opened = agg.open_update(client_id(md.client), md.sample_count);
    if (!opened.ok()) abort_job(opened.status().message());
    std::shared_ptr<UpdateStream> update = std::move(*opened);
    streams_.receive_update(r, peer, update);
    out->bytes_up += layout_.total_bytes();
    ClientUpdateInfo info;
    info.client = md.client;
    info.sample_count = md.sample_count;
    info.train_loss = md.train_loss;
    info.has_validation = true;
    info.val_weight = md.sample_count;
    info.val_accuracy = md.val_accuracy;
    out->committed.push_back(info);
  }
  streams_.drain();
  out->upload_seconds = t_up ? since(*t_up) : 0.0;
  return Status::Ok();
}

void MpiServerTransport::finish(int) {
  for (int r = 1; r < world_; ++r) {
    WireModelBegin b{0, 1, 0, 0, layout_.hash(), layout_.total_bytes()};
    MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
  }
}

}  // namespace memfl
