// A client's session with `memfl server`, driven by its caller one step at a
// time with the caller's own tensors — what the Python client (`import
// memfl`, python/memfl_module.cpp) is built on. The protocol is the C++
// client's (GrpcClientTransport, comm/grpc/grpc_client_transport.h); this
// adds the tensors as a ModelPlace and the checks a caller's tensors need.
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
// The caller's tensors are checked against the server's layout before a
// byte moves: a missing, extra, mis-shaped or mis-typed tensor is refused by
// name. An update the server would refuse (a non-finite value, a sample
// count that is not a finite number above 0) is refused before it is sent.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/grpc/grpc_client_transport.h"
#include "common/status.h"
#include "tensor/layout.h"

namespace memfl {

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

  const std::string& config_yaml() const { return transport_->config_yaml(); }
  const Layout& layout() const { return transport_->layout(); }
  const std::string& peer() const { return transport_->peer(); }

  // The next round's number, once the server has begun sending its model;
  // -1 when the run is finished. receive() must follow a round.
  StatusOr<int> next_round();
  int local_steps() const { return local_steps_; }  // FedCompass's steps for this trip; 0: the config's
  Status receive(std::span<const TensorBuffer> tensors);
  Status send(std::span<const TensorBuffer> tensors, double num_samples, const std::map<std::string, double>& metrics);
  // Says Bye and ends the call (also done when the session is destroyed);
  // in the middle of a round, ends the call at once.
  Status close() { return transport_->close(); }

 private:
  std::unique_ptr<GrpcClientTransport> transport_;
  int round_ = -1, local_steps_ = 0;
  uint32_t client_id_ = 0;
};

}  // namespace memfl
