// Memory budget for the in-process simulator: how many worker replicas fit
// (`parallel_clients: -1`), and a governor that watches RSS against the
// budget — a warning at 85 % (once per crossing, with the numbers), and at
// 90 % one worker fewer, until the run is back under. Memory stays flat by
// construction; this is the guard for when a budget is set below what the
// run needs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace memfl {

// "80%" (of the machine's RAM), "12GiB", "512MiB", or plain bytes.
StatusOr<int64_t> parse_memory_budget(const std::string& text, int64_t total_ram_bytes);

// The memory this process may use: the cgroup's limit where there is one,
// else MemTotal. With log_source, says (once per process) which source it
// used. Not cached: on hosts whose MemTotal starts small and grows, a later
// call sees more.
int64_t total_ram_bytes(bool log_source = false);

// What total_ram_bytes() decided, and from where.
struct RamSize {
  int64_t bytes = 0;
  std::string source;  // "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes", "MemTotal", ...
};

// A cgroup memory limit file's text (v2 memory.max or v1
// memory.limit_in_bytes) as bytes; nullopt for "max", an unparsable text,
// zero, or a value so large it means "no limit" (v1 writes
// 9223372036854771712 for none).
std::optional<int64_t> parse_cgroup_memory_limit(std::string_view text);

// MemTotal of a /proc/meminfo text, in bytes; nullopt when absent.
std::optional<int64_t> parse_meminfo_total(std::string_view meminfo);

// The decision itself, from the files' texts (nullopt: the file is absent):
// cgroup v2, then v1, then MemTotal, then `fallback` (sysconf).
RamSize choose_ram_size(const std::optional<std::string>& cgroup_v2_max,
                        const std::optional<std::string>& cgroup_v1_limit, const std::optional<std::string>& meminfo,
                        int64_t fallback);

// Workers that fit: (budget − in use) ÷ cost of one replica, at least 1, at
// most `cores`.
int choose_parallel_clients(int64_t budget, int64_t in_use, int64_t replica_cost, int cores);

class WorkerGovernor {
 public:
  WorkerGovernor(int64_t budget, int workers) : budget_(budget), active_(workers) {}
  enum class Action { kNone, kWarn, kShed };
  // Called with the current RSS; returns what to do (and lowers active()
  // on kShed). Never sheds the last worker.
  Action observe(int64_t rss);
  int active() const { return active_; }
  int64_t budget() const { return budget_; }
  void set_budget(int64_t b) { budget_ = b; }

 private:
  int64_t budget_;
  int active_;
  bool warned_ = false;
};

}  // namespace memfl
