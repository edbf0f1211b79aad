#include "memory/budget.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <mutex>
#include <sstream>

#include <spdlog/spdlog.h>

namespace memfl {

namespace {

// Above this a cgroup "limit" is the kernel's way of saying none (v1 writes
// PAGE_COUNTER_MAX × page size, about 2^63); no machine has an exbibyte.
constexpr int64_t kNoLimitAbove = int64_t{1} << 60;

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<std::string> read_text(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::optional<int64_t> parse_cgroup_memory_limit(std::string_view text) {
  text = trim(text);
  if (text.empty() || text == "max") return std::nullopt;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // An overflow of int64 is "absurdly large" too.
  if (ec == std::errc::result_out_of_range) return std::nullopt;
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  if (v <= 0 || v >= kNoLimitAbove) return std::nullopt;
  return v;
}

std::optional<int64_t> parse_meminfo_total(std::string_view meminfo) {
  std::istringstream in{std::string(meminfo)};
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemTotal:", 0) != 0) continue;
    std::istringstream fields(line.substr(9));
    int64_t kib = 0;
    std::string unit;
    if (!(fields >> kib) || kib <= 0) return std::nullopt;
    fields >> unit;  // always "kB" (KiB) in /proc/meminfo
    return kib * 1024;
  }
  return std::nullopt;
}

RamSize choose_ram_size(const std::optional<std::string>& cgroup_v2_max,
                        const std::optional<std::string>& cgroup_v1_limit, const std::optional<std::string>& meminfo,
                        int64_t fallback) {
  // The cgroup's limit first: it is what the kernel enforces on this
  // process, and, unlike MemTotal on hosts whose memory is added while they
  // run, it does not start small.
  if (cgroup_v2_max) {
    if (auto v = parse_cgroup_memory_limit(*cgroup_v2_max)) return {*v, "cgroup v2 memory.max"};
  }
  if (cgroup_v1_limit) {
    if (auto v = parse_cgroup_memory_limit(*cgroup_v1_limit)) return {*v, "cgroup v1 memory.limit_in_bytes"};
  }
  if (meminfo) {
    if (auto v = parse_meminfo_total(*meminfo)) return {*v, "MemTotal"};
  }
  return {fallback, "sysconf(_SC_PHYS_PAGES)"};
}

int64_t total_ram_bytes(bool log_source) {
  const int64_t pages = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  const RamSize size =
      choose_ram_size(read_text("/sys/fs/cgroup/memory.max"), read_text("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                      read_text("/proc/meminfo"), pages);
  // Said once, by a role that sizes itself from it (not by every command
  // that validates a config: their stdout may be JSON).
  static std::once_flag logged;
  if (log_source)
    std::call_once(logged, [&] {
      spdlog::info("memory: sizing from {} = {} bytes (a budget in % is of this)", size.source, size.bytes);
    });
  return size.bytes;
}

StatusOr<int64_t> parse_memory_budget(const std::string& text, int64_t total_ram) {
  const std::string where = "server_configs.memory_budget";
  if (text.empty()) return invalid_argument("{}: empty", where);
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (...) {
    return invalid_argument("{}: '{}' is not a size (e.g. 80%, 12GiB, 512MiB, 1000000)", where, text);
  }
  std::string unit = text.substr(pos);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }), unit.end());
  double bytes = 0;
  if (unit == "%") {
    if (value <= 0 || value > 100) return invalid_argument("{}: '{}' must be in (0, 100]%", where, text);
    bytes = static_cast<double>(total_ram) * value / 100.0;
  } else if (unit.empty() || unit == "B") {
    bytes = value;
  } else if (unit == "KiB") {
    bytes = value * 1024;
  } else if (unit == "MiB") {
    bytes = value * 1024 * 1024;
  } else if (unit == "GiB") {
    bytes = value * 1024 * 1024 * 1024;
  } else {
    return invalid_argument("{}: unknown unit '{}' in '{}' (use %, B, KiB, MiB or GiB)", where, unit, text);
  }
  if (bytes <= 0) return invalid_argument("{}: '{}' must be positive", where, text);
  return static_cast<int64_t>(bytes);
}

int choose_parallel_clients(int64_t budget, int64_t in_use, int64_t replica_cost, int cores) {
  if (replica_cost <= 0) return std::max(1, cores);
  const int64_t room = budget - in_use;
  const int64_t k = room > 0 ? room / replica_cost : 0;
  return static_cast<int>(std::clamp<int64_t>(k, 1, std::max(1, cores)));
}

WorkerGovernor::Action WorkerGovernor::observe(int64_t rss) {
  const double level = static_cast<double>(rss) / static_cast<double>(budget_);
  if (level >= 0.90 && active_ > 1) {
    --active_;
    return Action::kShed;
  }
  if (level >= 0.85) {
    if (warned_) return Action::kNone;
    warned_ = true;
    return Action::kWarn;
  }
  warned_ = false;  // back under: the next crossing warns again
  return Action::kNone;
}

}  // namespace memfl
