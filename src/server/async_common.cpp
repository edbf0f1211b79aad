#include "server/async_common.h"

#include <filesystem>

namespace memfl {

int64_t async_eval_every(const ServerConfig& sc) {
  return sc.async_eval_every > 0 ? sc.async_eval_every : sc.num_clients;
}

Status AsyncMetricsLog::open(const std::string& run_dir) {
  MEMFL_ASSIGN_OR_RETURN(writer_, MetricsWriter::open((std::filesystem::path(run_dir) / "metrics.csv").string()));
  start_window();
  return Status::Ok();
}

void AsyncMetricsLog::start_window() { window_start_ = std::chrono::steady_clock::now(); }

Status AsyncMetricsLog::append(RoundMetrics& m) {
  m.round_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start_).count();
  record_process_metrics(sampler_, &m);
  MEMFL_RETURN_IF_ERROR(writer_->append(m));
  rows_.push_back(m);
  start_window();
  return Status::Ok();
}

nlohmann::ordered_json async_summary_head(const std::string& role, const ServerConfig& sc, int64_t updates,
                                          int64_t versions, double mean_staleness, int64_t max_staleness) {
  nlohmann::ordered_json summary;
  summary["role"] = role;
  summary["scheduler"] = sc.scheduler;
  summary["aggregator"] = sc.aggregator;
  summary["updates"] = updates;
  summary["global_versions"] = versions;
  summary["mean_staleness"] = mean_staleness;
  summary["max_staleness"] = max_staleness;
  return summary;
}

}  // namespace memfl
