// Rank 0 of `memfl mpi`: the server. The rounds are RoundDriver's (or the
// asynchronous core's) over MpiServerTransport; this wires them.
#include <signal.h>

#include <cstdlib>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "client/client_work.h"
#include "comm/mpi/mpi_transport.h"
#include "roles/async_server.h"
#include "roles/mpi_ranks.h"
#include "schedule/scheduler.h"
#include "secagg/wire.h"
#include "server/global_model.h"
#include "server/model_worker.h"
#include "server/round_driver.h"
#include "compress/settings.h"

namespace memfl {

Status run_mpi_server(const ExperimentConfig& cfg, int world, const std::string& dir, bool progress, bool resume,
                      const SharedRing& shm) {
  RankState st("server", cfg.memory.sample_interval_ms, dir);
  st.sampler.mark(0, "setup");
  SchedulerOptions so;
  so.num_clients = cfg.server.num_clients;
  so.clients_per_round = cfg.server.clients_per_round;
  so.seed = cfg.server.seed;
  std::unique_ptr<Scheduler> scheduler;
  if (!cfg.server.is_async()) {
    MEMFL_ASSIGN_OR_RETURN(scheduler, make_scheduler(cfg.server.scheduler, so));
  }
  const int64_t baseline = read_rss_bytes();
  // No data set and no network on rank 0: a network's initial weights and
  // the server-side evaluation come from a model worker process.
  if (cfg.server.is_async() && resume)
    return failed_precondition("--resume: an asynchronous run ({}) cannot be resumed yet", cfg.server.scheduler);
  std::unique_ptr<GlobalModel> global;
  if (cfg.server.is_async()) {
    MEMFL_ASSIGN_OR_RETURN(global, make_async_global_model(cfg, dir));
  } else {
    // Client ranks on this node hold a model each (two with several clients
    // per rank: the round's model kept aside) out of the same memory.
    ExperimentConfig here = cfg;
    here.colocated_model_copies = (shm.ranks_on_node - 1) * (cfg.server.clients_per_rank > 1 ? 2 : 1);
    MEMFL_ASSIGN_OR_RETURN(global, GlobalModel::create(here, InputSpec{}, dir, /*naive=*/false));
  }
  LocalModel& model = global->model();
  const Layout& layout = model.layout();
  const size_t chunk =
      transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  if (chunk > static_cast<size_t>(INT32_MAX))
    return invalid_argument("model_chunk_size must fit an MPI count (< 2 GiB)");
  // Register: every client rank says who it is and how many clients it runs.
  // With its pid and host, so that a rank excluded for a stall can be let
  // go (SIGCONT) before the job ends: OpenMPI's mpirun was seen to hang
  // when it ended a job around a stopped process.
  std::vector<WireRegister> registered(static_cast<size_t>(world));
  for (int r = 1; r < world; ++r) {
    WireRegister& reg = registered[static_cast<size_t>(r)];
    quiet_recv(&reg, sizeof reg, r, kTagRegister);
    if (reg.rank != r || reg.clients != cfg.server.clients_per_rank) {
      abort_job(fmt::format("rank {} registered as rank {} with {} clients; expected {}", r, reg.rank, reg.clients,
                            cfg.server.clients_per_rank));
    }
  }
  // Once every round is committed and every rank still in has written its
  // outputs (Bye): a rank that was excluded (a stall, metadata that was
  // refused) would hang MPI_Finalize, so it is told it is out and let go,
  // and leaves through MPI_Finalize too. A rank on another host reads the
  // message once its link is back; one on this host may be stopped, and is
  // woken.
  auto let_go = [&](const std::vector<int>& excluded) {
    if (excluded.empty()) return;
    spdlog::warn("mpi server: the run finished without rank(s) {}, which were excluded; letting them go",
                 fmt::join(excluded, ", "));
    const WireRegister me = this_rank_registration(0, 0);
    for (int r : excluded) {
      const WireRegister& reg = registered[static_cast<size_t>(r)];
      if (reg.host != me.host || reg.pid <= 0) continue;
      ::kill(reg.pid, SIGUSR1);  // first: the notice is pending when it runs again
      ::kill(reg.pid, SIGCONT);
    }
    send_exclusion_notices(excluded);
  };
  // Compressed frames and secure aggregation's masked words (one more
  // word, the masked weight, after the last chunk) arrive framed.
  ServerStreams streams(layout, chunk, shm, cfg.compressor.enable_compression || cfg.secagg.enable);
  MpiServerTransport transport(cfg, layout, streams, world);
  if (const char* hold = std::getenv("MEMFL_HOLD_COLLECT_MS"))
    transport.set_collect_hold(std::chrono::milliseconds(std::atoi(hold)));
  if (cfg.server.is_async()) {
    Status result = run_async_server(
        cfg, dir, progress, *global, st.sampler, baseline,
        [&](AsyncUpdateHandler& core, Arena& g, const AsyncServeOptions& serve_options) {
          return transport.serve_async(core, g, serve_options);
        },
        [&](nlohmann::ordered_json& summary) {
          summary["chunk_path"] = shm.enabled() ? "shared_ring" : "point_to_point";
          summary["excluded_ranks"] = transport.excluded_ranks();
        });
    if (!result.ok()) abort_job(result.message());
    transport.finish(0);
    let_go(transport.excluded_ranks());
    return Status::Ok();
  }
  RoundDriverOptions dopts;
  dopts.run_dir = dir;
  dopts.role = "mpi server";
  // Secure aggregation's stages: a request and a reply per call, point to
  // point with the client's rank.
  RemoteSecAggChannel secagg([&](int c, std::string req) { return transport.secagg_exchange(c, std::move(req)); },
                             [&](int) { transport.secagg_end_round(); },
                             [&](int c, const Status& why) { transport.secagg_drop(c, why.message()); });
  dopts.secure_aggregation = &secagg;
  dopts.resume = resume;
  std::unique_ptr<ModelWorker> evaluator;
  if (cfg.server.do_server_eval && !is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(evaluator,
                           ModelWorker::start(dir + "/config.yaml", layout, chunk, dir + "/model_worker.log"));
    // The worker evaluates round r while round r+1 goes on (RoundDriverOptions),
    // on the clients' thread count (they may share this host: memfl launch);
    // the last round's evaluation has the cores to itself.
    dopts.begin_evaluation = [&](int round, const Arena& g) {
      return evaluator->begin_evaluation(round, g, round == cfg.server.num_global_epochs ? machine_cores() : 0);
    };
    dopts.end_evaluation = [&](int round) { return evaluator->end_evaluation(round); };
  }
  dopts.on_round = [&](const RoundMetrics& m) {
    if (!progress) return;
    fmt::print("mpi round {:>3}/{}  clients {:>3}  test_acc {:.4f}  down {:.2f} GB/s  up {:.2f} GB/s  {:.2f} s\n",
               m.round, cfg.server.num_global_epochs, m.clients, m.test_accuracy,
               m.download_seconds > 0 ? static_cast<double>(m.bytes_down) / m.download_seconds / 1e9 : 0.0,
               m.upload_seconds > 0 ? static_cast<double>(m.bytes_up) / m.upload_seconds / 1e9 : 0.0, m.round_seconds);
    std::fflush(stdout);
  };
  RoundDriver driver(cfg, *global, transport, *scheduler, st.sampler, std::move(dopts));
  Status result = driver.run();
  if (!result.ok()) abort_job(result.message());  // client ranks wait for a round that will not come
  const std::vector<int> excluded = transport.excluded_ranks();
  nlohmann::ordered_json summary;
  summary["role"] = "server";
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  summary["sum_in_place"] = global->aggregator().sums_in_place();
  summary["maps_libtorch"] = maps_library("libtorch");
  summary["compression"] = compression_summary(compression_settings(cfg));
  summary["chunk_path"] = shm.enabled() ? "shared_ring" : "point_to_point";
  summary["excluded_ranks"] = excluded;
  if (cfg.secagg.enable) summary["secure_aggregation"] = secure_aggregation_summary(cfg);
  summary["updates_received_together"] = transport.most_received_together();
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/summary.json", summary.dump(2) + "\n"));
  let_go(excluded);
  return Status::Ok();
}

}  // namespace memfl
