#include "data/partition.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace memfl {

std::string_view partition_strategy_name(PartitionStrategy s) {
  switch (s) {
    case PartitionStrategy::kIid:
      return "iid";
    case PartitionStrategy::kDirichlet:
      return "dirichlet";
    case PartitionStrategy::kClassShards:
      return "class_shards";
    case PartitionStrategy::kLognormal:
      return "lognormal";
    case PartitionStrategy::kPowerLaw:
      return "power_law";
    case PartitionStrategy::kByGroup:
      return "by_group";
  }
  return "?";
}

StatusOr<std::vector<std::vector<uint32_t>>> partition_indices(const std::vector<uint8_t>& labels, int num_classes,
                                                               const PartitionSpec& spec) {
  const size_t n = labels.size();
  const auto k = static_cast<size_t>(spec.num_clients);
  if (spec.num_clients < 1) return invalid_argument("num_clients must be at least 1, got {}", spec.num_clients);
  if (n < k) return invalid_argument("{} training samples cannot be split among {} clients", n, k);
  std::mt19937_64 rng(spec.seed);
  std::vector<std::vector<uint32_t>> parts(k);

  switch (spec.strategy) {
    case PartitionStrategy::kIid: {
      std::vector<uint32_t> idx(n);
      std::iota(idx.begin(), idx.end(), 0u);
      std::shuffle(idx.begin(), idx.end(), rng);
      for (size_t c = 0; c < k; ++c) {
        const size_t b = c * n / k, e = (c + 1) * n / k;
        parts[c].assign(idx.begin() + static_cast<ptrdiff_t>(b), idx.begin() + static_cast<ptrdiff_t>(e));
      }
      break;
    }
    case PartitionStrategy::kDirichlet: {
      if (!(spec.alpha > 0)) return invalid_argument("dirichlet alpha must be > 0, got {}", spec.alpha);
      std::vector<std::vector<uint32_t>> by_class(static_cast<size_t>(num_classes));
      for (size_t i = 0; i < n; ++i) by_class[labels[i]].push_back(static_cast<uint32_t>(i));
      std::gamma_distribution<double> gamma(spec.alpha, 1.0);
      for (auto& cls : by_class) {
        std::shuffle(cls.begin(), cls.end(), rng);
        // Proportions for this class across clients ~ Dir(alpha).
        std::vector<double> p(k);
        double total = 0;
        for (auto& v : p) total += (v = gamma(rng));
        if (total <= 0) {  // all draws underflowed (tiny alpha): give the class to one client
          std::fill(p.begin(), p.end(), 0.0);
          p[std::uniform_int_distribution<size_t>(0, k - 1)(rng)] = 1.0;
          total = 1.0;
        }
        size_t start = 0;
        double cum = 0;
        for (size_t c = 0; c < k; ++c) {
          cum += p[c] / total;
          size_t end = c + 1 == k ? cls.size() : std::min(cls.size(), static_cast<size_t>(cum * cls.size() + 0.5));
          end = std::max(end, start);
          parts[c].insert(parts[c].end(), cls.begin() + static_cast<ptrdiff_t>(start),
                          cls.begin() + static_cast<ptrdiff_t>(end));
          start = end;
        }
      }
      // A client with no sample cannot train; move one from the largest.
      for (auto& p : parts) {
        if (!p.empty()) continue;
        auto largest = std::max_element(parts.begin(), parts.end(),
                                        [](const auto& a, const auto& b) { return a.size() < b.size(); });
        if (largest->size() < 2) return invalid_argument("dirichlet partition left a client without samples");
        p.push_back(largest->back());
        largest->pop_back();
      }
      break;
    }
    case PartitionStrategy::kLognormal:
    case PartitionStrategy::kPowerLaw: {
      // Client sizes drawn from the distribution, scaled to n (each ≥ 1),
      // then a shuffled index list cut at those sizes.
      std::vector<double> w(k);
      std::lognormal_distribution<double> lognormal(0.0, spec.sigma);
      std::uniform_real_distribution<double> u(1e-9, 1.0);
      for (auto& v : w) {
        v = spec.strategy == PartitionStrategy::kLognormal ? lognormal(rng) : std::pow(u(rng), -1.0 / spec.power_law_a);
      }
      const double total = std::accumulate(w.begin(), w.end(), 0.0);
      std::vector<size_t> sizes(k, 1);
      size_t assigned = k;
      for (size_t c = 0; c < k; ++c) {
        const size_t extra = static_cast<size_t>(std::floor(w[c] / total * static_cast<double>(n - k)));
        sizes[c] += extra;
        assigned += extra;
      }
      for (size_t c = 0; assigned < n; c = (c + 1) % k, ++assigned) sizes[c]++;  // rounding remainder
      std::vector<uint32_t> idx(n);
      std::iota(idx.begin(), idx.end(), 0u);
      std::shuffle(idx.begin(), idx.end(), rng);
      size_t at = 0;
      for (size_t c = 0; c < k; ++c) {
        parts[c].assign(idx.begin() + static_cast<ptrdiff_t>(at), idx.begin() + static_cast<ptrdiff_t>(at + sizes[c]));
        at += sizes[c];
      }
      break;
    }
    case PartitionStrategy::kByGroup: {
      if (num_classes < spec.num_clients) {
        return invalid_argument(
            "partition_strategy by_group: the data has {} group(s) for {} clients; each client "
            "needs a group of its own",
            num_classes, spec.num_clients);
      }
      for (size_t i = 0; i < n; ++i) parts[labels[i] % k].push_back(static_cast<uint32_t>(i));
      for (size_t c = 0; c < k; ++c) {
        if (parts[c].empty()) {
          return invalid_argument("partition_strategy by_group: client {} got no sample (its groups are empty)", c);
        }
      }
      break;
    }
    case PartitionStrategy::kClassShards: {
      if (spec.shards_per_client < 1) {
        return invalid_argument("shards_per_client must be at least 1, got {}", spec.shards_per_client);
      }
      const size_t num_shards = k * static_cast<size_t>(spec.shards_per_client);
      if (n < num_shards) return invalid_argument("{} samples cannot fill {} class shards", n, num_shards);
      std::vector<uint32_t> idx(n);
      std::iota(idx.begin(), idx.end(), 0u);
      std::shuffle(idx.begin(), idx.end(), rng);  // random order within a class
      std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return labels[a] < labels[b]; });
      std::vector<size_t> shard_ids(num_shards);
      std::iota(shard_ids.begin(), shard_ids.end(), size_t{0});
      std::shuffle(shard_ids.begin(), shard_ids.end(), rng);
      for (size_t s = 0; s < num_shards; ++s) {
        const size_t shard = shard_ids[s];
        const size_t b = shard * n / num_shards, e = (shard + 1) * n / num_shards;
        auto& dst = parts[s % k];
        dst.insert(dst.end(), idx.begin() + static_cast<ptrdiff_t>(b), idx.begin() + static_cast<ptrdiff_t>(e));
      }
      break;
    }
  }
  return parts;
}

std::vector<ClientPartition> split_train_val(std::vector<std::vector<uint32_t>> parts, double val_ratio,
                                             uint64_t seed) {
  std::vector<ClientPartition> out(parts.size());
  std::mt19937_64 rng(seed ^ 0x7a11da7eULL);
  for (size_t c = 0; c < parts.size(); ++c) {
    auto& p = parts[c];
    std::shuffle(p.begin(), p.end(), rng);
    size_t nval = static_cast<size_t>(static_cast<double>(p.size()) * val_ratio);
    if (nval >= p.size()) nval = p.size() - 1;
    out[c].val.assign(p.end() - static_cast<ptrdiff_t>(nval), p.end());
    p.resize(p.size() - nval);
    out[c].train = std::move(p);
  }
  return out;
}

}  // namespace memfl
