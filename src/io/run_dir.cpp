#include "io/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <atomic>
#include <filesystem>
#include <fstream>

#include "memory/sampler.h"

namespace memfl {

namespace {
std::atomic<RoundRowObserver> round_row_observer{nullptr};
}  // namespace

void set_round_row_observer(RoundRowObserver observer) {
  round_row_observer.store(observer, std::memory_order_release);
}

namespace fs = std::filesystem;

StatusOr<std::string> prepare_run_dir(const std::string& out, const ExperimentConfig& cfg) {
  std::string dir = out;
  if (dir.empty()) {
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
    dir = (fs::path(cfg.server.logging_output_dirname) / fmt::format("{}-{}", stamp, getpid())).string();
  }
  if (fs::exists(fs::path(dir) / "metrics.csv")) {
    return invalid_argument("run directory {} already holds a run (metrics.csv); choose another --out", dir);
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return invalid_argument("cannot create run directory {}: {}", dir, ec.message());
  return dir;
}

StatusOr<RunDirLock> RunDirLock::acquire(const std::string& dir) {
  const std::string path = (fs::path(dir) / "run.lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return invalid_argument("run directory {}: cannot open {}: {}", dir, path, std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK)
      return invalid_argument("run directory {}: cannot lock {}: {}", dir, path, std::strerror(err));
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    return failed_precondition(
        "run directory {} is in use by process {} (it holds {}); wait for it to end or stop it — two processes "
        "writing one run would interleave its checkpoint, state and metrics",
        dir, holder, path);
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    ::close(fd);
    return invalid_argument("run directory {}: cannot write {}: {}", dir, path, std::strerror(errno));
  }
  return RunDirLock(fd);
}

RunDirLock::~RunDirLock() {
  // The lock goes with the descriptor; the file stays (removing it would
  // race with a process that has just opened it to wait its turn).
  if (fd_ >= 0) ::close(fd_);
}

StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::open(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return not_found("cannot write {}: {}", path, std::strerror(errno));
  std::fputs(
      "round,clients,train_loss,train_accuracy,val_loss,val_accuracy,test_loss,test_accuracy,bytes_moved,"
      "round_seconds,peak_rss_bytes,download_seconds,upload_seconds,bytes_down,bytes_up,rss_bytes,commit_seconds,"
      "threads,open_fds,virtual_seconds,bytes_up_raw,test_perplexity\n",
      f);
  std::fflush(f);
  return std::unique_ptr<MetricsWriter>(new MetricsWriter(f));
}

MetricsWriter::~MetricsWriter() { std::fclose(f_); }

Status MetricsWriter::append(const RoundMetrics& m) {
  std::fputs(fmt::format("{},{},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{},{:.3f},{},{:.6f},{:.6f},{},{},{},{:.3f},{}"
                         ",{},{:.3f},{},{:.6g}\n",
                         m.round, m.clients, m.train_loss, m.train_accuracy, m.val_loss, m.val_accuracy, m.test_loss,
                         m.test_accuracy, m.bytes_moved, m.round_seconds, m.peak_rss_bytes, m.download_seconds,
                         m.upload_seconds, m.bytes_down, m.bytes_up, m.rss_bytes, m.commit_seconds, m.threads,
                         m.open_fds, m.virtual_seconds, m.bytes_up_raw,
                         // exp of the held-out mean loss per token (per sample for a
                         // classifier); 0 for a round the server did not evaluate.
                         m.test_loss > 0 ? std::exp(m.test_loss) : 0.0)
                 .c_str(),
             f_);
  if (std::fflush(f_) != 0) return internal_error("writing metrics.csv failed: {}", std::strerror(errno));
  // Every driver writes its rows here: the live page's curves follow them.
  if (RoundRowObserver o = round_row_observer.load(std::memory_order_acquire)) o(m);
  return Status::Ok();
}

namespace {
int count_entries(const char* dir) {
  std::error_code ec;
  int n = 0;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
  return n;
}
}  // namespace

int count_threads() { return count_entries("/proc/self/task"); }
// Less the descriptor the listing itself holds open.
int count_open_fds() { return count_entries("/proc/self/fd") - 1; }

void record_process_metrics(const MemorySampler& sampler, RoundMetrics* m) {
  m->peak_rss_bytes = sampler.peak_rss();
  m->rss_bytes = read_rss_bytes();
  m->threads = count_threads();
  m->open_fds = count_open_fds();
}

Status write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) return not_found("cannot write {}", path);
  out << text;
  return out ? Status::Ok() : internal_error("writing {} failed", path);
}

Status append_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::app);
  if (!out) return not_found("cannot append to {}", path);
  out << text;
  return out ? Status::Ok() : internal_error("appending to {} failed", path);
}

}  // namespace memfl
