// memfl report: RUN_DIR/report/index.html (+ summary.txt, CSV, folded stacks).
#include <CLI/CLI.hpp>
#include <memory>

#include "cli/commands.h"
#include "report/report.h"

namespace memfl::cli {

CommandFn add_report(CLI::App& cmd, SharedOptions&) {
  auto report_dir = std::make_shared<std::string>();
  cmd.add_option("RUN_DIR", *report_dir, "a run directory")->required();
  return [report_dir](int&, char**&) {
    auto r = memfl::write_report(*report_dir);
    if (!r.ok()) return fail(r.status());
    fmt::print("report: {}/index.html\n", *r);
    return kExitOk;
  };
}

}  // namespace memfl::cli
