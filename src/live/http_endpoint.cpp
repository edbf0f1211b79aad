#include "live/http_endpoint.h"

// Debian's cpp-httplib is a compiled library: this header is declarations
// only, and the one translation unit that includes it is this one. Where it
// is missing (the GPU machine), memfl builds without the endpoint and
// --http says so.
#ifdef MEMFL_HAVE_HTTPLIB
#include <httplib.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <strings.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

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

using Clock = std::chrono::steady_clock;

// What one connection may take of the endpoint. One event loop reads every
// request head and sends every answer without blocking, and httplib only
// parses a head that has fully arrived and routes it, so a client that sends
// (or reads) a byte at a time holds up no one but itself, and a crowd of them
// costs descriptors and small buffers, never threads.
constexpr size_t kMaxHeadBytes = 16 * 1024;  // request line and headers together
constexpr size_t kMaxHeaderLines = 100;
constexpr auto kHeadTimeout = std::chrono::seconds(5);     // a whole head, from connecting or the last answer
constexpr auto kAnswerTimeout = std::chrono::seconds(10);  // the client has taken the whole answer
constexpr auto kLingerTimeout = std::chrono::seconds(2);   // reading on after the last answer (see linger)
constexpr size_t kMaxConnections = 128;                    // descriptors are shared with the role's own sockets
constexpr size_t kMaxConnectionsPerPeer = 32;
constexpr size_t kMaxUnsentBytes = 16 << 20;  // answers not yet taken, all connections together
constexpr int kMaxRequestsPerConnection = 100;

// Compares without an early exit, so the time taken says nothing of the token.
bool same_token(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

std::string numeric_host(const sockaddr_storage& a, socklen_t len, int* port) {
  char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "";
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, serv, sizeof serv,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  if (port != nullptr) *port = std::atoi(serv);
  return host;
}

// Where the head ends (just past its empty line), or npos while it has not.
size_t head_end(const std::string& in) {
  for (size_t i = in.find('\n'); i != std::string::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 2;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 3;
  }
  return std::string::npos;
}

// Range requests are answered whole: every answer here is small, and
// httplib 0.11 builds a multi-range answer in memory, one copy of the body
// per range asked for.
void drop_range_headers(std::string* head) {
  size_t line = head->find('\n');
  while (line != std::string::npos && line + 1 < head->size()) {
    const size_t start = line + 1, next = head->find('\n', start);
    if (next == std::string::npos) break;
    if (head->size() - start > 6 && strncasecmp(head->data() + start, "range:", 6) == 0) {
      head->erase(start, next + 1 - start);
    } else {
      line = next;
    }
  }
}

struct Connection {
  enum class State { kReading, kWriting, kLingering };
  int fd = -1;       // -1 once closed (swept at the end of the loop's turn)
  std::string peer;  // numeric address: what the per-peer cap counts
  int peer_port = 0;
  State state = State::kReading;
  std::string in;   // read, not yet answered
  std::string out;  // the answer being sent, `sent` bytes of it gone
  size_t sent = 0;
  bool peer_done = false;    // the client shut its side: answer what came, then close
  bool close_after = false;  // no request after this answer
  int answered = 0;
  Clock::time_point since;     // when this state began: eviction takes the oldest
  Clock::time_point deadline;  // closed when it passes
};

// A request head that has fully arrived, given to httplib to parse; the
// answer it writes is collected for the event loop to send.
class HeadStream final : public httplib::Stream {
 public:
  HeadStream(std::string_view head, const Connection& c, std::string* out) : head_(head), c_(c), out_(out) {}
  bool is_readable() const override { return pos_ < head_.size(); }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, head_.size() - pos_);
    std::memcpy(ptr, head_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    out_->append(ptr, size);
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.peer;
    port = c_.peer_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    port = 0;
    ip = getsockname(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0 ? numeric_host(a, len, &port) : "";
  }
  socket_t socket() const override { return c_.fd; }

 private:
  std::string_view head_;
  size_t pos_ = 0;
  const Connection& c_;
  std::string* out_;
};

// httplib's parser and router, driven by the event loop instead of its
// blocking threads.
class Router : public httplib::Server {
 public:
  // Answers the request whose whole head is `head`, appending the answer to
  // `out`; `last`: the answer says the connection closes. Returns whether
  // the connection may carry another request (the head parsed, and neither
  // side closes).
  bool answer(const Connection& c, std::string_view head, bool last, std::string* out) {
    HeadStream strm(head, c, out);
    bool parsed = false, client_closes = false;
    process_request(strm, last, client_closes, [&parsed](httplib::Request&) { parsed = true; });
    return parsed && !client_closes && !last;
  }
  int listening_socket() const { return svr_sock_; }
};

}  // namespace

struct LiveEndpoint::Impl {
  LiveEndpointOptions opts;
  Router router;
  std::string host;
  int port = 0;
  int listen_fd = -1;
  int wake_fd = -1;  // the destructor wakes the loop through it
  std::atomic<bool> stop_loop{false};
  std::thread loop, sampler;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::string page;  // built once: the page's data comes from /api/state

  // The loop thread's own.
  std::vector<std::unique_ptr<Connection>> conns;
  size_t open = 0;    // conns not yet closed
  size_t unsent = 0;  // bytes of answers in `out` buffers

  void run_loop();
  void accept_new(Clock::time_point* paused_until);
  void admit(int fd, const sockaddr_storage& a, socklen_t len);
  void read_some(Connection& c);
  void next_request(Connection& c);
  void refuse(Connection& c);
  void start_writing(Connection& c);
  void flush(Connection& c);
  void linger(Connection& c);
  void close_connection(Connection& c);
  Connection* oldest_of_heaviest_peer(const std::string* peer, bool writing_only, const Connection* except);
};

void LiveEndpoint::Impl::run_loop() {
  std::vector<pollfd> fds;
  std::vector<Connection*> polled;
  Clock::time_point accept_paused_until{};
  while (!stop_loop.load()) {
    const auto now = Clock::now();
    fds.clear();
    polled.clear();
    const bool accepting = now >= accept_paused_until;
    fds.push_back({wake_fd, POLLIN, 0});
    fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});  // poll skips a negative descriptor
    auto wake_at = accepting ? now + std::chrono::seconds(1) : accept_paused_until;
    for (const auto& c : conns) {
      fds.push_back({c->fd, static_cast<short>(c->state == Connection::State::kWriting ? POLLOUT : POLLIN), 0});
      polled.push_back(c.get());
      wake_at = std::min(wake_at, c->deadline);
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, ms))) < 0 && errno != EINTR) {
      spdlog::error("live endpoint: poll failed ({}); it stops serving", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) {
      uint64_t n = 0;
      (void)!::read(wake_fd, &n, sizeof n);
    }
    for (size_t i = 0; i < polled.size(); ++i) {
      Connection& c = *polled[i];
      const short ev = fds[i + 2].revents;
      if (ev == 0 || c.fd < 0) continue;
      if (c.state == Connection::State::kWriting) {
        flush(c);
      } else {
        read_some(c);
      }
    }
    const auto after = Clock::now();
    for (const auto& c : conns) {
      if (c->fd >= 0 && c->deadline <= after) close_connection(*c);
    }
    if (accepting && (fds[1].revents & POLLIN) != 0) accept_new(&accept_paused_until);
    std::erase_if(conns, [](const auto& c) { return c->fd < 0; });
  }
  for (const auto& c : conns) close_connection(*c);
  conns.clear();
}

void LiveEndpoint::Impl::accept_new(Clock::time_point* paused_until) {
  for (int i = 0; i < 64; ++i) {  // then back to the connections already open
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&a), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      admit(fd, a, len);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // No descriptor to take it with: free one of ours, or wait for the
      // process to free some, rather than spin on a listening socket that
      // stays readable.
      if (Connection* v = oldest_of_heaviest_peer(nullptr, false, nullptr)) {
        close_connection(*v);
      } else {
        *paused_until = Clock::now() + std::chrono::milliseconds(100);
      }
    }
    return;
  }
}

// A new connection makes room for itself: past its peer's cap it replaces
// that peer's oldest connection, past the total the oldest of the peer that
// holds the most. Whoever opens connections fastest loses its own first,
// and a scraper's fresh connection always gets in.
void LiveEndpoint::Impl::admit(int fd, const sockaddr_storage& a, socklen_t len) {
  auto c = std::make_unique<Connection>();
  c->fd = fd;
  c->peer = numeric_host(a, len, &c->peer_port);
  const int yes = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // headers and body leave as separate writes
  size_t same_peer = 0;
  for (const auto& o : conns) same_peer += o->fd >= 0 && o->peer == c->peer ? 1 : 0;
  Connection* victim = nullptr;
  if (same_peer >= kMaxConnectionsPerPeer) {
    victim = oldest_of_heaviest_peer(&c->peer, false, nullptr);
  } else if (open >= kMaxConnections) {
    victim = oldest_of_heaviest_peer(nullptr, false, nullptr);
  }
  if (victim != nullptr) close_connection(*victim);
  c->since = Clock::now();
  c->deadline = c->since + kHeadTimeout;
  ++open;
  conns.push_back(std::move(c));
}

Connection* LiveEndpoint::Impl::oldest_of_heaviest_peer(const std::string* peer, bool writing_only,
                                                        const Connection* except) {
  const auto eligible = [&](const Connection& c) {
    return c.fd >= 0 && &c != except && (!writing_only || c.state == Connection::State::kWriting) &&
           (peer == nullptr || c.peer == *peer);
  };
  std::map<std::string, size_t> per_peer;
  for (const auto& c : conns) {
    if (eligible(*c)) ++per_peer[c->peer];
  }
  Connection* best = nullptr;
  for (const auto& c : conns) {
    if (!eligible(*c)) continue;
    if (best == nullptr || per_peer[c->peer] > per_peer[best->peer] ||
        (per_peer[c->peer] == per_peer[best->peer] && c->since < best->since)) {
      best = c.get();
    }
  }
  return best;
}

void LiveEndpoint::Impl::read_some(Connection& c) {
  char buf[4096];
  // A bounded number of reads a turn, so one fast sender cannot keep the
  // loop to itself.
  for (int i = 0; i < 16; ++i) {
    if (c.state == Connection::State::kReading &&
        (c.in.size() > kMaxHeadBytes || head_end(c.in) != std::string::npos)) {
      break;  // enough to answer or refuse; the rest waits in the kernel
    }
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n > 0) {
      if (c.state == Connection::State::kReading) c.in.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      c.peer_done = true;
      break;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      close_connection(c);
      return;
    }
    break;
  }
  if (c.state == Connection::State::kLingering) {
    if (c.peer_done) close_connection(c);
    return;
  }
  next_request(c);
}

void LiveEndpoint::Impl::next_request(Connection& c) {
  const size_t end = head_end(c.in);
  if (end == std::string::npos || end > kMaxHeadBytes) {
    if (c.in.size() > kMaxHeadBytes) {
      refuse(c);
    } else if (c.peer_done) {
      close_connection(c);
    }
    return;
  }
  if (static_cast<size_t>(std::count(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(end), '\n')) >
      kMaxHeaderLines + 2) {  // the request line and the empty line are not headers
    refuse(c);
    return;
  }
  std::string head = c.in.substr(0, end);
  c.in.erase(0, end);
  drop_range_headers(&head);
  ++c.answered;
  const bool last = c.peer_done || c.answered >= kMaxRequestsPerConnection;
  c.close_after = !router.answer(c, head, last, &c.out);
  start_writing(c);
}

void LiveEndpoint::Impl::refuse(Connection& c) {
  static const std::string body = fmt::format("the request head is over {} KiB or has over {} header lines\n",
                                              kMaxHeadBytes / 1024, kMaxHeaderLines);
  c.out = fmt::format(
      "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Type: text/plain\r\n"
      "Content-Length: {}\r\n\r\n{}",
      body.size(), body);
  std::string().swap(c.in);
  c.close_after = true;
  start_writing(c);
}

void LiveEndpoint::Impl::start_writing(Connection& c) {
  c.state = Connection::State::kWriting;
  c.sent = 0;
  c.since = Clock::now();
  c.deadline = c.since + kAnswerTimeout;
  unsent += c.out.size();
  // Answers a client does not take are what a slow reader holds: past the
  // budget, the oldest of the peer holding the most goes.
  while (unsent > kMaxUnsentBytes) {
    Connection* v = oldest_of_heaviest_peer(nullptr, true, &c);
    if (v == nullptr) break;
    close_connection(*v);
  }
  flush(c);
}

void LiveEndpoint::Impl::flush(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n > 0) {
      c.sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // poll says when it can take more
    close_connection(c);
    return;
  }
  unsent -= c.out.size();
  std::string().swap(c.out);
  c.sent = 0;
  if (c.close_after) {
    linger(c);
    return;
  }
  c.state = Connection::State::kReading;
  c.since = Clock::now();
  c.deadline = c.since + kHeadTimeout;
  next_request(c);  // a pipelined request may have arrived whole already
}

// Closing with unread bytes from the client would reset the connection and
// could take the answer just sent with it (a refused oversized head is
// exactly that case): shut our side, read and drop what still comes, close
// at the client's end or shortly after.
void LiveEndpoint::Impl::linger(Connection& c) {
  ::shutdown(c.fd, SHUT_WR);
  std::string().swap(c.in);
  c.state = Connection::State::kLingering;
  c.since = Clock::now();
  c.deadline = c.since + kLingerTimeout;
  if (c.peer_done) close_connection(c);
}

void LiveEndpoint::Impl::close_connection(Connection& c) {
  if (c.fd < 0) return;
  ::close(c.fd);
  c.fd = -1;
  --open;
  if (c.state == Connection::State::kWriting) unsent -= c.out.size();
  std::string().swap(c.in);
  std::string().swap(c.out);
}

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
  httplib::Server& s = impl->router;
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which
  // another process could bind the same port and take half the connections.
  s.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
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
  impl->listen_fd = impl->router.listening_socket();
  // httplib listens with a backlog of 5: a burst of connections would wait
  // in SYN retries before the loop could take them.
  ::listen(impl->listen_fd, static_cast<int>(kMaxConnections));
  ::fcntl(impl->listen_fd, F_SETFL, ::fcntl(impl->listen_fd, F_GETFL) | O_NONBLOCK);
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0) {
    ::close(impl->listen_fd);
    return internal_error("--http {}: no eventfd for the endpoint's loop: {}", impl->opts.listen, std::strerror(errno));
  }
  impl->loop = std::thread([raw] { raw->run_loop(); });
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
  impl_->stop_loop = true;
  const uint64_t one = 1;
  (void)!::write(impl_->wake_fd, &one, sizeof one);
  if (impl_->loop.joinable()) impl_->loop.join();
  if (impl_->sampler.joinable()) impl_->sampler.join();
  ::close(impl_->listen_fd);
  ::close(impl_->wake_fd);
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
