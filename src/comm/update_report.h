// What a client reports with its update, as one type on every transport:
// its sample count (FedAvg's weight), training loss and accuracy, the
// validation it ran (loss, accuracy and the held-out samples they are over),
// the local steps it took, and DP-SGD's steps, sampling rate and ε.
//
// It travels as the metadata's name → value map (gRPC's UpdateMetadata,
// the Python session) or in MPI's fixed struct built from that map, and is
// encoded by encode_update_report and decoded and checked by
// decode_update_report wherever it arrives, so that metrics.csv and the
// scheduler see the same numbers however the clients connect.
//
//   UpdateMeta meta{.round = r, .client = c, .sample_count = report.sample_count,
//                   .metrics = encode_update_report(report)};
//   MEMFL_ASSIGN_OR_RETURN(UpdateReport got, decode_update_report(md.sample_count(), md.metrics(), peer, r));
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/transport.h"
#include "common/status.h"

namespace memfl {

struct UpdateReport {
  double sample_count = 0;
  double train_loss = 0, train_accuracy = 0;
  // Validation on the client's held-out split: the samples scored (0: none
  // was run, and the loss and accuracy mean nothing).
  int64_t val_samples = 0;
  double val_loss = 0, val_accuracy = 0;
  int64_t local_steps = 0;
  // DP-SGD: the steps this trip took and their Poisson rate; ε over all the
  // client's steps so far, where it keeps an accountant.
  int64_t dp_steps = 0;
  double dp_sample_rate = 0;
  bool has_epsilon = false;
  double epsilon = 0;
};

// The metadata map's names: train_loss, train_accuracy, val_samples,
// val_loss, val_accuracy, local_steps, dp_steps, dp_sample_rate, epsilon.
// Validation and DP entries are there only when the client ran them.
std::map<std::string, double> encode_update_report(const UpdateReport& report);

// The report a map of metrics encodes, checked before any value is used or
// cast: every value finite; the counts (val_samples, local_steps, dp_steps)
// whole numbers in [0, 2^53]; dp_sample_rate in [0, 1]. Names it does not
// know (a Python client's own metrics) are checked for being finite and
// left out. A refusal is kRejected, naming `peer`, the metric and `round`.
[[nodiscard]] StatusOr<UpdateReport> decode_update_report(double sample_count,
                                                          const std::vector<std::pair<std::string, double>>& metrics,
                                                          std::string_view peer, int round);
// The same for a std::map, a protobuf Map or an array of pairs.
template <typename Metrics>
[[nodiscard]] StatusOr<UpdateReport> decode_update_report(double sample_count, const Metrics& metrics,
                                                          std::string_view peer, int round) {
  std::vector<std::pair<std::string, double>> flat;
  for (const auto& m : metrics) flat.emplace_back(std::string(m.first), static_cast<double>(m.second));
  return decode_update_report(sample_count, flat, peer, round);
}

// What the round driver aggregates of a client's report: validation weighed
// by the held-out samples it is over, on every transport.
ClientUpdateInfo update_info(int client, const UpdateReport& report);

}  // namespace memfl
