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
// its own text. The newest `checkpoint_keep` commits (2 by default) are
// kept: a torn or corrupt newest one is detected by checksum and the one
// before is used, with a warning naming the file. Which rounds commit is a
// CheckpointPolicy (every round by default).
#pragma once

#include <algorithm>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "config/config.h"
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
  // experiment_identity() of the run that committed it: resume refuses a
  // commit of another experiment (empty: not recorded, not checked).
  std::map<std::string, std::string> experiment;
};

// Which rounds commit, and how many commits stay on disk
// (server_configs.checkpoint_keep / checkpoint_every / checkpoint_final_only).
struct CheckpointPolicy {
  int keep = 2;
  int every = 1;
  bool final_only = false;
  static CheckpointPolicy from(const ServerConfig& sc) {
    return {sc.checkpoint_keep, sc.checkpoint_every, sc.checkpoint_final_only};
  }
  // Round `round` of a run of `last` rounds commits: every `every`-th, and
  // always the last (a finished run can always be read back).
  bool commits(int round, int last) const {
    if (round == last) return true;
    return !final_only && round % every == 0;
  }
  // Model checkpoints on disk at the policy's peak in a run of `last`
  // rounds (0: unknown): the kept commits (no more than the commits before
  // the last one) + the file being written; + the undo checkpoint of a round
  // that did not commit (it holds a model no commit links) when rounds are
  // skipped. A one-round run needs one file, whatever `keep` says.
  uint64_t peak_model_files(int last = 0) const {
    int commits_before_last = keep;
    if (last > 0) {
      int n = 0;
      for (int r = 1; r < last; ++r) n += commits(r, last) ? 1 : 0;
      commits_before_last = std::min(keep, n);
    }
    const bool skips = last > 0 ? (final_only || every > 1) && last > 1 : (final_only || every > 1);
    return static_cast<uint64_t>(commits_before_last) + 1 + (skips ? 1 : 0);
  }
};

// Commits round `state.round`: links `checkpoint` (already written and
// fsynced) as the round's model file, writes the JSON, and drops all but the
// newest `keep` commits. `model` is the arena the checkpoint holds.
Status commit_state(const std::string& run_dir, const std::string& checkpoint, const Layout& layout, const Arena& model,
                    CommittedState state, int keep = 2);

// Bytes of checkpoints already in `run_dir` (global_model.safetensors and its
// .next, state/*.safetensors, a server optimizer's state/aggregator-round-*;
// a file hard-linked twice counts once):
// the policy's peak is reached partly with them.
uint64_t checkpoint_bytes_on_disk(const std::string& run_dir);

// Refuses, naming `run_dir` and the bytes needed and free, when the policy's
// peak (model_bytes × peak_model_files(), plus `state_bytes` — a server
// optimizer's saved moments — for each commit kept and the one being written,
// less `already_on_disk`) exceeds `free_bytes`; the next commit needs a whole
// model and its state free in any case. A function of the free bytes, not of
// the disk, so that it can be tested with any number.
Status check_checkpoint_disk(const std::string& run_dir, const CheckpointPolicy& policy, uint64_t model_bytes,
                             uint64_t already_on_disk, uint64_t free_bytes, int last_round = 0,
                             uint64_t state_bytes = 0);

// Bytes an unprivileged writer may still use on `dir`'s file system (statvfs).
StatusOr<uint64_t> free_disk_bytes(const std::string& dir);

// The newest commit in `run_dir` whose JSON and model bytes check out,
// with its model loaded into `model` (whose layout must match the file's).
// Commits that fail a check are named in a warning and skipped. NotFound
// when `run_dir` holds no commit at all. A commit whose experiment (see
// CommittedState::experiment) differs from `experiment` is refused, naming
// the keys; one written before commits recorded it passes with a warning.
StatusOr<CommittedState> load_committed_state(const std::string& run_dir, const Layout& layout, Arena& model,
                                              const std::map<std::string, std::string>& experiment = {});

// Fault injection for the crash tests: MEMFL_CRASH_AT="<round>:<point>"
// kills this process with SIGKILL (as kill -9 would) when the round driver
// reaches that point of that round (broadcast, upload, aggregate, commit).
void crash_point(int round, const char* point);
// Whether crash_point(round, point) would kill the process.
bool crash_point_armed(int round, const char* point);

}  // namespace memfl
