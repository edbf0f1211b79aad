// ServerAgent over gRPC. One bidirectional stream per client session, served
// by gRPC's synchronous server (a thread per session); the main thread runs
// the rounds (SyncScheduler) and the sessions wait on its phase.
#include <malloc.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/grpc/wire.h"
#include "server/round_driver.h"
#include "server/transport.h"
#include "memory/sampler.h"
#include "client/client_work.h"
#include "roles/grpc_roles.h"
#include "server/global_model.h"
#include "io/run_dir.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void tune_malloc_for_streaming();

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}

enum class Phase { kWaiting, kBroadcast, kUpload, kFinished };

struct ClientSlot {
  bool connected = false;
  bool failed = false;  // disconnected, timed out or sent bad bytes: out for the run
  bool selected = false;
  int served_round = 0;  // last round whose model this client was sent
  bool received = false;
  bool committed = false;
  bool uploading = false;  // a session is inside its update (holds an aggregator stream)
  grpc::ServerContext* ctx = nullptr;
  ClientUpdateInfo info;  // what its update's metadata said
};

// The gRPC transport of the server core: sessions (a thread each, gRPC's
// synchronous server) wait on the phase the round driver puts the transport
// in — broadcast, then upload — and move chunks between the wire and the
// global arena or the aggregator.
class ServerAgent final : public ServerTransport {
 public:
  ServerAgent(const ExperimentConfig& cfg, GlobalModel& global, bool naive)
      : cfg_(cfg),
        global_(global),
        chunk_(transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size,
                                    global.layout().total_bytes())),
        naive_(naive),
        slots_(static_cast<size_t>(cfg.server.num_clients)) {}
  grpc::Status session(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream);
  // Waits (round_timeout_s at most) for every client to register.
  void wait_for_clients();

  std::string_view name() const override { return "grpc"; }
  bool broadcast_done_before_collect() const override { return true; }
  Status broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) override;
  Status collect(int round, const std::vector<int>& selected, const Arena& global, Aggregator& aggregator,
                 CollectResult* out) override;
  void finish(int last_round) override;

 private:
  bool wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, const std::function<bool()>& pred);
  void fail_locked(int id, const std::string& why);
  grpc::Status send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round, const std::string& peer);
  grpc::Status receive_update(grpc::ServerReaderWriter<Frame, Frame>* stream, int id, const wire::UpdateMetadata& md,
                              const std::string& peer);
  void naive_average_locked();

  const ExperimentConfig& cfg_;
  GlobalModel& global_;
  size_t chunk_ = 0;
  bool naive_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  Phase phase_ = Phase::kWaiting;
  int round_ = 0;
  Clock::time_point deadline_;
  Aggregator* aggregator_ = nullptr;  // the round's, during the upload phase
  std::vector<ClientSlot> slots_;
  std::vector<int> order_;  // selected clients
  std::atomic<int64_t> inflight_{0};
  // Transfer timing of the current round.
  std::optional<Clock::time_point> down_start_, up_start_;
  Clock::time_point down_end_, up_end_;
  uint64_t bytes_down_ = 0, bytes_up_ = 0;
  // Naive mode: every client's serialised model, held until the end of the upload phase.
  std::vector<std::pair<int, std::pair<double, std::vector<std::byte>>>> naive_updates_;
};

bool ServerAgent::wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                           const std::function<bool()>& pred) {
  return cv_.wait_until(lock, deadline, pred);
}

void ServerAgent::fail_locked(int id, const std::string& why) {
  auto& s = slots_[static_cast<size_t>(id)];
  if (s.failed) return;
  s.failed = true;
  spdlog::warn("client_{} is out: {}", id, why);
  if (s.ctx != nullptr) s.ctx->TryCancel();
  cv_.notify_all();
}

grpc::Status ServerAgent::send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round,
                                     const std::string& peer) {
  const Layout& layout = global_.layout();
  wire::ServerMessage begin;
  begin.mutable_model_begin()->set_round(round);
  begin.mutable_model_begin()->set_layout_hash(layout.hash());
  begin.mutable_model_begin()->set_total_bytes(layout.total_bytes());
  if (!stream->Write(encode_message(begin))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  {
    std::lock_guard lock(mu_);
    if (!down_start_) down_start_ = Clock::now();
  }
  // Naive mode serialises the whole model into one buffer first, as typical
  // frameworks do (pickle/torch.save); streaming sends from the arena.
  std::vector<std::byte> serialised;
  std::atomic<int64_t> serialised_inflight{0};
  const std::byte* base = global_.arena().data();
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
    ChunkHeader h{layout.hash(), off, len, chunk_checksum(bytes)};
    // One write in flight: Write returns when gRPC has taken the message.
    if (!stream->Write(encode_chunk_frame(kServerChunkField, h, bytes, naive_ ? &serialised_inflight : &inflight_))) {
      return {grpc::StatusCode::UNAVAILABLE, peer + " went away during the broadcast"};
    }
  }
  wire::ServerMessage end;
  end.mutable_model_end();
  if (!stream->Write(encode_message(end))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  std::lock_guard lock(mu_);
  bytes_down_ += layout.total_bytes();
  return grpc::Status::OK;
}

grpc::Status ServerAgent::receive_update(grpc::ServerReaderWriter<Frame, Frame>* stream, int id,
                                         const wire::UpdateMetadata& md, const std::string& peer) {
  {
    std::unique_lock lock(mu_);
    const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.round_timeout_s);
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
  const Layout& layout = global_.layout();
  std::unique_ptr<UpdateStream> update;
  Done done{this, id};  // declared before `update`: the stream closes first
  std::vector<std::byte> naive_copy;
  if (!naive_) {
    Aggregator* agg = nullptr;
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
  Frame frame;
  DecodedFrame d;
  wire::ClientMessage msg;
  uint64_t received = 0;
  Status bad;
  while (true) {
    if (!stream->Read(&frame)) {
      bad = Status(StatusCode::kUnavailable, fmt::format("{} disconnected after {} of {} bytes of its update", peer,
                                                         received, layout.total_bytes()));
      break;
    }
    Status st = decode_frame(frame, kClientChunkField, peer, &d, &msg);
    if (!st.ok()) {
      bad = st;
      break;
    }
    if (!d.is_chunk) {
      if (msg.has_update_end()) break;
      bad = data_loss("{}: unexpected message in the middle of an update", peer);
      break;
    }
    if (!naive_) {
      st = update->accept(d.header, d.payload());
    } else {
      st = verify_chunk(d.header, d.payload(), layout, received, peer);
      if (st.ok()) {
        size_t at = d.header.offset;
        for (auto p : d.pieces) {
          std::memcpy(naive_copy.data() + at, p.data(), p.size());
          at += p.size();
        }
      }
    }
    if (!st.ok()) {
      bad = st;
      break;
    }
    received += d.header.length;
  }
  if (bad.ok() && !naive_) bad = update->commit();
  if (bad.ok() && naive_ && received != layout.total_bytes()) {
    bad = data_loss("update from {} ended after {} of {} bytes", peer, received, layout.total_bytes());
  }
  wire::ServerMessage ack;
  ack.mutable_update_ack()->set_accepted(bad.ok());
  ack.mutable_update_ack()->set_message(bad.ok() ? "" : bad.message());
  stream->Write(encode_message(ack));
  std::lock_guard lock(mu_);
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
    if (s.connected) {
      refusal = fmt::format("client id {} from {} is already connected", id, peer_addr);
    } else {
      s.connected = true;
      s.ctx = ctx;
      cv_.notify_all();
    }
  }
  wire::ServerMessage reply;
  reply.mutable_register_reply()->set_accepted(refusal.empty());
  reply.mutable_register_reply()->set_message(refusal);
  stream->Write(encode_message(reply));
  if (!refusal.empty()) {
    spdlog::warn("refused: {}", refusal);
    return {grpc::StatusCode::UNAUTHENTICATED, refusal};
  }
  const std::string peer = fmt::format("client_{} ({})", id, peer_addr);
  auto on_exit = [&](grpc::Status s) {
    std::lock_guard lock(mu_);
    auto& slot = slots_[static_cast<size_t>(id)];
    slot.ctx = nullptr;
    if (!s.ok() && phase_ != Phase::kFinished) fail_locked(id, s.error_message());
    return s;
  };
  while (true) {
    if (!stream->Read(&frame)) {
      std::lock_guard lock(mu_);
      if (phase_ != Phase::kFinished) fail_locked(id, peer + " disconnected");
      slots_[static_cast<size_t>(id)].ctx = nullptr;
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
    } else if (msg.has_get_global_model()) {
      int round = 0;
      {
        std::unique_lock lock(mu_);
        auto& s = slots_[static_cast<size_t>(id)];
        cv_.wait(lock, [&] {
          return phase_ == Phase::kFinished || s.failed ||
                 (phase_ == Phase::kBroadcast && s.selected && s.served_round < round_);
        });
        if (s.failed) return on_exit({grpc::StatusCode::ABORTED, peer + " was dropped from the run"});
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
      grpc::Status gs = send_model(stream, round, peer);
      if (!gs.ok()) return on_exit(gs);
    } else if (msg.has_model_received()) {
      std::lock_guard lock(mu_);
      slots_[static_cast<size_t>(id)].received = true;
      down_end_ = Clock::now();
      cv_.notify_all();
    } else if (msg.has_update_metadata()) {
      grpc::Status gs = receive_update(stream, id, msg.update_metadata(), peer);
      if (!gs.ok()) return on_exit(gs);
    } else if (msg.has_custom_action()) {
      // InvokeCustomAction: the actions a client may ask of the server.
      wire::ServerMessage r;
      if (msg.custom_action().action() == "get_round") {
        std::lock_guard lock(mu_);
        r.mutable_custom_action_reply()->set_payload(std::to_string(round_));
      } else {
        r.mutable_error()->set_message("unknown custom action '" + msg.custom_action().action() + "'");
      }
      stream->Write(encode_message(r));
    } else if (msg.has_bye()) {
      std::lock_guard lock(mu_);
      slots_[static_cast<size_t>(id)].ctx = nullptr;
      return grpc::Status::OK;
    } else {
      return on_exit({grpc::StatusCode::INVALID_ARGUMENT, peer + ": unexpected message"});
    }
  }
}

void ServerAgent::naive_average_locked() {
  // Naive: every client's model was held whole; average them now.
  for (auto& [id, update] : naive_updates_) {
    auto& [w, bytes] = update;
    auto u = aggregator_->open_update(client_id(id), w);
    if (!u.ok()) continue;
    std::span<const std::byte> all(bytes.data(), bytes.size());
    ChunkHeader h{global_.layout().hash(), 0, bytes.size(), chunk_checksum(all)};
    (void)(*u)->accept(h, all);
    (void)(*u)->commit();
  }
  naive_updates_.clear();
}

Status ServerAgent::broadcast(int round, const std::vector<int>& selected, const Arena&, BroadcastResult* out) {
  std::unique_lock lock(mu_);
  deadline_ = Clock::now() + std::chrono::seconds(cfg_.server.round_timeout_s);
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
  round_ = round;
  phase_ = Phase::kBroadcast;
  cv_.notify_all();
  auto all_received = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.received) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_received)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].received)
        fail_locked(c, fmt::format("round {} timed out in broadcast", round));
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

Status ServerAgent::collect(int round, const std::vector<int>&, const Arena&, Aggregator& aggregator,
                            CollectResult* out) {
  std::unique_lock lock(mu_);
  aggregator_ = &aggregator;
  phase_ = Phase::kUpload;
  cv_.notify_all();
  auto all_done = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.committed) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_done)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].committed) fail_locked(c, fmt::format("round {} timed out in upload", round));
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

void tune_malloc_for_streaming() {
  // Chunk buffers are allocated and freed at line rate. With glibc's default
  // dynamic thresholds each multi-MiB buffer was a fresh mmap and page faults
  // (0.1–0.2 GB/s here); keeping them in the heap and not trimming it reached
  // 1.1–1.7 GB/s (../shared/DEPENDENCIES.md). Freed chunks are reused, so the
  // heap stays at a few chunks, not a model.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // gRPC's threads would each get a malloc arena holding its own freed
  // chunks; a few shared arenas keep the retained heap to a few chunks.
  mallopt(M_ARENA_MAX, 2);
}

Status run_grpc_server(const ExperimentConfig& cfg, const RoleOptions& opts) {
  tune_malloc_for_streaming();
  const auto& sc = cfg.server;
  if (sc.client_selection != "random") {
    return invalid_argument(
        "server_configs.client_selection: '{}' runs in the in-process simulation; over gRPC "
        "the server selects at random",
        sc.client_selection);
  }
  MemorySampler sampler("server", cfg.memory.sample_interval_ms);
  sampler.start();
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);
  sampler.mark(0, "setup");
  SchedulerOptions so;
  so.num_clients = sc.num_clients;
  so.clients_per_round = sc.clients_per_round;
  so.seed = sc.seed;
  // Refused before any work: an unknown scheduler name.
  MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(sc.scheduler, so));
  // Measured before the model exists: the bound is stated on top of it.
  const int64_t baseline_rss = read_rss_bytes();
  std::optional<DatasetSplits> data;
  InputSpec input;
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
  }
  const bool naive = sc.memory_mode == "naive";
  MEMFL_ASSIGN_OR_RETURN(auto global, GlobalModel::create(cfg, input, opts.run_dir, naive));
  const Layout& layout = global->layout();
  ServerAgent agent(cfg, *global, naive);
  spdlog::info("server: model {} ({} parameters, {}), layout {:016x}, {} aggregation, chunk {}", cfg.model.model_name,
               layout.num_params(), format_bytes(static_cast<double>(layout.payload_bytes())), layout.hash(),
               global->description(),
               format_bytes(static_cast<double>(
                   transfer_chunk_bytes(sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes()))));

  SessionService service(&agent);
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
  // model_chunk_size says: limits and the flow-control window follow that bound.
  const int64_t wire_chunk = static_cast<int64_t>(kMaxTransferChunk);
  const int limit = max_message_bytes(wire_chunk, sc.max_message_size);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // Flow control is the backpressure: a session may have only a few chunks
  // in the server's buffers. HTTP/2's BDP probing would grow the window far
  // past that (≈150 MiB buffered at 1 GiB models).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                             stream_window_bytes(static_cast<int64_t>(transfer_chunk_bytes(
                                 sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes()))));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return invalid_argument("server_configs.comm_configs.grpc_configs.server_uri: cannot listen on {}", sc.server_uri);
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "port").string(), std::to_string(port) + "\n"));
  spdlog::info("server: listening on {} (port {}){}", sc.server_uri, port, sc.use_ssl ? " with TLS" : "");
  agent.wait_for_clients();

  RoundDriverOptions dopts;
  dopts.run_dir = opts.run_dir;
  dopts.role = "server";
  dopts.resume = opts.resume;
  if (sc.do_server_eval && global->model().replica() != nullptr) {
    dopts.evaluate = [&](int, Arena&) {
      std::vector<uint32_t> idx(data->test.size());
      std::iota(idx.begin(), idx.end(), 0u);
      return global->model().replica()->evaluate(data->test, idx, sc.eval_batch_size);
    };
  }
  dopts.on_round = [&](const RoundMetrics& m) {
    if (!opts.progress) return;
    fmt::print(
        "server round {:>3}/{}  clients {:>2}  test_acc {:.4f}  down {:.2f} GB/s  up {:.2f} GB/s  {:.2f} s  "
        "peak RSS {}\n",
        m.round, sc.num_global_epochs, m.clients, m.test_accuracy,
        m.download_seconds > 0 ? static_cast<double>(m.bytes_down) / m.download_seconds / 1e9 : 0.0,
        m.upload_seconds > 0 ? static_cast<double>(m.bytes_up) / m.upload_seconds / 1e9 : 0.0, m.round_seconds,
        format_bytes(static_cast<double>(m.peak_rss_bytes)));
    std::fflush(stdout);
  };
  RoundDriver driver(cfg, *global, agent, *scheduler, sampler, std::move(dopts));
  Status result = driver.run();
  agent.finish(sc.num_global_epochs);  // also on failure: sessions must not wait for a round
  // Let clients hear "finished" and say Bye, then stop.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const auto& rounds = driver.rounds();
  nlohmann::ordered_json summary;
  summary["role"] = "server";
  summary["rounds"] = rounds.size();
  summary["model_bytes"] = layout.payload_bytes();
  summary["num_params"] = layout.num_params();
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["peak_rss_bytes"] = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  summary["sum_in_place"] = global->aggregator().sums_in_place();
  summary["memory_mode"] = sc.memory_mode;
  summary["final_test_accuracy"] = rounds.empty() ? 0.0 : rounds.back().test_accuracy;
  summary["status"] = result.ok() ? "ok" : result.message();
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
