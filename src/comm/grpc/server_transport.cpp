// The gRPC transport of the server core. One bidirectional stream per client
// session, served by gRPC's synchronous server (a thread per session); the
// round driver puts the transport in a phase (broadcast, then upload) and the
// sessions move chunks between the wire and the global arena or the
// aggregator. Updates are taken as they come: the aggregator parks one whose
// turn to fold has not come, so no client waits for another.
#include "comm/grpc/server_transport.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <utility>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <spdlog/spdlog.h>

#include "comm/chunk.h"
#include "comm/grpc/data_channel.h"
#include "comm/grpc/wire.h"
#include "comm/spool_update.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}

enum class Phase { kWaiting, kBroadcast, kUpload, kFinished };

// Reads an update's frames until UpdateEnd, giving each chunk to `on_chunk`
// (which checks it and takes its bytes) while the next frames are read
// (read_chunk_run); returns the first failure: the stream broke, a frame
// was malformed, or a chunk was refused. With a data channel (`data`), the
// chunks come from it, each read into one chunk-sized buffer (the socket's
// kernel buffer is the read-ahead), and the stream says UpdateEnd.
Status read_update_frames(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                          const std::string& peer, uint64_t total, std::atomic<int>* read_ahead_budget,
                          uint64_t* received, DataSocket* data, size_t chunk,
                          const std::function<Status(const DecodedFrame&)>& on_chunk) {
  wire::ClientMessage msg;
  bool broke = false;
  if (data != nullptr) {
    std::vector<std::byte> buffer(chunk);
    DecodedFrame d;
    d.is_chunk = true;
    Status st = read_data_chunks(*data, total, buffer, received, [&](const ChunkHeader& h, auto bytes) {
      d.header = h;
      d.pieces.assign(1, bytes);
      return on_chunk(d);
    });
    if (st.code() == StatusCode::kUnavailable) {
      return Status(StatusCode::kUnavailable, fmt::format("{} disconnected after {} of {} bytes of its update ({})",
                                                          peer, *received, total, st.message()));
    }
    MEMFL_RETURN_IF_ERROR(st);
    Frame frame;
    if (!stream->Read(&frame)) {
      return Status(StatusCode::kUnavailable, fmt::format("{} disconnected before the end of its update", peer));
    }
    MEMFL_RETURN_IF_ERROR(decode_frame(frame, kClientChunkField, peer, &d, &msg));
    if (d.is_chunk || !msg.has_update_end()) return data_loss("{}: unexpected message at the end of an update", peer);
    return Status::Ok();
  }
  Status st = read_chunk_run([stream](Frame* f) { return stream->Read(f); }, [ctx] { ctx->TryCancel(); },
                             kClientChunkField, peer, ChunkRunOptions{.budget = read_ahead_budget},
                             [&](const DecodedFrame& d) {
                               MEMFL_RETURN_IF_ERROR(on_chunk(d));
                               *received += d.header.length;
                               return Status::Ok();
                             },
                             &msg, &broke);
  if (broke) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{} disconnected after {} of {} bytes of its update", peer, *received, total));
  }
  MEMFL_RETURN_IF_ERROR(st);
  if (!msg.has_update_end()) return data_loss("{}: unexpected message in the middle of an update", peer);
  return Status::Ok();
}

struct ClientSlot {
  bool connected = false;
  bool failed = false;  // disconnected, timed out or sent bad bytes: out for the run
  bool selected = false;
  int served_round = 0;  // last round whose model this client was sent
  bool received = false;
  bool committed = false;
  bool uploading = false;  // a session is inside its update (holds an aggregator stream)
  grpc::ServerContext* ctx = nullptr;
  // Which session is the client's now: a dropped client may register again
  // while its old session thread is still winding down, and that thread
  // must not touch the new session's state.
  uint64_t session = 0;
  // A client that registered again during a round it had been selected for
  // is not waited for in that round (its new session starts afresh).
  int lost_round = 0;
  ClientUpdateInfo info;  // what its update's metadata said
  // The data channel (grpc_configs.data_channel: tcp): the ticket its
  // session was given (0: none, or already used) and the connection it
  // opened with it.
  uint64_t data_ticket = 0;
  std::shared_ptr<DataSocket> data;
  // Ends the data connection and its ticket (the session holding a copy
  // sees its reads and writes fail at once).
  void close_data() {
    if (data) data->shutdown();
    data.reset();
    data_ticket = 0;
  }
};

// The gRPC transport of the server core: sessions (a thread each, gRPC's
// synchronous server) wait on the phase the round driver puts the transport
// in — broadcast, then upload — and move chunks between the wire and the
// global arena or the aggregator.
class ServerAgent final : public ServerTransport {
 public:
  ServerAgent(const ExperimentConfig& cfg, const Layout& layout, bool naive)
      : cfg_(cfg),
        layout_(layout),
        chunk_(grpc_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes())),
        naive_(naive),
        slots_(static_cast<size_t>(cfg.server.num_clients)) {
    // Asynchronous from the first message: a client may ask for the model
    // before serve_async starts, and must then wait for it, not for a round.
    if (cfg.server.is_async()) {
      async_ = std::make_unique<Async>();
      async_->ready_steps.assign(slots_.size(), -1);
      async_->base_version.assign(slots_.size(), 0);
      async_->sending_since.assign(slots_.size(), Clock::time_point::max());
      async_->send_progress = std::make_unique<std::atomic<int64_t>[]>(slots_.size());
      async_->dispatched_at.assign(slots_.size(), 0.0);
    }
  }
  grpc::Status session(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream);
  // Waits (round_timeout_s at most) for every client to register.
  void wait_for_clients();

  std::string_view name() const override { return "grpc"; }
  bool broadcast_done_before_collect() const override { return true; }
  Status broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) override;
  Status collect(int round, const std::vector<int>& selected, const Arena& global, UpdateOpener& aggregator,
                 CollectResult* out) override;
  void finish(int last_round) override;
  std::vector<int> take_rejoined() override {
    std::lock_guard lock(mu_);
    return std::exchange(rejoined_, {});
  }
  // Asynchronous serving: see GrpcServerTransport::serve_async.
  Status serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options);
  // data_channel: tcp — listens beside the gRPC port; sessions registered
  // from then on are offered it.
  Status start_data_channel();
  void stop_data_channel() { data_listener_.stop(); }

 private:
  bool attach_data(int fd, const DataHello& hello, const std::string& addr);
  // The session's data connection, once its client has opened it
  // (connect_timeout_s at most); null if it did not, or the session ended.
  std::shared_ptr<DataSocket> wait_for_data(int id, uint64_t session);
  // Asynchronous mode's state (null in rounds). Lock order: model_mu, then mu_.
  struct Async {
    AsyncUpdateHandler* core = nullptr;
    Arena* global = nullptr;
    AsyncServeOptions options;
    std::shared_mutex model_mu;         // senders share it; applying an update takes it alone
    std::unique_ptr<SpoolSlots> slots;  // updates wait here until applied
    std::vector<int> ready_steps;       // per client: its next trip's local steps, -1 while it has none
    std::vector<int64_t> base_version;
    // Per client: when the send of its model began (max: not sending). A
    // sender holds model_mu shared, which applying an update needs alone, so
    // a client that stops reading would freeze every update behind it: a
    // watchdog cancels a send older than broadcast_timeout_s, as the
    // synchronous broadcast's deadline does.
    std::vector<Clock::time_point> sending_since;
    // Per client: when its send last moved a chunk (steady clock ticks), and
    // how many threads wait to apply an update (or evaluate) behind the
    // senders: a send that moves nothing for connect_timeout_s while one
    // waits is cancelled before its deadline.
    std::unique_ptr<std::atomic<int64_t>[]> send_progress;
    std::atomic<int> appliers_waiting{0};
    std::vector<double> dispatched_at;
    std::vector<std::pair<double, int>> deadlines;  // FedCompass groups
    int64_t evals_due = 0;                          // evaluations the serving thread owes
    bool done = false;
    Clock::time_point t0;
    double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
  };
  void follow_locked(const AsyncNext& next);
  // Drops every client whose model send has taken longer than the broadcast
  // deadline, or has moved nothing for connect_timeout_s while an update waits.
  void cancel_stalled_senders_locked();
  std::unique_lock<std::shared_mutex> lock_to_apply(Async& a);
  // Chunks of the global model are handed to gRPC without a copy: before the
  // model changes, gRPC must have let go of every one (senders are done:
  // the caller holds the model lock alone).
  void wait_for_sent_chunks() {
    while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  grpc::Status async_send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int id, uint64_t session,
                                const std::string& peer, DataSocket* data, bool* finished);
  grpc::Status async_receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream, int id,
                                    uint64_t session, const wire::UpdateMetadata& md, const std::string& peer,
                                    DataSocket* data);
  std::unique_ptr<Async> async_;

  bool wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, const std::function<bool()>& pred);
  // Drops client `id` for the run (until it registers again). `cancel` ends
  // its session from outside (a deadline passed); a session that fails on
  // its own returns its status instead, which the client reads.
  void fail_locked(int id, const std::string& why, bool cancel = false);
  // `data` (may be null): the session's data channel, which then carries the chunks.
  // `progress` (may be null): set to the steady clock's time after each chunk.
  grpc::Status send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round, const std::string& peer,
                          DataSocket* data, int local_steps = 0, std::atomic<int64_t>* progress = nullptr);
  grpc::Status receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream, int id,
                              uint64_t session, const wire::UpdateMetadata& md, const std::string& peer,
                              DataSocket* data);
  void naive_average_locked();

  const ExperimentConfig& cfg_;
  const Layout& layout_;
  const Arena* global_ = nullptr;  // the round's global model, during the broadcast
  size_t chunk_ = 0;
  bool naive_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  Phase phase_ = Phase::kWaiting;
  int round_ = 0;
  Clock::time_point deadline_;
  UpdateOpener* aggregator_ = nullptr;  // the round's, during the upload phase
  std::vector<ClientSlot> slots_;
  std::vector<int> order_;     // selected clients
  std::vector<int> rejoined_;  // clients back since the driver last asked
  std::atomic<int64_t> inflight_{0};
  // Chunks the upload sessions may read ahead of their folds, all of them
  // together (read_chunk_run): the server's memory does not grow with its
  // clients. Four (≤ 4 MiB): two clients' uploads read two ahead each; at
  // 4 clients 1 GiB uploads measured the same with 4 or 8 (2.02 GB/s median).
  std::atomic<int> read_ahead_budget_{4};
  ChunkChecksums down_sums_;  // of the model being broadcast
  int64_t broadcasts_ = 0;    // rounds mode: the key of down_sums_
  // Transfer timing of the current round.
  std::optional<Clock::time_point> down_start_, up_start_;
  Clock::time_point down_end_, up_end_;
  uint64_t bytes_down_ = 0, bytes_up_ = 0;
  // Naive mode: every client's serialised model, held until the end of the upload phase.
  std::vector<std::pair<int, std::pair<double, std::vector<std::byte>>>> naive_updates_;
  int data_port_ = 0;         // 0: no TCP port offered
  bool offers_data_ = false;  // a data channel (TCP port or Unix socket) is offered
  // Last: destroyed first, so its thread stops before what it touches.
  DataListener data_listener_;
};

Status ServerAgent::start_data_channel() {
  // Under TLS the chunks may leave the encrypted stream only where they never
  // leave the kernel: the Unix socket, for clients on this host (its ticket
  // travels inside the TLS stream). A plain server also offers a TCP port.
  const bool tcp = !cfg_.server.use_ssl;
  const bool unix_socket = cfg_.server.data_channel_unix || !tcp;
  MEMFL_RETURN_IF_ERROR(data_listener_.start(
      cfg_.server.server_uri, cfg_.server.data_channel_port, unix_socket,
      [this](int fd, const DataHello& hello, const std::string& addr) { return attach_data(fd, hello, addr); }, tcp));
  data_port_ = data_listener_.port();
  offers_data_ = data_port_ != 0 || !data_listener_.unix_name().empty();
  if (tcp) {
    spdlog::info("server: TCP data channel on port {}{}", data_port_,
                 data_listener_.unix_name().empty() ? "" : ", and a Unix socket for clients on this host");
  } else if (offers_data_) {
    spdlog::info(
        "server: data channel on a Unix socket for clients on this host (TLS: clients elsewhere use the "
        "encrypted stream)");
  }
  return Status::Ok();
}

bool ServerAgent::attach_data(int fd, const DataHello& hello, const std::string& addr) {
  std::lock_guard lock(mu_);
  if (hello.client_id >= slots_.size()) return false;
  auto& s = slots_[hello.client_id];
  // The ticket is the session's, and good once.
  if (s.data_ticket == 0 || s.data_ticket != hello.ticket || !send_data_welcome(fd)) return false;
  s.data_ticket = 0;
  s.data = std::make_shared<DataSocket>(fd, fmt::format("client_{} ({}, data channel)", hello.client_id, addr));
  spdlog::info("client_{}: chunks on the data channel ({})", hello.client_id, addr);
  cv_.notify_all();
  return true;
}

std::shared_ptr<DataSocket> ServerAgent::wait_for_data(int id, uint64_t session) {
  std::unique_lock lock(mu_);
  auto& s = slots_[static_cast<size_t>(id)];
  wait_for(lock, Clock::now() + std::chrono::seconds(cfg_.server.connect_timeout_s),
           [&] { return s.data != nullptr || s.failed || s.session != session; });
  return s.session == session && !s.failed ? s.data : nullptr;
}

bool ServerAgent::wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                           const std::function<bool()>& pred) {
  return cv_.wait_until(lock, deadline, pred);
}

void ServerAgent::fail_locked(int id, const std::string& why, bool cancel) {
  auto& s = slots_[static_cast<size_t>(id)];
  if (s.failed) return;
  s.failed = true;
  spdlog::warn("client_{} is out: {}", id, why);
  if (cancel && s.ctx != nullptr) s.ctx->TryCancel();
  // A read or write blocked on its data channel returns now.
  if (s.data) s.data->shutdown();
  cv_.notify_all();
}

grpc::Status ServerAgent::send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round, const std::string& peer,
                                     DataSocket* data, int local_steps, std::atomic<int64_t>* progress) {
  auto made_progress = [progress] {
    if (progress != nullptr) progress->store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  };
  const Layout& layout = layout_;
  wire::ServerMessage begin;
  begin.mutable_model_begin()->set_round(round);
  begin.mutable_model_begin()->set_local_steps(local_steps);
  begin.mutable_model_begin()->set_layout_hash(layout.hash());
  begin.mutable_model_begin()->set_total_bytes(layout.total_bytes());
  if (!stream->Write(encode_message(begin))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  {
    std::lock_guard lock(mu_);
    if (!down_start_) down_start_ = Clock::now();
    // Every sender of this model shares its chunks' checksums. Asynchronous,
    // a new version forgets the old ones (the model changes only while no
    // sender runs); in rounds, broadcast() resets them.
    if (async_) down_sums_.reset(round, layout.total_bytes(), chunk_);
  }
  // Naive mode serialises the whole model into one buffer first, as typical
  // frameworks do (pickle/torch.save); streaming sends from the arena.
  std::vector<std::byte> serialised;
  std::atomic<int64_t> serialised_inflight{0};
  const std::byte* base = global_->data();
  if (naive_) {
    serialised.assign(base, base + layout.total_bytes());
    base = serialised.data();
  }
  // The serialised copy must outlive gRPC's references to it.
  struct WaitForRelease {
    std::atomic<int64_t>& n;
    ~WaitForRelease() {
      while (n.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  } wait_for_release{serialised_inflight};
  for (size_t off = 0; off < layout.total_bytes(); off += chunk_) {
    const size_t len = std::min(chunk_, layout.total_bytes() - off);
    std::span<const std::byte> bytes(base + off, len);
    ChunkHeader h{layout.hash(), off, len, down_sums_.get(off, bytes)};
    if (data != nullptr) {
      // The kernel copies the bytes before write_chunk returns.
      const Status w = data->write_chunk(h, bytes);
      if (!w.ok()) return {grpc::StatusCode::UNAVAILABLE, peer + " went away during the broadcast: " + w.message()};
      made_progress();
      continue;
    }
    // One write in flight: Write returns when gRPC has taken the message.
    if (!stream->Write(encode_chunk_frame(kServerChunkField, h, bytes, naive_ ? &serialised_inflight : &inflight_))) {
      return {grpc::StatusCode::UNAVAILABLE, peer + " went away during the broadcast"};
    }
    made_progress();
  }
  wire::ServerMessage end;
  end.mutable_model_end();
  if (!stream->Write(encode_message(end))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  std::lock_guard lock(mu_);
  bytes_down_ += layout.total_bytes();
  return grpc::Status::OK;
}

grpc::Status ServerAgent::receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                                         int id, uint64_t session, const wire::UpdateMetadata& md,
                                         const std::string& peer, DataSocket* data) {
  {
    std::unique_lock lock(mu_);
    // The others' broadcast may still run: this update waits for the upload
    // phase at most as long as the two phases may take.
    const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.broadcast_deadline_s()) +
                          std::chrono::seconds(cfg_.server.upload_deadline_s());
    // No turn to wait for: the aggregator parks an update that is early.
    if (!wait_for(lock, deadline, [&] {
          return phase_ == Phase::kFinished || slots_[static_cast<size_t>(id)].failed || phase_ == Phase::kUpload;
        })) {
      return {grpc::StatusCode::DEADLINE_EXCEEDED, peer + ": the upload phase did not reach it in time"};
    }
    if (slots_[static_cast<size_t>(id)].failed || phase_ != Phase::kUpload) {
      return {grpc::StatusCode::ABORTED, peer + ": not part of this round's upload"};
    }
    if (!up_start_) up_start_ = Clock::now();
    slots_[static_cast<size_t>(id)].uploading = true;
  }
  // However this update ends, the round may be aggregated once it has.
  struct Done {
    ServerAgent* a;
    int id;
    ~Done() {
      std::lock_guard lock(a->mu_);
      a->slots_[static_cast<size_t>(id)].uploading = false;
      a->cv_.notify_all();
    }
  };
  const Layout& layout = layout_;
  std::unique_ptr<UpdateStream> update;
  Done done{this, id};  // declared before `update`: the stream closes first
  std::vector<std::byte> naive_copy;
  if (!naive_) {
    UpdateOpener* agg = nullptr;
    {
      std::lock_guard lock(mu_);
      agg = aggregator_;
    }
    if (agg == nullptr) return {grpc::StatusCode::ABORTED, peer + ": not part of this round's upload"};
    auto u = agg->open_update(client_id(id), md.sample_count());
    if (!u.ok()) return {grpc::StatusCode::INVALID_ARGUMENT, u.status().message()};
    update = std::move(*u);
  } else {
    if (!(md.sample_count() > 0)) return {grpc::StatusCode::INVALID_ARGUMENT, peer + ": bad sample count"};
    naive_copy.resize(layout.total_bytes());
  }
  uint64_t received = 0;
  Status bad = read_update_frames(ctx, stream, peer, layout.total_bytes(), &read_ahead_budget_, &received, data, chunk_,
                                  [&](const DecodedFrame& d) {
                                    if (!naive_) return update->accept(d.header, d.payload());
                                    MEMFL_RETURN_IF_ERROR(verify_chunk(d.header, d.payload(), layout, received, peer));
                                    size_t at = d.header.offset;
                                    for (auto p : d.pieces) {
                                      std::memcpy(naive_copy.data() + at, p.data(), p.size());
                                      at += p.size();
                                    }
                                    return Status::Ok();
                                  });
  if (bad.ok() && !naive_) bad = update->commit();
  if (bad.ok() && naive_ && received != layout.total_bytes()) {
    bad = data_loss("update from {} ended after {} of {} bytes", peer, received, layout.total_bytes());
  }
  wire::ServerMessage ack;
  ack.mutable_update_ack()->set_accepted(bad.ok());
  ack.mutable_update_ack()->set_message(bad.ok() ? "" : bad.message());
  stream->Write(encode_message(ack));
  std::lock_guard lock(mu_);
  if (slots_[static_cast<size_t>(id)].session != session) {
    // The client registered again meanwhile: this session was cancelled, and
    // its update never counts (the round already closed on it).
    update.reset();
    return {grpc::StatusCode::CANCELLED, peer + ": session replaced"};
  }
  if (!bad.ok()) {
    update.reset();  // aborts: taints the sum if some bytes were folded
    fail_locked(id, bad.message());
    return {grpc::StatusCode::DATA_LOSS, bad.message()};
  }
  auto& s = slots_[static_cast<size_t>(id)];
  s.committed = true;
  s.info = ClientUpdateInfo{};
  s.info.client = id;
  s.info.sample_count = md.sample_count();
  s.info.train_loss = md.metrics().count("train_loss") ? md.metrics().at("train_loss") : 0;
  s.info.has_validation = md.metrics().count("val_accuracy") > 0;
  s.info.val_weight = md.sample_count();
  s.info.val_accuracy = s.info.has_validation ? md.metrics().at("val_accuracy") : 0;
  if (naive_) naive_updates_.emplace_back(id, std::make_pair(md.sample_count(), std::move(naive_copy)));
  bytes_up_ += received;
  up_end_ = Clock::now();
  cv_.notify_all();
  return grpc::Status::OK;
}

grpc::Status ServerAgent::session(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream) {
  const std::string peer_addr = ctx->peer();
  Frame frame;
  DecodedFrame d;
  wire::ClientMessage msg;
  if (!stream->Read(&frame)) return grpc::Status::OK;
  Status st = decode_frame(frame, kClientChunkField, peer_addr, &d, &msg);
  if (!st.ok() || d.is_chunk || !msg.has_register_()) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "the first message must be Register"};
  }
  const auto& reg = msg.register_();
  int id = -1;
  uint64_t my_session = 0;   // this session's number in the client's slot
  uint64_t data_ticket = 0;  // non-zero: chunks travel on the data channel
  std::string refusal;
  try {
    size_t pos = 0;
    id = std::stoi(reg.client_id(), &pos);
    if (pos != reg.client_id().size()) id = -1;
  } catch (...) {
    id = -1;
  }
  if (!cfg_.server.auth_token.empty() && reg.token() != cfg_.server.auth_token) {
    refusal = fmt::format("client '{}' from {}: wrong token", reg.client_id(), peer_addr);
  } else if (id < 0 || id >= cfg_.server.num_clients) {
    refusal = fmt::format("client id '{}' from {} is unknown (expected 0..{})", reg.client_id(), peer_addr,
                          cfg_.server.num_clients - 1);
  } else {
    std::lock_guard lock(mu_);
    auto& s = slots_[static_cast<size_t>(id)];
    if (s.connected && s.ctx != nullptr && !s.failed) {
      refusal = fmt::format("client id {} from {} is already connected (its session is open)", id, peer_addr);
    } else {
      // A client whose earlier session ended (killed, restarted) may come
      // back: it takes part again from the next round.
      if (s.failed) {
        if (s.selected && phase_ != Phase::kWaiting && phase_ != Phase::kFinished) s.lost_round = round_;
        s.failed = false;
        s.selected = false;
        rejoined_.push_back(id);
        if (async_ && async_->core != nullptr && !async_->done)
          async_->ready_steps[static_cast<size_t>(id)] = async_->core->start(id, async_->now());
        spdlog::info("client_{} rejoined from {}; it takes part from the next round", id, peer_addr);
      }
      s.connected = true;
      s.ctx = ctx;
      my_session = ++s.session;
      // An earlier session's data connection is not this one's.
      s.close_data();
      s.data_ticket = data_ticket = offers_data_ && reg.data_channel() ? draw_data_ticket() : 0;
      cv_.notify_all();
    }
  }
  wire::ServerMessage reply;
  reply.mutable_register_reply()->set_accepted(refusal.empty());
  reply.mutable_register_reply()->set_message(refusal);
  if (data_ticket != 0) {
    reply.mutable_register_reply()->set_data_port(static_cast<uint32_t>(data_port_));
    reply.mutable_register_reply()->set_data_ticket(data_ticket);
    reply.mutable_register_reply()->set_data_unix_socket(data_listener_.unix_name());
  }
  stream->Write(encode_message(reply));
  if (!refusal.empty()) {
    spdlog::warn("refused: {}", refusal);
    return {grpc::StatusCode::UNAUTHENTICATED, refusal};
  }
  const std::string peer = fmt::format("client_{} ({})", id, peer_addr);
  // A session that ends hands the slot back, unless the client already has
  // a newer one.
  auto on_exit = [&](grpc::Status s) {
    std::lock_guard lock(mu_);
    auto& slot = slots_[static_cast<size_t>(id)];
    if (slot.session != my_session) return s;
    slot.ctx = nullptr;
    if (!s.ok() && phase_ != Phase::kFinished) fail_locked(id, s.error_message());
    return s;
  };
  // However the session ends, its data connection closes with it.
  struct CloseData {
    ServerAgent* a;
    int id;
    uint64_t session;
    ~CloseData() {
      std::lock_guard lock(a->mu_);
      auto& slot = a->slots_[static_cast<size_t>(id)];
      if (slot.session == session) slot.close_data();
    }
  } close_data{this, id, my_session};
  std::shared_ptr<DataSocket> data;
  // The data connection, the first time a model or an update needs it.
  auto need_data = [&]() -> grpc::Status {
    if (data_ticket == 0 || data) return grpc::Status::OK;
    data = wait_for_data(id, my_session);
    if (data) return grpc::Status::OK;
    return {grpc::StatusCode::UNAVAILABLE,
            fmt::format("{}: its data channel did not connect within {} s (grpc_configs.connect_timeout_s)", peer,
                        cfg_.server.connect_timeout_s)};
  };
  while (true) {
    if (!stream->Read(&frame)) {
      std::lock_guard lock(mu_);
      auto& slot = slots_[static_cast<size_t>(id)];
      if (slot.session != my_session) return grpc::Status::OK;
      if (phase_ != Phase::kFinished) fail_locked(id, peer + " disconnected");
      slot.ctx = nullptr;
      return grpc::Status::OK;
    }
    st = decode_frame(frame, kClientChunkField, peer, &d, &msg);
    if (!st.ok() || d.is_chunk) {
      return on_exit({grpc::StatusCode::INVALID_ARGUMENT, st.ok() ? peer + ": chunk outside an update" : st.message()});
    }
    if (msg.has_get_configuration()) {
      wire::ServerMessage r;
      r.mutable_configuration()->set_config_yaml(cfg_.resolved_yaml);
      stream->Write(encode_message(r));
    } else if (msg.has_get_global_model() && async_) {
      bool finished = false;
      if (grpc::Status gs = need_data(); !gs.ok()) return on_exit(gs);
      grpc::Status gs = async_send_model(stream, id, my_session, peer, data.get(), &finished);
      if (!gs.ok()) return on_exit(gs);
      if (finished) {
        wire::ServerMessage r;
        r.mutable_model_begin()->set_finished(true);
        stream->Write(encode_message(r));
      }
    } else if (msg.has_get_global_model()) {
      int round = 0;
      {
        std::unique_lock lock(mu_);
        auto& s = slots_[static_cast<size_t>(id)];
        cv_.wait(lock, [&] {
          return phase_ == Phase::kFinished || s.failed || s.session != my_session ||
                 (phase_ == Phase::kBroadcast && s.selected && s.served_round < round_);
        });
        if (s.failed || s.session != my_session) {
          lock.unlock();  // on_exit takes the lock itself
          return on_exit({grpc::StatusCode::ABORTED, peer + " was dropped from the run"});
        }
        if (phase_ == Phase::kFinished) {
          wire::ServerMessage r;
          r.mutable_model_begin()->set_finished(true);
          lock.unlock();
          stream->Write(encode_message(r));
          continue;
        }
        round = round_;
        s.served_round = round;
      }
      if (grpc::Status gs = need_data(); !gs.ok()) return on_exit(gs);
      grpc::Status gs = send_model(stream, round, peer, data.get());
      if (!gs.ok()) return on_exit(gs);
    } else if (msg.has_model_received()) {
      std::lock_guard lock(mu_);
      if (slots_[static_cast<size_t>(id)].session != my_session) return grpc::Status::OK;
      slots_[static_cast<size_t>(id)].received = true;
      down_end_ = Clock::now();
      cv_.notify_all();
    } else if (msg.has_update_metadata()) {
      if (grpc::Status gs = need_data(); !gs.ok()) return on_exit(gs);
      grpc::Status gs = async_
                            ? async_receive_update(ctx, stream, id, my_session, msg.update_metadata(), peer, data.get())
                            : receive_update(ctx, stream, id, my_session, msg.update_metadata(), peer, data.get());
      if (!gs.ok()) return on_exit(gs);
    } else if (msg.has_custom_action()) {
      // InvokeCustomAction: the actions a client may ask of the server.
      wire::ServerMessage r;
      if (msg.custom_action().action() == "get_round") {
        std::lock_guard lock(mu_);
        r.mutable_custom_action_reply()->set_payload(std::to_string(round_));
      } else if (msg.custom_action().action() == "get_layout") {
        // Names, dtypes and shapes in arena order: a client that brings its
        // own tensors (the Python client) checks them against this, and the
        // layout it rebuilds must hash to what ModelBegin says.
        nlohmann::json entries = nlohmann::json::array();
        for (const auto& e : layout_.entries()) {
          entries.push_back({{"name", e.name}, {"dtype", std::string(dtype_name(e.dtype))}, {"shape", e.shape}});
        }
        r.mutable_custom_action_reply()->set_payload(entries.dump());
      } else {
        r.mutable_error()->set_message("unknown custom action '" + msg.custom_action().action() + "'");
      }
      stream->Write(encode_message(r));
    } else if (msg.has_data_channel_declined()) {
      // The client cannot reach the channel it was offered: its chunks use
      // the stream, and its ticket is no longer good.
      std::lock_guard lock(mu_);
      auto& slot = slots_[static_cast<size_t>(id)];
      if (slot.session == my_session && slot.data_ticket == data_ticket) slot.data_ticket = 0;
      if (data_ticket != 0) {
        spdlog::info("{}: chunks on the gRPC stream ({})", peer, msg.data_channel_declined().reason());
      }
      data_ticket = 0;
    } else if (msg.has_bye()) {
      std::lock_guard lock(mu_);
      if (slots_[static_cast<size_t>(id)].session == my_session) slots_[static_cast<size_t>(id)].ctx = nullptr;
      return grpc::Status::OK;
    } else {
      return on_exit({grpc::StatusCode::INVALID_ARGUMENT, peer + ": unexpected message"});
    }
  }
}

void ServerAgent::follow_locked(const AsyncNext& next) {
  for (const auto& d : next.send) async_->ready_steps[static_cast<size_t>(d.client)] = d.local_steps;
  for (const auto& dl : next.deadlines) async_->deadlines.push_back(dl);
  cv_.notify_all();
}

grpc::Status ServerAgent::async_send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int id, uint64_t session,
                                           const std::string& peer, DataSocket* data, bool* finished) {
  Async& a = *async_;
  int steps = 0;
  {
    std::unique_lock lock(mu_);
    auto& s = slots_[static_cast<size_t>(id)];
    // A FedCompass client whose group has not aggregated yet waits here.
    cv_.wait(lock, [&] {
      return phase_ == Phase::kFinished || a.done || s.failed || s.session != session ||
             (a.core != nullptr && a.ready_steps[static_cast<size_t>(id)] >= 0);
    });
    if (s.failed || s.session != session) return {grpc::StatusCode::ABORTED, peer + " was dropped from the run"};
    if (phase_ == Phase::kFinished || a.done) {
      *finished = true;
      return grpc::Status::OK;
    }
    steps = std::exchange(a.ready_steps[static_cast<size_t>(id)], -1);
  }
  // The model cannot change while it is sent: its version is the trip's base.
  std::shared_lock model_lock(a.model_mu);
  int64_t version = 0;
  {
    std::lock_guard lock(mu_);
    if (slots_[static_cast<size_t>(id)].session != session) return {grpc::StatusCode::ABORTED, peer + " was replaced"};
    version = a.core->version();
    a.base_version[static_cast<size_t>(id)] = version;
    a.dispatched_at[static_cast<size_t>(id)] = a.now();
    a.sending_since[static_cast<size_t>(id)] = Clock::now();
    a.send_progress[static_cast<size_t>(id)].store(Clock::now().time_since_epoch().count());
    global_ = a.global;
  }
  grpc::Status sent =
      send_model(stream, static_cast<int>(version), peer, data, steps, &a.send_progress[static_cast<size_t>(id)]);
  std::lock_guard lock(mu_);
  if (slots_[static_cast<size_t>(id)].session == session)
    a.sending_since[static_cast<size_t>(id)] = Clock::time_point::max();
  return sent;
}

// Applying an update (or a FedCompass group) needs the model alone: it
// waits for the senders, and says so to the watchdog while it waits.
std::unique_lock<std::shared_mutex> ServerAgent::lock_to_apply(Async& a) {
  a.appliers_waiting.fetch_add(1);
  std::unique_lock lock(a.model_mu);
  a.appliers_waiting.fetch_sub(1);
  return lock;
}

void ServerAgent::cancel_stalled_senders_locked() {
  Async& a = *async_;
  const auto limit = std::chrono::seconds(cfg_.server.broadcast_deadline_s());
  const auto stall = std::chrono::seconds(cfg_.server.connect_timeout_s);
  const bool someone_waits = a.appliers_waiting.load() > 0;
  const auto now = Clock::now();
  for (size_t id = 0; id < a.sending_since.size(); ++id) {
    if (a.sending_since[id] == Clock::time_point::max()) continue;
    const auto last = Clock::time_point(Clock::duration(a.send_progress[id].load(std::memory_order_relaxed)));
    std::string why;
    if (now - a.sending_since[id] >= limit) {
      why = fmt::format("did not take the model within {} s (server_configs.broadcast_timeout_s)",
                        cfg_.server.broadcast_deadline_s());
    } else if (someone_waits && now - last >= stall) {
      why = fmt::format("took no chunk of the model for {} s (grpc_configs.connect_timeout_s) while updates waited",
                        cfg_.server.connect_timeout_s);
    } else {
      continue;
    }
    a.sending_since[id] = Clock::time_point::max();
    fail_locked(static_cast<int>(id), why + "; its send is cancelled so that updates can be applied", /*cancel=*/true);
  }
}

grpc::Status ServerAgent::async_receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                                               int id, uint64_t session, const wire::UpdateMetadata& md,
                                               const std::string& peer, DataSocket* data) {
  Async& a = *async_;
  const Layout& layout = layout_;
  size_t slot = 0;
  {
    std::lock_guard lock(mu_);
    slot = a.slots->take();
  }
  auto give_back = [&] {
    std::lock_guard lock(mu_);
    a.slots->give_back(slot);
  };
  // The update is checked chunk by chunk into its spool slot; it touches the
  // model only once it is whole.
  SpoolSlotWriter into(a.slots->spool(), slot, layout, peer);
  uint64_t received = 0;
  Status bad = read_update_frames(ctx, stream, peer, layout.total_bytes(), &read_ahead_budget_, &received, data, chunk_,
                                  [&](const DecodedFrame& d) { return into.accept(d.header, d.payload()); });
  if (bad.ok()) bad = into.commit();
  if (!bad.ok()) {
    give_back();
    wire::ServerMessage nack;
    nack.mutable_update_ack()->set_accepted(false);
    nack.mutable_update_ack()->set_message(bad.message());
    stream->Write(encode_message(nack));
    std::lock_guard lock(mu_);
    if (slots_[static_cast<size_t>(id)].session == session) fail_locked(id, bad.message());
    return {grpc::StatusCode::DATA_LOSS, bad.message()};
  }
  Status applied;
  {
    std::unique_lock model_lock = lock_to_apply(a);
    wait_for_sent_chunks();
    std::lock_guard lock(mu_);
    if (a.done || slots_[static_cast<size_t>(id)].session != session) {
      // The run has all its updates (or the session was replaced): not applied.
      a.slots->give_back(slot);
    } else {
      AsyncTripRecord trip;
      trip.client = id;
      trip.update = std::make_shared<SpoolSlotSource>(a.slots->spool(), slot, layout.total_bytes());
      trip.base_version = a.base_version[static_cast<size_t>(id)];
      trip.dispatched_at = a.dispatched_at[static_cast<size_t>(id)];
      trip.local_steps = md.metrics().count("local_steps") ? static_cast<int64_t>(md.metrics().at("local_steps")) : 0;
      trip.train_loss = md.metrics().count("train_loss") ? md.metrics().at("train_loss") : 0;
      auto next = a.core->arrive(std::move(trip), a.now());
      if (!next.ok()) {
        applied = next.status();
      } else {
        follow_locked(*next);
        bytes_up_ += layout.total_bytes();
        if (a.core->arrivals() % a.options.eval_every == 0 || a.core->arrivals() >= a.options.total) a.evals_due++;
        if (a.core->arrivals() >= a.options.total) a.done = true;
        cv_.notify_all();
      }
    }
  }
  wire::ServerMessage ack;
  ack.mutable_update_ack()->set_accepted(applied.ok());
  ack.mutable_update_ack()->set_message(applied.ok() ? "" : applied.message());
  stream->Write(encode_message(ack));
  if (!applied.ok()) return {grpc::StatusCode::INTERNAL, applied.message()};
  return grpc::Status::OK;
}

Status ServerAgent::serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options) {
  if (!async_)
    return failed_precondition("serve_async: the config's scheduler ({}) is not asynchronous", cfg_.server.scheduler);
  {
    std::lock_guard lock(mu_);
    async_->global = &global;
    async_->options = options;
    const size_t n = slots_.size();
    async_->slots = std::make_unique<SpoolSlots>("asynchronous update spool", layout_.total_bytes());
    MEMFL_RETURN_IF_ERROR(async_->slots->open(options.spool_dir));
    async_->t0 = Clock::now();
    async_->core = &core;  // last: sessions wait for it
    // Applied (or folded into FedBuff's buffer) updates give their slot back;
    // the core calls this with mu_ held.
    core.set_release([this](AsyncTripRecord& t) {
      const auto* src = dynamic_cast<const SpoolSlotSource*>(t.update.get());
      if (src != nullptr) async_->slots->give_back(src->slot());
      t.update.reset();
    });
    for (size_t c = 0; c < n; ++c) {
      if (!slots_[c].failed) async_->ready_steps[c] = core.start(static_cast<int>(c), 0.0);
    }
    cv_.notify_all();
  }
  Async& a = *async_;
  // The watchdog runs beside the serving loop, which may itself wait for
  // model_mu (a FedCompass deadline, an evaluation).
  struct Watchdog {
    explicit Watchdog(ServerAgent* a) : agent(a) {}
    ServerAgent* agent;
    std::mutex m;
    std::condition_variable cv;
    bool stop = false;
    std::thread thread;
    ~Watchdog() {
      {
        std::lock_guard lock(m);
        stop = true;
      }
      cv.notify_all();
      if (thread.joinable()) thread.join();
    }
  } watchdog(this);
  watchdog.thread = std::thread([&watchdog] {
    while (true) {
      {
        std::unique_lock lock(watchdog.m);
        if (watchdog.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return watchdog.stop; })) return;
      }
      std::lock_guard agent_lock(watchdog.agent->mu_);
      watchdog.agent->cancel_stalled_senders_locked();
    }
  });
  int64_t evaluated = 0;
  while (true) {
    std::unique_lock lock(mu_);
    auto due = Clock::time_point::max();
    size_t first = 0;
    for (size_t i = 0; i < a.deadlines.size(); ++i) {
      const auto when = a.t0 + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(std::min(a.deadlines[i].first, 1e9)));
      if (when < due) {
        due = when;
        first = i;
      }
    }
    const bool everyone_out = std::all_of(slots_.begin(), slots_.end(), [](const ClientSlot& s) { return s.failed; });
    if (everyone_out)
      return failed_precondition("every client is out; {} updates of {} arrived", core.arrivals(), options.total);
    const auto wake = std::min(due, Clock::now() + std::chrono::seconds(1));
    cv_.wait_until(lock, wake, [&] { return a.evals_due > 0 || (a.done && a.evals_due == 0) || Clock::now() >= due; });
    if (a.evals_due > 0) {
      a.evals_due--;
      const int64_t arrivals = core.arrivals();
      const double seconds = a.now();
      lock.unlock();
      std::shared_lock model_lock(a.model_mu);
      MEMFL_RETURN_IF_ERROR(options.on_eval(++evaluated, arrivals, seconds));
      continue;
    }
    if (a.done) break;
    if (due != Clock::time_point::max() && Clock::now() >= due) {
      const int group = a.deadlines[first].second;
      a.deadlines.erase(a.deadlines.begin() + static_cast<std::ptrdiff_t>(first));
      lock.unlock();
      std::unique_lock model_lock = lock_to_apply(a);
      wait_for_sent_chunks();
      std::lock_guard relock(mu_);
      MEMFL_ASSIGN_OR_RETURN(AsyncNext next, core.deadline(group, a.now()));
      follow_locked(next);
    }
  }
  return core.flush_log();
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

Status ServerAgent::broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) {
  std::unique_lock lock(mu_);
  global_ = &global;
  deadline_ = Clock::now() + std::chrono::seconds(cfg_.server.broadcast_deadline_s());
  order_.clear();
  for (auto& s : slots_) s.selected = false;
  for (int c : selected) {
    auto& s = slots_[static_cast<size_t>(c)];
    if (s.failed) continue;
    s.selected = true;
    s.received = s.committed = false;
    s.served_round = 0;
    order_.push_back(c);
  }
  if (order_.empty()) return failed_precondition("round {}: every selected client has failed", round);
  down_start_.reset();
  up_start_.reset();
  bytes_down_ = bytes_up_ = 0;
  naive_updates_.clear();
  // A new model to send (a round redone after a broken update sends the
  // restored model again: its checksums are computed again too). No sender
  // runs until the phase below says so.
  down_sums_.reset(++broadcasts_, layout_.total_bytes(), chunk_);
  round_ = round;
  phase_ = Phase::kBroadcast;
  cv_.notify_all();
  auto all_received = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.received && s.lost_round != round_) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_received)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].received && slots_[static_cast<size_t>(c)].lost_round != round)
        fail_locked(c,
                    fmt::format("round {}: it had not received the global model after {} s "
                                "(server_configs.broadcast_timeout_s); the round goes on without it",
                                round, cfg_.server.broadcast_deadline_s()),
                    /*cancel=*/true);
    }
  }
  // gRPC may still hold references to the arena's bytes; the sum must not
  // overwrite them before it lets go.
  lock.unlock();
  while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  lock.lock();
  out->bytes = bytes_down_;
  if (down_start_) out->seconds = std::chrono::duration<double>(down_end_ - *down_start_).count();
  return Status::Ok();
}

Status ServerAgent::collect(int round, const std::vector<int>&, const Arena&, UpdateOpener& aggregator,
                            CollectResult* out) {
  std::unique_lock lock(mu_);
  aggregator_ = &aggregator;
  // The upload's own deadline: a client stalled in the broadcast has not
  // used up the others' time.
  deadline_ = Clock::now() + std::chrono::seconds(cfg_.server.upload_deadline_s());
  phase_ = Phase::kUpload;
  cv_.notify_all();
  auto all_done = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.committed && s.lost_round != round_) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_done)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].committed && slots_[static_cast<size_t>(c)].lost_round != round)
        fail_locked(c,
                    fmt::format("round {}: no complete update {} s into the upload (server_configs.upload_timeout_s); "
                                "the round ends with the clients that finished",
                                round, cfg_.server.upload_deadline_s()),
                    /*cancel=*/true);
    }
    // A session still inside its update holds a stream of the aggregator:
    // it ends (cancelled above) before the round can be aggregated.
    lock.unlock();
    while (true) {
      lock.lock();
      const bool busy =
          std::any_of(order_.begin(), order_.end(), [&](int c) { return slots_[static_cast<size_t>(c)].uploading; });
      lock.unlock();
      if (!busy) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    lock.lock();
  }
  phase_ = Phase::kWaiting;
  if (naive_) naive_average_locked();
  aggregator_ = nullptr;
  for (int c : order_) {
    const auto& s = slots_[static_cast<size_t>(c)];
    if (s.committed) {
      out->committed.push_back(s.info);
    } else {
      out->failed.push_back(c);
    }
  }
  out->bytes_up = bytes_up_;
  if (up_start_) out->upload_seconds = std::chrono::duration<double>(up_end_ - *up_start_).count();
  return Status::Ok();
}

void ServerAgent::finish(int) {
  std::lock_guard lock(mu_);
  phase_ = Phase::kFinished;
  cv_.notify_all();
}

void ServerAgent::wait_for_clients() {
  std::unique_lock lock(mu_);
  const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.round_timeout_s);
  if (!wait_for(lock, deadline, [&] {
        return std::all_of(slots_.begin(), slots_.end(), [](const ClientSlot& s) { return s.connected; });
      })) {
    int n = static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](auto& s) { return s.connected; }));
    spdlog::warn("server: only {} of {} clients registered within {} s; going on with them", n, cfg_.server.num_clients,
                 cfg_.server.round_timeout_s);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].connected) slots_[i].failed = true;
    }
  }
}

class SessionService final : public grpc::Service {
 public:
  explicit SessionService(ServerAgent* agent) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<ServerAgent, Frame, Frame>(
            [](ServerAgent* a, grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* s) {
              return a->session(ctx, s);
            },
            agent)));
  }
};

}  // namespace

struct GrpcServerTransport::Impl {
  Impl(const ExperimentConfig& cfg, const Layout& layout, bool naive) : agent(cfg, layout, naive), service(&agent) {}
  ServerAgent agent;
  SessionService service;
  std::unique_ptr<grpc::Server> server;
  bool finished = false;
};

StatusOr<std::unique_ptr<GrpcServerTransport>> GrpcServerTransport::listen(const ExperimentConfig& cfg,
                                                                           const Layout& layout, bool naive,
                                                                           const std::string& run_dir) {
  const auto& sc = cfg.server;
  std::unique_ptr<GrpcServerTransport> t(new GrpcServerTransport());
  t->impl_ = std::make_unique<Impl>(cfg, layout, naive);
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (sc.use_ssl) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({read_file(sc.server_key), read_file(sc.server_cert)});
    if (ssl.pem_key_cert_pairs[0].private_key.empty() || ssl.pem_key_cert_pairs[0].cert_chain.empty()) {
      return not_found("server_configs.comm_configs.grpc_configs: cannot read server_key {} or server_cert {}",
                       sc.server_key, sc.server_cert);
    }
    creds = grpc::SslServerCredentials(ssl);
  }
  int port = 0;
  builder.AddListeningPort(sc.server_uri, creds, &port);
  // A message is at most one transfer chunk (comm/chunk.h), whatever
  // model_chunk_size says: the limits follow that bound.
  const int limit = max_message_bytes(static_cast<int64_t>(kMaxTransferChunk), sc.max_message_size);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // Flow control is the backpressure: a session may have only a few chunks
  // in the server's buffers. HTTP/2's BDP probing would grow the window far
  // past that (≈150 MiB buffered at 1 GiB models). One chunk in flight per
  // upload: the sessions read ahead from a shared budget besides; with two,
  // 256 MiB × 8 clients peaked at 1.277–1.306 × model against 1.252–1.279
  // (3 alternated runs), and the bound there is 1.30.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             stream_window_bytes(static_cast<int64_t>(grpc_chunk_bytes(
                                                     sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes())),
                                                 /*chunks=*/1));
  builder.RegisterService(&t->impl_->service);
  // Before the first client can register: every session is offered it.
  if (sc.data_channel == "tcp" || sc.data_channel == "auto")
    MEMFL_RETURN_IF_ERROR(t->impl_->agent.start_data_channel());
  t->impl_->server = builder.BuildAndStart();
  if (!t->impl_->server || port == 0) {
    return invalid_argument(
        "server_configs.comm_configs.grpc_configs.server_uri: cannot listen on {}{}", sc.server_uri,
        sc.use_ssl ? fmt::format(" — or TLS could not start: is server_key ({}) a PEM private key that matches "
                                 "server_cert ({})?",
                                 sc.server_key, sc.server_cert)
                   : "");
  }
  std::ofstream((fs::path(run_dir) / "port").string()) << port << "\n";
  spdlog::info("server: listening on {} (port {}){}", sc.server_uri, port, sc.use_ssl ? " with TLS" : "");
  return t;
}

GrpcServerTransport::~GrpcServerTransport() {
  if (impl_) finish(0);
}

void GrpcServerTransport::wait_for_clients() { impl_->agent.wait_for_clients(); }
bool GrpcServerTransport::broadcast_done_before_collect() const { return true; }
Status GrpcServerTransport::broadcast(int round, const std::vector<int>& selected, const Arena& global,
                                      BroadcastResult* out) {
  return impl_->agent.broadcast(round, selected, global, out);
}
Status GrpcServerTransport::collect(int round, const std::vector<int>& selected, const Arena& global,
                                    UpdateOpener& aggregator, CollectResult* out) {
  return impl_->agent.collect(round, selected, global, aggregator, out);
}
std::vector<int> GrpcServerTransport::take_rejoined() { return impl_->agent.take_rejoined(); }
Status GrpcServerTransport::serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options) {
  return impl_->agent.serve_async(core, global, options);
}

void GrpcServerTransport::finish(int last_round) {
  if (impl_->finished) return;
  impl_->finished = true;
  impl_->agent.finish(last_round);
  // Let clients hear "finished" and say Bye, then stop (a server that never
  // started — bad TLS files — has nothing to stop).
  if (impl_->server) impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  impl_->agent.stop_data_channel();
}

}  // namespace memfl
