// The MPI transport's control plane (comm/mpi/mpi_transport.h): aborting the
// job, the quiet waits, and the server core's transport (MpiServerTransport).
#include "comm/mpi/mpi_transport.h"
#include "comm/spool_update.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <chrono>
#include <cmath>
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
#include "comm/update_check.h"
#include "comm/update_report.h"

namespace memfl {

namespace {
volatile std::sig_atomic_t g_excluded = 0;

// The stream of an update refused for its metadata: the rank sends its
// chunks all the same (MPI has no way to stop it mid-update), and they are
// read and dropped, so that nothing of it is stored or folded and the
// other ranks' streams stay in step.
class DiscardedUpdate final : public UpdateStream {
 public:
  Status accept(const ChunkHeader&, Payload) override { return Status::Ok(); }
  Status commit() override { return Status::Ok(); }
};


}  // namespace

WireUpdateMeta wire_update_meta(int round, int client, double sample_count,
                                const std::map<std::string, double>& metrics) {
  WireUpdateMeta md{};
  md.round = round;
  md.client = client;
  md.sample_count = sample_count;
  for (size_t i = 0; i < kWireMetrics; ++i) {
    if (auto it = metrics.find(kWireMetricNames[i]); it != metrics.end()) {
      md.present |= 1u << i;
      md.values[i] = it->second;
    }
  }
  return md;
}

std::vector<std::pair<std::string, double>> wire_metrics(const WireUpdateMeta& md) {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < kWireMetrics; ++i) {
    if (md.present & (1u << i)) out.emplace_back(kWireMetricNames[i], md.values[i]);
  }
  return out;
}

namespace {

// Counts the bytes an update's chunks carried (its frames, when compressed)
// on their way to `inner`; the fold worker may call it.
class CountingStream final : public UpdateStream {
 public:
  CountingStream(std::unique_ptr<UpdateStream> inner, std::shared_ptr<std::atomic<uint64_t>> bytes)
      : inner_(std::move(inner)), bytes_(std::move(bytes)) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload p) override {
    MEMFL_RETURN_IF_ERROR(inner_->accept(h, p));
    *bytes_ += payload_size(p);
    return Status::Ok();
  }
  Status commit() override { return inner_->commit(); }

 private:
  std::unique_ptr<UpdateStream> inner_;
  std::shared_ptr<std::atomic<uint64_t>> bytes_;
};

// Set on client ranks: their waits also look for the server's notice message.
bool g_listen_for_notice = false;

// Whether the server's notice has come (then it is taken, and the rank knows
// it is out). Only the main thread calls it, as every MPI call here.
bool notice_arrived() {
  int flag = 0;
  MPI_Iprobe(0, kTagExcluded, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
  if (flag == 0) return false;
  int32_t notice = 0;
  MPI_Recv(&notice, 1, MPI_INT32_T, 0, kTagExcluded, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  g_excluded = 1;
  return true;
}
}  // namespace

void install_exclusion_notice() {
  std::signal(SIGUSR1, [](int) { g_excluded = 1; });
  g_listen_for_notice = true;
}

void send_exclusion_notices(const std::vector<int>& ranks) {
  std::vector<MPI_Request> sends(ranks.size());
  const int32_t notice = 1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    MPI_Isend(&notice, 1, MPI_INT32_T, ranks[i], kTagExcluded, MPI_COMM_WORLD, &sends[i]);
  }
  mpi_detail::quiet_waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE, mpi_detail::kIdle);
}

[[noreturn]] void abort_job(const std::string& why) {
  // A rank woken after its exclusion may find its streams broken before its
  // notice is handled (another thread may take the signal): give it a moment.
  if (g_excluded == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  if (g_excluded != 0) throw RankExcluded{};
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
  (void)quiet_waitall_until(n, reqs, statuses, style, Clock::time_point::max());
}

bool quiet_waitall_until(int n, MPI_Request* reqs, MPI_Status* statuses, WaitStyle style, Clock::time_point deadline) {
  int done = 0;
  for (int i = 0; i < 32; ++i) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return true;
  }
  const auto yield_until = Clock::now() + std::chrono::microseconds(style.yield_us);
  // A rank that waits this long may be one the server has left behind: it
  // looks for the notice now and then (not while chunks flow).
  auto next_look = yield_until;
  for (int sleep_us = 5;;) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return true;
    if (Clock::now() >= deadline) return false;
    if (g_excluded != 0) throw RankExcluded{};
    if (Clock::now() < yield_until) {
      std::this_thread::yield();
    } else {
      if (g_listen_for_notice && Clock::now() >= next_look) {
        if (notice_arrived()) throw RankExcluded{};
        next_look = Clock::now() + std::chrono::milliseconds(50);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(2 * sleep_us, style.max_sleep_us);
    }
  }
}

void cancel_receive(MPI_Request* r) {
  if (*r == MPI_REQUEST_NULL) return;
  int done = 0;
  MPI_Test(r, &done, MPI_STATUS_IGNORE);
  if (done) return;
  MPI_Cancel(r);
  MPI_Wait(r, MPI_STATUS_IGNORE);  // an unmatched receive cancels at once
}

void abandon_send(MPI_Request* r) {
  if (*r == MPI_REQUEST_NULL) return;
  int done = 0;
  MPI_Test(r, &done, MPI_STATUS_IGNORE);
  if (!done) MPI_Request_free(r);
}

int quiet_probe_first(const std::vector<int>& sources, int tag, std::chrono::microseconds grace,
                      Clock::time_point deadline) {
  MPI_Status status;
  int flag = 0;
  std::optional<Clock::time_point> others_ready;
  for (int sleep_us = 5;;) {
    // What has arrived by the deadline still counts: probe first.
    const bool last_look = Clock::now() >= deadline;
    for (size_t i = 0; i < sources.size(); ++i) {
      MPI_Iprobe(sources[i], tag, MPI_COMM_WORLD, &flag, &status);
      if (!flag) continue;
      if (i == 0) return sources[0];
      // A later source is ready: the first gets `grace` to follow (ranks
      // that finish together arrive a few µs apart), then the ready one goes.
      if (!others_ready) others_ready = Clock::now();
      if (Clock::now() - *others_ready >= grace || last_look) return sources[i];
      break;
    }
    if (last_look) return -1;
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

void MpiServerTransport::exclude(int rank, int round, const std::string& why) {
  if (excluded_.empty()) excluded_.assign(static_cast<size_t>(world_), false);
  if (excluded_[static_cast<size_t>(rank)]) return;
  excluded_[static_cast<size_t>(rank)] = true;
  spdlog::warn("round {}: rank {} {}; it is out of the run (MPI cannot take a rank back), the others go on", round,
               rank, why);
}

std::vector<int> MpiServerTransport::excluded_ranks() const {
  std::vector<int> out;
  for (size_t r = 0; r < excluded_.size(); ++r) {
    if (excluded_[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

Status MpiServerTransport::broadcast(int round, const std::vector<int>& selected, const Arena& global,
                                     BroadcastResult* out) {
  if (excluded_.empty()) excluded_.assign(static_cast<size_t>(world_), false);
  const int k = cfg_.server.clients_per_rank;
  std::vector<int> ranks;
  for (int c : selected) {
    const int r = rank_of_client(c, k);
    if (excluded_[static_cast<size_t>(r)]) continue;
    if (ranks.empty() || ranks.back() != r) ranks.push_back(r);
  }
  round_ = round;
  round_ranks_ = ranks;
  const auto t = Clock::now();
  for (int r = 1; r < world_; ++r) {
    if (excluded_[static_cast<size_t>(r)]) continue;
    WireModelBegin b{
        round, 0, std::find(ranks.begin(), ranks.end(), r) != ranks.end(), 0, layout_.hash(), layout_.total_bytes()};
    MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
  }
  // A stalled rank holds the stream up for one broadcast_timeout_s at most
  // (in the shared ring every rank must free a slot before it is reused);
  // then it is out and the others go on.
  const std::chrono::seconds stall(cfg_.server.broadcast_deadline_s());
  for (int r : streams_.broadcast(ranks, global, stall)) {
    exclude(r, round,
            fmt::format("left a chunk of the global model untaken for {} s (server_configs.broadcast_timeout_s)",
                        stall.count()));
  }
  const auto deadline = Clock::now() + stall;
  for (int r : ranks) {
    if (excluded_[static_cast<size_t>(r)]) continue;
    int32_t ok = 0;
    MPI_Request rq;
    MPI_Irecv(&ok, sizeof ok, MPI_BYTE, r, kTagModelReceived, MPI_COMM_WORLD, &rq);
    if (!mpi_detail::quiet_waitall_until(1, &rq, MPI_STATUS_IGNORE, mpi_detail::kIdle, deadline)) {
      mpi_detail::cancel_receive(&rq);
      exclude(r, round,
              fmt::format("did not confirm the global model within {} s (server_configs.broadcast_timeout_s)",
                          stall.count()));
      continue;
    }
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
  // The upload's own deadline, from its start (a broadcast stall has not
  // used it up): a rank that has not announced its update by then is out.
  // An update that has begun is cut off only when it stalls — no chunk for
  // upload_timeout_s — not because a stalled one before it used up the time.
  const int timeout = cfg_.server.upload_deadline_s();
  std::vector<bool> done(static_cast<size_t>(cfg_.server.num_clients), false);
  // A rank's clients send in client order, so its next update is the first
  // of its clients not yet received.
  auto waiting_ranks = [&] {
    std::vector<int> ranks;  // in fold order of their next update
    for (int c : selected) {
      const int r = rank_of_client(c, k);
      if (!done[static_cast<size_t>(c)] && !excluded_[static_cast<size_t>(r)] &&
          std::find(ranks.begin(), ranks.end(), r) == ranks.end())
        ranks.push_back(r);
    }
    return ranks;
  };
  if (collect_hold_.count() > 0) hold_until_announced(waiting_ranks());  // before the deadline starts
  const auto deadline = Clock::now() + std::chrono::seconds(timeout);
  // Upload time runs from the first update's first message to the last
  // byte folded, as for gRPC (the clients' training is not in it).
  std::optional<Clock::time_point> t_up;
  std::vector<std::shared_ptr<std::atomic<uint64_t>>> counted_up;  // committed updates' wire bytes
  while (true) {
    const std::vector<int> waiting = waiting_ranks();
    if (waiting.empty()) break;
    // Whichever rank is ready, earliest in fold order first: no update waits
    // for one that has not come, and of those ready, the one whose turn is
    // nearest goes first (fewer updates park).
    const int r = quiet_probe_first(waiting, kTagUpdateMeta, std::chrono::milliseconds(20), deadline);
    if (r < 0) {
      for (int late : waiting) {
        exclude(late, round,
                fmt::format("had not sent its update {} s into the upload (server_configs.upload_timeout_s)", timeout));
      }
      break;
    }
    // The ranks next in fold order after it whose updates are announced
    // too come with it (up to what the ring shares out): their chunks then
    // arrive in turn and fold together (ServerStreams::receive_updates).
    // Only those next to it: one behind a gap (an update not yet
    // announced) could not fold and would be parked.
    std::vector<int> together{r};
    for (auto w = std::find(waiting.begin(), waiting.end(), r) + 1;
         w != waiting.end() && together.size() < streams_.max_together(); ++w) {
      int announced = 0;
      MPI_Iprobe(*w, kTagUpdateMeta, MPI_COMM_WORLD, &announced, MPI_STATUS_IGNORE);
      if (!announced) break;
      together.push_back(*w);
    }
    std::vector<ServerStreams::Incoming> batch;
    std::vector<WireUpdateMeta> metas;
    std::vector<UpdateReport> reports;
    std::vector<std::shared_ptr<std::atomic<uint64_t>>> wire_bytes;
    std::vector<Status> refused;  // per batch entry: why its metadata was refused
    for (int w : together) {
      WireUpdateMeta md{};
      quiet_recv(&md, sizeof md, w, kTagUpdateMeta);
      if (!t_up) t_up = Clock::now();
      // Refused before a byte counts, and the rank is out once its chunks
      // are read (they come by source rank, so a lie cannot misplace them):
      // an update for a client the rank does not play this round, one that
      // says another round, a metric that is not a number. Nothing of the
      // claimed client is marked: the rank's true one fails with it.
      const bool expected = md.client >= 0 && md.client < cfg_.server.num_clients &&
                            rank_of_client(md.client, k) == w &&
                            std::find(selected.begin(), selected.end(), md.client) != selected.end() &&
                            !done[static_cast<size_t>(md.client)];
      Status bad = expected ? check_update_round(md.round, round, client_id(md.client))
                            : invalid_argument(
                                  "round {}: the update from rank {} is refused: it names client_{}, which round {} "
                                  "did not ask of that rank",
                                  round, w, md.client, round);
      if (expected) done[static_cast<size_t>(md.client)] = true;
      UpdateReport report;
      if (bad.ok()) {
        auto decoded = decode_update_report(md.sample_count, wire_metrics(md), client_id(md.client), round);
        if (decoded.ok()) report = *decoded;
        bad = decoded.status();
      }
      StatusOr<std::unique_ptr<UpdateStream>> opened =
          bad.ok() ? agg.open_update(client_id(md.client), md.sample_count)
                   : StatusOr<std::unique_ptr<UpdateStream>>(std::make_unique<DiscardedUpdate>());
      if (!opened.ok()) {  // the aggregator refused it (its sample count): out, as a lie is
        bad = opened.status();
        opened = StatusOr<std::unique_ptr<UpdateStream>>(std::make_unique<DiscardedUpdate>());
      }
      refused.push_back(bad);
      // The bytes on the wire (compressed frames are fewer than the model's).
      auto counted = std::make_shared<std::atomic<uint64_t>>(0);
      const std::string peer = expected ? fmt::format("client_{} (rank {})", md.client, w) : fmt::format("rank {}", w);
      batch.push_back({w, peer, std::make_shared<CountingStream>(std::move(*opened), counted)});
      metas.push_back(md);
      reports.push_back(report);
      wire_bytes.push_back(counted);
    }
    most_together_ = std::max(most_together_, batch.size());
    const std::vector<Status> received = streams_.receive_updates(batch, std::chrono::seconds(timeout));
    for (size_t j = 0; j < batch.size(); ++j) {
      if (!received[j].ok()) {
        exclude(batch[j].rank, round, received[j].message());
        continue;  // its update was closed uncommitted: the aggregator withdrew it
      }
      if (!refused[j].ok()) {
        spdlog::warn("{}", refused[j].message());
        exclude(batch[j].rank, round, "sent metadata that was refused");
        continue;  // its chunks were read and dropped: nothing of it was folded
      }
      counted_up.push_back(wire_bytes[j]);
      ClientUpdateInfo info = update_info(metas[j].client, reports[j]);
      info.bytes_down = layout_.total_bytes();  // the broadcast sends every rank the model's bytes
      out->committed.push_back(info);
    }
  }
  streams_.drain();
  for (size_t j = 0; j < counted_up.size(); ++j) {  // folded (and counted) by now
    out->committed[j].bytes_up = counted_up[j]->load();
    out->bytes_up += out->committed[j].bytes_up;
  }
  for (int c : selected) {
    if (std::none_of(out->committed.begin(), out->committed.end(), [&](const auto& u) { return u.client == c; }))
      out->failed.push_back(c);
  }
  out->upload_seconds = t_up ? since(*t_up) : 0.0;
  return Status::Ok();
}

// The tests' hold: until every rank of `ranks` (those still in this round)
// has announced its next update, or collect_hold_ has passed (a rank that stalled before
// announcing never will). Waiting for the announcements, not a fixed time,
// is what makes the batch the tests assert certain: under ASan beside other
// tests a rank was seen to announce more than 3 s after the broadcast.
void MpiServerTransport::hold_until_announced(const std::vector<int>& ranks) {
  auto announced = [](int r) {
    int flag = 0;
    MPI_Iprobe(r, kTagUpdateMeta, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  };
  const auto until = Clock::now() + collect_hold_;
  while (Clock::now() < until && !std::all_of(ranks.begin(), ranks.end(), announced)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

bool MpiServerTransport::send_model_to(int r, int round, int local_steps, const Arena& global) {
  WireModelBegin b{round, 0, 1, local_steps, layout_.hash(), layout_.total_bytes()};
  MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
  const std::chrono::seconds stall(cfg_.server.broadcast_deadline_s());
  if (!streams_.broadcast({r}, global, stall).empty()) {
    exclude(r, round, fmt::format("left a chunk of the global model untaken for {} s", stall.count()));
    return false;
  }
  int32_t ok = 0;
  MPI_Request rq;
  MPI_Irecv(&ok, sizeof ok, MPI_BYTE, r, kTagModelReceived, MPI_COMM_WORLD, &rq);
  if (!mpi_detail::quiet_waitall_until(1, &rq, MPI_STATUS_IGNORE, mpi_detail::kIdle, Clock::now() + stall)) {
    mpi_detail::cancel_receive(&rq);
    exclude(r, round, fmt::format("did not confirm the global model within {} s", stall.count()));
    return false;
  }
  return true;
}

Status MpiServerTransport::serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options) {
  if (excluded_.empty()) excluded_.assign(static_cast<size_t>(world_), false);
  if (cfg_.server.clients_per_rank != 1)
    return invalid_argument(
        "server_configs.clients_per_rank: {} — an asynchronous run over MPI has one client per rank",
        cfg_.server.clients_per_rank);
  const int n = world_ - 1;
  SpoolSlots slots("asynchronous update spool", layout_.total_bytes());
  MEMFL_RETURN_IF_ERROR(slots.open(options.spool_dir));
  core.set_release([&](AsyncTripRecord& t) { slots.release(t); });
  const auto t0 = Clock::now();
  auto now = [&] { return since(t0); };
  std::vector<bool> training(static_cast<size_t>(n), false);
  std::vector<int64_t> base(static_cast<size_t>(n), 0);
  std::vector<double> left(static_cast<size_t>(n), 0.0);
  std::vector<std::pair<double, int>> deadlines;
  auto send = [&](int c, int steps) {
    const int r = c + 1;
    if (excluded_[static_cast<size_t>(r)]) return;
    base[static_cast<size_t>(c)] = core.version();
    left[static_cast<size_t>(c)] = now();
    training[static_cast<size_t>(c)] = send_model_to(r, static_cast<int>(core.version()), steps, global);
  };
  auto follow = [&](const AsyncNext& next) {
    for (const auto& d : next.deadlines) deadlines.push_back(d);
    for (const auto& d : next.send) send(d.client, d.local_steps);
  };
  for (int c = 0; c < n; ++c) send(c, core.start(c, 0.0));
  const std::chrono::seconds stall(cfg_.server.upload_deadline_s());
  int evaluated = 0;
  while (core.arrivals() < options.total) {
    std::vector<int> sources;
    for (int c = 0; c < n; ++c) {
      if (training[static_cast<size_t>(c)] && !excluded_[static_cast<size_t>(c + 1)]) sources.push_back(c + 1);
    }
    auto first = std::min_element(deadlines.begin(), deadlines.end());
    if (sources.empty() && first == deadlines.end())
      return failed_precondition("no client rank is training and no group is due; {} updates of {} arrived",
                                 core.arrivals(), options.total);
    const auto due =
        first == deadlines.end()
            ? Clock::now() + stall
            : t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(first->first));
    const int r = sources.empty() ? -1 : quiet_probe_first(sources, kTagUpdateMeta, std::chrono::microseconds(0), due);
    if (r < 0) {
      if (sources.empty()) std::this_thread::sleep_until(due);
      if (first != deadlines.end() && Clock::now() >= due) {
        const int group = first->second;
        deadlines.erase(first);
        MEMFL_ASSIGN_OR_RETURN(AsyncNext next, core.deadline(group, now()));
        follow(next);
      } else if (first == deadlines.end()) {
        for (int late : sources) {
          exclude(late, static_cast<int>(core.version()),
                  fmt::format("sent no update for {} s (server_configs.upload_timeout_s)", stall.count()));
        }
      }
      continue;
    }
    WireUpdateMeta md{};
    quiet_recv(&md, sizeof md, r, kTagUpdateMeta);
    const int c = r - 1;
    const std::string peer = fmt::format("client_{} (rank {})", c, r);
    // The metadata before any byte counts, as in a synchronous round: the
    // update names the client this rank hosts, says it is the change from
    // the version this rank was sent, and its metrics are numbers. A refused
    // one's chunks are read and dropped (the rank sends them all the same)
    // and the rank is out of the run.
    const int sent_version = static_cast<int>(base[static_cast<size_t>(c)]);
    Status refused = md.client == c ? check_update_round(md.round, sent_version, client_id(c))
                                    : invalid_argument("the update from rank {} is refused: it names client_{}; the "
                                                       "rank hosts client_{}",
                                                       r, md.client, c);
    UpdateReport report;
    if (refused.ok()) {
      auto decoded = decode_update_report(md.sample_count, wire_metrics(md), client_id(c), sent_version);
      if (decoded.ok()) report = *decoded;
      refused = decoded.status();
    }
    if (!refused.ok()) {
      std::shared_ptr<UpdateStream> dropped = std::make_shared<DiscardedUpdate>();
      (void)streams_.receive_update(r, peer, dropped, stall);
      streams_.drain();
      training[static_cast<size_t>(c)] = false;
      spdlog::warn("{}", refused.message());
      exclude(r, static_cast<int>(core.version()), "sent metadata that was refused");
      continue;
    }
    const size_t slot = slots.take();
    std::unique_ptr<UpdateStream> into = std::make_unique<SpoolSlotWriter>(slots.spool(), slot, layout_, peer);
    if (options.wrap_update) into = options.wrap_update(std::move(into), peer);
    auto counted = std::make_shared<std::atomic<uint64_t>>(0);
    std::shared_ptr<UpdateStream> writer = std::make_shared<CountingStream>(std::move(into), counted);
    Status received = streams_.receive_update(r, peer, writer, stall);
    streams_.drain();  // checked and written whole before it is used
    training[static_cast<size_t>(c)] = false;
    if (!received.ok()) {
      slots.give_back(slot);
      exclude(r, static_cast<int>(core.version()), received.message());
      continue;
    }
    AsyncTripRecord trip;
    trip.client = c;
    trip.update = std::make_shared<SpoolSlotSource>(slots.spool(), slot, layout_.total_bytes());
    trip.base_version = base[static_cast<size_t>(c)];
    trip.dispatched_at = left[static_cast<size_t>(c)];
    trip.local_steps = report.local_steps;
    trip.train_loss = report.train_loss;
    trip.bytes_up = counted->load();
    MEMFL_ASSIGN_OR_RETURN(AsyncNext next, core.arrive(std::move(trip), now()));
    if (core.arrivals() < options.total) follow(next);
    if (options.eval_due(core.arrivals())) MEMFL_RETURN_IF_ERROR(options.on_eval(++evaluated, core.arrivals(), now()));
  }
  // Ranks still training send their update; it is taken (not applied) so
  // that they come to hear that the run is over.
  for (int c = 0; c < n; ++c) {
    const int r = c + 1;
    if (!training[static_cast<size_t>(c)] || excluded_[static_cast<size_t>(r)]) continue;
    if (quiet_probe_first({r}, kTagUpdateMeta, std::chrono::microseconds(0), Clock::now() + stall) < 0) {
      exclude(r, static_cast<int>(core.version()), "sent no update after the run's last one");
      continue;
    }
    WireUpdateMeta md{};
    quiet_recv(&md, sizeof md, r, kTagUpdateMeta);
    const size_t slot = slots.take();
    const std::string peer = fmt::format("rank {}", r);
    std::unique_ptr<UpdateStream> into = std::make_unique<SpoolSlotWriter>(slots.spool(), slot, layout_, peer);
    if (options.wrap_update) into = options.wrap_update(std::move(into), peer);
    std::shared_ptr<UpdateStream> writer = std::move(into);
    (void)streams_.receive_update(r, peer, writer, stall);
    streams_.drain();
    slots.give_back(slot);
  }
  return core.flush_log();
}

void MpiServerTransport::finish(int) {
  if (excluded_.empty()) excluded_.assign(static_cast<size_t>(world_), false);
  std::vector<MPI_Request> byes;
  std::vector<int32_t> bye(static_cast<size_t>(world_), 0);
  for (int r = 1; r < world_; ++r) {
    if (excluded_[static_cast<size_t>(r)]) continue;
    WireModelBegin b{0, 1, 0, 0, layout_.hash(), layout_.total_bytes()};  // finished
    MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
    byes.emplace_back();
    MPI_Irecv(&bye[static_cast<size_t>(r)], 1, MPI_INT32_T, r, kTagBye, MPI_COMM_WORLD, &byes.back());
  }
  // Their outputs are written once they say Bye; one that does not within
  // the broadcast's timeout is not waited for.
  const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.broadcast_deadline_s());
  if (!mpi_detail::quiet_waitall_until(static_cast<int>(byes.size()), byes.data(), MPI_STATUSES_IGNORE,
                                       mpi_detail::kIdle, deadline)) {
    for (auto& rq : byes) mpi_detail::cancel_receive(&rq);
  }
}

StatusOr<std::string> MpiServerTransport::secagg_exchange(int client, std::string request) {
  if (client < 0 || client >= cfg_.server.num_clients) {
    return invalid_argument("secure aggregation: no client_{} in this run", client);
  }
  const int r = rank_of_client(client, cfg_.server.clients_per_rank);
  if (excluded_.empty()) excluded_.assign(static_cast<size_t>(world_), false);
  if (excluded_[static_cast<size_t>(r)]) {
    return Status(StatusCode::kUnavailable, fmt::format("client_{} (rank {}) is out of the run", client, r));
  }
  const int wait_s = cfg_.secagg_deadline_s();
  const auto deadline = Clock::now() + std::chrono::seconds(wait_s);
  const auto lost = [&](const char* what) {
    const std::string why = fmt::format(
        "client_{} (rank {}) did not {} secure aggregation's request within {} s "
        "(server_configs.secure_aggregation.timeout)",
        client, r, what, wait_s);
    exclude(r, round_, why);
    return Status(StatusCode::kUnavailable, why);
  };
  // Sent without blocking: a rank that stalled must not hold the server.
  const uint64_t n = request.size();
  MPI_Request sends[2];
  MPI_Isend(&n, sizeof n, MPI_BYTE, r, kTagSecAggRequest, MPI_COMM_WORLD, &sends[0]);
  MPI_Isend(request.data(), static_cast<int>(n), MPI_BYTE, r, kTagSecAggRequest, MPI_COMM_WORLD, &sends[1]);
  uint64_t m = 0;
  MPI_Request rq;
  MPI_Irecv(&m, sizeof m, MPI_BYTE, r, kTagSecAggReply, MPI_COMM_WORLD, &rq);
  if (!mpi_detail::quiet_waitall_until(1, &rq, MPI_STATUS_IGNORE, mpi_detail::kIdle, deadline)) {
    mpi_detail::cancel_receive(&rq);
    for (auto& s : sends) MPI_Request_free(&s);  // let go: the rank is out
    return lost("answer");
  }
  mpi_detail::quiet_waitall(2, sends, MPI_STATUSES_IGNORE, mpi_detail::kIdle);
  if (m > kMaxSecAggMessage) {
    abort_job(
        fmt::format("rank {} announced a secure aggregation reply of {} bytes (at most {})", r, m, kMaxSecAggMessage));
  }
  std::string reply(m, '\0');
  MPI_Irecv(reply.data(), static_cast<int>(m), MPI_BYTE, r, kTagSecAggReply, MPI_COMM_WORLD, &rq);
  if (!mpi_detail::quiet_waitall_until(1, &rq, MPI_STATUS_IGNORE, mpi_detail::kIdle, deadline)) {
    mpi_detail::cancel_receive(&rq);
    return lost("finish its reply to");
  }
  return reply;
}

void MpiServerTransport::secagg_end_round() {
  // Every rank of the round listens for requests until this empty one.
  for (int r : round_ranks_) {
    if (excluded_[static_cast<size_t>(r)]) continue;
    const uint64_t none = 0;
    MPI_Send(&none, sizeof none, MPI_BYTE, r, kTagSecAggRequest, MPI_COMM_WORLD);
  }
}

void MpiServerTransport::secagg_drop(int client, const std::string& why) {
  if (client < 0 || client >= cfg_.server.num_clients) return;
  exclude(rank_of_client(client, cfg_.server.clients_per_rank), round_, "was left out of secure aggregation: " + why);
}

}  // namespace memfl
