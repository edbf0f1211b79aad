// The gRPC transport of the server core. One bidirectional stream per client
// session, served by gRPC's synchronous server (a thread per session); the
// round driver puts the transport in a phase (broadcast, then upload) and the
// sessions move chunks between the wire and the global arena or the
// aggregator. Updates are taken as they come: the aggregator parks one whose
// turn to fold has not come, so no client waits for another.
//
// This file: a session (registration, then each message to the path of the
// transport's mode), the gRPC service, listening, and GrpcServerTransport.
// server_agent.h says where each mode's path lives.
#include "comm/grpc/server_transport.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/ranges.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <spdlog/spdlog.h>

#include "comm/client_transport.h"
#include "comm/grpc/server_agent.h"

namespace memfl {

namespace grpc_detail {

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
  uint64_t my_session = 0;   // this session's number in the client's slot
  uint64_t data_ticket = 0;  // non-zero: chunks travel on the data channel
  std::string refusal;
  const int id = parse_client_id(reg.client_id(), cfg_.server.num_clients).value_or(-1);
  // The id is checked before the token so that a refusal never says whose
  // token a guess was tried against; the bytes shown are escaped (a peer's).
  const std::string shown_id = printable_peer_text(reg.client_id());
  if (id < 0) {
    refusal = fmt::format("client id '{}' from {} is not an id of this run (expected a plain decimal 0..{})", shown_id,
                          peer_addr, cfg_.server.num_clients - 1);
  } else if (!tokens_.empty() ? !tokens_.matches(id, reg.token())
                              : !cfg_.server.auth_token.empty() && !tokens_equal(reg.token(), cfg_.server.auth_token)) {
    refusal =
        fmt::format("client {} from {}: wrong token{}", id, peer_addr,
                    !tokens_.empty() && tokens_.token(id).empty() ? " (client_tokens_file gives this id none)" : "");
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
      s.secagg_over = false;
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
      uint64_t sent = 0;
      grpc::Status gs =
          send_model(stream, round, peer, data.get(), 0, nullptr, msg.get_global_model().held_round(), &sent);
      if (!gs.ok()) return on_exit(gs);
      std::lock_guard lock(mu_);
      if (slots_[static_cast<size_t>(id)].session == my_session) slots_[static_cast<size_t>(id)].bytes_down = sent;
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
    } else if (msg.has_secagg_poll()) {
      // Secure aggregation: the client waits for its next stage's request
      // (secagg_exchange posts it), or hears that the round's is over.
      std::string request;
      {
        std::unique_lock lock(mu_);
        auto& s = slots_[static_cast<size_t>(id)];
        cv_.wait(lock, [&] {
          return s.secagg_request || s.secagg_over || s.failed || s.session != my_session || phase_ == Phase::kFinished;
        });
        if (s.failed || s.session != my_session) {
          lock.unlock();
          return on_exit({grpc::StatusCode::ABORTED, peer + " was dropped from the run"});
        }
        if (s.secagg_over) {
          s.secagg_over = false;  // empty: the round's stages are over
        } else if (s.secagg_request) {
          request = std::move(*s.secagg_request);
          s.secagg_request.reset();
        }
      }
      wire::ServerMessage r;
      r.mutable_secagg_request()->set_payload(std::move(request));
      stream->Write(encode_message(r));
    } else if (msg.has_secagg_reply()) {
      if (msg.secagg_reply().payload().size() > kMaxSecAggMessage) {
        return on_exit({grpc::StatusCode::INVALID_ARGUMENT, peer + ": secure aggregation reply too large"});
      }
      std::lock_guard lock(mu_);
      auto& s = slots_[static_cast<size_t>(id)];
      if (s.session != my_session) return grpc::Status::OK;
      s.secagg_reply = msg.secagg_reply().payload();
      cv_.notify_all();
    } else if (msg.has_bye()) {
      std::lock_guard lock(mu_);
      if (slots_[static_cast<size_t>(id)].session == my_session) slots_[static_cast<size_t>(id)].ctx = nullptr;
      return grpc::Status::OK;
    } else {
      return on_exit({grpc::StatusCode::INVALID_ARGUMENT, peer + ": unexpected message"});
    }
  }
}

}  // namespace grpc_detail

namespace fs = std::filesystem;

namespace {

using grpc_detail::ServerAgent;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
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
  if (!sc.client_tokens_file.empty()) {
    std::vector<std::string> warnings;
    MEMFL_ASSIGN_OR_RETURN(auto tokens,
                           load_client_tokens(sc.client_tokens_file, kClientTokensFileKey, sc.num_clients, &warnings));
    for (const auto& w : warnings) spdlog::warn("{}", w);
    if (const auto missing = tokens.missing(); !missing.empty()) {
      spdlog::warn("{} gives no token to client(s) {}: they cannot register", kClientTokensFileKey,
                   fmt::join(missing, ", "));
    }
    t->impl_->agent.set_client_tokens(std::move(tokens));
  } else if (!sc.auth_token.empty()) {
    // Kept for the single-tenant case (every client run by one person), but
    // a shared token proves only membership, not which client one is.
    spdlog::warn(
        "server_configs.comm_configs.grpc_configs.auth_token is one token for every client: whoever holds it can "
        "register as any client id; give each client its own with {}",
        kClientTokensFileKey);
  }
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
int GrpcServerTransport::connected_clients() { return impl_->agent.connected_clients(); }
uint64_t GrpcServerTransport::transfer_buffer_bytes() const { return impl_->agent.transfer_buffer_bytes(); }

uint64_t grpc_transfer_buffer_bytes(const ExperimentConfig& cfg, const Layout& layout) {
  const auto& sc = cfg.server;
  return ServerAgent::transfer_buffer_bytes_for(
      grpc_chunk_bytes(sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes()), sc.num_clients,
      sc.data_channel == "grpc");
}
void GrpcServerTransport::set_broadcast_frames(const BroadcastFrames* frames) {
  impl_->agent.set_broadcast_frames(frames);
}
StatusOr<std::string> GrpcServerTransport::secagg_exchange(int client, std::string request) {
  return impl_->agent.secagg_exchange(client, std::move(request));
}
void GrpcServerTransport::secagg_end_round() { impl_->agent.secagg_end_round(); }
void GrpcServerTransport::secagg_drop(int client, const std::string& why) { impl_->agent.secagg_drop(client, why); }
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
