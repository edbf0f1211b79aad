// The DP-SGD clipping-mode sweep's outputs (`memfl bench dp`): the records as
// JSON, a CSV, and a self-contained HTML page with four charts — peak memory
// per mode by sequence length, time per iteration per mode, memory against
// time, and the overhead of each mode over no_dp in % — drawn as inline SVG
// (no scripts, so it opens anywhere, CI's headless browser included).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace memfl {

// Writes `json_path` (an array of the records), and `<report_dir>/dp_sweep.html`
// and `<report_dir>/dp_sweep.csv` when report_dir is not empty.
Status write_dp_sweep(const std::vector<nlohmann::ordered_json>& records, const std::string& json_path,
                      const std::string& report_dir);

// Overhead over no_dp (ratio) of `mode` at `seq_length` for `key`
// ("peak_memory_bytes" | "avg_iteration_ms"); 0 when either is missing.
double dp_overhead(const std::vector<nlohmann::ordered_json>& records, const std::string& mode, int seq_length,
                   const std::string& key);

}  // namespace memfl
