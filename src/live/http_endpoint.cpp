#include "live/http_endpoint.h"

// Debian's cpp-httplib is a compiled library: this header is declarations
// only, and the one translation unit that includes it is this one. Where it
// is missing (the GPU machine), memfl builds without the endpoint and
// --http says so.
#ifdef MEMFL_HAVE_HTTPLIB
#include <httplib.h>
#endif

#include <atomic>
#include <charconv>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "io/run_dir.h"
#include "live/live_metrics.h"
#include "report/report.h"

namespace memfl {

Status parse_listen_address(const std::string& text, std::string* host, int* port) {
  std::string h = "127.0.0.1", p = text;
  if (const auto colon = text.rfind(':'); colon != std::string::npos) {
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);  // [::1]:9100
    if (h.empty()) h = "127.0.0.1";
  }
  int v = -1;
  const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
  if (ec != std::errc() || end != p.data() + p.size() || v < 0 || v > 65535) {
    return invalid_argument("--http {}: expected ADDR:PORT (e.g. 127.0.0.1:9100; port 0 picks one)", text);
  }
  *host = h;
  *port = v;
  return Status::Ok();
}

#ifdef MEMFL_HAVE_HTTPLIB

namespace {

// Compares without an early exit, so the time taken says nothing of the token.
bool same_token(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

}  // namespace

struct LiveEndpoint::Impl {
  LiveEndpointOptions opts;
  httplib::Server server;
  std::string host;
  int port = 0;
  std::thread listener, sampler;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::string page;  // built once: the page's data comes from /api/state
};

LiveEndpoint::LiveEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

int LiveEndpoint::port() const { return impl_->port; }
std::string LiveEndpoint::address() const {
  return (impl_->host.find(':') != std::string::npos ? "[" + impl_->host + "]" : impl_->host) + ":" +
         std::to_string(impl_->port);
}

StatusOr<std::unique_ptr<LiveEndpoint>> LiveEndpoint::start(LiveEndpointOptions opts) {
  auto impl = std::make_unique<Impl>();
  MEMFL_RETURN_IF_ERROR(parse_listen_address(opts.listen, &impl->host, &impl->port));
  impl->opts = std::move(opts);
  live::enable(impl->opts.role);
  impl->page = live_page_html("memfl live — " + impl->opts.role);
  httplib::Server& s = impl->server;
  // A few threads are plenty for a scraper and a browser; more connections
  // wait in the queue (each is cut after the read timeout if it stalls).
  s.new_task_queue = [] { return new httplib::ThreadPool(4); };
  // Headers and body leave as separate writes: without TCP_NODELAY, Nagle
  // and the scraper's delayed ACK held every kept-alive answer ~40 ms.
  s.set_tcp_nodelay(true);
  s.set_read_timeout(5, 0);
  s.set_write_timeout(5, 0);
  s.set_keep_alive_max_count(100);
  s.set_payload_max_length(4096);  // every path is a GET
  const std::string token = impl->opts.token;
  s.set_pre_routing_handler([token](const httplib::Request& req, httplib::Response& res) {
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = 405;
      res.set_content("only GET\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (token.empty() || req.path == "/healthz") return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    const bool ok = same_token(auth, "Bearer " + token) ||
                    (req.has_param("token") && same_token(req.get_param_value("token"), token));
    if (ok) return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    res.set_content("this endpoint needs Authorization: Bearer <token> (--http-token)\n", "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
  s.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(live::prometheus_text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    const bool up = live::loop_running();
    res.status = up ? 200 : 503;
    res.set_content(up ? "ok\n" : "finished\n", "text/plain");
  });
  s.Get("/api/state", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(live::state_json(), "application/json");
  });
  Impl* raw = impl.get();
  s.Get("/", [raw](const httplib::Request&, httplib::Response& res) { res.set_content(raw->page, "text/html"); });
  s.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) res.set_content(std::to_string(res.status) + "\n", "text/plain");
  });
  if (impl->port == 0) {
    impl->port = s.bind_to_any_port(impl->host);
    if (impl->port < 0) return failed_precondition("--http {}: cannot listen on {}", impl->opts.listen, impl->host);
  } else if (!s.bind_to_port(impl->host, impl->port)) {
    return failed_precondition("--http {}: cannot listen there (in use, or not an address of this host)",
                               impl->opts.listen);
  }
  impl->listener = std::thread([raw] { raw->server.listen_after_bind(); });
  impl->sampler = std::thread([raw] {
    std::unique_lock lock(raw->mu);
    while (!raw->stopping) {
      live::sample_rss();
      raw->cv.wait_for(lock, std::chrono::milliseconds(raw->opts.sample_ms));
    }
  });
  return std::unique_ptr<LiveEndpoint>(new LiveEndpoint(std::move(impl)));
}

Status LiveEndpoint::freeze(const std::string& dir) const {
  live::loop_finished();
  live::sample_rss();  // the timeline ends at the end
  nlohmann::json state = nlohmann::json::parse(live::state_json());
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  state["frozen_at"] = when;
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/live_state.json", state.dump(1) + "\n"));
  return write_text_file(dir + "/live.html",
                         frozen_live_page_html("memfl live — " + impl_->opts.role + " (as it ended)", state.dump()));
}

LiveEndpoint::~LiveEndpoint() {
  live::loop_finished();
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->server.stop();
  if (impl_->listener.joinable()) impl_->listener.join();
  if (impl_->sampler.joinable()) impl_->sampler.join();
}

#else  // no cpp-httplib

struct LiveEndpoint::Impl {};

LiveEndpoint::LiveEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LiveEndpoint::~LiveEndpoint() = default;
int LiveEndpoint::port() const { return 0; }
std::string LiveEndpoint::address() const { return {}; }
Status LiveEndpoint::freeze(const std::string&) const { return Status::Ok(); }

StatusOr<std::unique_ptr<LiveEndpoint>> LiveEndpoint::start(LiveEndpointOptions opts) {
  std::string host;
  int port = 0;
  MEMFL_RETURN_IF_ERROR(parse_listen_address(opts.listen, &host, &port));
  return failed_precondition(
      "--http {}: this memfl was built without cpp-httplib (Debian's libcpp-httplib-dev), so it has no live "
      "endpoint; the run's report and memory.csv are written as usual",
      opts.listen);
}

#endif  // MEMFL_HAVE_HTTPLIB

}  // namespace memfl
