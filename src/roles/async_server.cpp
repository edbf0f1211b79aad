#include "roles/async_server.h"

#include <filesystem>

#include <spdlog/spdlog.h>

#include "aggregate/async_aggregator.h"
#include "client/client_work.h"
#include "compress/decoding_opener.h"
#include "compress/settings.h"
#include "io/run_dir.h"
#include "server/async_common.h"
#include "server/async_core.h"
#include "server/model_worker.h"

namespace memfl {

namespace fs = std::filesystem;

StatusOr<std::unique_ptr<GlobalModel>> make_async_global_model(const ExperimentConfig& cfg,
                                                               const std::string& run_dir) {
  // An in-place FedAvg holds nothing beside the model.
  ExperimentConfig gcfg = cfg;
  gcfg.server.scheduler = "SyncScheduler";
  gcfg.server.aggregator = "FedAvgAggregator";
  return GlobalModel::create(gcfg, InputSpec{}, run_dir, /*naive=*/false);
}

Status run_async_server(const ExperimentConfig& cfg, const std::string& run_dir, bool progress, GlobalModel& global,
                        MemorySampler& sampler, int64_t baseline_rss, const AsyncServeFn& serve,
                        const std::function<void(nlohmann::ordered_json&)>& add_summary) {
  const auto& sc = cfg.server;
  if (sc.client_weights_mode != "equal") {
    return invalid_argument(
        "server_configs.aggregator_kwargs.client_weights_mode: '{}' needs every client's sample count, which a "
        "server process does not see before the clients train; use equal (or the simulator, memfl run)",
        sc.client_weights_mode);
  }
  const Layout& layout = global.layout();
  MEMFL_ASSIGN_OR_RETURN(auto aggregator, make_async_aggregator(cfg, layout, run_dir));
  AsyncServerCore core(cfg, layout, global.arena(), *aggregator,
                       std::vector<double>(static_cast<size_t>(sc.num_clients), 1.0 / sc.num_clients), nullptr);
  MEMFL_RETURN_IF_ERROR(core.open_log((fs::path(run_dir) / "async_log.csv").string()));
  AsyncMetricsLog metrics(sampler);
  MEMFL_RETURN_IF_ERROR(metrics.open(run_dir));
  std::unique_ptr<ModelWorker> evaluator;
  if (sc.do_server_eval && !is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(evaluator,
                           ModelWorker::start((fs::path(run_dir) / "config.yaml").string(), layout,
                                              transfer_chunk_bytes(true, sc.model_chunk_size, layout.total_bytes()),
                                              (fs::path(run_dir) / "model_worker.log").string()));
  }
  metrics.start_window();
  int64_t last_updates = 0;
  AsyncServeOptions so;
  so.total = sc.num_global_epochs;
  so.eval_every = async_eval_every(sc);
  so.spool_dir = cfg.memory.scratch_dir.empty() ? run_dir : cfg.memory.scratch_dir;
  if (cfg.compressor.enable_compression) {
    // An asynchronous update is a change already when it is lossy (the config
    // asks gradient_based), so its frames decode against no base.
    const CompressionSettings cs = compression_settings(cfg);
    spdlog::info("server: client updates arrive compressed: {}", describe_compression(cs));
    so.wrap_update = [&layout](std::unique_ptr<UpdateStream> slot, const std::string& peer) {
      return decoding_stream(std::move(slot), layout, nullptr, peer);
    };
  }
  so.on_eval = [&](int k, int64_t updates, double seconds) -> Status {
    RoundMetrics m;
    m.round = k;
    m.clients = static_cast<int>(updates - last_updates);
    last_updates = updates;
    if (evaluator) {
      MEMFL_ASSIGN_OR_RETURN(EvalResult ev, evaluator->evaluate(k, global.arena()));
      m.test_loss = ev.loss;
      m.test_accuracy = ev.accuracy;
    }
    m.virtual_seconds = seconds;  // real seconds here, on the simulator's clock axis
    MEMFL_RETURN_IF_ERROR(metrics.append(m));
    if (progress) {
      fmt::print("server updates {:>5}/{}  versions {}  test_acc {:.4f}  {:.1f} s  peak RSS {}\n", updates,
                 sc.num_global_epochs, core.version(), m.test_accuracy, seconds,
                 format_bytes(static_cast<double>(m.peak_rss_bytes)));
      std::fflush(stdout);
    }
    return Status::Ok();
  };
  spdlog::info("server: {} with {}, model {} ({}), {} updates", sc.scheduler, sc.aggregator, cfg.model.model_name,
               format_bytes(static_cast<double>(layout.payload_bytes())), sc.num_global_epochs);
  Status result = serve(core, global.arena(), so);
  if (result.ok()) result = global.write_checkpoint(static_cast<int>(core.version()));
  nlohmann::ordered_json summary =
      async_summary_head("server", sc, core.arrivals(), core.version(), core.mean_staleness(), core.max_staleness());
  summary["model_bytes"] = layout.payload_bytes();
  summary["num_params"] = layout.num_params();
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["peak_rss_bytes"] = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  summary["aggregator_state_bytes"] = aggregator->state_bytes();
  summary["maps_libtorch"] = maps_library("libtorch");
  summary["compression"] = compression_summary(compression_settings(cfg));
  const auto& evals = metrics.rows();
  summary["final_test_accuracy"] = evals.empty() ? 0.0 : evals.back().test_accuracy;
  summary["status"] = result.ok() ? "ok" : result.message();
  if (add_summary) add_summary(summary);
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
