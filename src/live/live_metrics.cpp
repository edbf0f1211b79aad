#include "live/live_metrics.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/run_dir.h"
#include "memory/ledger.h"
#include "memory/sampler.h"

namespace memfl::live {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct ClientRow {
  std::string state;  // selected | done | dropped | applied
  double last_seen_s = 0;
  int64_t rounds = 0;  // updates counted
  uint64_t bytes_down = 0, bytes_up = 0;
  int last_round = 0;
};

struct RoundRow {
  int round;
  int clients;
  double train_loss, train_accuracy, test_loss, test_accuracy, round_seconds;
  uint64_t bytes_moved;
  int64_t rss_bytes, peak_rss_bytes;
};

struct PhaseRow {
  double t_s;
  int round;
  std::string name;
};

// Everything lives in one object so reset_for_test() can rebuild it.
struct State {
  std::atomic<bool> enabled{false};
  std::atomic<bool> running{false};
  Clock::time_point t0 = Clock::now();
  std::atomic<int64_t> current_round{0}, rounds_completed{0}, planned{0};
  std::atomic<bool> asynchronous{false};
  std::atomic<int64_t> async_version{0}, async_updates{0};
  std::atomic<int64_t> clients_selected{0}, clients_dropped_total{0}, clients_updates_total{0};
  std::atomic<int64_t> clients_connected{-1};
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0};
  std::atomic<double> last_round_seconds{NAN}, test_accuracy{NAN}, test_loss{NAN}, train_loss{NAN};
  std::atomic<int64_t> bound_bytes{0}, budget_bytes{0};
  std::atomic<int64_t> baseline_bytes{0};  // RSS when the endpoint started, before the role's model

  std::mutex mu;  // guards what follows; held for a push or a copy only
  std::string role = "memfl";
  std::map<int, ClientRow> clients;
  int64_t clients_not_listed = 0;
  std::deque<RoundRow> rounds;
  std::deque<PhaseRow> phases;
  std::map<int64_t, int64_t> staleness;  // staleness → updates
  // The RSS timeline: (seconds, max RSS since the last point), decimated.
  std::vector<std::pair<double, int64_t>> timeline;
  size_t timeline_stride = 1, timeline_pending = 0;
  int64_t timeline_pending_max = 0;
};

State* g = new State();  // never freed: hooks may run from threads during exit

double since_start() { return std::chrono::duration<double>(Clock::now() - g->t0).count(); }

void store_relaxed(std::atomic<double>& a, double v) { a.store(v, std::memory_order_relaxed); }

ClientRow& client_row(int client) {  // under mu
  auto it = g->clients.find(client);
  if (it != g->clients.end()) return it->second;
  if (g->clients.size() >= kMaxClients) {
    static ClientRow overflow;
    ++g->clients_not_listed;
    return overflow;
  }
  return g->clients[client];
}

// /proc/self/status fields in kB ("VmRSS:  1234 kB") → bytes.
std::map<std::string, int64_t> proc_status() {
  std::map<std::string, int64_t> out;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, colon);
    if (key != "VmRSS" && key != "VmHWM" && key != "RssAnon" && key != "RssFile" && key != "RssShmem" &&
        key != "Threads")
      continue;
    long long v = 0;
    if (std::sscanf(line.c_str() + colon + 1, "%lld", &v) != 1) continue;
    out[key] = key == "Threads" ? v : v * 1024;
  }
  return out;
}

// Prometheus' text format: a label value escapes \, " and newline.
std::string label_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

class Writer {
 public:
  explicit Writer(std::string role) : labels_("role=\"" + label_escape(role) + "\"") {}
  void metric(std::string_view name, std::string_view type, std::string_view help, double v) {
    head(name, type, help);
    out_ += fmt::format("{}{{{}}} {}\n", name, labels_, num(v));
  }
  void head(std::string_view name, std::string_view type, std::string_view help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void sample(std::string_view name, std::string_view extra_labels, double v) {
    out_ += fmt::format("{}{{{},{}}} {}\n", name, labels_, extra_labels, num(v));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string labels_;
  std::string out_;
};

}  // namespace

void enable(std::string role) {
  {
    std::lock_guard lock(g->mu);
    g->role = std::move(role);
  }
  // What the process held before its model (libraries, the runtime): the
  // stated bound is on top of it.
  g->baseline_bytes.store(read_rss_bytes(), std::memory_order_relaxed);
  g->running.store(true);
  g->enabled.store(true);
  // memory/ and io/ know nothing of this folder: they call what is set here.
  set_phase_observer(&phase);
  set_round_row_observer(&round_row);
}

bool enabled() { return g->enabled.load(std::memory_order_relaxed); }

void reset_for_test() {
  // The old state leaks on purpose: a hook on another thread may still hold it.
  g = new State();
}

void set_planned(int64_t planned, bool asynchronous) {
  g->planned.store(planned, std::memory_order_relaxed);
  g->asynchronous.store(asynchronous, std::memory_order_relaxed);
}

void set_memory_bound(int64_t bound_bytes, int64_t budget_bytes) {
  g->bound_bytes.store(bound_bytes, std::memory_order_relaxed);
  g->budget_bytes.store(budget_bytes, std::memory_order_relaxed);
}

void round_started(int round, const std::vector<int>& selected) {
  if (!enabled()) return;
  g->current_round.store(round, std::memory_order_relaxed);
  g->clients_selected.store(static_cast<int64_t>(selected.size()), std::memory_order_relaxed);
  const double now = since_start();
  std::lock_guard lock(g->mu);
  for (int c : selected) {
    ClientRow& r = client_row(c);
    r.state = "selected";
    r.last_round = round;
    r.last_seen_s = now;
  }
}

void clients_connected(int connected) {
  if (!enabled()) return;
  g->clients_connected.store(connected, std::memory_order_relaxed);
}

void client_updated(int client, int round, uint64_t bytes_down, uint64_t bytes_up) {
  if (!enabled()) return;
  g->clients_updates_total.fetch_add(1, std::memory_order_relaxed);
  const double now = since_start();
  std::lock_guard lock(g->mu);
  ClientRow& r = client_row(client);
  r.state = "done";
  r.last_round = round;
  r.last_seen_s = now;
  r.rounds++;
  r.bytes_down += bytes_down;
  r.bytes_up += bytes_up;
}

void client_dropped(int client, int round) {
  if (!enabled()) return;
  g->clients_dropped_total.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(g->mu);
  ClientRow& r = client_row(client);
  r.state = "dropped";
  r.last_round = round;
}

void round_bytes(uint64_t bytes_down, uint64_t bytes_up) {
  if (!enabled()) return;
  g->bytes_sent.fetch_add(bytes_down, std::memory_order_relaxed);
  g->bytes_received.fetch_add(bytes_up, std::memory_order_relaxed);
}

void round_row(const RoundMetrics& m) {
  if (!enabled()) return;
  g->rounds_completed.fetch_add(1, std::memory_order_relaxed);
  store_relaxed(g->last_round_seconds, m.round_seconds);
  store_relaxed(g->test_accuracy, m.test_accuracy);
  store_relaxed(g->test_loss, m.test_loss);
  store_relaxed(g->train_loss, m.train_loss);
  std::lock_guard lock(g->mu);
  g->rounds.push_back({m.round, m.clients, m.train_loss, m.train_accuracy, m.test_loss, m.test_accuracy,
                       m.round_seconds, m.bytes_moved, m.rss_bytes, m.peak_rss_bytes});
  if (g->rounds.size() > kMaxRounds) g->rounds.pop_front();
}

void async_applied(int client, int64_t version, int64_t staleness, uint64_t bytes_up) {
  if (!enabled()) return;
  g->async_version.store(version, std::memory_order_relaxed);
  g->current_round.store(version, std::memory_order_relaxed);
  g->async_updates.fetch_add(1, std::memory_order_relaxed);
  const double now = since_start();
  std::lock_guard lock(g->mu);
  g->staleness[staleness]++;
  ClientRow& r = client_row(client);
  r.state = "applied";
  r.last_seen_s = now;
  r.rounds++;
  r.bytes_up += bytes_up;
}

void phase(int round, std::string_view name) {
  if (!enabled()) return;
  const double now = since_start();
  std::lock_guard lock(g->mu);
  g->phases.push_back({now, round, std::string(name)});
  if (g->phases.size() > kMaxPhases) g->phases.pop_front();
}

void loop_finished() { g->running.store(false); }
bool loop_running() { return g->enabled.load() && g->running.load(); }

void sample_rss() {
  const int64_t rss = read_rss_bytes();
  const double now = since_start();
  std::lock_guard lock(g->mu);
  // Each point is the max of `stride` readings, so a short peak survives
  // decimation; when full, pairs merge (max) and the stride doubles.
  g->timeline_pending_max = std::max(g->timeline_pending_max, rss);
  if (++g->timeline_pending < g->timeline_stride) return;
  g->timeline.emplace_back(now, g->timeline_pending_max);
  g->timeline_pending = 0;
  g->timeline_pending_max = 0;
  if (g->timeline.size() >= kMaxTimelinePoints) {
    std::vector<std::pair<double, int64_t>> half;
    half.reserve(kMaxTimelinePoints / 2 + 1);
    for (size_t i = 0; i + 1 < g->timeline.size(); i += 2)
      half.emplace_back(g->timeline[i + 1].first, std::max(g->timeline[i].second, g->timeline[i + 1].second));
    if (g->timeline.size() % 2) half.push_back(g->timeline.back());
    g->timeline = std::move(half);
    g->timeline_stride *= 2;
  }
}

std::string prometheus_text() {
  std::string role;
  std::map<int64_t, int64_t> staleness;
  size_t clients_listed = 0;
  {
    std::lock_guard lock(g->mu);
    role = g->role;
    staleness = g->staleness;
    clients_listed = g->clients.size();
  }
  const auto st = proc_status();
  auto get = [&](const char* k) {
    auto it = st.find(k);
    return it == st.end() ? 0.0 : static_cast<double>(it->second);
  };
  const auto rel = std::memory_order_relaxed;
  Writer w(role);
  w.metric("memfl_up", "gauge", "1 while the role runs its loop, 0 once it has finished", loop_running() ? 1 : 0);
  w.metric("memfl_uptime_seconds", "gauge", "Seconds since the endpoint started", since_start());
  w.metric("memfl_round", "gauge", "The current round (synchronous) or global model version (asynchronous)",
           static_cast<double>(g->current_round.load(rel)));
  w.metric("memfl_rounds_planned", "gauge", "Rounds (synchronous) or client updates (asynchronous) the run plans",
           static_cast<double>(g->planned.load(rel)));
  w.metric("memfl_rounds_completed_total", "counter", "Metrics rows written (rounds, or async evaluations)",
           static_cast<double>(g->rounds_completed.load(rel)));
  w.metric("memfl_async_version", "gauge", "The asynchronous global model's version (0 for synchronous runs)",
           static_cast<double>(g->async_version.load(rel)));
  w.metric("memfl_async_updates_applied_total", "counter", "Client updates the asynchronous server applied",
           static_cast<double>(g->async_updates.load(rel)));
  w.metric("memfl_clients_known", "gauge", "Clients seen so far (selected or updated at least once)",
           static_cast<double>(clients_listed));
  w.metric("memfl_clients_selected", "gauge", "Clients selected for the current round",
           static_cast<double>(g->clients_selected.load(rel)));
  if (const int64_t connected = g->clients_connected.load(rel); connected >= 0) {
    w.metric("memfl_clients_connected", "gauge",
             "Clients whose process is connected: a gRPC session open, an MPI rank still in the job",
             static_cast<double>(connected));
  }
  w.metric("memfl_client_updates_total", "counter", "Client updates counted into an aggregate",
           static_cast<double>(g->clients_updates_total.load(rel)));
  w.metric("memfl_clients_dropped_total", "counter", "Selected clients that sent no whole update",
           static_cast<double>(g->clients_dropped_total.load(rel)));
  w.metric("memfl_received_bytes_total", "counter", "Update bytes received on the wire",
           static_cast<double>(g->bytes_received.load(rel)));
  w.metric("memfl_sent_bytes_total", "counter", "Model bytes sent to clients on the wire",
           static_cast<double>(g->bytes_sent.load(rel)));
  w.metric("memfl_last_round_seconds", "gauge", "Wall seconds of the last finished round",
           g->last_round_seconds.load(rel));
  w.metric("memfl_test_accuracy", "gauge", "Test accuracy of the global model after the last round",
           g->test_accuracy.load(rel));
  w.metric("memfl_test_loss", "gauge", "Test loss of the global model after the last round", g->test_loss.load(rel));
  w.metric("memfl_train_loss", "gauge", "Clients' sample-weighted training loss in the last round",
           g->train_loss.load(rel));
  w.metric("memfl_resident_memory_bytes", "gauge", "Resident set size (VmRSS)", get("VmRSS"));
  w.metric("memfl_resident_memory_peak_bytes", "gauge", "Peak resident set size (VmHWM)", get("VmHWM"));
  w.metric("memfl_resident_memory_anon_bytes", "gauge", "Anonymous resident bytes (RssAnon): heap, arenas",
           get("RssAnon"));
  w.metric("memfl_resident_memory_file_bytes", "gauge",
           "File-backed and shared resident bytes (RssFile + RssShmem): code, mapped files",
           get("RssFile") + get("RssShmem"));
  w.metric("memfl_memory_bound_bytes", "gauge",
           "The role's stated bound: global model + aggregator state + working bytes (0: not stated)",
           static_cast<double>(g->bound_bytes.load(rel)));
  w.metric("memfl_memory_baseline_bytes", "gauge",
           "Resident bytes before the role built its model (libraries, the runtime); the bound is on top of it",
           static_cast<double>(g->baseline_bytes.load(rel)));
  w.metric("memfl_memory_budget_bytes", "gauge", "server_configs.memory_budget the bound is checked against",
           static_cast<double>(g->budget_bytes.load(rel)));
  const LedgerSnapshot ledger = Ledger::instance().snapshot();
  w.head("memfl_ledger_bytes", "gauge", "Bytes held per memory ledger category, now");
  for (size_t c = 0; c < ledger.current.size(); ++c) {
    w.sample("memfl_ledger_bytes", fmt::format("category=\"{}\"", memory_category_name(static_cast<MemoryCategory>(c))),
             static_cast<double>(ledger.current[c]));
  }
  w.head("memfl_ledger_peak_bytes", "gauge", "Peak bytes per memory ledger category");
  for (size_t c = 0; c < ledger.peak.size(); ++c) {
    w.sample("memfl_ledger_peak_bytes",
             fmt::format("category=\"{}\"", memory_category_name(static_cast<MemoryCategory>(c))),
             static_cast<double>(ledger.peak[c]));
  }
  w.metric("memfl_threads", "gauge", "Threads of the process", get("Threads"));
  w.metric("memfl_open_fds", "gauge", "Open file descriptors of the process", count_open_fds());
  if (!staleness.empty()) {
    // A histogram with one bucket per staleness seen (cumulative, as
    // Prometheus wants), plus +Inf.
    w.head("memfl_async_staleness", "histogram", "Staleness of applied asynchronous updates (versions behind)");
    int64_t cum = 0, sum = 0;
    for (const auto& [s, n] : staleness) {
      cum += n;
      sum += s * n;
      w.sample("memfl_async_staleness_bucket", fmt::format("le=\"{}\"", s), static_cast<double>(cum));
    }
    w.sample("memfl_async_staleness_bucket", "le=\"+Inf\"", static_cast<double>(cum));
    std::string out = w.take();
    const std::string labels = "{role=\"" + label_escape(role) + "\"}";
    out += fmt::format("memfl_async_staleness_sum{} {}\nmemfl_async_staleness_count{} {}\n", labels, sum, labels, cum);
    return out;
  }
  return w.take();
}

std::string state_json() {
  json j;
  {
    std::lock_guard lock(g->mu);
    j["role"] = g->role;
    json rounds = json::array();
    for (const auto& r : g->rounds) {
      rounds.push_back({{"round", r.round},
                        {"clients", r.clients},
                        {"train_loss", r.train_loss},
                        {"train_accuracy", r.train_accuracy},
                        {"test_loss", r.test_loss},
                        {"test_accuracy", r.test_accuracy},
                        {"round_seconds", r.round_seconds},
                        {"bytes_moved", r.bytes_moved},
                        {"rss_bytes", r.rss_bytes},
                        {"peak_rss_bytes", r.peak_rss_bytes}});
    }
    j["metrics"] = std::move(rounds);
    json t = json::array(), v = json::array();
    for (const auto& [ts, rss] : g->timeline) {
      t.push_back(ts * 1000.0);
      v.push_back(rss);
    }
    j["samples"] = {{"t_ms", std::move(t)}, {"rss_bytes", std::move(v)}};
    // Phases as the report has them: [start, end) in ms.
    json phases = json::array();
    for (size_t i = 0; i < g->phases.size(); ++i) {
      const double end = i + 1 < g->phases.size() ? g->phases[i + 1].t_s : since_start();
      phases.push_back({{"round", g->phases[i].round},
                        {"phase", g->phases[i].name},
                        {"start_ms", g->phases[i].t_s * 1000.0},
                        {"end_ms", end * 1000.0}});
    }
    j["phases"] = std::move(phases);
    json clients = json::array();
    const double now = since_start();
    for (const auto& [id, c] : g->clients) {
      clients.push_back({{"client", id},
                         {"state", c.state},
                         {"last_seen_seconds_ago", now - c.last_seen_s},
                         {"last_round", c.last_round},
                         {"updates", c.rounds},
                         {"bytes_down", c.bytes_down},
                         {"bytes_up", c.bytes_up}});
    }
    j["clients"] = std::move(clients);
    j["clients_not_listed"] = g->clients_not_listed;
    json hist = json::array();
    for (const auto& [s, n] : g->staleness) hist.push_back({s, n});
    j["staleness"] = std::move(hist);
  }
  const auto rel = std::memory_order_relaxed;
  j["running"] = loop_running();
  j["uptime_seconds"] = since_start();
  j["round"] = g->current_round.load(rel);
  j["planned"] = g->planned.load(rel);
  j["asynchronous"] = g->asynchronous.load(rel);
  j["rss_bytes"] = read_rss_bytes();
  j["peak_rss_bytes"] = read_peak_rss_bytes();
  j["memory_bound_bytes"] = g->bound_bytes.load(rel);
  j["memory_baseline_bytes"] = g->baseline_bytes.load(rel);
  j["clients_connected"] = g->clients_connected.load(rel);
  const LedgerSnapshot ledger = Ledger::instance().snapshot();
  json lj = json::object();
  for (size_t c = 0; c < ledger.current.size(); ++c)
    lj[std::string(memory_category_name(static_cast<MemoryCategory>(c)))] = ledger.current[c];
  j["ledger"] = std::move(lj);
  // NaN (no evaluation yet) is not JSON: dump replaces it with null.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace memfl::live
