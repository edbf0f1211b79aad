// Partitions of a training set among virtual clients: IID, Dirichlet(alpha)
// label skew (Hsu et al. 2019), class shards (McMahan et al. 2017), and
// quantity skew with lognormal or power-law client sizes (IID labels), and
// by group (each label — a token set's source or topic — to one client). Every
// sample goes to exactly one client; each client then splits its indices into
// train and validation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

enum class PartitionStrategy { kIid, kDirichlet, kClassShards, kLognormal, kPowerLaw, kByGroup };

struct PartitionSpec {
  PartitionStrategy strategy = PartitionStrategy::kIid;
  int num_clients = 1;
  double alpha = 0.5;         // Dirichlet concentration
  int shards_per_client = 2;  // class shards
  uint64_t seed = 0;
  double sigma = 1.0;        // lognormal client sizes: σ of log(size)
  double power_law_a = 1.5;  // power-law (Pareto) client sizes: tail exponent
};

struct ClientPartition {
  std::vector<uint32_t> train;  // indices into the training set
  std::vector<uint32_t> val;
};

// Assigns indices 0..labels.size()-1 to clients. Fails when a client would get
// no sample (too many clients for the data). kByGroup: every sample of label
// (group) g goes to client g mod num_clients, so groups are dealt round-robin
// in their order; fewer groups than clients is refused naming both counts.
StatusOr<std::vector<std::vector<uint32_t>>> partition_indices(const std::vector<uint8_t>& labels, int num_classes,
                                                               const PartitionSpec& spec);

// Splits each client's indices into train and validation (the last
// `val_ratio` of a seeded shuffle; at least one training sample remains).
std::vector<ClientPartition> split_train_val(std::vector<std::vector<uint32_t>> parts, double val_ratio, uint64_t seed);

std::string_view partition_strategy_name(PartitionStrategy s);

}  // namespace memfl
