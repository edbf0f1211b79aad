// GrpcServerTransport: the server core's transport over gRPC (TLS and
// per-client tokens as configured). It listens, registers clients, and in
// each round sends the global model's chunks to the selected clients and
// feeds their updates, as they arrive, into the aggregator.
//
//   MEMFL_ASSIGN_OR_RETURN(auto transport, GrpcServerTransport::listen(cfg, layout, naive, run_dir));
//   transport->wait_for_clients();
//   RoundDriver driver(cfg, global, *transport, scheduler, sampler, opts);
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "config/config.h"
#include "comm/transport.h"
#include "tensor/layout.h"

namespace memfl {

// What a gRPC server of `cfg` and `layout` will hold for uploads in flight
// (GrpcServerTransport::transfer_buffer_bytes), known before it listens.
uint64_t grpc_transfer_buffer_bytes(const ExperimentConfig& cfg, const Layout& layout);

class GrpcServerTransport final : public ServerTransport {
 public:
  // Listens on server_configs.comm_configs.grpc_configs.server_uri and writes
  // the port it got to run_dir/port. `naive` (memory_mode: naive) holds each
  // client's update whole, as typical frameworks do, for comparison.
  static StatusOr<std::unique_ptr<GrpcServerTransport>> listen(const ExperimentConfig& cfg, const Layout& layout,
                                                               bool naive, const std::string& run_dir);
  ~GrpcServerTransport() override;
  // Waits round_timeout_s at most for every client to register; the ones
  // that did not are out of the run.
  void wait_for_clients();

  std::string_view name() const override { return "grpc"; }
  bool broadcast_done_before_collect() const override;
  Status broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) override;
  Status collect(int round, const std::vector<int>& selected, const Arena& global, UpdateOpener& aggregator,
                 CollectResult* out) override;
  // Tells clients the run is over and stops serving (once; also on destruction).
  void finish(int last_round) override;
  std::vector<int> take_rejoined() override;
  int connected_clients() override;
  uint64_t transfer_buffer_bytes() const override;
  void set_broadcast_frames(const BroadcastFrames* frames) override;
  // Asynchronous FL over the same sessions: each client gets the model as
  // it is when it asks (and, from FedCompass, its local steps), its update
  // goes to a spool slot, checked chunk by chunk, and `core` applies it with
  // its staleness once whole. Returns after options.total updates.
  Status serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options);
  // Secure aggregation's stages over the clients' sessions, as opaque bytes
  // (roles/grpc_server.cpp makes them a secagg RemoteSecAggChannel): hands
  // `request` to `client`'s next poll and returns its reply (a client that
  // does not answer within secure_aggregation.timeout is out); polls hear
  // that the round's stages are over until the next broadcast; a client
  // left out of the key exchange is dropped.
  StatusOr<std::string> secagg_exchange(int client, std::string request);
  void secagg_end_round();
  void secagg_drop(int client, const std::string& why);

 private:
  GrpcServerTransport() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memfl
