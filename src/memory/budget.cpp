#include "memory/budget.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>

namespace memfl {

int64_t total_ram_bytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
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
