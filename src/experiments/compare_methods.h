// `memfl compare-methods CONFIG --methods a,b --repeats R`: each client
// selection method R times (seeds seed, seed+1, …), one after another in
// this process, then a results table (final accuracy mean ± std, rounds to
// a target accuracy, time) and accuracy-per-round curves (SVG).
#pragma once

#include <string>
#include <vector>

#include "config/config.h"

namespace memfl {

struct CompareMethodsOptions {
  std::vector<std::string> methods;
  int repeats = 1;
  double target_accuracy = 0.8;
  std::string out_dir;
};

// Returns the results table as text (also results.csv, results.md, accuracy.svg in out_dir).
StatusOr<std::string> run_compare_methods(const ExperimentConfig& cfg, const CompareMethodsOptions& opts);

}  // namespace memfl
