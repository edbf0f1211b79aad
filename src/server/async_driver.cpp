#include "server/async_driver.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <queue>
#include <random>

#include <spdlog/spdlog.h>

#include "comm/spool_update.h"
#include "comm/update_check.h"
#include "server/async_common.h"
#include "server/async_core.h"

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

}  // namespace

struct AsyncDriver::Impl {
  Impl(const ExperimentConfig& c, const Layout& l, Arena& g, AsyncAggregator& a, MemorySampler& s, AsyncDriverOptions o)
      : cfg(c),
        layout(l),
        global(g),
        agg(a),
        sampler(s),
        opts(std::move(o)),
        core(c, l, g, a, opts.weights, [this](AsyncTripRecord& t) { slots.release(t); }) {}

  const ExperimentConfig& cfg;
  const Layout& layout;
  Arena& global;
  AsyncAggregator& agg;
  MemorySampler& sampler;
  AsyncDriverOptions opts;
  AsyncServerCore core;
  AsyncMetricsLog metrics{sampler};

  SpoolSlots slots{"asynchronous update spool", layout.total_bytes()};
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  uint64_t seq = 0;
  std::map<int, AsyncTripRecord> in_flight;
  double now = 0;

  // Trains the client from the model as it is now and puts its update in
  // the spool; it arrives local steps × its time per step later.
  Status dispatch(int client, int local_steps) {
    AsyncTrip t;
    t.version = core.version();
    auto trained_or = opts.train(client, local_steps, global, &t);
    // A refused update (a non-finite loss, or values: checked here as every
    // transport checks what it receives) is that client's alone: it is out
    // for the rest of the run and the others go on.
    Status refused = trained_or.ok() ? Status::Ok() : trained_or.status();
    if (refused.ok()) {
      FiniteValueCheck values(layout);
      refused = values.check(0, (*trained_or)->bytes(0, layout.total_bytes()), client_id(client), -1);
    }
    if (refused.code() == StatusCode::kRejected) {
      spdlog::warn("{}; client_{} is out for the rest of the run", refused.message(), client);
      return Status::Ok();
    }
    MEMFL_RETURN_IF_ERROR(refused);
    const Arena* trained = *trained_or;
    AsyncTripRecord trip;
    trip.client = client;
    const size_t slot = slots.take();
    trip.update = std::make_shared<SpoolSlotSource>(slots.spool(), slot, layout.total_bytes());
    trip.base_version = core.version();
    trip.dispatched_at = now;
    trip.local_steps = t.steps > 0 ? t.steps : std::max(1, local_steps);
    trip.train_loss = t.train_loss;
    trip.bytes_up = layout.total_bytes();  // in process an update is its bytes
    trip.arrived_at = now + static_cast<double>(trip.local_steps) * opts.step_time_s[static_cast<size_t>(client)];
    const uint64_t base = static_cast<uint64_t>(slot) * layout.total_bytes();
    if (!agg.options().gradient_based) {
      MEMFL_RETURN_IF_ERROR(slots.spool().write(base, trained->bytes(0, layout.total_bytes())));
    } else {
      // The change from its base model, g = x_base − y (what APPFL's clients
      // send with send_gradient); counters as they are.
      MEMFL_RETURN_IF_ERROR(
          write_gradient(layout, global, *trained, agg.options().block_elements,
                         [&](size_t off, std::span<const std::byte> b) { return slots.spool().write(base + off, b); }));
    }
    events.push({trip.arrived_at, 0, seq++, client});
    in_flight[client] = std::move(trip);
    return Status::Ok();
  }

  Status follow(const AsyncNext& next) {
    for (const auto& [when, g] : next.deadlines) events.push({when, 1, seq++, g});
    for (const auto& d : next.send) MEMFL_RETURN_IF_ERROR(dispatch(d.client, d.local_steps));
    return Status::Ok();
  }
};

AsyncDriver::AsyncDriver(const ExperimentConfig& cfg, const Layout& layout, Arena& global, AsyncAggregator& aggregator,
                         MemorySampler& sampler, AsyncDriverOptions opts)
    : impl_(std::make_unique<Impl>(cfg, layout, global, aggregator, sampler, std::move(opts))) {}

AsyncDriver::~AsyncDriver() = default;

const std::vector<RoundMetrics>& AsyncDriver::evaluations() const { return impl_->metrics.rows(); }
int64_t AsyncDriver::versions() const { return impl_->core.version(); }
double AsyncDriver::mean_staleness() const { return impl_->core.mean_staleness(); }
int64_t AsyncDriver::max_staleness() const { return impl_->core.max_staleness(); }

Status AsyncDriver::run() {
  Impl& s = *impl_;
  const ServerConfig& sc = s.cfg.server;
  const int n = sc.num_clients;
  if (static_cast<int>(s.opts.step_time_s.size()) != n || static_cast<int>(s.opts.weights.size()) != n)
    return invalid_argument("asynchronous driver: {} clients but {} speeds and {} weights", n,
                            s.opts.step_time_s.size(), s.opts.weights.size());
  MEMFL_RETURN_IF_ERROR(s.slots.open(s.cfg.memory.scratch_dir.empty() ? s.opts.run_dir : s.cfg.memory.scratch_dir));
  MEMFL_RETURN_IF_ERROR(s.core.open_log((fs::path(s.opts.run_dir) / "async_log.csv").string()));
  MEMFL_RETURN_IF_ERROR(s.metrics.open(s.opts.run_dir));

  const int64_t total = sc.num_global_epochs;
  const int64_t eval_every = async_eval_every(sc);
  int window_updates = 0;
  double window_loss = 0;

  // One metrics.csv row: the updates since the last, the model evaluated now.
  auto evaluate_window = [&](double clock) -> Status {
    const int64_t arrivals = s.core.arrivals();
    RoundMetrics m;
    m.round = static_cast<int>(s.metrics.rows().size()) + 1;
    m.clients = window_updates;
    m.train_loss = window_updates > 0 ? window_loss / window_updates : 0.0;
    if (s.opts.evaluate) {
      s.sampler.mark(m.round, "evaluate");
      auto ev2 = s.opts.evaluate(s.global);
      if (!ev2.ok()) return ev2.status().with_context(fmt::format("evaluation after {} updates", arrivals));
      m.test_loss = ev2->loss;
      m.test_accuracy = ev2->accuracy;
    }
    m.bytes_down = m.bytes_up = m.bytes_up_raw = static_cast<uint64_t>(window_updates) * s.layout.payload_bytes();
    m.bytes_moved = m.bytes_down + m.bytes_up;
    m.virtual_seconds = clock;
    MEMFL_RETURN_IF_ERROR(s.metrics.append(m));
    MEMFL_RETURN_IF_ERROR(s.core.flush_log());
    if (s.opts.on_eval) s.opts.on_eval(m);
    window_updates = 0;
    window_loss = 0;
    return Status::Ok();
  };

  s.sampler.mark(0, "train");
  for (int c = 0; c < n; ++c) MEMFL_RETURN_IF_ERROR(s.dispatch(c, s.core.start(c, 0.0)));
  while (s.core.arrivals() < total) {
    if (s.events.empty()) {
      return failed_precondition("asynchronous run: every client is out after {} of {} updates (each named above)",
                                 s.core.arrivals(), total);
    }
    const Event ev = s.events.top();
    if (sc.async_virtual_seconds > 0 && ev.time > sc.async_virtual_seconds) {
      // The time budget is spent: what has arrived counts, and the window
      // since the last evaluation gets one.
      if (window_updates > 0) MEMFL_RETURN_IF_ERROR(evaluate_window(sc.async_virtual_seconds));
      break;
    }
    s.events.pop();
    s.now = ev.time;
    if (ev.kind == 1) {
      MEMFL_ASSIGN_OR_RETURN(AsyncNext next, s.core.deadline(ev.id, s.now));
      MEMFL_RETURN_IF_ERROR(s.follow(next));
      continue;
    }
    AsyncTripRecord trip = std::move(s.in_flight.at(ev.id));
    s.in_flight.erase(ev.id);
    window_updates++;
    window_loss += trip.train_loss;
    s.sampler.mark(static_cast<int>(s.core.arrivals() + 1), "aggregate");
    MEMFL_ASSIGN_OR_RETURN(AsyncNext next, s.core.arrive(std::move(trip), s.now));
    MEMFL_RETURN_IF_ERROR(s.follow(next));

    const int64_t arrivals = s.core.arrivals();
    if (async_eval_due(arrivals, eval_every, total)) MEMFL_RETURN_IF_ERROR(evaluate_window(s.now));
  }
  return s.core.flush_log();
}

}  // namespace memfl
