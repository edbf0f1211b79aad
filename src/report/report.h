// Reports: `memfl report RUN_DIR` and `memfl compare RUN_A RUN_B ...`.
//
// A run directory holds one process (an in-process run) or several
// (server/, client_<i>/, rank_<i>/), each with memory.json and, when it ran
// with --profile, profile.bin. The report is one self-contained HTML page
// (the pinned front-end libraries are built into memfl and inlined; no
// network at view time) plus summary.txt, CSV files and folded stacks.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

// Writes RUN_DIR/report/{index.html, summary.txt, peaks.csv, sites.csv,
// <process>.folded, data.json}. Returns the report directory.
StatusOr<std::string> write_report(const std::string& run_dir);

// Writes OUT/{index.html, comparison.txt, comparison.csv, <role>.diff.folded}
// comparing runs (the first is the baseline).
StatusOr<std::string> write_comparison(const std::vector<std::string>& run_dirs, const std::string& out_dir);

// The live page a role's HTTP endpoint serves (live/http_endpoint.h): the
// report's page and inlined assets in live mode, drawing what /api/state
// answers as the run goes.
std::string live_page_html(const std::string& title);

// The live page frozen on `state_json` (/api/state at the end of a run):
// the same page and script, drawing that state once. What a role run with
// --http leaves as RUN_DIR/live.html.
std::string frozen_live_page_html(const std::string& title, const std::string& state_json);

}  // namespace memfl
