// memfl compare: runs compared (peaks with % change, timelines, differential
// flamegraphs), the first run the baseline.
#include <CLI/CLI.hpp>
#include <memory>

#include "cli/commands.h"
#include "report/report.h"

namespace memfl::cli {

namespace {

struct CompareArgs {
  std::vector<std::string> dirs;
  std::string out;
};

}  // namespace

CommandFn add_compare(CLI::App& cmd, SharedOptions&) {
  auto a = std::make_shared<CompareArgs>();
  cmd.add_option("RUNS", a->dirs, "run directories; the first is the baseline")->required()->expected(2, -1);
  cmd.add_option("--out", a->out, "output directory (default: <first run>/compare)");
  return [a](int&, char**&) {
    const std::string out = a->out.empty() ? a->dirs[0] + "/compare" : a->out;
    if (memfl::Status d = make_out_dir(out); !d.ok()) return fail(d);
    auto r = memfl::write_comparison(a->dirs, out);
    if (!r.ok()) return fail(r.status());
    fmt::print("comparison: {}/index.html\n", *r);
    return kExitOk;
  };
}

}  // namespace memfl::cli
