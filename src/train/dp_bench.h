// `memfl bench dp`, plugin side: the DP-SGD clipping-mode sweep on a
// Llama-style sequence classifier built from the DP layers of
// train/dp_sgd.h. One JSON record per (seq_length, mode); see dp_bench.cpp
// for what is measured and how.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "train/trainer_backend.h"

namespace memfl::torch_internal {

// Runs the sweep: for each seq_length, each mode in options.modes, a fresh
// seeded model, warm-up then timed iterations. Returns one JSON object (text)
// per run. A run that runs out of memory gives a record with
// "error": "out of memory" and the sweep goes on; any other failure, or a bad
// option (unknown model, mode or device), fails the whole call.
StatusOr<std::vector<std::string>> run_dp_bench(const DpBenchOptions& options);

}  // namespace memfl::torch_internal
