#include "server/model_worker.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "client/client_work.h"
#include "comm/chunk.h"
#include "io/process.h"
#include "memory/sampler.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace {

// What crosses the pipe besides the chunks (host byte order: one machine).
constexpr uint64_t kBeginMagic = 0x6d656d666c457631ULL;  // "memflEv1"
struct EvalBegin {
  uint64_t magic = kBeginMagic;
  int64_t round = 0;
  uint64_t layout_hash = 0;
  uint64_t total_bytes = 0;
  int32_t threads = 0;  // > 0: evaluate on this many threads from now on
  int32_t pad = 0;
};
struct EvalReply {
  uint64_t magic = kBeginMagic;
  int64_t round = 0;
  double loss = 0, accuracy = 0;
  int64_t num_samples = 0;
  uint64_t error_bytes = 0;  // an error message of this length follows
};

Status write_all(int fd, const void* data, size_t n, const char* what) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      return Status(StatusCode::kUnavailable,
                    fmt::format("model worker: writing {} failed: {}", what, std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

// Reads exactly n bytes; false at a clean end of stream before the first byte.
StatusOr<bool> read_all(int fd, void* data, size_t n, const char* what) {
  auto* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd, p + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && got == 0) return false;
    if (r <= 0) {
      return Status(StatusCode::kUnavailable, fmt::format("model worker: {} ended after {} of {} bytes", what, got, n));
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

// A chunk sink that writes to the pipe: header, then the bytes straight
// from the arena (the kernel's pipe buffer is the only copy).
class PipeSink final : public ChunkSink {
 public:
  explicit PipeSink(int fd) : fd_(fd) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload p) override {
    MEMFL_RETURN_IF_ERROR(write_all(fd_, &h, sizeof h, "a chunk header"));
    for (auto part : p) MEMFL_RETURN_IF_ERROR(write_all(fd_, part.data(), part.size(), "a chunk"));
    return Status::Ok();
  }

 private:
  int fd_;
};

}  // namespace

Status write_initial_model(const std::string& config_path, const std::string& out_path, const std::string& log_path) {
  MEMFL_ASSIGN_OR_RETURN(pid_t pid,
                         spawn_process({self_executable(), "model-worker", config_path, "--write-initial", out_path},
                                       {.log_path = log_path, .append = true}));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return internal_error("the model worker could not write the initial model ({}); its log {}:\n{}", out_path,
                          log_path, tail_of_file(log_path, 1500));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<ModelWorker>> ModelWorker::start(const std::string& config_path, const Layout& layout,
                                                          size_t chunk, const std::string& log_path) {
  int down[2], up[2];
  if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0) {
    return internal_error("model worker: pipe: {}", std::strerror(errno));
  }
  std::unique_ptr<ModelWorker> w(new ModelWorker(layout, chunk));
  w->log_path_ = log_path;
  auto pid = spawn_process({self_executable(), "model-worker", config_path},
                           {.log_path = log_path, .append = true, .stdin_fd = down[0], .stdout_fd = up[1]});
  ::close(down[0]);
  ::close(up[1]);
  w->to_worker_ = down[1];
  w->from_worker_ = up[0];
  if (!pid.ok()) return pid.status();
  w->pid_ = *pid;
  // A worker that dies must not kill the server with SIGPIPE: the write fails instead.
  ::signal(SIGPIPE, SIG_IGN);
  return w;
}

ModelWorker::~ModelWorker() {
  if (to_worker_ >= 0) ::close(to_worker_);  // end of stdin: the worker exits
  if (from_worker_ >= 0) ::close(from_worker_);
  if (pid_ > 0) {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

int machine_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

StatusOr<EvalResult> ModelWorker::evaluate(int round, const Arena& global) {
  MEMFL_RETURN_IF_ERROR(begin_evaluation(round, global));
  return end_evaluation(round);
}

Status ModelWorker::begin_evaluation(int round, const Arena& global, int threads) {
  EvalBegin b;
  b.round = round;
  b.threads = threads;
  b.layout_hash = layout_.hash();
  b.total_bytes = layout_.total_bytes();
  if (Status s = write_all(to_worker_, &b, sizeof b, "the model header"); !s.ok()) return with_log(s);
  PipeSink sink(to_worker_);
  if (auto sent = stream_arena(layout_, global, chunk_, sink); !sent.ok()) return with_log(sent.status());
  return Status::Ok();
}

StatusOr<EvalResult> ModelWorker::end_evaluation(int round) {
  EvalReply r;
  auto got = read_all(from_worker_, &r, sizeof r, "the evaluation reply");
  if (!got.ok()) return with_log(got.status());
  if (!*got || r.magic != kBeginMagic || r.round != round) {
    return with_log(internal_error("model worker: no answer for round {}", round));
  }
  if (r.error_bytes > 0) {
    std::string msg(std::min<uint64_t>(r.error_bytes, 1 << 16), '\0');
    (void)read_all(from_worker_, msg.data(), msg.size(), "the error message");
    return internal_error("model worker, round {}: {}", round, msg);
  }
  return EvalResult{r.loss, r.accuracy, r.num_samples};
}

Status ModelWorker::with_log(const Status& s) const {
  return Status(s.code(), fmt::format("{} (its log {}:\n{})", s.message(), log_path_, tail_of_file(log_path_, 1500)));
}

Status run_model_worker(const std::string& config_path, const std::string& write_initial) {
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg, load_config_file(config_path, {}));
  MEMFL_ASSIGN_OR_RETURN(DatasetSplits data, load_data(cfg));
  MEMFL_ASSIGN_OR_RETURN(InputSpec input, input_spec(cfg, data.train));
  // The initial global model: the same construction and seed as every client.
  MEMFL_ASSIGN_OR_RETURN(LocalModel model,
                         make_local_model(cfg, input, /*fill=*/true, cfg.server.seed, /*run_dir=*/{}));
  const Layout& layout = model.layout();
  if (!write_initial.empty()) {
    return write_safetensors(write_initial, layout, model.arena(),
                             {{"format", "memfl"}, {"round", "0"}, {"model_name", cfg.model.model_name}});
  }
  std::vector<uint32_t> idx(data.test.size());
  std::iota(idx.begin(), idx.end(), 0u);
  // Replies go to the pipe the server reads; whatever else prints to stdout
  // (logs) goes to the log instead.
  const int reply = ::dup(1);
  ::dup2(2, 1);
  while (true) {
    EvalBegin b;
    MEMFL_ASSIGN_OR_RETURN(bool more, read_all(0, &b, sizeof b, "a model header"));
    if (!more) {  // the server closed the pipe: done
      spdlog::info("model worker: done, peak RSS {} (the kernel's VmHWM)",
                   format_bytes(static_cast<double>(read_peak_rss_bytes())));
      return Status::Ok();
    }
    if (b.magic != kBeginMagic || b.layout_hash != layout.hash() || b.total_bytes != layout.total_bytes()) {
      return data_loss(
          "model worker: the server's model (layout {:016x}, {} bytes) is not this network's ({:016x}, {})",
          b.layout_hash, b.total_bytes, layout.hash(), layout.total_bytes());
    }
    // The chunks, checked as any receiver checks them.
    ArenaWriter into(layout, model.arena(), "server");
    std::vector<std::byte> buf;
    while (into.received() < layout.total_bytes()) {
      ChunkHeader h;
      MEMFL_ASSIGN_OR_RETURN(bool ok, read_all(0, &h, sizeof h, "a chunk header"));
      if (!ok || h.length > kMaxTransferChunk) return data_loss("model worker: bad chunk header from the server");
      buf.resize(h.length);
      MEMFL_ASSIGN_OR_RETURN(ok, read_all(0, buf.data(), buf.size(), "a chunk"));
      MEMFL_RETURN_IF_ERROR(into.accept(h, std::span<const std::byte>(buf.data(), buf.size())));
    }
    MEMFL_RETURN_IF_ERROR(into.finish());
    EvalReply r;
    r.round = b.round;
    if (b.threads > 0) {
      MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
      backend->set_num_threads(b.threads);
    }
    auto ev = model.replica()->evaluate(data.test, idx, cfg.server.eval_batch_size);
    std::string err;
    if (ev.ok()) {
      r.loss = ev->loss;
      r.accuracy = ev->accuracy;
      r.num_samples = ev->num_samples;
    } else {
      err = ev.status().message();
      r.error_bytes = err.size();
    }
    MEMFL_RETURN_IF_ERROR(write_all(reply, &r, sizeof r, "the reply"));
    if (!err.empty()) MEMFL_RETURN_IF_ERROR(write_all(reply, err.data(), err.size(), "the error"));
  }
}

}  // namespace memfl
