// memfl compare-methods: client selection methods run one after another and
// compared.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "experiments/compare_methods.h"

namespace memfl::cli {

namespace {

struct CompareMethodsArgs {
  memfl::CompareMethodsOptions cm;
  std::string methods_csv;
};

int compare_methods(SharedOptions& o, CompareMethodsArgs& a) {
  memfl::CompareMethodsOptions& cm = a.cm;
  auto cfg = load(o.config_path, o.sets);
  if (!cfg.ok()) return fail(cfg.status());
  std::stringstream ss(a.methods_csv);
  std::string m;
  while (std::getline(ss, m, ',')) {
    if (!m.empty()) cm.methods.push_back(m);
  }
  if (memfl::Status c = check_target(cm.target_accuracy, fmt::format("{}", cm.target_accuracy)); !c.ok())
    return fail(c);
  cm.out_dir = o.out_dir.empty() ? fmt::format("runs/compare-methods-{}", getpid()) : o.out_dir;
  if (memfl::Status d = make_out_dir(cm.out_dir); !d.ok()) return fail(d);
  auto r = memfl::run_compare_methods(*cfg, cm);
  if (!r.ok()) return fail(r.status());
  fmt::print("{}\nresults: {}/results.md, results.csv, accuracy.svg\n", *r, cm.out_dir);
  return kExitOk;
}

}  // namespace

CommandFn add_compare_methods(CLI::App& cmd, SharedOptions& shared) {
  auto a = std::make_shared<CompareMethodsArgs>();
  cmd.add_option("CONFIG", shared.config_path, "YAML config (default: the embedded default)");
  cmd.add_option("--methods", a->methods_csv, "comma-separated, e.g. random,topk_loss,oort")->required();
  cmd.add_option("--repeats", a->cm.repeats, "runs per method (seeds seed, seed+1, ...)")->capture_default_str();
  cmd.add_option("--target", a->cm.target_accuracy, "accuracy for 'rounds to target'")->capture_default_str();
  cmd.add_option("--out", shared.out_dir, "output directory (default: runs/compare-methods-<pid>)");
  cmd.add_option("--set", shared.sets, "override a config key (repeatable)");
  return [&shared, a](int&, char**&) { return compare_methods(shared, *a); };
}

}  // namespace memfl::cli
