#include "server/async_driver.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <queue>
#include <random>

#include <spdlog/spdlog.h>

#include "io/spool_file.h"
#include "schedule/compass.h"

namespace memfl {

namespace fs = std::filesystem;

std::vector<double> client_step_times(const ServerConfig& sc) {
  std::vector<double> out(static_cast<size_t>(sc.num_clients), sc.client_step_time_s);
  // One stream for the speeds, apart from selection and training seeds, so
  // every algorithm of a comparison meets the same clients.
  std::mt19937_64 rng(sc.seed ^ 0x5eed5bd5eedULL);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(1.0, sc.client_speed_max_ratio);
  for (auto& t : out) {
    if (sc.client_speed_distribution == "lognormal") {
      t = sc.client_step_time_s * std::exp(sc.client_speed_sigma * normal(rng));
    } else if (sc.client_speed_distribution == "uniform") {
      t = sc.client_step_time_s * uniform(rng);
    }
  }
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

// A client's update on its way: trained when sent off, waiting in the spool
// until it arrives (and, buffered, until it is applied).
struct Trip {
  int client = -1;
  size_t slot = 0;
  int64_t base_version = 0;
  double dispatched_at = 0, arrives_at = 0;
  int64_t local_steps = 0;
  double train_loss = 0;
  int64_t update = 0;  // arrival number, from 1
  std::string how;     // alone | group N | late | buffer
  int64_t staleness = 0;
  double alpha = 0;
};

struct Event {
  double time;
  int kind;  // 0: an update arrives; 1: a FedCompass group's latest arrival time
  uint64_t seq;
  int id;  // client or group
  bool operator>(const Event& o) const {
    if (time != o.time) return time > o.time;
    if (kind != o.kind) return kind > o.kind;
    return seq > o.seq;
  }
};

class SpoolSource final : public UpdateSource {
 public:
  SpoolSource(const SpoolFile& spool, uint64_t base) : spool_(spool), base_(base) {}
  Status read(size_t offset, std::span<std::byte> into) const override { return spool_.read(base_ + offset, into); }

 private:
  const SpoolFile& spool_;
  uint64_t base_;
};

}  // namespace

struct AsyncDriver::Impl {
  Impl(const ExperimentConfig& c, const Layout& l, Arena& g, AsyncAggregator& a, MemorySampler& s, AsyncDriverOptions o)
      : cfg(c),
        layout(l),
        global(g),
        agg(a),
        sampler(s),
        opts(std::move(o)),
        planner(CompassOptions{c.server.max_local_steps, c.server.min_local_steps, c.server.speed_momentum,
                               c.server.latest_time_factor}) {}

  const ExperimentConfig& cfg;
  const Layout& layout;
  Arena& global;
  AsyncAggregator& agg;
  MemorySampler& sampler;
  AsyncDriverOptions opts;
  CompassPlanner planner;
  bool compass = false;

  SpoolFile spool{"asynchronous update spool"};
  std::vector<size_t> free_slots;
  size_t next_slot = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  uint64_t seq = 0;
  std::map<int, Trip> in_flight;
  std::vector<Trip> general_buffer, fedbuff_pending;
  std::map<int, std::vector<Trip>> group_buffer;
  double now = 0;
  int64_t arrivals = 0;
  FILE* log = nullptr;
  double staleness_sum = 0;
  int64_t applied = 0;

  size_t alloc_slot() {
    if (!free_slots.empty()) {
      const size_t s = free_slots.back();
      free_slots.pop_back();
      return s;
    }
    return next_slot++;
  }
  void free_slot(size_t s) {
    spool.release(static_cast<uint64_t>(s) * layout.total_bytes(), layout.total_bytes());
    free_slots.push_back(s);
  }

  // Trains the client from the model as it is now and puts its update in
  // the spool; it arrives local steps × its time per step later.
  Status dispatch(int client, int local_steps, int64_t version) {
    AsyncTrip t;
    MEMFL_ASSIGN_OR_RETURN(const Arena* trained, opts.train(client, local_steps, global, &t));
    Trip trip;
    trip.client = client;
    trip.slot = alloc_slot();
    trip.base_version = version;
    trip.dispatched_at = now;
    trip.local_steps = t.steps > 0 ? t.steps : std::max(1, local_steps);
    trip.train_loss = t.train_loss;
    trip.arrives_at = now + static_cast<double>(trip.local_steps) * opts.step_time_s[static_cast<size_t>(client)];
    const uint64_t base = static_cast<uint64_t>(trip.slot) * layout.total_bytes();
    if (!agg.options().gradient_based) {
      MEMFL_RETURN_IF_ERROR(spool.write(base, trained->bytes(0, layout.total_bytes())));
    } else {
      // The change from its base model, g = x_base − y (what APPFL's clients
      // send with send_gradient); counters as they are.
      std::vector<float> g(agg.options().block_elements);
      for (const auto& e : layout.entries()) {
        if (e.dtype != DType::kF32) {
          MEMFL_RETURN_IF_ERROR(spool.write(base + e.offset, trained->bytes(e.offset, e.nbytes())));
          continue;
        }
        const float* x = global.as<float>(e.offset);
        const float* y = trained->as<float>(e.offset);
        for (size_t at = 0; at < e.numel(); at += g.size()) {
          const size_t len = std::min(g.size(), e.numel() - at);
          for (size_t k = 0; k < len; ++k) g[k] = x[at + k] - y[at + k];
          MEMFL_RETURN_IF_ERROR(
              spool.write(base + e.offset + at * sizeof(float), std::as_bytes(std::span(g.data(), len))));
        }
      }
    }
    events.push({trip.arrives_at, 0, seq++, client});
    in_flight[client] = std::move(trip);
    return Status::Ok();
  }

  void write_log(const Trip& t, int64_t version_after) {
    std::fprintf(log, "%lld,%d,%lld,%lld,%.17g,%lld,%.9f,%.9f,%.9f,%lld,%s\n", static_cast<long long>(t.update),
                 t.client, static_cast<long long>(t.base_version), static_cast<long long>(t.staleness), t.alpha,
                 static_cast<long long>(t.local_steps), t.dispatched_at, t.arrives_at, now,
                 static_cast<long long>(version_after), t.how.c_str());
  }

  // Applies trips as one group (FedAsync and a lone FedCompass arrival: one).
  StatusOr<bool> apply(std::vector<Trip>& trips, int64_t version) {
    std::vector<SpoolSource> sources;
    sources.reserve(trips.size());
    std::vector<AsyncContribution> group;
    for (auto& t : trips) {
      sources.emplace_back(spool, static_cast<uint64_t>(t.slot) * layout.total_bytes());
      t.staleness = version - t.base_version;
      group.push_back({&sources.back(), opts.weights[static_cast<size_t>(t.client)], t.staleness});
      t.alpha = agg.alpha_t(group.back());
      staleness_sum += static_cast<double>(t.staleness);
      applied++;
    }
    return agg.apply(global, group);
  }
};

AsyncDriver::AsyncDriver(const ExperimentConfig& cfg, const Layout& layout, Arena& global, AsyncAggregator& aggregator,
                         MemorySampler& sampler, AsyncDriverOptions opts)
    : impl_(std::make_unique<Impl>(cfg, layout, global, aggregator, sampler, std::move(opts))) {}

AsyncDriver::~AsyncDriver() {
  if (impl_ && impl_->log != nullptr) std::fclose(impl_->log);
}

double AsyncDriver::mean_staleness() const {
  return impl_->applied > 0 ? impl_->staleness_sum / static_cast<double>(impl_->applied) : 0.0;
}

Status AsyncDriver::run() {
  Impl& s = *impl_;
  const ServerConfig& sc = s.cfg.server;
  const int n = sc.num_clients;
  if (static_cast<int>(s.opts.step_time_s.size()) != n || static_cast<int>(s.opts.weights.size()) != n)
    return invalid_argument("asynchronous driver: {} clients but {} speeds and {} weights", n,
                            s.opts.step_time_s.size(), s.opts.weights.size());
  s.compass = sc.scheduler == "CompassScheduler";
  MEMFL_RETURN_IF_ERROR(s.spool.open(s.cfg.memory.scratch_dir.empty() ? s.opts.run_dir : s.cfg.memory.scratch_dir));
  const std::string log_path = (fs::path(s.opts.run_dir) / "async_log.csv").string();
  s.log = std::fopen(log_path.c_str(), "w");
  if (s.log == nullptr) return not_found("cannot write {}: {}", log_path, std::strerror(errno));
  std::fputs(
      "update,client,base_version,staleness,alpha,local_steps,dispatched_at,arrived_at,applied_at,version_after,how\n",
      s.log);
  MEMFL_ASSIGN_OR_RETURN(auto metrics, MetricsWriter::open((fs::path(s.opts.run_dir) / "metrics.csv").string()));

  const int64_t total = sc.num_global_epochs;
  const int64_t eval_every = sc.async_eval_every > 0 ? sc.async_eval_every : n;
  auto t_window = Clock::now();
  int window_updates = 0;
  double window_loss = 0;

  // Sends a client off again with its next local steps (FedCompass: a group
  // and its deadline).
  auto send_off = [&](int c) -> Status {
    if (!s.compass) return s.dispatch(c, 0, version_);
    std::optional<int> opened;
    const int steps = s.planner.assign(c, s.now, &opened);
    if (opened) s.events.push({s.planner.latest_arrival_time(*opened), 1, s.seq++, *opened});
    return s.dispatch(c, steps, version_);
  };
  auto group_aggregate = [&](int g) -> Status {
    auto it = s.group_buffer.find(g);
    if (it == s.group_buffer.end() || it->second.empty()) return Status::Ok();
    std::vector<Trip> trips = std::move(s.general_buffer);
    s.general_buffer.clear();
    for (auto& t : it->second) trips.push_back(std::move(t));
    s.group_buffer.erase(it);
    std::sort(trips.begin(), trips.end(), [](const Trip& a, const Trip& b) { return a.client < b.client; });
    MEMFL_RETURN_IF_ERROR(s.apply(trips, version_).status());
    ++version_;
    for (const auto& t : trips) {
      max_staleness_ = std::max(max_staleness_, t.staleness);
      s.write_log(t, version_);
      s.free_slot(t.slot);
    }
    for (int c : s.planner.close_group(g)) MEMFL_RETURN_IF_ERROR(send_off(c));
    return Status::Ok();
  };

  s.sampler.mark(0, "train");
  for (int c = 0; c < n; ++c) {
    if (s.compass) {
      s.planner.start(c, 0.0);
      MEMFL_RETURN_IF_ERROR(s.dispatch(c, sc.max_local_steps, 0));
    } else {
      MEMFL_RETURN_IF_ERROR(s.dispatch(c, 0, 0));
    }
  }
  while (s.arrivals < total) {
    if (s.events.empty()) return internal_error("asynchronous driver: no client is on its way");
    const Event ev = s.events.top();
    s.events.pop();
    s.now = ev.time;
    if (ev.kind == 1) {
      MEMFL_RETURN_IF_ERROR(group_aggregate(ev.id));
      continue;
    }
    const int c = ev.id;
    Trip trip = std::move(s.in_flight.at(c));
    s.in_flight.erase(c);
    trip.update = ++s.arrivals;
    window_updates++;
    window_loss += trip.train_loss;
    s.sampler.mark(static_cast<int>(trip.update), "aggregate");
    if (!s.compass) {
      std::vector<Trip> one{std::move(trip)};
      MEMFL_ASSIGN_OR_RETURN(const bool moved, s.apply(one, version_));
      max_staleness_ = std::max(max_staleness_, one[0].staleness);
      // FedBuff's Δ holds the update now: its spool slot goes back at once.
      s.free_slot(one[0].slot);
      if (s.agg.options().rule == AsyncRule::kFedBuff) {
        one[0].how = "buffer";
        s.fedbuff_pending.push_back(std::move(one[0]));
        if (moved) {
          ++version_;
          for (const auto& t : s.fedbuff_pending) s.write_log(t, version_);
          s.fedbuff_pending.clear();
        }
      } else {
        ++version_;
        one[0].how = "alone";
        s.write_log(one[0], version_);
      }
      MEMFL_RETURN_IF_ERROR(send_off(c));
    } else {
      s.planner.observe_arrival(c, s.now);
      const int g = s.planner.group_of(c);
      if (g < 0) {
        // Its first arrival (or its group is gone): applied alone.
        trip.how = "alone";
        std::vector<Trip> one{std::move(trip)};
        MEMFL_RETURN_IF_ERROR(s.apply(one, version_).status());
        ++version_;
        max_staleness_ = std::max(max_staleness_, one[0].staleness);
        s.write_log(one[0], version_);
        s.free_slot(one[0].slot);
        MEMFL_RETURN_IF_ERROR(send_off(c));
      } else if (s.planner.is_late(g, s.now)) {
        // Past its group's latest arrival: it waits in the general buffer
        // for the next group, and goes off again at once.
        s.planner.leave(c, g);
        trip.how = "late";
        s.general_buffer.push_back(std::move(trip));
        MEMFL_RETURN_IF_ERROR(send_off(c));
      } else {
        trip.how = fmt::format("group {}", g);
        const bool all_in = s.planner.arrive(c, g);
        s.group_buffer[g].push_back(std::move(trip));
        if (all_in) MEMFL_RETURN_IF_ERROR(group_aggregate(g));
      }
    }

    if (s.arrivals % eval_every == 0 || s.arrivals == total) {
      RoundMetrics m;
      m.round = static_cast<int>(evals_.size()) + 1;
      m.clients = window_updates;
      m.train_loss = window_updates > 0 ? window_loss / window_updates : 0.0;
      if (s.opts.evaluate) {
        s.sampler.mark(m.round, "evaluate");
        auto ev2 = s.opts.evaluate(s.global);
        if (!ev2.ok()) return ev2.status().with_context(fmt::format("evaluation after {} updates", s.arrivals));
        m.test_loss = ev2->loss;
        m.test_accuracy = ev2->accuracy;
      }
      m.bytes_down = m.bytes_up = static_cast<uint64_t>(window_updates) * s.layout.payload_bytes();
      m.bytes_moved = m.bytes_down + m.bytes_up;
      m.round_seconds = std::chrono::duration<double>(Clock::now() - t_window).count();
      m.virtual_seconds = s.now;
      m.rss_bytes = read_rss_bytes();
      m.peak_rss_bytes = s.sampler.peak_rss();
      m.threads = count_threads();
      m.open_fds = count_open_fds();
      MEMFL_RETURN_IF_ERROR(metrics->append(m));
      std::fflush(s.log);
      evals_.push_back(m);
      if (s.opts.on_eval) s.opts.on_eval(m);
      t_window = Clock::now();
      window_updates = 0;
      window_loss = 0;
    }
  }
  if (std::fflush(s.log) != 0) return internal_error("writing {} failed: {}", log_path, std::strerror(errno));
  return Status::Ok();
}

}  // namespace memfl
