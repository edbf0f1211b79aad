// The TCP data channel (grpc_configs.data_channel: tcp): a model's chunks
// travel over a plain TCP connection beside the client's gRPC stream, which
// keeps every control message (Register, ModelBegin/End, UpdateMetadata/End,
// UpdateAck). gRPC's HTTP/2 transport moves 1 GiB at 1.2–2.7 GB/s on this
// machine whatever its server API, where TCP doing the same checked work
// moves 2.9–3.6 (docs/BENCHMARKS.md): the bytes leave gRPC, the
// protocol does not.
//
// On one host the connection is a Unix-domain socket instead (an abstract
// name, offered with the port; grpc_configs.data_channel_unix): with 4 MiB
// socket buffers, raw and checked, one client's 1 GiB download moves at
// 2.8–3.0 GB/s here against 2.2–2.7 over loopback TCP, whose receive path
// costs the sender nearly half its core (docs/BENCHMARKS.md). A client on
// another host (or network namespace) cannot reach the name and dials TCP.
//
// The connection is tied to one gRPC session: RegisterReply hands the client
// a port and a 64-bit ticket drawn for that session; the client's first bytes
// on the connection are a hello with its id and that ticket, used once. A
// chunk on the wire is a 32-byte header (layout hash, offset, length, xxh3;
// little-endian u64) and its bytes. Nothing on the connection is trusted:
// a receiver checks a header (length bounded by the chunk size, offset in
// order, inside the model) before it reads a byte of the payload, and the
// checksum before it counts the chunk. The channel is not encrypted: a config
// that asks for it with use_ssl is refused.
//
//   server: DataListener listener;  listener.start(uri, port, [&](int fd, const DataHello& h, auto peer) {...});
//   client: MEMFL_ASSIGN_OR_RETURN(auto sock, dial_data_channel(uri, port, id, ticket, timeout_s));
//           sock->write_chunk(header, bytes);  /  sock->read_header(&h, limit)  +  sock->read_exact(dst)
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "comm/chunk.h"
#include "common/status.h"

namespace memfl {

inline constexpr char kDataHelloMagic[8] = {'m', 'e', 'm', 'f', 'l', 'D', 'C', '1'};
inline constexpr char kDataWelcomeMagic[8] = {'m', 'e', 'm', 'f', 'l', 'O', 'K', '1'};
inline constexpr size_t kDataHeaderBytes = 32;

struct DataHello {
  uint32_t client_id = 0;
  uint64_t ticket = 0;
};

// One end of a data connection. shutdown() may be called from any thread
// (a deadline passed): a read or write blocked on it returns at once.
class DataSocket {
 public:
  DataSocket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~DataSocket();
  DataSocket(const DataSocket&) = delete;
  DataSocket& operator=(const DataSocket&) = delete;

  const std::string& peer() const { return peer_; }
  // Header and bytes in one system call (no copy into a staging buffer).
  Status write_chunk(const ChunkHeader& header, std::span<const std::byte> bytes);
  // The next chunk's header; its length must be in [1, max_length] before
  // the caller reads the payload (read_exact into a buffer of that size).
  Status read_header(ChunkHeader* header, size_t max_length);
  Status read_exact(std::span<std::byte> into);
  void shutdown();

 private:
  int fd_;
  std::string peer_;
};

// The server's side: listens beside the gRPC port and hands every
// connection whose hello reads in time (hello_timeout, per connection) to
// `attach`, which returns whether it
// took the connection (a known client with the ticket of its session: it
// then says send_data_welcome before the session may use it); a refused one
// is closed unwelcomed, with a warning naming the address.
class DataListener {
 public:
  using Attach = std::function<bool(int fd, const DataHello& hello, const std::string& peer)>;
  ~DataListener() { stop(); }
  // Binds the host of `server_uri` (host:port, [v6]:port) at `port` (0: any
  // free port); port() is then the one bound. With `unix_socket`, also an
  // abstract Unix-domain socket of a random name, unix_name(). With `tcp`
  // false, only the Unix socket (port() is 0): for a server whose stream is
  // TLS, whose chunks may leave the stream only where they never leave the
  // kernel.
  Status start(const std::string& server_uri, int port, bool unix_socket, Attach attach, bool tcp = true);
  int port() const { return port_; }
  const std::string& unix_name() const { return unix_name_; }
  void stop();
  // Handshakes run side by side: each connection has this long to say its
  // hello, counted from its own accept (set before start). At most
  // kMaxPendingHellos wait at once; one more closes the oldest, so a flood of
  // silent connections cannot keep a client's hello out for longer than it
  // takes the flood to be accepted, and costs the listener bounded memory.
  void set_hello_timeout(std::chrono::milliseconds t) { hello_timeout_ = t; }
  static constexpr size_t kMaxPendingHellos = 256;

 private:
  Status listen_tcp(const std::string& host, int port);
  void serve();
  std::chrono::milliseconds hello_timeout_{2000};
  int listen_fd_ = -1, unix_fd_ = -1, wake_[2] = {-1, -1}, port_ = 0;
  std::string unix_name_;
  Attach attach_;
  std::thread thread_;
};

bool send_data_welcome(int fd);

// The client's side: connects to the server's Unix socket `unix_name` if
// it is given and reachable (the same host), else to the host of
// `server_uri` at `port` (0: none offered); says its hello and waits for the
// server's welcome (a refused ticket closes the connection: the error says
// so). kNotFound: nothing offered could be reached (the client may then move
// its chunks on the stream); any other error is the channel failing.
StatusOr<std::unique_ptr<DataSocket>> dial_data_channel(const std::string& server_uri, int port,
                                                        const std::string& unix_name, uint32_t client_id,
                                                        uint64_t ticket, int timeout_s);

// Reads chunks from `sock` until `total` bytes arrived, each into `buffer`
// (sized to the largest chunk allowed) and then to `on_chunk`; the header's
// length is bounded by the buffer before a payload byte is read, and
// `*received` counts what on_chunk took. `framed_chunk` > 0: the chunks are
// compressed frames, one per `framed_chunk` bytes of the model in order,
// each standing for that many model bytes whatever its own length.
Status read_data_chunks(DataSocket& sock, uint64_t total, std::span<std::byte> buffer, uint64_t* received,
                        const std::function<Status(const ChunkHeader&, std::span<const std::byte>)>& on_chunk,
                        uint64_t framed_chunk = 0);

// host and port of a gRPC target ("dns:///h:p", "ipv4:h:p", "[::1]:p", "h:p").
Status split_host_port(const std::string& uri, std::string* host, std::string* port);

// A ticket nobody can guess: 64 bits from the OS, never 0.
uint64_t draw_data_ticket();

}  // namespace memfl
