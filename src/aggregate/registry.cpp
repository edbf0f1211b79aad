#include "aggregate/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace memfl {

const std::vector<AggregatorInfo>& aggregators() {
  static const std::vector<AggregatorInfo> known = {
      {"FedAvgAggregator", "weighted mean of client models (McMahan et al. 2017), streamed chunk by chunk"},
  };
  return known;
}

std::vector<std::string> aggregator_names() {
  std::vector<std::string> names;
  for (const auto& a : aggregators()) names.push_back(a.name);
  return names;
}

StatusOr<std::unique_ptr<Aggregator>> make_aggregator(const std::string& name, const AggregatorContext& ctx) {
  if (name != "FedAvgAggregator") {
    return invalid_argument("server_configs.aggregator: unknown aggregator '{}'; known: {}", name,
                            fmt::join(aggregator_names(), ", "));
  }
  const Layout& layout = *ctx.layout;
  // FedAvg's state: in the global arena when the sum can share its bytes (f32
  // and i64 entries, or a running mean in the model's dtype), else an f32/f64
  // sum of its own.
  if (ctx.in_place != nullptr &&
      (ctx.accumulation == Accumulation::kRunningMean || FedAvgAggregator::can_sum_in_place(layout))) {
    return std::unique_ptr<Aggregator>(
        std::make_unique<FedAvgAggregator>(layout, ctx.weights, *ctx.in_place, ctx.accumulation));
  }
  MEMFL_ASSIGN_OR_RETURN(Arena sum, ctx.make_state_arena(FedAvgAggregator::sum_bytes(layout)));
  return std::unique_ptr<Aggregator>(std::make_unique<FedAvgAggregator>(layout, ctx.weights, std::move(sum)));
}

}  // namespace memfl
