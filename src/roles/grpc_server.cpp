// `memfl server`: the wiring of a server process over gRPC — global model,
// the gRPC transport (comm/grpc/server_transport.h), the scheduler, the
// round driver, and a model worker process for what needs the network
// (server/model_worker.h), so this process never maps libtorch.
#include <filesystem>
#include <numeric>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "client/client_work.h"
#include "comm/chunk.h"
#include "comm/grpc/server_transport.h"
#include "io/run_dir.h"
#include "memory/malloc_policy.h"
#include "memory/sampler.h"
#include "roles/grpc_roles.h"
#include "roles/async_server.h"
#include "server/global_model.h"
#include "server/model_worker.h"
#include "secagg/wire.h"
#include "server/round_driver.h"
#include "compress/settings.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Asynchronous FL over gRPC (AsyncScheduler, CompassScheduler): the same
// sessions, the rules of server/async_core.h, real time.
Status run_async_grpc_server(const ExperimentConfig& cfg, const RoleOptions& opts) {
  if (opts.resume)
    return failed_precondition("--resume: an asynchronous run ({}) cannot be resumed yet", cfg.server.scheduler);
  MemorySampler sampler("server", cfg.memory.sample_interval_ms);
  sampler.start();
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);
  sampler.mark(0, "setup");
  const int64_t baseline_rss = read_rss_bytes();
  MEMFL_ASSIGN_OR_RETURN(auto global, make_async_global_model(cfg, opts.run_dir));
  MEMFL_ASSIGN_OR_RETURN(auto transport,
                         GrpcServerTransport::listen(cfg, global->layout(), /*naive=*/false, opts.run_dir));
  transport->wait_for_clients();
  Status result = run_async_server(cfg, opts.run_dir, opts.progress, *global, sampler, baseline_rss,
                                   [&](AsyncUpdateHandler& core, Arena& g, const AsyncServeOptions& so) {
                                     Status s = transport->serve_async(core, g, so);
                                     transport->finish(cfg.server.num_global_epochs);
                                     return s;
                                   });
  return result;
}

}  // namespace

Status run_grpc_server(const ExperimentConfig& cfg, const RoleOptions& opts) {
  tune_malloc_for_streaming();
  const auto& sc = cfg.server;
  if (sc.is_async()) return run_async_grpc_server(cfg, opts);
  if (sc.client_selection != "random") {
    return invalid_argument(
        "server_configs.client_selection: '{}' runs in the in-process simulation; over gRPC "
        "the server selects at random",
        sc.client_selection);
  }
  MemorySampler sampler("server", cfg.memory.sample_interval_ms);
  sampler.start();
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);
  sampler.mark(0, "setup");
  SchedulerOptions so;
  so.num_clients = sc.num_clients;
  so.clients_per_round = sc.clients_per_round;
  so.seed = sc.seed;
  // Refused before any work: an unknown scheduler name.
  MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(sc.scheduler, so));
  // Measured before the model exists: the bound is stated on top of it.
  const int64_t baseline_rss = read_rss_bytes();
  const bool naive = sc.memory_mode == "naive";
  // No data set and no network here: a network's initial weights and the
  // server-side evaluation come from a model worker process.
  MEMFL_ASSIGN_OR_RETURN(auto global, GlobalModel::create(cfg, InputSpec{}, opts.run_dir, naive));
  // Before any client waits.
  MEMFL_RETURN_IF_ERROR(check_server_memory_bound(cfg, *global, grpc_transfer_buffer_bytes(cfg, global->layout())));
  const Layout& layout = global->layout();
  MEMFL_ASSIGN_OR_RETURN(auto transport, GrpcServerTransport::listen(cfg, layout, naive, opts.run_dir));
  spdlog::info("server: model {} ({} parameters, {}), layout {:016x}, {} aggregation, chunk {}", cfg.model.model_name,
               layout.num_params(), format_bytes(static_cast<double>(layout.payload_bytes())), layout.hash(),
               global->description(),
               format_bytes(static_cast<double>(
                   grpc_chunk_bytes(sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes()))));

  transport->wait_for_clients();

  RoundDriverOptions dopts;
  dopts.run_dir = opts.run_dir;
  dopts.role = "server";
  // Secure aggregation's stages: each a request and a reply over the
  // client's session.
  RemoteSecAggChannel secagg([&](int c, std::string req) { return transport->secagg_exchange(c, std::move(req)); },
                             [&](int) { transport->secagg_end_round(); },
                             [&](int c, const Status& why) { transport->secagg_drop(c, why.message()); });
  dopts.secure_aggregation = &secagg;
  dopts.resume = opts.resume;
  std::unique_ptr<ModelWorker> evaluator;
  if (sc.do_server_eval && !is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(evaluator,
                           ModelWorker::start((fs::path(opts.run_dir) / "config.yaml").string(), layout,
                                              transfer_chunk_bytes(true, sc.model_chunk_size, layout.total_bytes()),
                                              (fs::path(opts.run_dir) / "model_worker.log").string()));
    // The worker evaluates round r while round r+1 goes on (RoundDriverOptions),
    // on the clients' thread count (they may share this host: memfl launch);
    // the last round's evaluation has the cores to itself.
    dopts.begin_evaluation = [&](int round, const Arena& g) {
      return evaluator->begin_evaluation(round, g, round == cfg.server.num_global_epochs ? machine_cores() : 0);
    };
    dopts.end_evaluation = [&](int round) { return evaluator->end_evaluation(round); };
  }
  dopts.on_round = [&](const RoundMetrics& m) {
    if (!opts.progress) return;
    fmt::print(
        "server round {:>3}/{}  clients {:>2}  test_acc {:.4f}  down {:.2f} GB/s  up {:.2f} GB/s  {:.2f} s  "
        "peak RSS {}\n",
        m.round, sc.num_global_epochs, m.clients, m.test_accuracy,
        m.download_seconds > 0 ? static_cast<double>(m.bytes_down) / m.download_seconds / 1e9 : 0.0,
        m.upload_seconds > 0 ? static_cast<double>(m.bytes_up) / m.upload_seconds / 1e9 : 0.0, m.round_seconds,
        format_bytes(static_cast<double>(m.peak_rss_bytes)));
    std::fflush(stdout);
  };
  RoundDriver driver(cfg, *global, *transport, *scheduler, sampler, std::move(dopts));
  Status result = driver.run();
  transport->finish(sc.num_global_epochs);  // also on failure: sessions must not wait for a round
  const auto& rounds = driver.rounds();
  nlohmann::ordered_json summary;
  summary["role"] = "server";
  summary["rounds"] = rounds.size();
  summary["model_bytes"] = layout.payload_bytes();
  summary["num_params"] = layout.num_params();
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["peak_rss_bytes"] = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  summary["sum_in_place"] = global->aggregator().sums_in_place();
  summary["maps_libtorch"] = maps_library("libtorch");
  summary["compression"] = compression_summary(compression_settings(cfg));
  summary["memory_mode"] = sc.memory_mode;
  if (cfg.secagg.enable) summary["secure_aggregation"] = secure_aggregation_summary(cfg);
  summary["final_test_accuracy"] = rounds.empty() ? 0.0 : rounds.back().test_accuracy;
  summary["status"] = result.ok() ? "ok" : result.message();
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
