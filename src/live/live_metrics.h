// Live metrics: what a running role shows through its HTTP endpoint
// (live/http_endpoint.h) — Prometheus text on /metrics, JSON on /api/state
// for the live page — kept by the code that already knows it: the round
// driver (rounds, clients, bytes), the asynchronous core (versions,
// staleness), the metrics writer (accuracy and loss) and the sampler (phase
// marks). Process figures (RSS, threads, descriptors, the ledger) are read
// when a scrape asks, not kept.
//
// Cheap for the round loop: counters are relaxed atomics; the few tables
// (rounds, clients, phases, an RSS timeline) sit behind one mutex held for a
// push or a copy, never across I/O. Every hook returns at once until
// live::enable() is called, so a run without --http pays one relaxed load.
// Memory is bounded whatever the run's length: the timeline keeps at most
// kMaxTimelinePoints (halved by taking every other point when full), the
// phase list and the rounds list the newest kMaxPhases / kMaxRounds.
//
//   live::enable("simulation");
//   live::round_started(3, {0, 1, 2});          // round driver
//   std::string text = live::prometheus_text();  // a scrape
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memfl {
struct RoundMetrics;  // io/run_dir.h
}  // namespace memfl

namespace memfl::live {

inline constexpr size_t kMaxTimelinePoints = 1024;
inline constexpr size_t kMaxPhases = 512;
inline constexpr size_t kMaxRounds = 4096;
inline constexpr size_t kMaxClients = 4096;  // the clients table's rows; more are counted, not listed

// Turns the hooks on; `role` names the process in the page and in the
// `role` label of every metric.
void enable(std::string role);
bool enabled();
// Back to the initial state (tests run several endpoints in one process).
void reset_for_test();

// The planned number of rounds (sync) or client updates (async).
void set_planned(int64_t planned, bool asynchronous);
// The role's stated memory bound and the budget it is checked against.
void set_memory_bound(int64_t bound_bytes, int64_t budget_bytes);

// Round driver: round `round` starts with `selected` clients.
void round_started(int round, const std::vector<int>& selected);
// Round driver: clients whose process is connected (-1: not processes).
void clients_connected(int connected);
// Round driver: `client`'s update of `round` counted, with the bytes it
// took (model down, update up); or it failed and is out.
void client_updated(int client, int round, uint64_t bytes_down, uint64_t bytes_up);
void client_dropped(int client, int round);
// The round's totals on the wire.
void round_bytes(uint64_t bytes_down, uint64_t bytes_up);
// A metrics row is final (MetricsWriter::append: every driver writes one).
void round_row(const RoundMetrics& m);
// Asynchronous core: an update of `client` (`bytes_up` on the wire) applied
// as version `version` with `staleness`.
void async_applied(int client, int64_t version, int64_t staleness, uint64_t bytes_up);
// The sampler's phase marks (round k: broadcast, train, upload, ...).
void phase(int round, std::string_view name);
// The loop is over (the run still writes its files; /healthz says so).
void loop_finished();
bool loop_running();
// Adds one RSS point to the timeline (the endpoint's sampling thread).
void sample_rss();

// /metrics: Prometheus text exposition format 0.0.4.
std::string prometheus_text();
// /api/state: the live page's data (JSON).
std::string state_json();

}  // namespace memfl::live
