#include "server/async_core.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "client/client_work.h"
#include "live/live_metrics.h"

namespace memfl {

AsyncServerCore::AsyncServerCore(const ExperimentConfig& cfg, const Layout& layout, Arena& global,
                                 AsyncAggregator& aggregator, std::vector<double> weights,
                                 std::function<void(AsyncTripRecord&)> release)
    : cfg_(cfg),
      layout_(layout),
      global_(global),
      agg_(aggregator),
      weights_(std::move(weights)),
      release_(std::move(release)),
      compass_(cfg.server.scheduler == "CompassScheduler"),
      planner_(CompassOptions{cfg.server.max_local_steps, cfg.server.min_local_steps, cfg.server.speed_momentum,
                              cfg.server.latest_time_factor}) {
  live::set_planned(cfg.server.num_global_epochs, /*asynchronous=*/true);
}

AsyncServerCore::~AsyncServerCore() {
  if (log_ != nullptr) std::fclose(log_);
}

Status AsyncServerCore::open_log(const std::string& path) {
  log_path_ = path;
  log_ = std::fopen(path.c_str(), "w");
  if (log_ == nullptr) return not_found("cannot write {}: {}", path, std::strerror(errno));
  std::fputs(
      "update,client,base_version,staleness,alpha,local_steps,dispatched_at,arrived_at,applied_at,version_after,how\n",
      log_);
  return flush_log();
}

Status AsyncServerCore::flush_log() {
  if (log_ != nullptr && std::fflush(log_) != 0)
    return internal_error("writing {} failed: {}", log_path_, std::strerror(errno));
  return Status::Ok();
}

void AsyncServerCore::log_row(const AsyncTripRecord& t, double now) {
  live::async_applied(t.client, version_, t.staleness, t.bytes_up);  // every applied update passes here
  if (log_ == nullptr) return;
  // Full precision: the log is what a run is replayed from.
  std::fprintf(log_, "%lld,%d,%lld,%lld,%.17g,%lld,%.9f,%.9f,%.9f,%lld,%s\n", static_cast<long long>(t.update_number),
               t.client, static_cast<long long>(t.base_version), static_cast<long long>(t.staleness), t.alpha,
               static_cast<long long>(t.local_steps), t.dispatched_at, t.arrived_at, now,
               static_cast<long long>(version_), t.how.c_str());
  // Handed to the kernel at once (a row per update is cheap next to
  // applying one): a run killed in the middle keeps the log of what it applied.
  std::fflush(log_);
}

int AsyncServerCore::start(int client, double now) {
  if (!compass_) return 0;
  planner_.start(client, now);
  return cfg_.server.max_local_steps;
}

StatusOr<bool> AsyncServerCore::apply(std::vector<AsyncTripRecord>& trips) {
  std::vector<AsyncContribution> group;
  for (auto& t : trips) {
    t.staleness = version_ - t.base_version;
    group.push_back({t.update.get(), weights_.at(static_cast<size_t>(t.client)), t.staleness});
    t.alpha = agg_.alpha_t(group.back());
    staleness_sum_ += static_cast<double>(t.staleness);
    max_staleness_ = std::max(max_staleness_, t.staleness);
    applied_++;
  }
  return agg_.apply(global_, group);
}

void AsyncServerCore::send_off(int client, double now, AsyncNext* next) {
  if (!compass_) {
    next->send.push_back({client, 0});
    return;
  }
  std::optional<int> opened;
  const int steps = planner_.assign(client, now, &opened);
  if (opened) next->deadlines.emplace_back(planner_.latest_arrival_time(*opened), *opened);
  next->send.push_back({client, steps});
}

Status AsyncServerCore::group_aggregate(int group, double now, AsyncNext* next) {
  auto it = group_buffer_.find(group);
  if (it == group_buffer_.end() || it->second.empty()) return Status::Ok();
  // The late updates waiting in the general buffer join this group.
  std::vector<AsyncTripRecord> trips = std::exchange(general_buffer_, {});
  for (auto& t : it->second) trips.push_back(std::move(t));
  group_buffer_.erase(it);
  std::sort(trips.begin(), trips.end(), [](const AsyncTripRecord& a, const AsyncTripRecord& b) {
    return a.client != b.client ? a.client < b.client : a.update_number < b.update_number;
  });
  MEMFL_RETURN_IF_ERROR(apply(trips).status());
  ++version_;
  for (auto& t : trips) {
    log_row(t, now);
    release_(t);
  }
  for (int c : planner_.close_group(group)) send_off(c, now, next);
  return Status::Ok();
}

StatusOr<AsyncNext> AsyncServerCore::arrive(AsyncTripRecord trip, double now) {
  AsyncNext next;
  const int c = trip.client;
  trip.update_number = ++arrivals_;
  trip.arrived_at = now;
  if (!compass_) {
    std::vector<AsyncTripRecord> one;
    one.push_back(std::move(trip));
    MEMFL_ASSIGN_OR_RETURN(const bool moved, apply(one));
    AsyncTripRecord& t = one[0];
    if (agg_.options().rule == AsyncRule::kFedBuff) {
      // Its bytes are in the buffer's Δ now; the row waits for the flush.
      release_(t);
      t.how = "buffer";
      fedbuff_pending_.push_back(std::move(t));
      if (moved) {
        ++version_;
        for (auto& p : fedbuff_pending_) log_row(p, now);
        fedbuff_pending_.clear();
      }
    } else {
      ++version_;
      t.how = "alone";
      log_row(t, now);
      release_(t);
    }
    send_off(c, now, &next);
    return next;
  }
  planner_.observe_arrival(c, now);
  const int g = planner_.group_of(c);
  if (g < 0) {
    // Its first arrival (or its group is gone): applied alone.
    trip.how = "alone";
    std::vector<AsyncTripRecord> one;
    one.push_back(std::move(trip));
    MEMFL_RETURN_IF_ERROR(apply(one).status());
    ++version_;
    log_row(one[0], now);
    release_(one[0]);
    send_off(c, now, &next);
  } else if (planner_.is_late(g, now)) {
    // Past its group's latest arrival: it waits for the next group's
    // aggregation in the general buffer, and goes off again at once.
    planner_.leave(c, g);
    trip.how = "late";
    general_buffer_.push_back(std::move(trip));
    send_off(c, now, &next);
  } else {
    trip.how = fmt::format("group {}", g);
    const bool all_in = planner_.arrive(c, g);
    group_buffer_[g].push_back(std::move(trip));
    if (all_in) MEMFL_RETURN_IF_ERROR(group_aggregate(g, now, &next));
  }
  return next;
}

StatusOr<AsyncNext> AsyncServerCore::deadline(int group, double now) {
  AsyncNext next;
  MEMFL_RETURN_IF_ERROR(group_aggregate(group, now, &next));
  return next;
}

StatusOr<std::unique_ptr<AsyncAggregator>> make_async_aggregator(const ExperimentConfig& cfg, const Layout& layout,
                                                                 const std::string& run_dir) {
  const auto& sc = cfg.server;
  AsyncAggregatorOptions o;
  o.alpha = sc.alpha;
  MEMFL_ASSIGN_OR_RETURN(o.staleness, make_staleness_fn(sc.staleness_fn, sc.staleness_a, sc.staleness_b));
  o.buffer_size = sc.buffer_size;
  o.gradient_based = sc.gradient_based;
  return AsyncAggregator::create(sc.aggregator, o, layout, [&](size_t bytes) {
    return make_model_arena(cfg, bytes, run_dir, MemoryCategory::kAggregation);
  });
}

}  // namespace memfl
