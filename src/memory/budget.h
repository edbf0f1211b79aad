// Memory budget for the in-process simulator: how many worker replicas fit
// (`parallel_clients: -1`), and a governor that watches RSS against the
// budget — a warning at 85 % (once per crossing, with the numbers), and at
// 90 % one worker fewer, until the run is back under. Memory stays flat by
// construction; this is the guard for when a budget is set below what the
// run needs.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace memfl {

// "80%" (of the machine's RAM), "12GiB", "512MiB", or plain bytes.
StatusOr<int64_t> parse_memory_budget(const std::string& text, int64_t total_ram_bytes);
int64_t total_ram_bytes();

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
