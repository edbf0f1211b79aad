// The server's global model and its aggregator, with the round's undo — the
// state the round driver (server/round_driver.h) plays rounds on, whatever
// the transport. Client-level DP-FedAvg's noise is added here, on the
// aggregate, so it is one code path for every transport.
//
// Where the bytes live and how a round folds into them:
//   memory, f32 model        the running sum shares the global arena after the
//                            broadcast (1× model); undo = the checkpoint file
//                            written after every round.
//   memory, bf16/f16 model   an f32 running sum beside the model (3× in all),
//                            or with accumulator: model_dtype a running mean
//                            in the global arena (1×); undo = the checkpoint.
//   file (dense layout)      the global model *is* the checkpoint file,
//                            mapped; each round folds a running mean into the
//                            next round's file, which replaces it (rename)
//                            once the round completes; undo = the untouched
//                            current file. Anonymous memory: chunks only.
//   file (layout with gaps)  the global arena is a scratch file, otherwise as
//                            for memory.
//   naive                    own f32 sum; the server keeps whole client copies
//                            elsewhere (memory_mode: naive).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "aggregate/fedavg_aggregator.h"
#include "client/client_work.h"
#include "compress/frame.h"

namespace memfl {

class GlobalModel {
 public:
  // `sum_in_place`: the running sum may overwrite the global arena once the
  // broadcast is done (false when clients read the global model while
  // updates fold: the in-process simulation).
  // `network_here`: a network model (CNN, ResNet18, …) is built in this
  // process (the simulator, which trains anyway); otherwise its initial
  // weights come from a model worker process (server/model_worker.h) through
  // a safetensors file, and this process never maps libtorch.
  static StatusOr<std::unique_ptr<GlobalModel>> create(const ExperimentConfig& cfg, const InputSpec& input,
                                                       const std::string& run_dir, bool naive, bool sum_in_place = true,
                                                       bool network_here = false);
  LocalModel& model() { return model_; }
  const Layout& layout() const { return model_.layout(); }
  Arena& arena() { return model_.arena(); }
  Aggregator& aggregator() { return *aggregator_; }
  const std::string& checkpoint_path() const { return checkpoint_; }
  // After the broadcast (the in-place modes overwrite the global arena).
  // `fold_order`: the round's clients, in the order their updates combine.
  Status begin_round(int round, std::vector<std::string> fold_order);
  // Finalizes the aggregate into the global model. On failure the pre-round
  // model is back in place and the failure is returned: redo the round.
  // `contributors`: how many client updates the aggregate is of, when the
  // aggregator saw fewer (secure aggregation hands it one mean); 0: its count.
  Status finish_round(int round, int contributors = 0);
  // Whether the aggregator writes the round's result over the global
  // model's own memory (not a next checkpoint file): then, once the model is
  // broadcast, nothing reads it from memory before the aggregator writes
  // (the undo and the server optimizers' pre-round model are the
  // checkpoint, or the seed), and secure aggregation can sum there.
  bool folds_over_model() const { return !mapped_ && aggregator_->sums_in_place(); }
  // Writes the checkpoint after a round (nothing to do when the global model
  // is the checkpoint file).
  Status write_checkpoint(int round);
  // Where this round's global model can be read while updates fold (the
  // base of compressed updates' deltas): the arena when the round does not
  // overwrite it, else the checkpoint file, which holds it until the round
  // commits. Call after begin_round.
  StatusOr<std::unique_ptr<BaseModel>> round_base();
  // "in-place streaming", ... for the log line.
  std::string description() const;

 private:
  GlobalModel() = default;
  Status restore();
  ExperimentConfig cfg_;
  LocalModel model_;
  std::unique_ptr<Aggregator> aggregator_;
  std::string checkpoint_;
  std::string description_;
  bool mapped_ = false;  // the global arena is the checkpoint file's data
  // The pre-round model is the seed's initial one, not yet on disk: a failed
  // first round regenerates it (writing a 141 GB round 0 cost minutes and a
  // second model's worth of disk beside round 1's file).
  bool seeded_start_ = false;
  std::optional<Arena> next_;  // mapped: the next round's file, being folded into
};

// Which accumulation a config asks of the aggregator (see the table above),
// `auto` decided against server_configs.memory_budget; logs the choice and
// why when the config says auto and the layout has 16-bit tensors.
Accumulation resolve_accumulation(const ExperimentConfig& cfg, const Layout& layout);

struct AccumulationChoice {
  Accumulation accumulation = Accumulation::kSum;
  std::string reason;  // for the log line
};

// resolve_accumulation's decision with the budget (bytes) given, so a test
// can state it. `auto` on a layout that needs a wider sum (bf16/f16): f32
// when the global model (anonymous) + that sum + the aggregator's working
// bytes fit the budget, else a running mean in the model's dtype.
AccumulationChoice choose_accumulation(const ExperimentConfig& cfg, const Layout& layout, int64_t budget);

}  // namespace memfl
