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

// `memfl compare-algorithms CONFIG --algorithms FedAvg,FedAsync,FedBuff,FedCompass`:
// each FL algorithm on the same clients, partition, speeds and seed, one
// after another in the simulator. A synchronous algorithm plays
// num_global_epochs rounds of the selected clients; an asynchronous one the
// same number of client updates (rounds × clients per round), evaluated
// every clients-per-round updates, so "round" k means the same work for
// both (or, with equal_time, the asynchronous ones run as long in virtual
// time as the synchronous ones took). Virtual time comes from
// server_configs.client_speed_*: a synchronous round waits for its slowest
// client, asynchronous clients do not wait.
struct CompareAlgorithmsOptions {
  std::vector<std::string> algorithms;  // FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad, FedAsync, FedBuff, FedCompass
  std::vector<double> targets = {0.8};  // accuracies for "time to target"
  // The asynchronous algorithms run for the virtual time the synchronous
  // ones took (the longest), not for as many updates (at most
  // `max_update_factor` × as many).
  bool equal_time = false;
  int max_update_factor = 100;
  std::string out_dir;
};

// The scheduler and aggregator an algorithm's short name stands for; an
// unknown name is an error listing the known ones.
StatusOr<std::pair<std::string, std::string>> algorithm_components(const std::string& algorithm);

// Returns the results table (also results.md, results.csv, curves.csv,
// accuracy_vs_time.svg, accuracy_vs_rounds.svg and compare.html in out_dir).
StatusOr<std::string> run_compare_algorithms(const ExperimentConfig& cfg, const CompareAlgorithmsOptions& opts);

}  // namespace memfl
