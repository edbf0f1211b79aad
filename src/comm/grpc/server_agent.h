// The gRPC server transport's insides, shared by its files and by nothing
// else (GrpcServerTransport, server_transport.h, is the interface). One
// agent serves every mode under one mutex; each mode's path has its file:
//   server_transport.cpp        sessions (registration, the message loop), the gRPC service, listen
//   server_agent.cpp            what every mode uses: the data channel, dropping a client, sending
//                               the model, reading an update's frames, waiting for clients
//   server_transport_sync.cpp   rounds: broadcast, collect, one client's update of a round
//   server_transport_async.cpp  asynchronous serving (serve_async): model sends, updates, the watchdog
//   server_transport_naive.cpp  memory_mode: naive — whole copies of the model and of every update
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include "comm/chunk.h"
#include "comm/chunk_pool.h"
#include "comm/client_tokens.h"
#include "comm/grpc/data_channel.h"
#include "comm/grpc/wire.h"
#include "comm/spool_update.h"
#include "comm/transport.h"
#include "config/config.h"
#include "tensor/layout.h"

namespace memfl::grpc_detail {

using Clock = std::chrono::steady_clock;

enum class Phase { kWaiting, kBroadcast, kUpload, kFinished };

// Reads an update's frames until UpdateEnd, giving each chunk to `on_chunk`
// (which checks it and takes its bytes) while the next frames are read
// (read_chunk_run); returns the first failure: the stream broke, a frame
// was malformed, or a chunk was refused. With a data channel (`data`), the
// chunks come from it, each read into one chunk-sized buffer (the socket's
// kernel buffer is the read-ahead), and the stream says UpdateEnd; `order`
// is the update's place in the fold order, by which the pool serves it.
// `framed`: the chunks are compressed frames (compress/frame.h), one per
// chunk of the grid, each at most chunk + kMaxFrameOverhead bytes;
// `*received` counts the bytes on the wire either way.
Status read_update_frames(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                          const std::string& peer, uint64_t total, std::atomic<int>* read_ahead_budget,
                          uint64_t* received, DataSocket* data, ChunkPool* buffers, uint64_t order, size_t chunk,
                          bool framed, const std::function<Status(const DecodedFrame&)>& on_chunk);

struct ClientSlot {
  bool connected = false;
  bool failed = false;  // disconnected, timed out or sent bad bytes: out for the run
  bool selected = false;
  int served_round = 0;     // last round whose model this client was sent
  uint64_t bytes_down = 0;  // that model, on the wire (frames, when it went as its change)
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
  // Secure aggregation: a stage's request waiting for this client's poll,
  // and its reply (server_transport_sync.cpp); `secagg_over`: the round it
  // took part in has ended and its next poll is told so (kept per client,
  // not cleared by the next broadcast, so a poll that arrives late still
  // hears it before the next round's first request).
  std::optional<std::string> secagg_request, secagg_reply;
  bool secagg_over = false;
  // Ends the data connection and its ticket (the session holding a copy
  // sees its reads and writes fail at once).
  void close_data() {
    if (data) data->shutdown();
    data.reset();
    data_ticket = 0;
  }
};

// Naive mode's serialised model, for one send (server_transport_naive.cpp).
struct NaiveSerialised {
  std::vector<std::byte> bytes;
  std::atomic<int64_t> inflight{0};  // gRPC's references to `bytes`
  // Copies the model's `total` bytes from `model`; returns where the copy starts.
  const std::byte* copy(const std::byte* model, size_t total);
  // The serialised copy must outlive gRPC's references to it.
  ~NaiveSerialised();
};

// The gRPC transport of the server core: sessions (a thread each, gRPC's
// synchronous server) wait on the phase the round driver puts the transport
// in — broadcast, then upload — and move chunks between the wire and the
// global arena or the aggregator.
class ServerAgent final : public ServerTransport {
 public:
  // Before the server starts: who may register as which id.
  void set_client_tokens(ClientTokens tokens) { tokens_ = std::move(tokens); }
  ServerAgent(const ExperimentConfig& cfg, const Layout& layout, bool naive)
      : cfg_(cfg),
        layout_(layout),
        chunk_(grpc_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes())),
        naive_(naive),
        upload_buffers_(kUploadBuffers, chunk_ + kMaxFrameOverhead),
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
  uint64_t transfer_buffer_bytes() const override {
    return transfer_buffer_bytes_for(chunk_, cfg_.server.num_clients, cfg_.server.data_channel == "grpc");
  }
  // What the transport holds beside the model, whatever its clients do: the
  // upload pool (8 · (c + frame overhead)), and per session its thread and
  // gRPC's per-connection state (kSessionBytes; ≈ 50–54 KB measured by
  // bench/server_sessions.sh from 100 to 1,000 sessions), plus, on the
  // stream (`data_channel: grpc`), the one-chunk HTTP/2 window an upload in
  // flight may hold (c + 1 KiB).
  static uint64_t transfer_buffer_bytes_for(size_t chunk, int sessions, bool chunks_on_stream) {
    const uint64_t per_session = kSessionBytes + (chunks_on_stream ? chunk + kStreamWindowOverhead : 0);
    return kUploadBuffers * (chunk + kMaxFrameOverhead) + static_cast<uint64_t>(std::max(sessions, 0)) * per_session;
  }
  static constexpr uint64_t kSessionBytes = 64 << 10;
  static constexpr uint64_t kStreamWindowOverhead = 1 << 10;
  int connected_clients() override {
    std::lock_guard lock(mu_);
    return static_cast<int>(
        std::count_if(slots_.begin(), slots_.end(), [](const ClientSlot& s) { return s.ctx != nullptr && !s.failed; }));
  }
  void set_broadcast_frames(const BroadcastFrames* frames) override { frames_ = frames; }
  // Asynchronous serving: see GrpcServerTransport::serve_async.
  Status serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options);
  // Secure aggregation's stages (secagg/wire.h): hands `request` to
  // `client`'s next poll and waits for its reply, secure_aggregation.timeout
  // seconds at most (0: the upload's deadline); a client that does not
  // answer is out.
  StatusOr<std::string> secagg_exchange(int client, std::string request);
  // Every client of the round hears "round over" at its next poll.
  void secagg_end_round();
  void secagg_drop(int client, const std::string& why);
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
  // `held_round`: the round whose model the client holds (GetGlobalModel);
  // when the broadcast's frames are the change from it, they go instead of
  // the model's bytes. `sent` (may be null): the bytes that went.
  grpc::Status send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round, const std::string& peer,
                          DataSocket* data, int local_steps = 0, std::atomic<int64_t>* progress = nullptr,
                          int held_round = 0, uint64_t* sent = nullptr);
  grpc::Status receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream, int id,
                              uint64_t session, const wire::UpdateMetadata& md, const std::string& peer,
                              DataSocket* data);
  // Naive mode (server_transport_naive.cpp): where a client's update is
  // copied whole as it arrives; keeping that copy for the end of the upload
  // phase (with mu_ held); averaging every kept copy into the round's
  // aggregator then.
  std::unique_ptr<UpdateStream> naive_open_update(const std::string& peer);
  void naive_keep_locked(int id, double sample_count, std::unique_ptr<UpdateStream> copy);
  void naive_average_locked();

  const ExperimentConfig& cfg_;
  const Layout& layout_;
  const Arena* global_ = nullptr;  // the round's global model, during the broadcast
  size_t chunk_ = 0;
  bool naive_ = false;
  // What every upload on the data channel reads its chunks into, all
  // sessions together: the server's chunk buffers do not grow with its
  // clients (a session that finds them taken waits, its client's socket
  // full). Eight: a chunk is held only while it is read and folded, so a
  // few keep the 2–4 cores that fold busy.
  static constexpr size_t kUploadBuffers = 8;
  ChunkPool upload_buffers_;

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
  ChunkChecksums down_sums_;                 // of the model being broadcast
  const BroadcastFrames* frames_ = nullptr;  // broadcast_compression: lossy
  int64_t broadcasts_ = 0;                   // rounds mode: the key of down_sums_
  // Transfer timing of the current round.
  std::optional<Clock::time_point> down_start_, up_start_;
  Clock::time_point down_end_, up_end_;
  uint64_t bytes_down_ = 0, bytes_up_ = 0;
  // Naive mode: every client's serialised model, held until the end of the upload phase.
  std::vector<std::pair<int, std::pair<double, std::vector<std::byte>>>> naive_updates_;
  // Per-client tokens (client_tokens_file); empty: the shared auth_token, if any.
  ClientTokens tokens_;
  int data_port_ = 0;         // 0: no TCP port offered
  bool offers_data_ = false;  // a data channel (TCP port or Unix socket) is offered
  // Last: destroyed first, so its thread stops before what it touches.
  DataListener data_listener_;
};

}  // namespace memfl::grpc_detail
