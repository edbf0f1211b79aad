#include "aggregate/registry.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <utility>

namespace memfl {

const std::vector<AggregatorInfo>& aggregators() {
  static const std::vector<AggregatorInfo> known = {
      {"FedAvgAggregator", "weighted mean of client models (McMahan et al. 2017), streamed chunk by chunk"},
      {"FedAvgMAggregator", "FedAvg with server momentum (Hsu et al. 2019): m = b1 m + D, x += lr m"},
      {"FedAdagradAggregator", "server Adagrad on the pseudo-gradient D = mean - x (Reddi et al. 2021)"},
      {"FedAdamAggregator", "server Adam on the pseudo-gradient, no bias correction (Reddi et al. 2021, as APPFL)"},
      {"FedYogiAggregator", "server Yogi on the pseudo-gradient (Reddi et al. 2021)"},
      // Asynchronous (aggregate/async_aggregator.h): under AsyncScheduler or
      // CompassScheduler, driven by server/async_core.h.
      {"FedAsyncAggregator", "each update as it arrives, weighted by its staleness (Xie et al. 2019)"},
      {"FedBuffAggregator", "buffers K updates, then moves the model (Nguyen et al. 2022)"},
      {"FedCompassAggregator", "arrival groups planned by client speed (Li et al. 2023)"},
  };
  return known;
}

std::vector<std::string> aggregator_names() {
  std::vector<std::string> names;
  for (const auto& a : aggregators()) names.push_back(a.name);
  return names;
}

namespace {
StatusOr<std::unique_ptr<Aggregator>> make_fedavg(const AggregatorContext& ctx);
}  // namespace

StatusOr<std::unique_ptr<Aggregator>> make_aggregator(const std::string& name, const AggregatorContext& ctx) {
  if (name == "FedAvgAggregator") return make_fedavg(ctx);
  const std::pair<const char*, ServerOptKind> optimizers[] = {{"FedAvgMAggregator", ServerOptKind::kAvgM},
                                                              {"FedAdagradAggregator", ServerOptKind::kAdagrad},
                                                              {"FedAdamAggregator", ServerOptKind::kAdam},
                                                              {"FedYogiAggregator", ServerOptKind::kYogi}};
  for (const auto& [opt_name, kind] : optimizers) {
    if (name != opt_name) continue;
    // The step is f32; a bf16/f16 tensor would silently take FedAvg's mean.
    for (const auto& e : ctx.layout->entries()) {
      if (dtype_is_float(e.dtype) && e.dtype != DType::kF32) {
        return invalid_argument(
            "server_configs.aggregator: {} steps f32 tensors only, and tensor '{}' is {}; use FedAvgAggregator or "
            "an f32 model",
            name, e.name, dtype_name(e.dtype));
      }
    }
    if (ctx.previous_model.empty())
      return invalid_argument("server_configs.aggregator: {} needs the server's checkpoint", name);
    MEMFL_ASSIGN_OR_RETURN(auto inner, make_fedavg(ctx));
    // Moments as f32 at the model's offsets: sized as the model (entries of
    // other dtypes leave their bytes unused).
    const size_t bytes = ctx.layout->total_bytes();
    MEMFL_ASSIGN_OR_RETURN(Arena m, ctx.make_state_arena(bytes));
    Arena v;
    if (kind != ServerOptKind::kAvgM) {
      MEMFL_ASSIGN_OR_RETURN(v, ctx.make_state_arena(bytes));
    }
    std::memset(m.data(), 0, m.size());
    if (v.size() > 0) std::memset(v.data(), 0, v.size());
    return std::unique_ptr<Aggregator>(std::make_unique<ServerOptAggregator>(
        name, kind, ctx.server_opt, std::move(inner), *ctx.layout, std::move(m), std::move(v), ctx.previous_model));
  }
  if (name == "FedAsyncAggregator" || name == "FedBuffAggregator" || name == "FedCompassAggregator") {
    return invalid_argument(
        "server_configs.aggregator: {} is asynchronous: it runs under AsyncScheduler or CompassScheduler "
        "(server_configs.scheduler), not in rounds",
        name);
  }
  return invalid_argument("server_configs.aggregator: unknown aggregator '{}'; known: {}", name,
                          fmt::join(aggregator_names(), ", "));
}

namespace {
StatusOr<std::unique_ptr<Aggregator>> make_fedavg(const AggregatorContext& ctx) {
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
}  // namespace

}  // namespace memfl
