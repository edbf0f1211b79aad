// Bare gRPC over loopback: what gRPC itself moves on this
// machine in memfl's message pattern, with none of memfl's session logic.
// The same shape as tcp_raw_bandwidth and `memfl bench transfer`: one server,
// N client processes, each on one bidirectional stream of memfl's method
// with memfl's frames (comm/grpc/wire.h: 1 MiB chunks handed to gRPC as
// slices of the model, no serialised copy) and memfl's channel settings
// (message limits, no BDP probing, the same HTTP/2 windows). Per round the
// server writes its model to every client at once (a handler thread each)
// and each client copies the chunks it reads into its model buffer; then
// every client writes its model back and the server reads it (the slices
// are dropped: no fold). With HASH=1 both sides also compute each chunk's
// xxh3, as memfl's do. No read-ahead thread, no fold, no aggregator: the
// distance from this to raw TCP is gRPC's; from memfl to this, memfl's.
//
// API=callback serves the same protocol with gRPC's callback API (a
// ServerBidiReactor per stream: reads and writes complete on gRPC's own
// threads, which the synchronous API hands over to the handler's thread);
// the clients stay synchronous, as memfl's.
//
// Usage: grpc_raw_bandwidth MODEL_MB CLIENTS HASH REPS [sync|callback]
// Prints one JSON object: the best and median of REPS rounds per direction.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/method_handler.h>
#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include "huge_buffer.h"

#include <algorithm>
#include <barrier>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/chunk.h"
#include "comm/grpc/wire.h"

namespace {

using memfl::Frame;
using Clock = std::chrono::steady_clock;
constexpr size_t kChunk = memfl::kMaxGrpcChunk;
constexpr int kField = memfl::kClientChunkField;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "grpc_raw_bandwidth: %s\n", what);
  std::exit(1);
}

// Writes `bytes` of `data` as chunk frames, then one empty chunk (the end).
template <typename Stream>
void send_model(Stream* s, const std::byte* data, size_t bytes, bool hash) {
  for (size_t off = 0; off < bytes; off += kChunk) {
    const size_t len = std::min(kChunk, bytes - off);
    const std::span<const std::byte> chunk(data + off, len);
    const memfl::ChunkHeader h{1, off, len, hash ? memfl::chunk_checksum(chunk) : 0};
    if (!s->Write(memfl::encode_chunk_frame(kField, h, chunk, nullptr))) die("write");
  }
  if (!s->Write(memfl::encode_chunk_frame(kField, memfl::ChunkHeader{1, bytes, 0, 0}, {}, nullptr))) die("write end");
}

// Reads chunk frames until the empty one; copies each into `into` (when
// given) and checks its xxh3 (with `hash`).
template <typename Stream>
void receive_model(Stream* s, std::byte* into, size_t bytes, bool hash) {
  Frame f;
  memfl::DecodedFrame d;
  memfl::wire::ServerMessage unused;
  while (true) {
    if (!s->Read(&f)) die("read");
    if (!memfl::decode_frame(f, kField, "peer", &d, &unused).ok() || !d.is_chunk) die("decode");
    if (d.header.length == 0) return;
    if (d.header.offset + d.header.length > bytes) die("chunk out of range");
    uint64_t sum = 0;
    if (into != nullptr) {
      sum = memfl::copy_with_checksum(into + d.header.offset, d.payload());
    } else if (hash) {
      sum = memfl::chunk_checksum(d.payload());
    }
    if (hash && sum != d.header.checksum) die("checksum");
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The times of one round, taken by the barrier's completion step (it runs
// once, when every handler has arrived).
struct Round {
  double down = 0, up = 0;
};

class Bench final : public grpc::Service {
 public:
  Bench(size_t bytes, int clients, bool hash, int reps)
      : bytes_(bytes), hash_(hash), reps_(reps), global_(bytes, 7), rounds_(reps), sync_(clients, Phase{this}) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        memfl::kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<Bench, Frame, Frame>(
            [](Bench* b, grpc::ServerContext*, grpc::ServerReaderWriter<Frame, Frame>* s) { return b->session(s); },
            this)));
  }
  const std::vector<Round>& rounds() const { return rounds_; }

 private:
  // Phases of a round: 0 every client is in (the download starts), 1 every
  // client has the model (the upload starts), 2 every update is in.
  struct Phase {
    Bench* b;
    void operator()() noexcept { b->on_phase(); }
  };
  void on_phase() {
    const auto now = Clock::now();
    const double since = std::chrono::duration<double>(now - mark_).count();
    Round& r = rounds_[static_cast<size_t>(phase_ / 3)];
    if (phase_ % 3 == 1) r.down = since;
    if (phase_ % 3 == 2) r.up = since;
    mark_ = now;
    ++phase_;
  }
  grpc::Status session(grpc::ServerReaderWriter<Frame, Frame>* s) {
    for (int r = 0; r < reps_; ++r) {
      sync_.arrive_and_wait();
      send_model(s, reinterpret_cast<const std::byte*>(global_.data()), bytes_, hash_);
      Frame ack;
      if (!s->Read(&ack)) die("ack");  // the client has all of it
      sync_.arrive_and_wait();
      receive_model(s, static_cast<std::byte*>(nullptr), bytes_, hash_);
      sync_.arrive_and_wait();
    }
    return grpc::Status::OK;
  }

  size_t bytes_;
  bool hash_;
  int reps_;
  HugeBuffer global_;
  std::vector<Round> rounds_;
  int phase_ = 0;
  Clock::time_point mark_;
  std::barrier<Phase> sync_;
};

// The callback-API server. The main thread runs the rounds: it starts each
// phase on every stream's reactor and waits until all have finished it; a
// reactor never blocks a gRPC thread.
class CallbackBench final : public grpc::Service {
 public:
  CallbackBench(size_t bytes, bool hash) : bytes_(bytes), hash_(hash), global_(bytes, 7) {
    AddMethod(new grpc::internal::RpcServiceMethod(memfl::kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING,
                                                   nullptr));
    MarkMethodCallback(0, new grpc::internal::CallbackBidiHandler<Frame, Frame>(
                              [this](grpc::CallbackServerContext*) { return new Reactor(this); }));
  }
  // Runs `reps` rounds once `clients` streams are open; their times.
  std::vector<Round> run(int clients, int reps) {
    std::vector<Round> rounds;
    wait_for([&] { return static_cast<int>(reactors_.size()) == clients; });
    for (int r = 0; r < reps; ++r) {
      Round round;
      round.down = phase(clients, &Reactor::begin_download);
      round.up = phase(clients, &Reactor::begin_upload);
      rounds.push_back(round);
    }
    for (Reactor* x : reactors_) x->close();
    return rounds;
  }

 private:
  class Reactor final : public grpc::ServerBidiReactor<Frame, Frame> {
   public:
    explicit Reactor(CallbackBench* b) : b_(b) { b_->add(this); }
    void begin_download() {
      off_ = 0;
      end_sent_ = false;
      state_ = State::kDownload;
      write_next();
    }
    void begin_upload() {
      state_ = State::kUpload;
      StartRead(&in_);
    }
    void close() {
      state_ = State::kClosing;
      StartRead(&in_);  // completes with ok = false once the client is done
    }
    void OnWriteDone(bool ok) override {
      if (!ok) die("write");
      write_next();
    }
    void OnReadDone(bool ok) override {
      if (state_ == State::kClosing) {
        if (ok) die("a frame after the last round");
        Finish(grpc::Status::OK);
        return;
      }
      if (!ok) die("read");
      if (state_ == State::kAck) {
        b_->done();
        return;
      }
      memfl::wire::ClientMessage unused;
      if (!memfl::decode_frame(in_, kField, "peer", &d_, &unused).ok() || !d_.is_chunk) die("decode");
      if (d_.header.length == 0) {
        b_->done();
        return;
      }
      if (b_->hash_ && memfl::chunk_checksum(d_.payload()) != d_.header.checksum) die("checksum");
      StartRead(&in_);
    }
    void OnDone() override { delete this; }

   private:
    enum class State { kDownload, kAck, kUpload, kClosing };
    void write_next() {
      if (off_ < b_->bytes_) {
        const size_t len = std::min(kChunk, b_->bytes_ - off_);
        const std::span<const std::byte> chunk(reinterpret_cast<const std::byte*>(b_->global_.data()) + off_, len);
        out_ = memfl::encode_chunk_frame(
            kField, memfl::ChunkHeader{1, off_, len, b_->hash_ ? memfl::chunk_checksum(chunk) : 0}, chunk, nullptr);
        off_ += len;
        StartWrite(&out_);
      } else if (!end_sent_) {
        end_sent_ = true;
        out_ = memfl::encode_chunk_frame(kField, memfl::ChunkHeader{1, b_->bytes_, 0, 0}, {}, nullptr);
        StartWrite(&out_);
      } else {
        state_ = State::kAck;
        StartRead(&in_);
      }
    }
    CallbackBench* b_;
    State state_ = State::kDownload;
    size_t off_ = 0;
    bool end_sent_ = false;
    Frame out_, in_;
    memfl::DecodedFrame d_;
  };

  void add(Reactor* r) {
    std::lock_guard lock(mu_);
    reactors_.push_back(r);
    cv_.notify_all();
  }
  void done() {
    std::lock_guard lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  template <typename Pred>
  void wait_for(Pred pred) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, pred);
  }
  // Starts `begin` on every reactor; seconds until all are done.
  double phase(int clients, void (Reactor::*begin)()) {
    {
      std::lock_guard lock(mu_);
      done_ = 0;
    }
    const auto t0 = Clock::now();
    for (Reactor* x : reactors_) (x->*begin)();
    wait_for([&] { return done_ == clients; });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  size_t bytes_;
  bool hash_;
  HugeBuffer global_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Reactor*> reactors_;
  int done_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: %s MODEL_MB CLIENTS HASH REPS [sync|callback]\n", argv[0]);
    return 2;
  }
  const size_t bytes = static_cast<size_t>(std::atof(argv[1]) * (1 << 20));
  const int clients = std::atoi(argv[2]);
  const bool hash = std::atoi(argv[3]) != 0;
  const int reps = std::atoi(argv[4]);
  const bool callback = argc == 6 && std::strcmp(argv[5], "callback") == 0;
  // memfl's malloc policy for streaming roles (roles/grpc_server.cpp,
  // before the fork, so the clients have it too): with glibc's defaults each
  // of gRPC's MiB-sized receive buffers is a fresh mmap, and its page faults,
  // not gRPC, set the rate (0.3–0.4 GB/s on the EPYC VM of 2026-11-27).
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  mallopt(M_ARENA_MAX, 2);
  if (bytes == 0 || clients < 1 || reps < 1 || (argc == 6 && !callback && std::strcmp(argv[5], "sync") != 0)) {
    std::fprintf(stderr, "MODEL_MB, CLIENTS and REPS must be positive\n");
    return 2;
  }
  const int limit = memfl::max_message_bytes(static_cast<int64_t>(memfl::kMaxTransferChunk), 0);
  // The clients fork before the server exists (gRPC's threads do not
  // survive a fork) and learn its port through a pipe.
  int ports[2];
  if (::pipe(ports) != 0) die("pipe");
  std::vector<pid_t> pids;
  for (int c = 0; c < clients; ++c) {
    const pid_t pid = ::fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    int port = 0;
    if (::read(ports[0], &port, sizeof port) != sizeof port) die("port");
    // A client: a channel of its own, as memfl's (comm/grpc/client_session.cpp).
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(limit);
    args.SetMaxSendMessageSize(limit);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, memfl::stream_window_bytes(kChunk));
    auto channel =
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args);
    grpc::ClientContext ctx;
    grpc::internal::RpcMethod method(memfl::kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel);
    std::unique_ptr<grpc::ClientReaderWriter<Frame, Frame>> s(
        grpc::internal::ClientReaderWriterFactory<Frame, Frame>::Create(channel.get(), method, &ctx));
    HugeBuffer model(bytes, c + 1);
    for (int r = 0; r < reps; ++r) {
      receive_model(s.get(), reinterpret_cast<std::byte*>(model.data()), bytes, hash);
      if (!s->Write(memfl::encode_chunk_frame(kField, memfl::ChunkHeader{1, 0, 0, 0}, {}, nullptr))) die("ack");
      send_model(s.get(), reinterpret_cast<const std::byte*>(model.data()), bytes, hash);
    }
    s->WritesDone();
    (void)s->Finish();
    std::_Exit(0);
  }
  // Only the chosen server is built: each holds a model.
  std::optional<Bench> sync_service;
  std::optional<CallbackBench> callback_service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, memfl::stream_window_bytes(kChunk, 1));
  if (callback) {
    builder.RegisterService(&callback_service.emplace(bytes, hash));
  } else {
    builder.RegisterService(&sync_service.emplace(bytes, clients, hash, reps));
  }
  auto server = builder.BuildAndStart();
  if (!server || port == 0) die("listen");
  for (int c = 0; c < clients; ++c) {
    if (::write(ports[1], &port, sizeof port) != sizeof port) die("port");
  }
  const std::vector<Round> rounds = callback ? callback_service->run(clients, reps) : std::vector<Round>{};
  int status = 0;
  for (pid_t p : pids) {
    if (::waitpid(p, &status, 0) != p || !WIFEXITED(status) || WEXITSTATUS(status) != 0) die("a client failed");
  }
  server->Shutdown();
  std::vector<double> down, up;
  for (const Round& r : callback ? rounds : sync_service->rounds()) {
    down.push_back(static_cast<double>(bytes) * clients / r.down / 1e9);
    up.push_back(static_cast<double>(bytes) * clients / r.up / 1e9);
  }
  std::printf(
      "{\"api\": \"%s\", \"model_bytes\": %zu, \"clients\": %d, \"chunk_bytes\": %zu, \"xxh3\": %s, \"reps\": %d, "
      "\"download_gbps_best\": %.3f, \"download_gbps_median\": %.3f, \"upload_gbps_best\": %.3f, "
      "\"upload_gbps_median\": %.3f}\n",
      callback ? "callback" : "sync", bytes, clients, kChunk, hash ? "true" : "false", reps,
      *std::max_element(down.begin(), down.end()), median(down), *std::max_element(up.begin(), up.end()), median(up));
  return 0;
}
