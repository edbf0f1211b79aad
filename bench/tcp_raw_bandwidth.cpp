// Raw TCP over loopback (the ceiling for gRPC): what the kernel moves
// between a server and N client processes with nothing of memfl or gRPC in
// between. The same shape as `memfl bench transfer`: the server sends its
// model (one buffer, MODEL_MB) to every client at once, a thread per client,
// and each client reads it straight into its own model buffer (no
// intermediate copy: the best case, which gRPC cannot have); then every
// client sends its buffer back and the server reads each into one reused
// chunk buffer per connection (as gRPC's receive slices are). With HASH=1
// the sender puts each chunk's xxh3-64 before it (8 bytes, where memfl sends
// a 32-byte header) and the receiver hashes what arrived and compares, as
// memfl's transports do. (Until 2026-11-27 the receiver discarded its hash
// and the sender's was never sent: the compiler removed both, and HASH=1
// measured TCP without hashing. Figures before then are raw TCP's.)
// GB/s counts the bytes of every client, like memfl's metrics.csv.
// With FOLD=1 the server also folds every received chunk into one f32 sum
// as memfl's FedAvg does, in a fixed fold order (client 0 writes the sum
// with streaming stores, every later client adds to a range once the client
// before it has folded that range, as memfl's trailing updates do): the
// upload's ceiling for a server that aggregates.
//
// Usage: tcp_raw_bandwidth MODEL_MB CLIENTS CHUNK_KB HASH REPS [FOLD]
// Prints one JSON object: the best and median of REPS rounds per direction.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#define XXH_INLINE_ALL  // the AVX2 build, as memfl's comm/xxh3_avx2.cpp
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ceiling_fold.h"
#include "huge_buffer.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) die("write");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void read_all(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) die("read");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// Sends `bytes` in chunks; with `hash`, hashes each chunk first (the sender's
// checksum, which memfl puts in the chunk header).
void send_model(int fd, const char* data, size_t bytes, size_t chunk, bool hash) {
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t len = std::min(chunk, bytes - off);
    if (!hash) {
      write_all(fd, data + off, len);
      continue;
    }
    // Checksum and chunk in one system call, as memfl's data channel sends
    // its header and chunk.
    uint64_t h = XXH3_64bits(data + off, len);
    iovec iov[2] = {{&h, sizeof h}, {const_cast<char*>(data + off), len}};
    int n = 2;
    for (iovec* v = iov; n > 0;) {
      const ssize_t w = ::writev(fd, v, n);
      if (w <= 0) die("writev");
      for (size_t left = static_cast<size_t>(w); n > 0 && left > 0;) {
        const size_t step = std::min(left, v->iov_len);
        v->iov_base = static_cast<char*>(v->iov_base) + step;
        v->iov_len -= step;
        left -= step;
        if (v->iov_len == 0) {
          ++v;
          --n;
        }
      }
    }
  }
}

// Reads a chunk's checksum (with `hash`), then the chunk, and checks it.
void receive_chunk(int fd, char* into, size_t len, bool hash) {
  uint64_t want = 0;
  if (hash) read_all(fd, reinterpret_cast<char*>(&want), sizeof want);
  read_all(fd, into, len);
  if (hash && XXH3_64bits(into, len) != want) {
    std::fprintf(stderr, "checksum mismatch\n");
    std::exit(1);
  }
}

// Unix-domain stream sockets default to ~200 KiB of buffer, which makes the
// two processes take turns; memfl's data channel asks for 4 MiB each way.
void widen_unix_buffers(int fd) {
  const int bytes = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6 || argc > 8) {
    std::fprintf(stderr, "usage: %s MODEL_MB CLIENTS CHUNK_KB HASH REPS [FOLD] [tcp|unix|unix_default_buffers]\n",
                 argv[0]);
    return 2;
  }
  const size_t bytes = static_cast<size_t>(std::atof(argv[1]) * (1 << 20));
  const int clients = std::atoi(argv[2]);
  const size_t chunk = static_cast<size_t>(std::atol(argv[3])) << 10;
  const bool hash = std::atoi(argv[4]) != 0;
  const int reps = std::atoi(argv[5]);
  const bool with_fold = argc >= 7 && std::atoi(argv[6]) != 0;
  // unix: the same over a Unix-domain stream socket with 4 MiB buffers (what
  // memfl's data channel uses between processes of one host).
  // unix_default_buffers: the same with the kernel's default buffers, to
  // show what widening them is for.
  const std::string socket_kind = argc == 8 ? argv[7] : "tcp";
  const bool unix_socket = socket_kind == "unix" || socket_kind == "unix_default_buffers";
  const bool widen = socket_kind == "unix";
  if (bytes == 0 || clients < 1 || chunk == 0 || reps < 1 || (with_fold && (chunk % 32 != 0 || bytes % chunk != 0))) {
    std::fprintf(stderr, "MODEL_MB, CLIENTS, CHUNK_KB and REPS must be positive (FOLD: whole 32-byte chunks)\n");
    return 2;
  }
  const int family = unix_socket ? AF_UNIX : AF_INET;
  const int ls = ::socket(family, SOCK_STREAM, 0);
  sockaddr_storage addr{};
  socklen_t alen = sizeof addr;
  if (unix_socket) {
    auto* u = reinterpret_cast<sockaddr_un*>(&addr);
    u->sun_family = AF_UNIX;
    // An abstract name: nothing on disk to clean up.
    const std::string name = "memfl-raw-" + std::to_string(::getpid());
    std::memcpy(u->sun_path + 1, name.data(), name.size());
    alen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (::bind(ls, reinterpret_cast<sockaddr*>(&addr), alen) != 0 || ::listen(ls, clients) != 0) die("listen");
  } else {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof(sockaddr_in)) != 0 || ::listen(ls, clients) != 0 ||
        ::getsockname(ls, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) {
      die("listen");
    }
  }
  for (int c = 0; c < clients; ++c) {
    if (::fork() != 0) continue;
    // A client: its model buffer, touched once (memfl's client arena is
    // resident after its first round).
    const int s = ::socket(family, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), alen) != 0) die("connect");
    if (widen) widen_unix_buffers(s);
    HugeBuffer model(bytes, c + 1);
    char go = 0;
    for (int r = 0; r < reps; ++r) {
      for (size_t off = 0; off < bytes; off += chunk) {
        const size_t len = std::min(chunk, bytes - off);
        receive_chunk(s, model.data() + off, len, hash);
      }
      write_all(s, &go, 1);  // downloaded
      read_all(s, &go, 1);   // the server's "upload now"
      send_model(s, model.data(), bytes, chunk, hash);
    }
    ::close(s);
    std::_Exit(0);
  }
  std::vector<int> fds;
  for (int c = 0; c < clients; ++c) {
    const int fd = ::accept(ls, nullptr, nullptr);
    if (widen && fd >= 0) widen_unix_buffers(fd);
    if (fd < 0) die("accept");
    fds.push_back(fd);
  }
  HugeBuffer global(bytes, 7);
  // The sum, resident and 32-byte aligned for the streaming stores.
  HugeBuffer sum_buffer(with_fold ? bytes : 64, 0);
  auto* sum = reinterpret_cast<float*>(sum_buffer.data());
  std::vector<double> down, up;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    {
      std::vector<std::thread> th;
      for (int fd : fds) {
        th.emplace_back([&, fd] {
          send_model(fd, global.data(), bytes, chunk, hash);
          char ack;
          read_all(fd, &ack, 1);
        });
      }
      for (auto& t : th) t.join();
    }
    const double ds = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    {
      // folded[c]: the bytes client c has folded this round.
      std::vector<std::atomic<uint64_t>> folded(fds.size());
      std::vector<std::thread> th;
      for (size_t c = 0; c < fds.size(); ++c) {
        th.emplace_back([&, c] {
          const int fd = fds[c];
          std::vector<char> buf(chunk);
          const char go = 1;
          write_all(fd, &go, 1);
          for (size_t off = 0; off < bytes; off += chunk) {
            const size_t len = std::min(chunk, bytes - off);
            receive_chunk(fd, buf.data(), len, hash);
            if (!with_fold) continue;
            if (c > 0) {  // fold order: the client before has folded this range
              for (uint64_t f = folded[c - 1].load(); f < off + len; f = folded[c - 1].load()) folded[c - 1].wait(f);
            }
            ceiling_fold(sum + off / 4, reinterpret_cast<const float*>(buf.data()), len / 4,
                         1.0f / static_cast<float>(clients), c == 0);
            folded[c].store(off + len);
            folded[c].notify_all();
          }
        });
      }
      for (auto& t : th) t.join();
    }
    const double us = std::chrono::duration<double>(Clock::now() - t0).count();
    down.push_back(static_cast<double>(bytes) * clients / ds / 1e9);
    up.push_back(static_cast<double>(bytes) * clients / us / 1e9);
  }
  for (int fd : fds) ::close(fd);
  while (::wait(nullptr) > 0) {
  }
  std::printf(
      "{\"socket\": \"%s\", \"model_bytes\": %zu, \"clients\": %d, \"chunk_bytes\": %zu, \"xxh3\": %s, "
      "\"fold\": %s, \"reps\": %d, "
      "\"download_gbps_best\": %.3f, \"download_gbps_median\": %.3f, \"upload_gbps_best\": %.3f, "
      "\"upload_gbps_median\": %.3f}\n",
      socket_kind.c_str(), bytes, clients, chunk, hash ? "true" : "false", with_fold ? "true" : "false", reps,
      *std::max_element(down.begin(), down.end()), median(down), *std::max_element(up.begin(), up.end()), median(up));
  return 0;
}
