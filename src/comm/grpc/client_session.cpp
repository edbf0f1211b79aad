#include "comm/grpc/client_session.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/update_check.h"
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

namespace {

std::string shape_text(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

StatusOr<std::vector<const TensorBuffer*>> match_layout(const Layout& layout, std::span<const TensorBuffer> tensors) {
  std::map<std::string_view, const TensorBuffer*> by_name;
  for (const auto& t : tensors) {
    if (!by_name.emplace(t.name, &t).second) return invalid_argument("tensor '{}' is given twice", t.name);
  }
  std::vector<const TensorBuffer*> ordered;
  for (const auto& e : layout.entries()) {
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      return invalid_argument("the state_dict has no tensor '{}' (the server's model has it: {} {})", e.name,
                              dtype_name(e.dtype), shape_text(e.shape));
    }
    const TensorBuffer& t = *it->second;
    if (t.shape != e.shape) {
      return invalid_argument("tensor '{}' has shape {}; the server's model has {}", e.name, shape_text(t.shape),
                              shape_text(e.shape));
    }
    if (t.dtype != dtype_name(e.dtype)) {
      return invalid_argument("tensor '{}' is {}; the server's model has {}", e.name, t.dtype, dtype_name(e.dtype));
    }
    if (t.nbytes != e.nbytes() || t.data == nullptr) {
      return invalid_argument("tensor '{}': {} bytes of storage for {} expected", e.name, t.nbytes, e.nbytes());
    }
    ordered.push_back(&t);
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return invalid_argument("tensor '{}' is not in the server's model ({} tensors)", by_name.begin()->first,
                            layout.size());
  }
  return ordered;
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

StatusOr<std::unique_ptr<GrpcClientSession>> GrpcClientSession::connect(const SessionOptions& o) {
  std::unique_ptr<GrpcClientSession> s(new GrpcClientSession());
  s->peer_ = o.server_uri;
  MEMFL_ASSIGN_OR_RETURN(s->channel_,
                         make_client_channel(o.server_uri, !o.root_cert.empty(), o.root_cert, 0, o.connect_timeout_s));
  s->ctx_ = std::make_unique<grpc::ClientContext>();
  grpc::internal::RpcMethod method(kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING, s->channel_);
  s->stream_.reset(
      grpc::internal::ClientReaderWriterFactory<Frame, Frame>::Create(s->channel_.get(), method, s->ctx_.get()));
  ClientStream& stream = *s->stream_;
  DecodedFrame d;
  wire::ServerMessage msg;
  wire::ClientMessage out;
  out.mutable_register_()->set_client_id(o.client_id);
  out.mutable_register_()->set_token(o.token);
  out.mutable_register_()->set_data_channel(true);  // the server's config decides
  MEMFL_RETURN_IF_ERROR(write_client_message(stream, out, s->peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(stream, s->peer_, &d, &msg));
  if (d.is_chunk || !msg.has_register_reply()) return data_loss("server {}: expected a RegisterReply", s->peer_);
  if (!msg.register_reply().accepted()) {
    return failed_precondition("server {} refused client {}: {}", s->peer_, o.client_id,
                               msg.register_reply().message());
  }
  // The server accepted the id, so it is a number.
  MEMFL_ASSIGN_OR_RETURN(s->data_, join_data_channel(stream, msg.register_reply(), o.server_uri,
                                                     static_cast<uint32_t>(std::stoul(o.client_id)),
                                                     msg.register_reply().data_ticket(), o.connect_timeout_s,
                                                     "client " + o.client_id));
  out.Clear();
  out.mutable_get_configuration();
  MEMFL_RETURN_IF_ERROR(write_client_message(stream, out, s->peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(stream, s->peer_, &d, &msg));
  if (d.is_chunk || !msg.has_configuration()) return data_loss("server {}: expected a Configuration", s->peer_);
  s->config_yaml_ = msg.configuration().config_yaml();
  // The layout, by name: what the caller's tensors are checked against.
  out.Clear();
  out.mutable_custom_action()->set_action("get_layout");
  MEMFL_RETURN_IF_ERROR(write_client_message(stream, out, s->peer_));
  MEMFL_RETURN_IF_ERROR(read_server_message(stream, s->peer_, &d, &msg));
  if (d.is_chunk || !msg.has_custom_action_reply()) return data_loss("server {}: expected its layout", s->peer_);
  LayoutBuilder b;
  try {
    const auto j = nlohmann::json::parse(msg.custom_action_reply().payload());
    for (const auto& e : j) {
      const auto dt = dtype_from_name(e.at("dtype").get<std::string>());
      if (!dt) return data_loss("server {}: unknown dtype in its layout", s->peer_);
      b.add(e.at("name").get<std::string>(), *dt, e.at("shape").get<std::vector<int64_t>>());
    }
  } catch (const std::exception& e) {
    return data_loss("server {}: unreadable layout: {}", s->peer_, e.what());
  }
  MEMFL_ASSIGN_OR_RETURN(s->layout_, std::move(b).build());
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg,
                         load_config_text(s->config_yaml_, "configuration from server " + s->peer_));
  s->chunk_ = grpc_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, s->layout_.total_bytes());
  s->connect_timeout_s_ = o.connect_timeout_s > 0 ? o.connect_timeout_s : 30;
  return s;
}

GrpcClientSession::~GrpcClientSession() { (void)close(); }

StatusOr<int> GrpcClientSession::next_round() {
  if (closed_) return failed_precondition("session with {} is closed", peer_);
  if (receiving_) return failed_precondition("round {}: receive() the model before asking for the next round", round_);
  wire::ClientMessage out;
  out.mutable_get_global_model();
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  DecodedFrame d;
  wire::ServerMessage msg;
  MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
  if (d.is_chunk || !msg.has_model_begin()) return data_loss("server {}: expected ModelBegin", peer_);
  const auto& begin = msg.model_begin();
  if (begin.finished()) return -1;
  if (begin.layout_hash() != layout_.hash() || begin.total_bytes() != layout_.total_bytes()) {
    return data_loss("server {}: its model (layout {:016x}, {} bytes) is not the layout it described ({:016x}, {})",
                     peer_, begin.layout_hash(), begin.total_bytes(), layout_.hash(), layout_.total_bytes());
  }
  round_ = begin.round();
  local_steps_ = begin.local_steps();
  receiving_ = true;
  return round_;
}

Status GrpcClientSession::receive(std::span<const TensorBuffer> tensors) {
  if (!receiving_) return failed_precondition("receive() without a round: call next_round() first");
  MEMFL_ASSIGN_OR_RETURN(auto ordered, match_layout(layout_, tensors));
  const auto& entries = layout_.entries();
  uint64_t next = 0;
  DecodedFrame d;
  wire::ServerMessage msg;
  // Scatters a checked chunk into the tensors; padding between entries is dropped.
  auto scatter = [&](const ChunkHeader& h, Payload payload) {
    size_t at = h.offset;
    for (auto piece : payload) {
      const size_t end = at + piece.size();
      for (size_t i = layout_.entry_at_or_after(at); i < entries.size() && entries[i].offset < end; ++i) {
        const auto& e = entries[i];
        const size_t from = std::max(at, e.offset), to = std::min(e.end(), end);
        if (to > from) std::memcpy(ordered[i]->data + (from - e.offset), piece.data() + (from - at), to - from);
      }
      at = end;
    }
    next += h.length;
  };
  if (data_) {
    // Each chunk into one buffer (its length bounded first), then checked
    // before a byte reaches the caller's tensors.
    std::vector<std::byte> buffer(chunk_);
    uint64_t received = 0;
    const Status read = read_data_chunks(
        *data_, layout_.total_bytes(), buffer, &received, [&](const ChunkHeader& h, std::span<const std::byte> bytes) {
          MEMFL_RETURN_IF_ERROR(verify_chunk(h, Payload(&bytes, 1), layout_, next, peer_));
          scatter(h, Payload(&bytes, 1));
          return Status::Ok();
        });
    MEMFL_RETURN_IF_ERROR(read);
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
    if (d.is_chunk || !msg.has_model_end()) {
      return data_loss("server {}: unexpected message at the end of the model download", peer_);
    }
  }
  while (!data_) {
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream_, peer_, &d, &msg));
    if (!d.is_chunk) {
      if (msg.has_model_end()) break;
      return data_loss("server {}: unexpected message during the model download", peer_);
    }
    MEMFL_RETURN_IF_ERROR(verify_chunk(d.header, d.payload(), layout_, next, peer_));
    scatter(d.header, d.payload());
  }
  if (next != layout_.total_bytes()) {
    return data_loss("model from {} ended after {} of {} bytes", peer_, next, layout_.total_bytes());
  }
  receiving_ = false;
  wire::ClientMessage out;
  out.mutable_model_received();
  return write_client_message(*stream_, out, peer_);
}

Status GrpcClientSession::send(std::span<const TensorBuffer> tensors, double num_samples,
                               const std::map<std::string, double>& metrics) {
  if (receiving_ || round_ < 0) return failed_precondition("send() before this round's model was received");
  MEMFL_ASSIGN_OR_RETURN(auto ordered, match_layout(layout_, tensors));
  // What the server would refuse is refused here, before a byte leaves:
  // the caller gets the reason at once, and the round's stream stays usable.
  if (!(std::isfinite(num_samples) && num_samples > 0)) {
    return invalid_argument("send(num_samples={}): the sample count must be a finite number above 0", num_samples);
  }
  for (size_t i = 0; i < ordered.size(); ++i) {
    const auto& e = layout_.entries()[i];
    const size_t bad = first_non_finite(e.dtype, ordered[i]->data, e.numel());
    if (bad < e.numel()) {
      return invalid_argument("send(): tensor '{}' element {} is not finite (NaN or Inf); the update is not sent",
                              e.name, bad);
    }
  }
  wire::ClientMessage out;
  auto* md = out.mutable_update_metadata();
  md->set_round(round_);
  md->set_sample_count(num_samples);
  for (const auto& [k, v] : metrics) (*md->mutable_metrics())[k] = v;
  MEMFL_RETURN_IF_ERROR(write_client_message(*stream_, out, peer_));
  // Each chunk is gathered from the tensors into one buffer (padding zero),
  // handed to gRPC by reference, and reused once gRPC has let go of it.
  std::vector<std::byte> buf(chunk_);
  std::atomic<int64_t> inflight{0};
  // gRPC holds the last chunk's buffer until the server has taken it. A
  // server that has stopped reading (it refused the update and ended the
  // call) never takes it: after connect_timeout_s the call is cancelled,
  // which makes gRPC let go, and the caller gets an error, not a hang.
  auto wait_released = [&]() -> Status {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(connect_timeout_s_);
    while (inflight.load() > 0) {
      if (std::chrono::steady_clock::now() > give_up) {
        ctx_->TryCancel();
        while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
        closed_ = true;
        return Status(StatusCode::kUnavailable,
                      fmt::format("server {} stopped reading the update for {} s; the session is closed", peer_,
                                  connect_timeout_s_));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return Status::Ok();
  };
  const auto& entries = layout_.entries();
  for (size_t off = 0; off < layout_.total_bytes(); off += chunk_) {
    MEMFL_RETURN_IF_ERROR(wait_released());
    const size_t len = std::min(chunk_, layout_.total_bytes() - off);
    std::memset(buf.data(), 0, len);
    for (size_t i = layout_.entry_at_or_after(off); i < entries.size() && entries[i].offset < off + len; ++i) {
      const auto& e = entries[i];
      const size_t from = std::max(off, e.offset), to = std::min(e.end(), off + len);
      if (to > from) std::memcpy(buf.data() + (from - off), ordered[i]->data + (from - e.offset), to - from);
    }
    const std::span<const std::byte> bytes(buf.data(), len);
    const ChunkHeader h{layout_.hash(), off, len, chunk_checksum(bytes)};
    if (data_) {
      // The kernel has copied the bytes when write_chunk returns.
      if (Status w = data_->write_chunk(h, bytes); !w.ok()) {
        return Status(StatusCode::kUnavailable, fmt::format("{} during the upload", w.message()));
      }
    } else if (!stream_->Write(encode_chunk_frame(kClientChunkField, h, bytes, &inflight))) {
      ctx_->TryCancel();
      while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      closed_ = true;
      return Status(StatusCode::kUnavailable, fmt::format("server {} closed the stream during the upload", peer_));
    }
  }
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
                  fmt::format("server {} rejected the update: {}", peer_, msg.update_ack().message()));
  }
  round_ = -1;
  return Status::Ok();
}

Status GrpcClientSession::close() {
  if (closed_ || !stream_) return Status::Ok();
  closed_ = true;
  // In the middle of a round the server is sending the model (or waiting
  // for the update) and would not read a Bye behind it: end the call.
  if (receiving_ || round_ >= 0) {
    ctx_->TryCancel();
    (void)stream_->Finish();
    return Status::Ok();
  }
  wire::ClientMessage out;
  out.mutable_bye();
  (void)write_client_message(*stream_, out, peer_);
  stream_->WritesDone();
  (void)stream_->Finish();  // the server may already have shut down
  return Status::Ok();
}

}  // namespace memfl
