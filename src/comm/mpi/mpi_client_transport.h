// MPI's ClientTransport: a client rank's side of the round protocol
// (comm/mpi/mpi_transport.h), for ClientDriver. A rank runs one client or
// several virtual clients (clients_per_rank); which of them train in a
// round comes from the config and the seed, as every rank computes it.
#pragma once

#include <functional>
#include <vector>

#include "comm/client_transport.h"
#include "comm/mpi/mpi_transport.h"

namespace memfl {

class MpiClientTransport final : public ClientTransport {
 public:
  // `clients_of_round(round)`: this rank's clients that train in `round`.
  // `faults` may be null (none).
  MpiClientTransport(const Layout& layout, size_t chunk, const SharedRing& shm, int rank,
                     std::function<std::vector<int>(int round)> clients_of_round, TransferFaults* faults);

  std::string_view name() const override { return "mpi"; }
  StatusOr<RoundOffer> next_round() override;
  Status receive(ModelPlace& into) override;
  Status send(const UpdateMeta& meta, ModelPlace& from) override;
  StatusOr<std::string> next_secagg_request() override;
  Status send_secagg_reply(std::string reply) override;
  // Tells the server this rank has written its outputs (it may end the job).
  Status close() override;

 private:
  const Layout& layout_;
  ClientStreams streams_;
  int rank_;
  std::function<std::vector<int>(int)> clients_of_round_;
  TransferFaults no_faults_;
  TransferFaults* faults_;
  int last_round_ = -1;
  bool closed_ = false;
};

}  // namespace memfl
