// MemorySampler: a thread that reads the process's resident set size from
// the kernel (/proc/self/statm) every few milliseconds, with phase marks
// (round k: broadcast, train, upload, aggregate, evaluate) set by the code
// that runs them. Writes memory.json and memory.csv into a run directory.
//
// Its own memory is bounded: when the sample buffer is full it keeps every
// other sample and doubles the period, so an hours-long run costs the same as
// a short one. The peak is exact whatever the decimation (it is also checked
// against the kernel's VmHWM).
//
//   MemorySampler sampler("simulation", 5);
//   sampler.start();
//   sampler.mark(1, "train");
//   ...
//   sampler.stop();
//   MEMFL_RETURN_IF_ERROR(sampler.write(run_dir));
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "memory/ledger.h"

namespace memfl {

// Current RSS of this process in bytes, from /proc/self/statm.
int64_t read_rss_bytes();
// RSS split: resident and file-backed (+ shared memory) bytes, from statm;
// anonymous = resident − file. Allocations are anonymous; mapped code and
// mmap'd files are not.
void read_rss_split(int64_t* resident, int64_t* file_backed);
// Peak RSS (VmHWM) of this process in bytes, from /proc/self/status.
int64_t read_peak_rss_bytes();
// Whether a shared library whose path contains `name` is mapped into this
// process (/proc/self/maps): a server states it never loaded libtorch.
bool maps_library(const std::string& name);

// Called with every phase mark of every sampler (null: none). A plain
// function pointer set once at start-up: memory/ stays below the code that
// watches it (live/ sets it when a role serves its live page).
using PhaseObserver = void (*)(int round, std::string_view phase);
void set_phase_observer(PhaseObserver observer);

class MemorySampler {
 public:
  MemorySampler(std::string role, int interval_ms, size_t max_samples = 200000);
  ~MemorySampler();
  MemorySampler(const MemorySampler&) = delete;
  MemorySampler& operator=(const MemorySampler&) = delete;

  void start();
  void stop();
  // Adds the GPU's memory to every sample (CUDA caching allocator: allocated
  // and reserved bytes); `probe` returns false when there is no GPU.
  using GpuProbe = std::function<bool(int64_t* allocated, int64_t* reserved, int64_t* peak_allocated)>;
  void set_gpu_probe(GpuProbe probe);
  // Starts phase `phase` of round `round` (round 0: set-up); ends the last one.
  void mark(int round, std::string_view phase);
  int64_t peak_rss() const { return peak_rss_.load(std::memory_order_relaxed); }
  size_t num_samples() const;
  int interval_ms() const { return interval_ms_.load(); }
  Status write(const std::string& dir) const;

  struct Sample {
    double t_ms;
    int64_t rss;
    int64_t rss_file;  // file-backed part of rss
    uint32_t phase;    // index into phases_
  };
  struct Phase {
    double t_ms;
    int round;
    std::string name;
  };
  std::vector<Sample> samples() const;
  std::vector<Phase> phases() const;

 private:
  void run();
  void record(int64_t rss, int64_t rss_file);
  void record_now();
  double now_ms() const;

  std::string role_;
  std::atomic<int> interval_ms_;
  size_t max_samples_;
  std::chrono::steady_clock::time_point t0_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  mutable std::mutex mu_;
  std::vector<Sample> samples_;
  std::vector<Phase> phases_;
  std::atomic<int64_t> peak_rss_{0};
  double peak_t_ms_ = 0;
  int64_t peak_rss_file_ = 0;
  uint32_t peak_phase_ = 0;
  LedgerSnapshot ledger_at_peak_;
  GpuProbe gpu_probe_;
  std::vector<std::array<int64_t, 2>> gpu_samples_;  // allocated, reserved (parallel to samples_)
  int64_t gpu_peak_allocated_ = 0, gpu_peak_reserved_ = 0;
};

// Stops `sampler` and writes memory.json / memory.csv into `dir` when it
// goes out of scope, however the scope is left: a run that fails part-way
// keeps what it measured.
class WriteMemoryOnExit {
 public:
  WriteMemoryOnExit(MemorySampler& sampler, std::string dir) : sampler_(sampler), dir_(std::move(dir)) {}
  ~WriteMemoryOnExit();
  WriteMemoryOnExit(const WriteMemoryOnExit&) = delete;
  WriteMemoryOnExit& operator=(const WriteMemoryOnExit&) = delete;

 private:
  MemorySampler& sampler_;
  std::string dir_;
};

}  // namespace memfl
