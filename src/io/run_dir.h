// The run directory: everything a run measured, written as it goes so a run
// that fails part-way keeps what it had (config.yaml first, metrics.csv one
// flushed row per round, memory.json at the end or on failure).
#pragma once

#include <cstdio>
#include <string>

#include "common/status.h"
#include "config/config.h"

namespace memfl {

// `out` if given, else <logging_output_dirname>/<timestamp>-<pid>. Refuses a
// directory that already holds a run (metrics.csv), so nothing is overwritten.
StatusOr<std::string> prepare_run_dir(const std::string& out, const ExperimentConfig& cfg);

// An exclusive hold on a run directory for as long as it lives: two
// processes writing one run (a resume started twice, two servers on one
// --out) would interleave its checkpoint, state and metrics. A flock on
// RUN_DIR/run.lock, so a process that dies, even by kill -9, releases it;
// the file holds the holder's pid for the message the next one gets.
class RunDirLock {
 public:
  // Refused (naming the holder's pid) when another live process holds it.
  static StatusOr<RunDirLock> acquire(const std::string& dir);
  RunDirLock(RunDirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  RunDirLock& operator=(RunDirLock&&) = delete;
  RunDirLock(const RunDirLock&) = delete;
  ~RunDirLock();

 private:
  explicit RunDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

struct RoundMetrics {
  int round = 0;
  int clients = 0;
  double train_loss = 0, train_accuracy = 0;
  double val_loss = 0, val_accuracy = 0;
  double test_loss = 0, test_accuracy = 0;
  uint64_t bytes_moved = 0;
  double round_seconds = 0;
  // Transfer phases: wall seconds from the first byte to the last of all
  // clients' downloads (broadcast) and uploads, and the bytes each moved.
  double download_seconds = 0, upload_seconds = 0;
  uint64_t bytes_down = 0, bytes_up = 0;  // on the wire (compressed updates: their frames)
  uint64_t bytes_up_raw = 0;              // the updates' model bytes (bytes_up uncompressed)
  int64_t rss_bytes = 0;                  // RSS when the round ended (flat memory is checked on this)
  int64_t peak_rss_bytes = 0;
  // Committing the server's state after the round (checkpoint written and
  // fsynced, state file): not part of round_seconds.
  double commit_seconds = 0;
  // The server process's threads and open file descriptors when the round
  // ended: a leak shows as a slope over rounds (the soak checks it).
  int threads = 0, open_fds = 0;
  // Simulated time at the end of the round (the simulator's per-client
  // speeds, server_configs.client_speed_*): a round lasts as long as its
  // slowest selected client; asynchronous runs count their own clock.
  double virtual_seconds = 0;
};

// Threads and open descriptors of this process (/proc/self).
int count_threads();
int count_open_fds();

class MemorySampler;
// The process's columns of a metrics row, written alike by every driver:
// RSS now, the sampler's peak, threads and open descriptors.
void record_process_metrics(const MemorySampler& sampler, RoundMetrics* m);

// Called with every row any MetricsWriter appends (null: none); set once at
// start-up by live/ when a role serves its live page, so io/ does not
// depend on it.
using RoundRowObserver = void (*)(const RoundMetrics& m);
void set_round_row_observer(RoundRowObserver observer);

class MetricsWriter {
 public:
  static StatusOr<std::unique_ptr<MetricsWriter>> open(const std::string& path);
  ~MetricsWriter();
  Status append(const RoundMetrics& m);

 private:
  explicit MetricsWriter(FILE* f) : f_(f) {}
  FILE* f_;
};

Status write_text_file(const std::string& path, const std::string& text);
// Appends (a CSV's rows written as a run goes, so a killed run keeps them).
Status append_text_file(const std::string& path, const std::string& text);

}  // namespace memfl
