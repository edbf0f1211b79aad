// The client's side of the gRPC session protocol, written once: the C++
// client role (roles/grpc_client.cpp, through ClientDriver) and the Python
// client's session (comm/grpc/client_session.h) both speak it through this
// ClientTransport.
//
//   Register (id, token) → RegisterReply [→ data channel hello] →
//   GetConfiguration → Configuration → get_layout → the layout, then per round:
//   GetGlobalModel → ModelBegin, chunks (stream or data channel), ModelEnd →
//   ModelReceived … UpdateMetadata, chunks, UpdateEnd → UpdateAck; finally Bye.
//
// Every chunk is checked (layout hash, offset, length, checksum) before its
// bytes count, on the stream or on the data channel when the server offers
// one. A server that went away (UNAVAILABLE), dropped this client at a
// deadline (CANCELLED) or ended its call mid-round with no reason (OK) is
// met with a new session (recover), with backoff, for connect_timeout_s at
// most.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/client_transport.h"
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

struct GrpcClientOptions {
  std::string server_uri = "127.0.0.1:50051";
  uint32_t client_id = 0;
  std::string token;
  bool use_ssl = false;
  std::string root_cert;  // PEM file, with use_ssl
  int64_t max_message_size = 0;
  int connect_timeout_s = 30;
  TransferFaults* faults = nullptr;  // the fault tests' seam; null: none
};

class GrpcClientTransport final : public ClientTransport {
 public:
  // Opens the channel and a session (Register, the data channel, the
  // configuration and the model's layout).
  static StatusOr<std::unique_ptr<GrpcClientTransport>> connect(const GrpcClientOptions& options);
  ~GrpcClientTransport() override;
  GrpcClientTransport(const GrpcClientTransport&) = delete;
  GrpcClientTransport& operator=(const GrpcClientTransport&) = delete;

  std::string_view name() const override { return "grpc"; }
  const std::string& config_yaml() const { return config_yaml_; }
  const Layout& layout() const { return layout_; }  // the server's model, as it described it
  const std::string& peer() const { return peer_; }
  bool in_round() const { return receiving_ || round_ >= 0; }

  StatusOr<RoundOffer> next_round() override;
  Status receive(ModelPlace& into) override;
  Status send(const UpdateMeta& meta, ModelPlace& from) override;
  StatusOr<std::string> next_secagg_request() override;
  Status send_secagg_reply(std::string reply) override;
  Status recover(const Status& why) override;
  Status close() override;

 private:
  GrpcClientTransport() = default;
  Status open_session();
  // Ends the call now (a failed round): gRPC lets go of every chunk it holds.
  void cancel();
  Status wait_released();
  // The call's status. gRPC allows one Finish() a call (a second aborts the
  // process): recover() and close() both ask, this asks gRPC once.
  grpc::Status finish();

  GrpcClientOptions o_;
  TransferFaults no_faults_;
  TransferFaults* faults_ = &no_faults_;
  std::string role_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<ClientStream> stream_;
  // The data channel, when the server offers one (data_channel: tcp, unix,
  // auto): the chunks travel there, the stream keeps the control messages.
  std::unique_ptr<DataSocket> data_;
  std::string peer_, config_yaml_;
  Layout layout_;
  size_t chunk_ = 0;
  int round_ = -1;
  bool receiving_ = false, closed_ = false;
  bool finished_ = false;  // this session's call has been finished; ended_ is its status
  grpc::Status ended_;
  // The round whose model the last place that keeps it received (0: none),
  // told to the server with each GetGlobalModel; and what this round's
  // ModelBegin says its chunks are the change from (0: the model's bytes).
  int held_round_ = 0, change_from_ = 0;
  // A copy of an update's chunk for a place without an arena: gRPC holds
  // it by reference (zero-copy) until it has been sent.
  std::vector<std::byte> staging_;
  // Chunks gRPC still holds by reference (encode_chunk_frame counts them).
  std::atomic<int64_t> inflight_{0};
};

}  // namespace memfl
