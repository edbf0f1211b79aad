#include "comm/grpc/grpc_client_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "compress/decoding_opener.h"
#include "config/config.h"
#include "tensor/dtype.h"

namespace memfl {

Status read_server_message(ClientStream& stream, const std::string& peer, DecodedFrame* d, wire::ServerMessage* msg) {
  Frame frame;
  if (!stream.Read(&frame)) return Status(StatusCode::kUnavailable, fmt::format("server {} closed the stream", peer));
  MEMFL_RETURN_IF_ERROR(decode_frame(frame, kServerChunkField, peer, d, msg));
  if (!d->is_chunk && msg->has_error()) return failed_precondition("server {}: {}", peer, msg->error().message());
  return Status::Ok();
}

Status write_client_message(ClientStream& stream, const google::protobuf::MessageLite& msg, const std::string& peer) {
  if (!stream.Write(encode_message(msg))) {
    return Status(StatusCode::kUnavailable, fmt::format("server {} closed the stream", peer));
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<grpc::Channel>> make_client_channel(const std::string& server_uri, bool use_ssl,
                                                             const std::string& root_cert, int64_t max_message_size,
                                                             int connect_timeout_s) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (use_ssl) {
    grpc::SslCredentialsOptions ssl;
    std::ifstream in(root_cert);
    ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(in), {});
    if (ssl.pem_root_certs.empty()) {
      return not_found("server_configs.comm_configs.grpc_configs.root_cert: cannot read {}", root_cert);
    }
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // Messages are at most one transfer chunk, whatever model_chunk_size says
  // (the server's may differ from this local config): the limits accept the
  // largest any transport sends, the flow control window holds two of gRPC's.
  const int64_t wire_chunk = static_cast<int64_t>(kMaxGrpcChunk);
  const int limit = max_message_bytes(static_cast<int64_t>(kMaxTransferChunk), max_message_size);
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);  // see the server: flow control is the backpressure
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, stream_window_bytes(wire_chunk));
  auto channel = grpc::CreateCustomChannel(server_uri, creds, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(connect_timeout_s))) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot connect to server {} within {} s{}", server_uri, connect_timeout_s,
                              use_ssl ? " (TLS: does root_cert sign the server's certificate?)" : ""));
  }
  return channel;
}

StatusOr<std::unique_ptr<DataSocket>> join_data_channel(ClientStream& stream, const wire::RegisterReply& reply,
                                                        const std::string& server_uri, uint32_t client_id,
                                                        uint64_t ticket, int timeout_s, const std::string& role) {
  if (reply.data_ticket() == 0) {
    spdlog::info("{}: chunks travel on the gRPC stream (the server offers no data channel)", role);
    return std::unique_ptr<DataSocket>();
  }
  auto link = dial_data_channel(server_uri, static_cast<int>(reply.data_port()), reply.data_unix_socket(), client_id,
                                ticket, timeout_s);
  if (link.ok()) {
    spdlog::info("{}: chunks travel on the data channel ({})", role, (*link)->peer());
    return link;
  }
  if (link.status().code() != StatusCode::kNotFound) return link.status();
  wire::ClientMessage out;
  out.mutable_data_channel_declined()->set_reason(link.status().message());
  MEMFL_RETURN_IF_ERROR(write_client_message(stream, out, server_uri));
  spdlog::info("{}: chunks travel on the gRPC stream ({})", role, link.status().message());
  return std::unique_ptr<DataSocket>();
}

StatusOr<std::unique_ptr<GrpcClientTransport>> GrpcClientTransport::connect(const GrpcClientOptions& o) {
  std::unique_ptr<GrpcClientTransport> t(new GrpcClientTransport());
  t->o_ = o;
  if (t->o_.connect_timeout_s <= 0) t->o_.connect_timeout_s = 30;
  if (o.faults != nullptr) t->faults_ = o.faults;
  t->peer_ = o.server_uri;
  t->role_ = fmt::format("client_{}", o.client_id);
  MEMFL_ASSIGN_OR_RETURN(t->channel_, make_client_channel(o.server_uri, o.use_ssl, o.root_cert, o.max_message_size,
                                                          t->o_.connect_timeout_s));
  MEMFL_RETURN_IF_ERROR(t->open_session());
  return t;
}

GrpcClientTransport::~GrpcClientTransport() { (void)close(); }

Status GrpcClientTransport::open_session() {
  stream_.reset();  // it refers to the context: it goes first
  ctx_ = std::make_unique<grpc::ClientContext>();
  grpc::internal::RpcMethod method(kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel_);
  stream_.reset(grpc::internal::ClientReaderWriterFactory<Frame, Frame>::Create(channel_.get(), method, ctx_.get()));
  finished_ = false;
  data_.reset();
  round_ = -1;
  receiving_ = false;
  closed_ = false;
  DecodedFrame d;
  wire::ServerMessage msg;
  wire::ClientMessage out;
  out.mutable_register_()->set_client_id(std::to_string(o_.client_id));
  out.mutable_register_()->set_token(faults_->token(o_.token));
  out.mutable_register_()->set_data_channel(true);  // the server's config decides
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_register_reply()) return data_loss("server {}: expected a RegisterReply", peer_);
  if (!msg.register_reply().accepted()) {
    return failed_precondition("server {} refused {}: {}", peer_, role_, msg.register_reply().message());
  }
  MEMFL_ASSIGN_OR_RETURN(
      data_, join_data_channel(*stream_, msg.register_reply(), o_.server_uri, o_.client_id,
                               faults_->data_ticket(msg.register_reply().data_ticket()), o_.connect_timeout_s, role_));
  // The server's configuration is the experiment; the local one only says
  // how to reach the server.
  out.Clear();
  out.mutable_get_configuration();
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_configuration()) return data_loss("server {}: expected a Configuration", peer_);
  config_yaml_ = msg.configuration().config_yaml();
  // The layout, by name: what the caller's model is checked against, and
  // what each round's ModelBegin must match.
  out.Clear();
  out.mutable_custom_action()->set_action("get_layout");
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_custom_action_reply()) return data_loss("server {}: expected its layout", peer_);
  LayoutBuilder b;
  try {
    const auto j = nlohmann::json::parse(msg.custom_action_reply().payload());
    for (const auto& e : j) {
      const auto dt = dtype_from_name(e.at("dtype").get<std::string>());
      if (!dt) return data_loss("server {}: unknown dtype in its layout", peer_);
      b.add(e.at("name").get<std::string>(), *dt, e.at("shape").get<std::vector<int64_t>>());
    }
  } catch (const std::exception& e) {
    return data_loss("server {}: unreadable layout: {}", peer_, e.what());
  }
  MEMFL_ASSIGN_OR_RETURN(Layout layout, std::move(b).build());
  if (layout_.total_bytes() != 0 && layout.hash() != layout_.hash()) {
    return failed_precondition("server {} came back with another model (layout {:016x}, was {:016x})", peer_,
                               layout.hash(), layout_.hash());
  }
  layout_ = std::move(layout);
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg, load_config_text(config_yaml_, "configuration from server " + peer_));
  chunk_ = grpc_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout_.total_bytes());
  return Status::Ok();
}

StatusOr<RoundOffer> GrpcClientTransport::next_round() {
  if (closed_) return failed_precondition("session with {} is closed", peer_);
  if (receiving_) return failed_precondition("round {}: receive() the model before asking for the next round", round_);
  wire::ClientMessage out;
  out.mutable_get_global_model()->set_held_round(held_round_);
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  DecodedFrame d;
  wire::ServerMessage msg;
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_model_begin()) return data_loss("server {}: expected ModelBegin", peer_);
  const auto& begin = msg.model_begin();
  RoundOffer offer;
  if (begin.finished()) return offer;
  if (begin.layout_hash() != layout_.hash() || begin.total_bytes() != layout_.total_bytes()) {
    return data_loss("server {}: its model (layout {:016x}, {} bytes) is not the layout it described ({:016x}, {})",
                     peer_, begin.layout_hash(), begin.total_bytes(), layout_.hash(), layout_.total_bytes());
  }
  if (begin.change_from_round() != 0 && begin.change_from_round() != held_round_) {
    return data_loss("server {}: it sends round {}'s model as the change from round {}, but this client holds {}",
                     peer_, begin.round(), begin.change_from_round(),
                     held_round_ > 0 ? fmt::format("round {}'s", held_round_) : std::string("none"));
  }
  change_from_ = begin.change_from_round();
  round_ = begin.round();
  receiving_ = true;
  offer.round = round_;
  offer.local_steps = begin.local_steps();
  offer.clients = {static_cast<int>(o_.client_id)};
  return offer;
}

Status GrpcClientTransport::receive(ModelPlace& place) {
  if (!receiving_) return failed_precondition("receive() without a round: call next_round() first");
  const std::string from = "server " + peer_;
  // The last upload's chunks (sent by reference) must be let go of before
  // the place is overwritten.
  while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  std::unique_ptr<ModelWriter> into = place.writer(layout_, from);
  DecodedFrame d;
  wire::ServerMessage msg;
  Arena* arena = place.arena();
  // What this place holds is the reference only once the whole model is in.
  const bool keeps = place.keeps_received_model() && arena != nullptr;
  held_round_ = 0;
  if (change_from_ > 0) {
    // Frames of the change from the model the place holds: each is checked
    // (compress/decoding_opener.h) and rebuilt in place, chunk by chunk.
    if (!keeps)
      return failed_precondition("round {}: the change from round {} needs the model it was taken from", round_,
                                 change_from_);
    ArenaBaseModel held(*arena);
    auto decoded = decoding_stream(std::make_unique<WriterStream>(*into), layout_, &held, from, chunk_);
    if (data_ != nullptr) {
      std::vector<std::byte> buffer(chunk_ + kMaxFrameOverhead);
      uint64_t received = 0;
      MEMFL_RETURN_IF_ERROR(read_data_chunks(
          *data_, layout_.total_bytes(), buffer, &received,
          [&](const ChunkHeader& h, std::span<const std::byte> bytes) {
            MEMFL_RETURN_IF_ERROR(decoded->accept(h, bytes));
            faults_->in_broadcast();
            return Status::Ok();
          },
          chunk_));
    } else {
      bool broke = false;
      MEMFL_RETURN_IF_ERROR(read_chunk_run([&](Frame* f) { return stream_->Read(f); }, [&] { ctx_->TryCancel(); },
                                           kServerChunkField, from, ChunkRunOptions{.drain = {}},
                                           [&](const DecodedFrame& frame) {
                                             MEMFL_RETURN_IF_ERROR(decoded->accept(frame.header, frame.payload()));
                                             faults_->in_broadcast();
                                             return Status::Ok();
                                           },
                                           &msg, &broke));
    }
    MEMFL_RETURN_IF_ERROR(decoded->commit());
  } else if (data_ != nullptr && arena != nullptr) {
    // Over the data channel into an arena: a header, checked before a byte
    // lands, then the bytes straight into the arena and their checksum
    // there (the chunk is still in cache).
    for (uint64_t next = 0; next < layout_.total_bytes();) {
      ChunkHeader h;
      MEMFL_RETURN_IF_ERROR(data_->read_header(&h, chunk_));
      MEMFL_RETURN_IF_ERROR(verify_chunk_header(h, h.length, layout_, next, from));
      const auto dst = arena->bytes(h.offset, h.length);
      MEMFL_RETURN_IF_ERROR(data_->read_exact(dst));
      if (chunk_checksum(std::span<const std::byte>(dst)) != h.checksum) return checksum_mismatch(h, from);
      next += h.length;
      faults_->in_broadcast();
    }
  } else if (data_ != nullptr) {
    // Elsewhere (shards, a caller's tensors): each chunk into one buffer, its
    // length bounded first, and through the place's checked writer.
    std::vector<std::byte> buffer(chunk_);
    uint64_t received = 0;
    const Status read = read_data_chunks(*data_, layout_.total_bytes(), buffer, &received,
                                         [&](const ChunkHeader& h, std::span<const std::byte> bytes) {
                                           MEMFL_RETURN_IF_ERROR(into->accept(h, bytes));
                                           faults_->in_broadcast();
                                           return Status::Ok();
                                         });
    MEMFL_RETURN_IF_ERROR(read);
    MEMFL_RETURN_IF_ERROR(into->finish());
  } else {
    // On the stream: the next chunks are read while one is checked and
    // copied in (read_chunk_run). A download that fails is not drained: the
    // stream is cancelled, and the client registers again.
    bool broke = false;
    const Status down = read_chunk_run([&](Frame* f) { return stream_->Read(f); }, [&] { ctx_->TryCancel(); },
                                       kServerChunkField, from, ChunkRunOptions{.drain = {}},
                                       [&](const DecodedFrame& frame) {
                                         MEMFL_RETURN_IF_ERROR(into->accept(frame.header, frame.payload()));
                                         faults_->in_broadcast();
                                         return Status::Ok();
                                       },
                                       &msg, &broke);
    MEMFL_RETURN_IF_ERROR(down);  // a broken stream: "server <peer> closed the stream"
    MEMFL_RETURN_IF_ERROR(into->finish());
  }
  if (data_ != nullptr) {
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
    if (d.is_chunk) return data_loss("server {}: a chunk on the stream while the data channel is open", peer_);
  }
  if (msg.has_error()) return failed_precondition("server {}: {}", peer_, msg.error().message());
  if (!msg.has_model_end()) return data_loss("server {}: unexpected message during the model download", peer_);
  receiving_ = false;
  if (keeps) held_round_ = round_;
  wire::ClientMessage out;
  out.mutable_model_received();
  return write_client_message(*stream_, out, peer_);
}

grpc::Status GrpcClientTransport::finish() {
  if (!finished_) {
    finished_ = true;
    ended_ = stream_->Finish();
  }
  return ended_;
}

void GrpcClientTransport::cancel() {
  ctx_->TryCancel();
  if (data_ != nullptr) data_->shutdown();
}

// gRPC holds a chunk's bytes by reference until it has sent them. A server
// that has stopped reading (it refused the update and ended the call) never
// takes them: after connect_timeout_s the call is cancelled, which makes
// gRPC let go, and the caller gets an error, not a hang.
Status GrpcClientTransport::wait_released() {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(o_.connect_timeout_s);
  while (inflight_.load() > 0) {
    if (std::chrono::steady_clock::now() > give_up) {
      cancel();
      while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      return Status(StatusCode::kUnavailable, fmt::format("server {} stopped reading the update of {} for {} s", peer_,
                                                          role_, o_.connect_timeout_s));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return Status::Ok();
}

Status GrpcClientTransport::send(const UpdateMeta& meta, ModelPlace& from) {
  if (receiving_ || round_ < 0) return failed_precondition("send() before this round's model was received");
  UpdateMeta told = meta;
  faults_->before_update_meta(&told);
  wire::ClientMessage out;
  auto* md = out.mutable_update_metadata();
  md->set_round(told.round);
  md->set_sample_count(told.sample_count);
  for (const auto& [k, v] : told.metrics) (*md->mutable_metrics())[k] = v;
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  // From an arena the chunks go by reference (zero-copy); from anywhere
  // else each is copied into one staging buffer, reused once gRPC let go;
  // a framed place's frames, one at a time, from the place's own buffer.
  const Arena* arena = from.framed() ? nullptr : from.arena();
  size_t index = 0;
  for (size_t off = 0; off < layout_.total_bytes(); off += chunk_, ++index) {
    const size_t len = std::min(chunk_, layout_.total_bytes() - off);
    std::span<const std::byte> bytes;
    if (arena != nullptr) {
      bytes = arena->bytes(off, len);
    } else if (from.framed()) {
      MEMFL_RETURN_IF_ERROR(wait_released());
      MEMFL_ASSIGN_OR_RETURN(bytes, from.frame(off, len));
    } else {
      MEMFL_RETURN_IF_ERROR(wait_released());
      staging_.resize(len);
      MEMFL_RETURN_IF_ERROR(from.read(off, staging_));
      bytes = staging_;
    }
    ChunkHeader h{layout_.hash(), off, bytes.size(), chunk_checksum(bytes)};
    if (Status f = faults_->before_upload_chunk(index, off + len >= layout_.total_bytes(), &h); !f.ok()) {
      cancel();
      return f;
    }
    if (data_ != nullptr) {
      // The kernel has copied the bytes when write_chunk returns.
      if (Status w = data_->write_chunk(h, bytes); !w.ok()) {
        return Status(StatusCode::kUnavailable, fmt::format("{} during the upload", w.message()));
      }
    } else if (!stream_->Write(encode_chunk_frame(kClientChunkField, h, bytes, &inflight_))) {
      // The call is over; recover() or close() finishes it, and gRPC lets
      // go of the chunks it still holds then.
      return Status(StatusCode::kUnavailable, fmt::format("server {} closed the stream during the upload", peer_));
    }
  }
  // The place's bytes are the caller's again once this returns.
  MEMFL_RETURN_IF_ERROR(wait_released());
  out.Clear();
  out.mutable_update_end();
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  DecodedFrame d;
  wire::ServerMessage msg;
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_update_ack()) return data_loss("server {}: expected UpdateAck", peer_);
  if (!msg.update_ack().accepted()) {
    return Status(StatusCode::kAborted,
                  fmt::format("server {} rejected the update of {}: {}", peer_, role_, msg.update_ack().message()));
  }
  round_ = -1;
  faults_->after_round(meta.round);
  return Status::Ok();
}

Status GrpcClientTransport::recover(const Status& why) {
  // Only a server that went away is worth a new session; bad bytes,
  // refusals and injected faults end the client with their message.
  if (why.code() != StatusCode::kUnavailable || closed_) return why;
  // The call is over: its status tells a server that went away (the
  // connection broke: UNAVAILABLE) from one that ended our session (it
  // dropped this client: CANCELLED, DATA_LOSS, …), which a new session
  // would not change. (Finish waits for every message to be read: read what
  // is left first; a rejection of our update says best why the session
  // ended.)
  for (Frame left; !finished_ && stream_->Read(&left);) {
    DecodedFrame ld;
    wire::ServerMessage lm;
    if (decode_frame(left, kServerChunkField, peer_, &ld, &lm).ok() && !ld.is_chunk && lm.has_update_ack() &&
        !lm.update_ack().accepted()) {
      return Status(StatusCode::kAborted,
                    fmt::format("server {} rejected the update of {}: {}", peer_, role_, lm.update_ack().message()));
    }
  }
  const grpc::Status ended = finish();
  // CANCELLED: the server dropped this client at a deadline (it stalled,
  // or its link did); OK: the call was ended in the middle of a round with
  // no reason given (a proxy, a server that let the session go). A new
  // session rejoins from the next round.
  if (ended.error_code() != grpc::StatusCode::UNAVAILABLE && ended.error_code() != grpc::StatusCode::CANCELLED &&
      !ended.ok()) {
    return Status(StatusCode::kAborted, fmt::format("{}; the server ended this client's session ({}{}{})",
                                                    why.message(), static_cast<int>(ended.error_code()),
                                                    ended.error_message().empty() ? "" : ": ", ended.error_message()));
  }
  // A new session, with backoff from 0.1 s to 2 s, for connect_timeout_s at most.
  spdlog::warn("{}; reconnecting for up to {} s", why.message(), o_.connect_timeout_s);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(o_.connect_timeout_s);
  auto wait = std::chrono::milliseconds(100);
  Status last = why;
  while (std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(wait);
    wait = std::min(2 * wait, std::chrono::milliseconds(2000));
    if (!channel_->WaitForConnected(std::chrono::system_clock::now() + wait)) continue;
    last = open_session();
    if (last.ok()) {
      spdlog::info("{}: reconnected to server {}", role_, peer_);
      return Status::Ok();
    }
    if (last.code() != StatusCode::kUnavailable) return last;  // refused: say why, stop
  }
  closed_ = true;
  return Status(StatusCode::kUnavailable,
                fmt::format("{}: gave up reconnecting to server {} after {} s (server_configs.comm_configs."
                            "grpc_configs.connect_timeout_s); last error: {}",
                            role_, peer_, o_.connect_timeout_s, last.message()));
}

Status GrpcClientTransport::close() {
  if (closed_ || !stream_) return Status::Ok();
  closed_ = true;
  // In the middle of a round the server is sending the model (or waiting
  // for the update) and would not read a Bye behind it: end the call.
  if (in_round()) {
    cancel();
    (void)finish();  // recover() may have finished it already
    return Status::Ok();
  }
  wire::ClientMessage out;
  out.mutable_bye();
  (void)write_client_message(*stream_, out, peer_);
  stream_->WritesDone();
  (void)finish();  // the server may already have shut down
  return Status::Ok();
}

StatusOr<std::string> GrpcClientTransport::next_secagg_request() {
  wire::ClientMessage poll;
  poll.mutable_secagg_poll()->set_round(round_);
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, poll, peer_));
  DecodedFrame d;
  wire::ServerMessage msg;
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_secagg_request()) {
    return data_loss("server {}: expected a secure aggregation request", peer_);
  }
  return std::move(*msg.mutable_secagg_request()->mutable_payload());
}

Status GrpcClientTransport::send_secagg_reply(std::string reply) {
  wire::ClientMessage m;
  m.mutable_secagg_reply()->set_payload(std::move(reply));
  return write_client_message(*stream_, m, peer_);
}

}  // namespace memfl
