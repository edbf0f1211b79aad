// memfl compare-algorithms: FL algorithms (FedAvg, FedAsync, FedBuff,
// FedCompass, ...) run on the same clients and compared.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "experiments/compare_methods.h"

namespace memfl::cli {

namespace {

struct CompareAlgorithmsArgs {
  memfl::CompareAlgorithmsOptions ca;
  std::string algorithms_csv;
  std::string targets_csv = "0.8";
};

int compare_algorithms(SharedOptions& o, CompareAlgorithmsArgs& a) {
  memfl::CompareAlgorithmsOptions& ca = a.ca;
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  std::stringstream ss(a.algorithms_csv);
  std::string alg;
  while (std::getline(ss, alg, ',')) {
    if (!alg.empty()) ca.algorithms.push_back(alg);
  }
  ca.targets.clear();
  std::stringstream ts(a.targets_csv);
  for (std::string t; std::getline(ts, t, ',');) {
    if (t.empty()) continue;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(t, &used);
    } catch (...) {
      return fail(memfl::invalid_argument("--target: '{}' is not a number", t));
    }
    if (used != t.size()) return fail(memfl::invalid_argument("--target: '{}' is not a number", t));
    if (memfl::Status c = check_target(v, t); !c.ok()) return fail(c);
    ca.targets.push_back(v);
  }
  ca.out_dir = o.out_dir.empty() ? fmt::format("runs/compare-algorithms-{}", getpid()) : o.out_dir;
  if (memfl::Status d = make_out_dir(ca.out_dir); !d.ok()) return fail(d);
  auto r = memfl::run_compare_algorithms(*cfg, ca);
  if (!r.ok()) return fail(r.status());
  fmt::print(
      "{}\nresults: {}/compare.html, results.md, results.csv, curves.csv, accuracy_vs_time.svg, "
      "accuracy_vs_rounds.svg\n",
      *r, ca.out_dir);
  return kExitOk;
}

}  // namespace

CommandFn add_compare_algorithms(CLI::App& cmd, SharedOptions& shared) {
  auto a = std::make_shared<CompareAlgorithmsArgs>();
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--algorithms", a->algorithms_csv, "comma-separated, e.g. FedAvg,FedAsync,FedBuff,FedCompass")
      ->required();
  cmd.add_option("--target", a->targets_csv, "accuracies for 'time to target', comma-separated")->capture_default_str();
  cmd.add_flag("--equal-time", a->ca.equal_time,
               "asynchronous algorithms run as long in virtual time as the synchronous ones took");
  cmd.add_option("--out", shared.out_dir, "output directory (default: runs/compare-algorithms-<pid>)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  return [&shared, a](int&, char**&) { return compare_algorithms(shared, *a); };
}

}  // namespace memfl::cli
