// The server's committed state: what `--resume RUN_DIR` continues from.
//
// At the end of every round the round driver commits, atomically, the whole
// state a later process needs to play the next round as this one would have:
// the global model (a hard link to the checkpoint the round just wrote — no
// copy, no extra memory, also for file-backed models), the round number, the
// scheduler's state (selection RNG, per-client stats and DP-SGD steps), the
// aggregator's state between rounds, and the round's metrics. Each commit is
// `state/round-NNNNNN.json` + `state/round-NNNNNN.safetensors`, written new,
// fsynced and renamed; the JSON carries the xxh3 of the model bytes and of
// its own text. The last two commits are kept: a torn or corrupt newest one
// is detected by checksum and the one before is used, with a warning naming
// the file.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

struct CommittedState {
  int round = 0;              // rounds completed
  std::string model_path;     // safetensors file of the global model after `round`
  uint64_t model_xxh3 = 0;    // of the model's bytes (the layout's total_bytes of the arena)
  nlohmann::json scheduler;   // Scheduler::save()
  nlohmann::json aggregator;  // aggregator state between rounds (none for FedAvg)
  nlohmann::json extra;       // per-transport (e.g. client-level DP ε)
};

// Commits round `state.round`: links `checkpoint` (already written and
// fsynced) as the round's model file, writes the JSON, and drops commits
// older than the previous one. `model` is the arena the checkpoint holds.
Status commit_state(const std::string& run_dir, const std::string& checkpoint, const Layout& layout, const Arena& model,
                    CommittedState state);

// The newest commit in `run_dir` whose JSON and model bytes check out,
// with its model loaded into `model` (whose layout must match the file's).
// Commits that fail a check are named in a warning and skipped. NotFound
// when `run_dir` holds no commit at all.
StatusOr<CommittedState> load_committed_state(const std::string& run_dir, const Layout& layout, Arena& model);

// Fault injection for the crash tests: MEMFL_CRASH_AT="<round>:<point>"
// kills this process with SIGKILL (as kill -9 would) when the round driver
// reaches that point of that round (broadcast, upload, aggregate, commit).
void crash_point(int round, const char* point);

}  // namespace memfl
