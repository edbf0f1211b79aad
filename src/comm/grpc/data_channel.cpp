#include "comm/grpc/data_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <vector>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include <spdlog/spdlog.h>

namespace memfl {

static_assert(std::endian::native == std::endian::little, "the data channel's headers are little-endian u64");

namespace {

void encode_header(const ChunkHeader& h, std::byte* out) {
  const uint64_t v[4] = {h.layout_hash, h.offset, h.length, h.checksum};
  std::memcpy(out, v, kDataHeaderBytes);
}

// Writes all of `iov` (partial writes resumed); false when the peer is gone.
bool write_all(int fd, iovec* iov, int count) {
  while (count > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(count);
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    size_t left = static_cast<size_t>(n);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

// 0: all read; else errno (or -1 for the peer closing).
int read_all(int fd, void* dst, size_t n) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return -1;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return 0;
}

std::string address_text(const sockaddr* sa) {
  if (sa->sa_family == AF_UNIX) return "unix socket";
  char host[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return fmt::format("{}:{}", host, ntohs(a->sin_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(sa);
  ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
  return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
}

void set_nodelay(int fd) {
  // Chunks are whole writes; the last segment of one must not wait for an
  // acknowledgement (Nagle's algorithm against delayed ACKs).
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Unix-domain stream sockets default to ~200 KiB of buffer, which makes
// the two processes take turns; 4 MiB each way (capped by the kernel's
// net.core.wmem_max / rmem_max) keeps both busy. Kernel memory, not RSS.
void widen_unix_buffers(int fd) {
  const int bytes = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

// An abstract Unix-domain address (no file; scoped to the network namespace).
socklen_t unix_address(const std::string& name, sockaddr_un* a) {
  *a = sockaddr_un{};
  a->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a->sun_path) - 1);
  std::memcpy(a->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

void set_timeouts(int fd, int seconds) {
  timeval tv{};
  tv.tv_sec = seconds;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

}  // namespace

DataSocket::~DataSocket() {
  if (fd_ >= 0) ::close(fd_);
}

void DataSocket::shutdown() { ::shutdown(fd_, SHUT_RDWR); }

Status DataSocket::write_chunk(const ChunkHeader& header, std::span<const std::byte> bytes) {
  std::byte head[kDataHeaderBytes];
  encode_header(header, head);
  iovec iov[2] = {{head, kDataHeaderBytes}, {const_cast<std::byte*>(bytes.data()), bytes.size()}};
  if (!write_all(fd_, iov, 2)) {
    return Status(StatusCode::kUnavailable, fmt::format("{} closed the data channel", peer_));
  }
  return Status::Ok();
}

Status DataSocket::read_exact(std::span<std::byte> into) {
  const int e = read_all(fd_, into.data(), into.size());
  if (e == 0) return Status::Ok();
  return Status(StatusCode::kUnavailable, fmt::format("{} closed the data channel{}", peer_,
                                                      e > 0 ? fmt::format(" ({})", std::strerror(e)) : ""));
}

Status DataSocket::read_header(ChunkHeader* h, size_t max_length) {
  uint64_t v[4];
  MEMFL_RETURN_IF_ERROR(read_exact(std::as_writable_bytes(std::span(v))));
  *h = ChunkHeader{v[0], v[1], v[2], v[3]};
  if (h->length == 0 || h->length > max_length) {
    return data_loss("chunk from {}: header says {} bytes (a chunk here is 1 to {} bytes)", peer_, h->length,
                     max_length);
  }
  return Status::Ok();
}

Status read_data_chunks(DataSocket& sock, uint64_t total, std::span<std::byte> buffer, uint64_t* received,
                        const std::function<Status(const ChunkHeader&, std::span<const std::byte>)>& on_chunk,
                        uint64_t framed_chunk) {
  uint64_t covered = 0;  // model bytes the chunks so far stand for
  while (covered < total) {
    ChunkHeader h;
    MEMFL_RETURN_IF_ERROR(sock.read_header(&h, buffer.size()));
    const auto payload = buffer.first(static_cast<size_t>(h.length));
    MEMFL_RETURN_IF_ERROR(sock.read_exact(payload));
    MEMFL_RETURN_IF_ERROR(on_chunk(h, payload));
    *received += h.length;
    covered += framed_chunk > 0 ? std::min<uint64_t>(framed_chunk, total - covered) : h.length;
  }
  return Status::Ok();
}

Status split_host_port(const std::string& uri, std::string* host, std::string* port) {
  std::string s = uri;
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (s.rfind(scheme, 0) == 0) {
      s = s.substr(std::strlen(scheme));
      break;
    }
  }
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    return invalid_argument("server_configs.comm_configs.grpc_configs.server_uri: '{}' is not host:port", uri);
  }
  *host = s.substr(0, colon);
  *port = s.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return Status::Ok();
}

uint64_t draw_data_ticket() {
  std::random_device rd;
  uint64_t t = 0;
  while (t == 0) t = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return t;
}

Status DataListener::listen_tcp(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int e = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res); e != 0) {
    return invalid_argument("grpc_configs.server_uri: cannot resolve '{}' for the data channel: {}", host,
                            ::gai_strerror(e));
  }
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
    } else {
      why = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0) {
    return invalid_argument("grpc_configs.data_channel_port: cannot listen on {} port {}: {}", host, port, why);
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ss.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                                  : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return Status::Ok();
}

Status DataListener::start(const std::string& server_uri, int port, bool unix_socket, Attach attach, bool tcp) {
  std::string host, unused;
  MEMFL_RETURN_IF_ERROR(split_host_port(server_uri, &host, &unused));
  if (tcp) MEMFL_RETURN_IF_ERROR(listen_tcp(host, port));
  if (unix_socket) {
    unix_name_ = fmt::format("memfl-data-{}-{:016x}", ::getpid(), draw_data_ticket());
    sockaddr_un a;
    const socklen_t alen = unix_address(unix_name_, &a);
    unix_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (unix_fd_ < 0 || ::bind(unix_fd_, reinterpret_cast<sockaddr*>(&a), alen) != 0 ||
        ::listen(unix_fd_, SOMAXCONN) != 0) {
      // Not fatal: clients dial TCP.
      spdlog::warn("grpc_configs.data_channel_unix: no Unix socket ({}); clients on this host use {}",
                   std::strerror(errno), tcp ? "TCP" : "the gRPC stream");
      if (unix_fd_ >= 0) ::close(unix_fd_);
      unix_fd_ = -1;
      unix_name_.clear();
    }
  }
  // The loop accepts every connection waiting, until accept says there are
  // no more: the listening sockets must not block.
  for (int fd : {listen_fd_, unix_fd_}) {
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  if (::pipe2(wake_, O_CLOEXEC) != 0) return internal_error("data channel: pipe: {}", std::strerror(errno));
  attach_ = std::move(attach);
  thread_ = std::thread([this] { serve(); });
  return Status::Ok();
}

namespace {

// A connection accepted but not yet past its hello. Handshakes run side by
// side in the listener's poll loop, each with its own deadline, so a peer
// that connects and says nothing (or says it one byte a second) delays
// nobody else: a known client's hello arrives with its connect and is read in
// the same turn of the loop.
struct PendingHello {
  int fd = -1;
  bool from_unix = false;
  std::string peer;
  std::chrono::steady_clock::time_point deadline;
  std::byte bytes[24] = {};
  size_t have = 0;
};

void set_blocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

}  // namespace

void DataListener::serve() {
  std::vector<PendingHello> pending;
  std::vector<pollfd> p;
  auto drop = [&](size_t i, const char* why) {
    spdlog::warn("data channel: {} {}; closed", pending[i].peer, why);
    ::close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    for (size_t i = pending.size(); i-- > 0;) {
      if (now >= pending[i].deadline) drop(i, "did not say a memfl hello in time");
    }
    int wait_ms = -1;
    for (const auto& h : pending) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(h.deadline - now).count() + 1;
      wait_ms = wait_ms < 0 ? static_cast<int>(left) : std::min(wait_ms, static_cast<int>(left));
    }
    p.assign({{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}, {unix_fd_, POLLIN, 0}});
    for (const auto& h : pending) p.push_back({h.fd, POLLIN, 0});
    if (::poll(p.data(), p.size(), wait_ms) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[0].revents != 0) break;
    // Hellos first (the connections are older than any new one), from the
    // back so that erasing keeps the indices of those not yet visited.
    for (size_t i = pending.size(); i-- > 0;) {
      if (p[3 + i].revents == 0) continue;
      PendingHello& h = pending[i];
      const ssize_t r = ::recv(h.fd, h.bytes + h.have, sizeof h.bytes - h.have, 0);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (r <= 0) {
        drop(i, "closed before its hello");
        continue;
      }
      h.have += static_cast<size_t>(r);
      if (std::memcmp(h.bytes, kDataHelloMagic, std::min(h.have, sizeof kDataHelloMagic)) != 0) {
        drop(i, "did not say a memfl hello");
        continue;
      }
      if (h.have < sizeof h.bytes) continue;
      DataHello hello;
      std::memcpy(&hello.client_id, h.bytes + 8, 4);
      std::memcpy(&hello.ticket, h.bytes + 16, 8);
      const int fd = h.fd;
      const std::string peer = h.peer;
      const bool from_unix = h.from_unix;
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      set_blocking(fd, true);
      if (!from_unix) set_nodelay(fd);
      // attach_ says the welcome (send_data_welcome) before it publishes the
      // connection to its session: the client's chunks may then follow. The
      // session's deadlines govern from here (shutdown).
      if (!attach_(fd, hello, peer)) {
        spdlog::warn("data channel: {} (client id {}) has no session with that ticket; closed", peer, hello.client_id);
        ::close(fd);
      }
    }
    for (const int which : {1, 2}) {
      if (p[static_cast<size_t>(which)].fd < 0 || p[static_cast<size_t>(which)].revents == 0) continue;
      const bool from_unix = which == 2;
      // Every connection waiting in the backlog, not one per turn.
      while (true) {
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        const int fd = ::accept4(from_unix ? unix_fd_ : listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                                 SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        if (from_unix) widen_unix_buffers(fd);
        if (pending.size() >= kMaxPendingHellos) drop(0, "was the oldest of too many connections without a hello");
        PendingHello h;
        h.fd = fd;
        h.from_unix = from_unix;
        h.peer = address_text(reinterpret_cast<sockaddr*>(&ss));
        h.deadline = std::chrono::steady_clock::now() + hello_timeout_;
        pending.push_back(std::move(h));
      }
    }
  }
  for (auto& h : pending) ::close(h.fd);
}

bool send_data_welcome(int fd) {
  iovec iov{const_cast<char*>(kDataWelcomeMagic), 8};
  return write_all(fd, &iov, 1);
}

void DataListener::stop() {
  if (thread_.joinable()) {
    const char c = 0;
    (void)!::write(wake_[1], &c, 1);
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &unix_fd_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

// The hello on a connected socket, and the wait for the welcome.
static StatusOr<std::unique_ptr<DataSocket>> say_hello(int fd, const std::string& peer, uint32_t client_id,
                                                       uint64_t ticket, int timeout_s) {
  auto sock = std::make_unique<DataSocket>(fd, peer);
  set_timeouts(fd, timeout_s);
  std::byte hello[24] = {};
  std::memcpy(hello, kDataHelloMagic, 8);
  std::memcpy(hello + 8, &client_id, 4);
  std::memcpy(hello + 16, &ticket, 8);
  iovec iov{hello, sizeof hello};
  std::byte welcome[8];
  if (!write_all(fd, &iov, 1)) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: could not send the data channel's hello: {}", peer, std::strerror(errno)));
  }
  // What went wrong decides what the user should look at: a closed
  // connection is the server refusing this session's ticket; silence is a
  // busy or wrong listener.
  const int e = read_all(fd, welcome, sizeof welcome);
  if (e == EAGAIN || e == EWOULDBLOCK) {
    return Status(StatusCode::kUnavailable, fmt::format("{} did not answer the data channel's hello within {} s "
                                                        "(grpc_configs.connect_timeout_s)",
                                                        peer, timeout_s));
  }
  if (e == -1 || e == ECONNRESET) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{} refused the data channel's ticket (closed the connection)", peer));
  }
  if (e != 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: reading the data channel's welcome: {}", peer, std::strerror(e)));
  }
  if (std::memcmp(welcome, kDataWelcomeMagic, 8) != 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{} answered the data channel's hello with bytes that are not a memfl welcome", peer));
  }
  set_timeouts(fd, 0);  // the rounds may idle for as long as training takes
  return sock;
}

StatusOr<std::unique_ptr<DataSocket>> dial_data_channel(const std::string& server_uri, int port,
                                                        const std::string& unix_name, uint32_t client_id,
                                                        uint64_t ticket, int timeout_s) {
  std::string host, unused;
  MEMFL_RETURN_IF_ERROR(split_host_port(server_uri, &host, &unused));
  // The same host first: the server's Unix socket, if this process can reach it.
  if (!unix_name.empty()) {
    sockaddr_un a;
    const socklen_t alen = unix_address(unix_name, &a);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), alen) == 0) {
      widen_unix_buffers(fd);
      return say_hello(fd, fmt::format("server {} (data channel, unix socket)", server_uri), client_id, ticket,
                       timeout_s);
    }
    if (fd >= 0) ::close(fd);
  }
  if (port == 0) {
    return not_found(
        "server {}: its data channel is a Unix socket this process cannot reach (another host or "
        "network namespace)",
        server_uri);
  }
  const std::string peer = fmt::format("server {} (data channel port {})", server_uri, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int e = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res); e != 0) {
    return not_found("{}: cannot resolve {}: {}", peer, host, ::gai_strerror(e));
  }
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    set_timeouts(fd, timeout_s);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return not_found("{}: cannot connect: {}", peer, why);
  set_nodelay(fd);
  return say_hello(fd, peer, client_id, ticket, timeout_s);
}

}  // namespace memfl
