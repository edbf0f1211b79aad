// A client's session with `memfl server`, driven by its caller one step at a
// time — what the Python client (`import memfl`, python/memfl_module.cpp) is
// built on. The C++ client role (roles/grpc_client.cpp) shares
// its channel set-up and message helpers.
//
//   MEMFL_ASSIGN_OR_RETURN(auto s, GrpcClientSession::connect({.server_uri = "127.0.0.1:50051", .client_id = "0"}));
//   while (true) {
//     MEMFL_ASSIGN_OR_RETURN(int round, s->next_round());   // -1: the run is over
//     if (round < 0) break;
//     MEMFL_RETURN_IF_ERROR(s->receive(tensors));          // chunks straight into the caller's buffers
//     … train …
//     MEMFL_RETURN_IF_ERROR(s->send(tensors, num_samples, metrics));
//   }
//
// The caller's tensors are checked against the server's layout (asked for
// with the custom action "get_layout") before a byte moves: a missing, extra,
// mis-shaped or mis-typed tensor is refused by name. Every chunk is checked
// (layout hash, offset, length, checksum) as in the C++ client, on the stream
// or on the TCP data channel when the server offers one.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <cstddef>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/grpc/data_channel.h"
#include "comm/grpc/wire.h"
#include "common/status.h"
#include "tensor/layout.h"

namespace memfl {

using ClientStream = grpc::ClientReaderWriter<Frame, Frame>;

// One server message; a closed stream is kUnavailable, an Error message a
// failed precondition with the server's text.
Status read_server_message(ClientStream& stream, const std::string& peer, DecodedFrame* d, wire::ServerMessage* msg);
Status write_client_message(ClientStream& stream, const google::protobuf::MessageLite& msg, const std::string& peer);

// After an accepted Register: the session's data connection, when the
// server offered one (a ticket) and this client can reach it; nullptr when
// the chunks travel on the stream — none offered, or none reachable, and
// then the server is told (DataChannelDeclined). Logs which path `role`
// takes. A channel that is reached but fails (a refused ticket, no welcome)
// is an error.
StatusOr<std::unique_ptr<DataSocket>> join_data_channel(ClientStream& stream, const wire::RegisterReply& reply,
                                                        const std::string& server_uri, uint32_t client_id,
                                                        uint64_t ticket, int timeout_s, const std::string& role);

// The channel a client opens: TLS when root_cert is given (PEM file), the
// message limits and stream window that fit one transfer chunk.
StatusOr<std::shared_ptr<grpc::Channel>> make_client_channel(const std::string& server_uri, bool use_ssl,
                                                             const std::string& root_cert, int64_t max_message_size,
                                                             int connect_timeout_s);

struct SessionOptions {
  std::string server_uri = "127.0.0.1:50051";
  std::string client_id = "0";
  std::string token;
  std::string root_cert;  // PEM file: TLS; empty: plaintext
  int connect_timeout_s = 30;
};

// A caller's tensor: its bytes (CPU, contiguous) and what it claims to be.
struct TensorBuffer {
  std::string name;
  std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string dtype;  // f32, bf16, … (tensor/dtype.h names)
  std::vector<int64_t> shape;
};

// Refuses tensors that are not exactly the layout's, naming the first
// tensor that differs; on success, the buffers in layout order.
StatusOr<std::vector<const TensorBuffer*>> match_layout(const Layout& layout, std::span<const TensorBuffer> tensors);

class GrpcClientSession {
 public:
  static StatusOr<std::unique_ptr<GrpcClientSession>> connect(const SessionOptions& options);
  ~GrpcClientSession();
  GrpcClientSession(const GrpcClientSession&) = delete;
  GrpcClientSession& operator=(const GrpcClientSession&) = delete;

  const std::string& config_yaml() const { return config_yaml_; }
  const Layout& layout() const { return layout_; }
  const std::string& peer() const { return peer_; }

  // The next round's number, once the server has begun sending its model;
  // -1 when the run is finished. receive() must follow a round.
  StatusOr<int> next_round();
  int local_steps() const { return local_steps_; }  // FedCompass's steps for this trip; 0: the config's
  Status receive(std::span<const TensorBuffer> tensors);
  Status send(std::span<const TensorBuffer> tensors, double num_samples, const std::map<std::string, double>& metrics);
  // Says Bye and ends the call (also done by the destructor).
  Status close();

 private:
  GrpcClientSession() = default;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<ClientStream> stream_;
  // The TCP data channel, when the server offers one (data_channel: tcp):
  // the chunks travel there, the stream keeps the control messages.
  std::unique_ptr<DataSocket> data_;
  std::string peer_, config_yaml_;
  Layout layout_;
  size_t chunk_ = 0;
  int connect_timeout_s_ = 30;
  int round_ = -1, local_steps_ = 0;
  bool receiving_ = false, closed_ = false;
};

}  // namespace memfl
