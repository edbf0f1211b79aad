#include "memory/sampler.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "memory/alloc_tracker.h"

namespace memfl {

namespace {
std::atomic<PhaseObserver> phase_observer{nullptr};
}  // namespace

void set_phase_observer(PhaseObserver observer) { phase_observer.store(observer, std::memory_order_release); }

void read_rss_split(int64_t* resident_bytes, int64_t* file_bytes) {
  *resident_bytes = *file_bytes = 0;
  // One open per call keeps this safe from any thread; ~2 µs.
  int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[128];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return;
  buf[n] = 0;
  long long size = 0, resident = 0, shared = 0;
  if (std::sscanf(buf, "%lld %lld %lld", &size, &resident, &shared) != 3) return;
  const int64_t page = sysconf(_SC_PAGESIZE);
  *resident_bytes = resident * page;
  *file_bytes = shared * page;
}

int64_t read_rss_bytes() {
  int64_t r, f;
  read_rss_split(&r, &f);
  return r;
}

int64_t read_peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

MemorySampler::MemorySampler(std::string role, int interval_ms, size_t max_samples)
    : role_(std::move(role)),
      interval_ms_(interval_ms),
      max_samples_(max_samples),
      t0_(std::chrono::steady_clock::now()) {
  samples_.reserve(std::min<size_t>(max_samples_, 4096));
  phases_.push_back({0.0, 0, "setup"});
}

MemorySampler::~MemorySampler() { stop(); }

double MemorySampler::now_ms() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
}

void MemorySampler::start() {
  if (running_.exchange(true)) return;
  record_now();
  thread_ = std::thread([this] { run(); });
}

void MemorySampler::stop() {
  if (!running_.exchange(false)) return;
  thread_.join();
  record_now();
}

void MemorySampler::run() {
  while (running_.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms_.load()));
    record_now();
  }
}

void MemorySampler::set_gpu_probe(GpuProbe probe) {
  std::lock_guard lock(mu_);
  gpu_probe_ = std::move(probe);
  gpu_samples_.assign(samples_.size(), {0, 0});
}

void MemorySampler::record_now() {
  int64_t r, f;
  read_rss_split(&r, &f);
  record(r, f);
}

void MemorySampler::record(int64_t rss, int64_t rss_file) {
  std::lock_guard lock(mu_);
  const uint32_t phase = static_cast<uint32_t>(phases_.size() - 1);
  const double t = now_ms();
  if (rss > peak_rss_.load(std::memory_order_relaxed)) {
    peak_rss_.store(rss, std::memory_order_relaxed);
    peak_t_ms_ = t;
    peak_phase_ = phase;
    peak_rss_file_ = rss_file;
    ledger_at_peak_ = Ledger::instance().snapshot();
  }
  if (samples_.size() >= max_samples_) {
    // Keep every other sample, and sample half as often from now on.
    size_t j = 0;
    for (size_t i = 0; i < samples_.size(); i += 2) {
      if (gpu_probe_) gpu_samples_[j] = gpu_samples_[i];
      samples_[j++] = samples_[i];
    }
    samples_.resize(j);
    if (gpu_probe_) gpu_samples_.resize(j);
    interval_ms_.store(interval_ms_.load() * 2);
  }
  samples_.push_back({t, rss, rss_file, phase});
  if (gpu_probe_) {
    int64_t a = 0, r = 0, p = 0;
    gpu_probe_(&a, &r, &p);
    gpu_samples_.push_back({a, r});
    gpu_peak_allocated_ = std::max({gpu_peak_allocated_, a, p});
    gpu_peak_reserved_ = std::max(gpu_peak_reserved_, r);
  }
}

void MemorySampler::mark(int round, std::string_view phase) {
  int64_t rss, rss_file;
  read_rss_split(&rss, &rss_file);
  {
    std::lock_guard lock(mu_);
    phases_.push_back({now_ms(), round, std::string(phase)});
  }
  record(rss, rss_file);  // every phase starts with a sample, however short it is
  const std::string name(phase);
  alloc_tracker_mark(round, name.c_str());  // the profile knows the phases too
  if (PhaseObserver o = phase_observer.load(std::memory_order_acquire)) o(round, phase);  // the live page
}

size_t MemorySampler::num_samples() const {
  std::lock_guard lock(mu_);
  return samples_.size();
}

std::vector<MemorySampler::Sample> MemorySampler::samples() const {
  std::lock_guard lock(mu_);
  return samples_;
}

std::vector<MemorySampler::Phase> MemorySampler::phases() const {
  std::lock_guard lock(mu_);
  return phases_;
}

Status MemorySampler::write(const std::string& dir) const {
  std::lock_guard lock(mu_);
  namespace fs = std::filesystem;
  nlohmann::ordered_json j;
  j["format"] = "memfl.memory";
  j["version"] = 1;
  j["role"] = role_;
  j["pid"] = static_cast<int64_t>(getpid());
  j["interval_ms"] = interval_ms_.load();
  j["start_rss_bytes"] = samples_.empty() ? 0 : samples_.front().rss;
  j["start_rss_anon_bytes"] = samples_.empty() ? 0 : samples_.front().rss - samples_.front().rss_file;
  j["peak_rss_bytes"] = peak_rss_.load();
  j["peak_t_ms"] = peak_t_ms_;
  j["peak_rss_file_bytes"] = peak_rss_file_;
  j["peak_rss_anon_bytes"] = peak_rss_.load() - peak_rss_file_;
  j["peak_phase"] = {{"round", phases_[peak_phase_].round}, {"phase", phases_[peak_phase_].name}};
  j["vm_hwm_bytes"] = read_peak_rss_bytes();
  nlohmann::ordered_json ledger = nlohmann::ordered_json::object();
  const auto now = Ledger::instance().snapshot();
  for (size_t c = 0; c < static_cast<size_t>(MemoryCategory::kCount); ++c) {
    ledger[std::string(memory_category_name(static_cast<MemoryCategory>(c)))] = {
        {"current_bytes", now.current[c]},
        {"peak_bytes", now.peak[c]},
        {"at_rss_peak_bytes", ledger_at_peak_.current[c]}};
  }
  j["ledger"] = ledger;
  // Per phase: start, end and the peak RSS sampled inside it.
  nlohmann::ordered_json phases = nlohmann::ordered_json::array();
  std::vector<int64_t> phase_peak(phases_.size(), 0);
  for (const auto& s : samples_) phase_peak[s.phase] = std::max(phase_peak[s.phase], s.rss);
  for (size_t i = 0; i < phases_.size(); ++i) {
    const double end = i + 1 < phases_.size() ? phases_[i + 1].t_ms : (samples_.empty() ? 0 : samples_.back().t_ms);
    phases.push_back({{"round", phases_[i].round},
                      {"phase", phases_[i].name},
                      {"start_ms", phases_[i].t_ms},
                      {"end_ms", end},
                      {"peak_rss_bytes", phase_peak[i]}});
  }
  j["phases"] = phases;
  nlohmann::json t = nlohmann::json::array(), r = nlohmann::json::array(), rf = nlohmann::json::array();
  for (const auto& s : samples_) {
    t.push_back(std::round(s.t_ms * 100) / 100);
    r.push_back(s.rss);
    rf.push_back(s.rss_file);
  }
  j["samples"] = {{"t_ms", t}, {"rss_bytes", r}, {"rss_file_bytes", rf}};
  if (gpu_probe_) {
    nlohmann::json ga = nlohmann::json::array(), gr = nlohmann::json::array();
    for (const auto& g : gpu_samples_) {
      ga.push_back(g[0]);
      gr.push_back(g[1]);
    }
    j["gpu"] = {{"peak_allocated_bytes", gpu_peak_allocated_},
                {"peak_reserved_bytes", gpu_peak_reserved_},
                {"allocated_bytes", ga},
                {"reserved_bytes", gr}};
  }
  const fs::path json_path = fs::path(dir) / "memory.json";
  std::ofstream out(json_path);
  if (!out) return not_found("cannot write {}", json_path.string());
  out << j.dump(1) << "\n";
  const fs::path csv_path = fs::path(dir) / "memory.csv";
  std::ofstream csv(csv_path);
  if (!csv) return not_found("cannot write {}", csv_path.string());
  csv << "t_ms,rss_bytes,rss_file_bytes,round,phase\n";
  for (const auto& s : samples_) {
    csv << fmt::format("{:.2f},{},{},{},{}\n", s.t_ms, s.rss, s.rss_file, phases_[s.phase].round,
                       phases_[s.phase].name);
  }
  return Status::Ok();
}

WriteMemoryOnExit::~WriteMemoryOnExit() {
  sampler_.stop();
  Status st = sampler_.write(dir_);
  if (!st.ok()) std::fprintf(stderr, "memfl: %s\n", st.message().c_str());
}

bool maps_library(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find(name) != std::string::npos) return true;
  }
  return false;
}

}  // namespace memfl
