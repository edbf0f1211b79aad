// The misbehaving peers the fault tests play, configured from the
// environment of the process that plays them:
//
//   MEMFL_FAULT=<kind>   MEMFL_FAULT_CLIENT=<gRPC client id>  (default 0)
//                        MEMFL_FAULT_RANK=<MPI rank>
//
// Kinds: wrong_token, wrong_data_ticket (refused at registration);
// disconnect_mid_upload, bad_checksum, wrong_layout_hash, offset_past_end,
// extra_bytes (the first upload's second chunk, or its only one);
// disconnect_before_upload (its metadata sent, none of its first update's
// chunks: under secure aggregation, a client gone after sharing its keys);
// stop_in_broadcast, stop_mid_upload (the process stops itself with SIGSTOP,
// once, as a stalled node would; SIGCONT lets it go on); die_after_round_1
// (the process exits at once after its part of round 1, as a crashed node);
// nan_train_loss, wrong_round, wrong_client (the first update's metadata
// reports a NaN train_loss, names the next round, or — over MPI, whose
// metadata carries it — the next client's id).
//
// Only process wiring (roles/) asks for a plan; the transports call the
// TransferFaults seam (comm/client_transport.h) and know no kind.
#pragma once

#include <memory>
#include <string_view>

#include "comm/client_transport.h"

namespace memfl {

// The plan for the process that is `who` under `who_variable`
// (MEMFL_FAULT_CLIENT or MEMFL_FAULT_RANK); a do-nothing plan when the
// environment names another process or no fault.
std::unique_ptr<TransferFaults> transfer_faults_from_env(int who, std::string_view who_variable);

}  // namespace memfl
