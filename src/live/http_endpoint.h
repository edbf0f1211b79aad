// LiveEndpoint: the HTTP endpoint of a running role (`--http ADDR:PORT`):
//   /metrics     Prometheus text (live/live_metrics.h)
//   /healthz     200 "ok" while the role runs its loop, 503 once it is over
//   /api/state   the live page's data, JSON
//   /            the live page (the report's page script and inlined charts,
//                polling /api/state; works with no network)
// It serves from one thread of its own, an event loop that reads request
// heads and sends answers without blocking, and reads only atomics and
// copies taken under the live state's short lock, so a slow or hostile
// client never holds up a round, nor the other clients: a connection that
// trickles its head or does not take its answer costs a descriptor and its
// buffers, and is closed at a deadline (a whole head within 5 s, an answer
// taken within 10 s). A head over 16 KiB or with over 100 headers gets 431;
// a Range is answered whole. Connections are capped (128, 32 a peer); a new
// one past a cap replaces the oldest of the peer that holds the most. With a
// token, every path but /healthz needs `Authorization: Bearer TOKEN` (or
// ?token=TOKEN, for a browser).
//
//   auto ep = LiveEndpoint::start({"127.0.0.1:0", "", "simulation"});
//   spdlog::info("live page on http://{}/", (*ep)->address());
//   ... the run ...
//   (*ep)->freeze(run_dir);  // run_dir/live.html: the page as it ended
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace memfl {

struct LiveEndpointOptions {
  std::string listen;   // ADDR:PORT or PORT (then 127.0.0.1); port 0 picks a free one
  std::string token;    // empty: none needed
  std::string role;     // names the process in the page and the metrics' role label
  int sample_ms = 250;  // the page's RSS timeline: one reading this often (max kept, decimated)
};

class LiveEndpoint {
 public:
  // Binds, then serves on its own threads; an address that cannot be bound
  // is an error naming it.
  static StatusOr<std::unique_ptr<LiveEndpoint>> start(LiveEndpointOptions opts);
  ~LiveEndpoint();  // stops serving and joins its threads
  LiveEndpoint(const LiveEndpoint&) = delete;
  LiveEndpoint& operator=(const LiveEndpoint&) = delete;

  int port() const;
  std::string address() const;  // host:port as bound

  // The loop is over: writes DIR/live_state.json (/api/state as it stands
  // now) and DIR/live.html, the live page frozen on it — the same page and
  // script, drawing that state once instead of polling. The endpoint keeps
  // serving until it is destroyed.
  Status freeze(const std::string& dir) const;

  struct Impl;

 private:
  explicit LiveEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Splits ADDR:PORT (or a bare PORT, on 127.0.0.1); an error names the flag.
Status parse_listen_address(const std::string& text, std::string* host, int* port);

}  // namespace memfl
