// What the server checks of a client update's values, as its chunks arrive
// (sizes, offsets and checksums are checked by verify_chunk before this):
// every float element is finite, and the sample count it is weighted by is
// finite, positive and at most server_configs.max_num_samples; its metadata
// names the round being collected and reports finite metrics. One NaN or
// Inf folded into a running sum makes every later global model NaN, and a
// sample count of 1e308 makes one client the whole mean; both are refused
// naming the client, the tensor and the round, and the round goes on with the
// others.
//
//   CheckedUpdateOpener checked(aggregator, round, limits);
//   transport.collect(round, selected, global, checked, &up);   // refused updates: up.failed
//
// The check reads each chunk once, just before the checksum reads it again
// (it is then in cache); its cost per GB folded is in docs/BENCHMARKS.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/chunk.h"
#include "comm/transport.h"
#include "tensor/layout.h"

namespace memfl {

struct UpdateLimits {
  double max_num_samples = 1e12;
};

// A sample count a server may weigh an update by; else kRejected naming
// `peer` and `round`.
Status check_sample_count(double sample_count, const UpdateLimits& limits, std::string_view peer, int round);

// The round an update says it is for (its metadata's round field) is the
// round being collected: an update kept from another round, or a made-up
// one, is refused (kRejected) naming `peer`.
Status check_update_round(int claimed, int round, std::string_view peer);

// A metric a client reports with its update (train_loss, val_accuracy,
// local_steps, …) is finite: one NaN would be averaged into metrics.csv and
// every later mean, and the scheduler would rank by it. Else kRejected
// naming `peer`, the metric and the round.
Status check_update_metric(std::string_view name, double value, std::string_view peer, int round);

// Every (name, value) of `metrics` (a std::map or a protobuf Map).
template <typename Metrics>
Status check_update_metrics(const Metrics& metrics, std::string_view peer, int round) {
  for (const auto& m : metrics) MEMFL_RETURN_IF_ERROR(check_update_metric(m.first, m.second, peer, round));
  return Status::Ok();
}

// Follows one model stream (chunks in order, cut anywhere, even inside an
// element) and fails at the first non-finite float element, naming its
// tensor and index. Integer tensors and the padding between entries are not
// looked at.
class FiniteValueCheck {
 public:
  explicit FiniteValueCheck(const Layout& layout) : layout_(layout) {}
  // `payload` holds the model's bytes [offset, offset + payload_size).
  Status check(uint64_t offset, Payload payload, std::string_view peer, int round);
  Status check(uint64_t offset, std::span<const std::byte> bytes, std::string_view peer, int round) {
    return check(offset, Payload(&bytes, 1), peer, round);
  }

 private:
  Status check_span(uint64_t offset, std::span<const std::byte> bytes, std::string_view peer, int round);
  const Layout& layout_;
  size_t entry_ = 0;
  std::byte carry_[8] = {};
  size_t carry_len_ = 0;
};

// Index of the first non-finite element of `n` elements of `dtype` at `p`,
// or n when all are finite (always n for integer dtypes).
size_t first_non_finite(DType dtype, const std::byte* p, size_t n);
// The same, on several threads when the run is ≥ 2 MiB (common/parallel.h).
size_t first_non_finite_parallel(DType dtype, const std::byte* p, size_t n);

// Wraps the round's aggregator: refuses an update whose sample count is out
// of bounds before it is opened, and checks every chunk's values before the
// aggregator folds it. A refused update fails with kRejected: the transport
// counts the client as failed for the round (a stream refused after part of
// it folded makes the round be redone without that client).
class CheckedUpdateOpener final : public UpdateOpener {
 public:
  CheckedUpdateOpener(UpdateOpener& inner, const Layout& layout, int round, UpdateLimits limits)
      : inner_(inner), layout_(layout), round_(round), limits_(limits) {}
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override;
  StatusOr<std::unique_ptr<UpdateStream>> open_local_update(const std::string& client_id, double sample_count) override;

 private:
  StatusOr<std::unique_ptr<UpdateStream>> open_checked(const std::string& client_id, double sample_count, bool hashed);
  UpdateOpener& inner_;
  const Layout& layout_;
  int round_;
  UpdateLimits limits_;
};

}  // namespace memfl
