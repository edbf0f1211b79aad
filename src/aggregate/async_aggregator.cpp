#include "aggregate/async_aggregator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensor/dtype.h"

namespace memfl {

double StalenessFn::operator()(int64_t staleness) const {
  const double u = static_cast<double>(std::max<int64_t>(0, staleness));
  switch (kind) {
    case StalenessKind::kConstant:
      return 1.0;
    case StalenessKind::kPolynomial:
      return std::pow(u + 1.0, -a);
    case StalenessKind::kHinge:
      return u <= b ? 1.0 : 1.0 / (a * (u - b) + 1.0);
  }
  return 1.0;
}

StatusOr<StalenessFn> make_staleness_fn(const std::string& name, double a, double b) {
  StalenessFn f;
  f.a = a;
  f.b = b;
  if (name == "constant") {
    f.kind = StalenessKind::kConstant;
  } else if (name == "polynomial") {
    f.kind = StalenessKind::kPolynomial;
  } else if (name == "hinge") {
    f.kind = StalenessKind::kHinge;
  } else {
    return invalid_argument(
        "server_configs.aggregator_kwargs.staleness_fn: unknown '{}'; known: constant, polynomial, hinge", name);
  }
  return f;
}

StatusOr<std::unique_ptr<AsyncAggregator>> AsyncAggregator::create(
    const std::string& name, const AsyncAggregatorOptions& options, const Layout& layout,
    const std::function<StatusOr<Arena>(size_t bytes)>& make_state_arena) {
  AsyncAggregatorOptions o = options;
  if (name == "FedAsyncAggregator") {
    o.rule = AsyncRule::kFedAsync;
  } else if (name == "FedBuffAggregator") {
    o.rule = AsyncRule::kFedBuff;
  } else if (name == "FedCompassAggregator") {
    o.rule = AsyncRule::kFedCompass;
  } else {
    return invalid_argument(
        "server_configs.aggregator: {} is not an asynchronous aggregator (FedAsyncAggregator, FedBuffAggregator, "
        "FedCompassAggregator)",
        name);
  }
  if (o.rule == AsyncRule::kFedBuff && o.buffer_size < 1)
    return invalid_argument("server_configs.aggregator_kwargs.K: {} (FedBuff's buffer) must be at least 1",
                            o.buffer_size);
  for (const auto& e : layout.entries()) {
    if (dtype_is_float(e.dtype) && e.dtype != DType::kF32) {
      return invalid_argument(
          "server_configs.aggregator: {} combines f32 tensors only, and tensor '{}' is {}; use an f32 model", name,
          e.name, dtype_name(e.dtype));
    }
  }
  Arena step;
  if (o.rule == AsyncRule::kFedBuff) {
    MEMFL_ASSIGN_OR_RETURN(step, make_state_arena(layout.total_bytes()));
    std::memset(step.data(), 0, step.size());
  }
  return std::unique_ptr<AsyncAggregator>(new AsyncAggregator(name, o, layout, std::move(step)));
}

// The group's terms Σ α_i (y_i − x) (or −Σ α_i g_i), block by block, with x
// the model before the group: added to x, or to FedBuff's Δ.
Status AsyncAggregator::fold(Arena& global, std::span<const AsyncContribution> group, bool into_step) {
  const size_t block = std::max<size_t>(1, options_.block_elements);
  std::vector<float> y(block), acc(block);
  std::vector<double> alphas;
  for (const auto& c : group) alphas.push_back(alpha_t(c));
  for (const auto& e : layout_.entries()) {
    if (e.dtype != DType::kF32) {
      // Counters: the newest contribution's value.
      MEMFL_RETURN_IF_ERROR(group.back().update->read(e.offset, global.bytes(e.offset, e.nbytes())));
      continue;
    }
    float* x = global.as<float>(e.offset);
    float* d = into_step ? step_.as<float>(e.offset) : nullptr;
    const size_t n = e.numel();
    for (size_t at = 0; at < n; at += block) {
      const size_t len = std::min(block, n - at);
      std::fill_n(acc.data(), len, 0.0f);
      for (size_t i = 0; i < group.size(); ++i) {
        MEMFL_RETURN_IF_ERROR(
            group[i].update->read(e.offset + at * sizeof(float), std::as_writable_bytes(std::span(y.data(), len))));
        const float a = static_cast<float>(alphas[i]);
        if (options_.gradient_based) {
          for (size_t k = 0; k < len; ++k) acc[k] -= a * y[k];
        } else {
          for (size_t k = 0; k < len; ++k) acc[k] += a * (y[k] - x[at + k]);
        }
      }
      float* target = d != nullptr ? d + at : x + at;
      for (size_t k = 0; k < len; ++k) target[k] += acc[k];
    }
  }
  return Status::Ok();
}

void AsyncAggregator::flush(Arena& global) {
  for (const auto& e : layout_.entries()) {
    if (e.dtype != DType::kF32) continue;
    float* x = global.as<float>(e.offset);
    float* d = step_.as<float>(e.offset);
    for (size_t k = 0; k < e.numel(); ++k) {
      x[k] += d[k];
      d[k] = 0.0f;
    }
  }
  buffered_ = 0;
}

StatusOr<bool> AsyncAggregator::apply(Arena& global, std::span<const AsyncContribution> group) {
  if (group.empty()) return false;
  if (global.size() < layout_.total_bytes())
    return invalid_argument("{}: global arena of {} bytes, model of {}", name_, global.size(), layout_.total_bytes());
  if (options_.rule != AsyncRule::kFedBuff) {
    if (options_.rule == AsyncRule::kFedAsync && group.size() != 1)
      return invalid_argument("FedAsyncAggregator applies one update at a time, not {}", group.size());
    MEMFL_RETURN_IF_ERROR(fold(global, group, /*into_step=*/false));
    return true;
  }
  // FedBuff: each update joins Δ against the model as it is now (APPFL's
  // rule); the K-th moves the model.
  bool moved = false;
  for (const auto& c : group) {
    MEMFL_RETURN_IF_ERROR(fold(global, std::span(&c, 1), /*into_step=*/true));
    if (++buffered_ == options_.buffer_size) {
      flush(global);
      moved = true;
    }
  }
  return moved;
}

Status write_gradient(const Layout& layout, const Arena& base, const Arena& trained, size_t block,
                      const std::function<Status(size_t offset, std::span<const std::byte>)>& write) {
  std::vector<float> g(std::max<size_t>(1, block));
  for (const auto& e : layout.entries()) {
    if (e.dtype != DType::kF32) {
      MEMFL_RETURN_IF_ERROR(write(e.offset, trained.bytes(e.offset, e.nbytes())));
      continue;
    }
    const float* x = base.as<float>(e.offset);
    const float* y = trained.as<float>(e.offset);
    for (size_t at = 0; at < e.numel(); at += g.size()) {
      const size_t len = std::min(g.size(), e.numel() - at);
      for (size_t k = 0; k < len; ++k) g[k] = x[at + k] - y[at + k];
      MEMFL_RETURN_IF_ERROR(write(e.offset + at * sizeof(float), std::as_bytes(std::span(g.data(), len))));
    }
  }
  return Status::Ok();
}

}  // namespace memfl
