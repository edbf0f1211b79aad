#include "roles/simulation.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <malloc.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "memory/malloc_policy.h"
#include "memory/sampler.h"
#include "server/async_common.h"
#include "server/async_simulation.h"
#include "server/global_model.h"
#include "server/round_driver.h"
#include "server/sim_workers.h"
#include "compress/settings.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// On a terminal, one progress bar redrawn in place (round, method,
// accuracy, RSS, ETA); otherwise a plain log line per round.
void print_progress(const ExperimentConfig& cfg, const RoundMetrics& m, double elapsed) {
  const int total = cfg.server.num_global_epochs;
  const double eta = elapsed / m.round * (total - m.round);
  if (isatty(fileno(stdout))) {
    const int width = 24, done = width * m.round / total;
    fmt::print("\r\033[K[{}{}] round {}/{}  {}  acc {:.4f}  loss {:.4f}  RSS {}  ETA {:.0f} s{}",
               std::string(done, '#'), std::string(width - done, '.'), m.round, total, cfg.server.client_selection,
               m.test_accuracy, m.train_loss, format_bytes(static_cast<double>(m.rss_bytes)), eta,
               m.round == total ? "\n" : "");
  } else {
    fmt::print(
        "round {:>3}/{}  clients {:>3}  train_loss {:.4f}  val_acc {:.4f}  test_loss {:.4f}  test_acc {:.4f}"
        "  moved {}  {:.1f} s  peak RSS {}  ETA {:.0f} s\n",
        m.round, total, m.clients, m.train_loss, m.val_accuracy, m.test_loss, m.test_accuracy,
        format_bytes(static_cast<double>(m.bytes_moved)), m.round_seconds,
        format_bytes(static_cast<double>(m.peak_rss_bytes)), eta);
  }
  std::fflush(stdout);
}

// Asynchronous FL (AsyncScheduler, CompassScheduler) in virtual time
// (server/async_simulation.h), on the first worker replica.
Status run_async(const ExperimentConfig& cfg, const SimulationOptions& opts, MemorySampler& sampler,
                 const SimClients& clients, SimWorkers& workers, int64_t baseline_rss,
                 std::chrono::steady_clock::time_point t_start, SimulationResult* result) {
  const auto& sc = cfg.server;
  if (opts.resume)
    return failed_precondition("--resume: an asynchronous run ({}) cannot be resumed yet; start it again",
                               sc.scheduler);
  auto on_eval = [&](const RoundMetrics& m) {
    if (!opts.progress) return;
    fmt::print("updates {:>6}/{}  virtual {:.1f} s  train_loss {:.4f}  test_acc {:.4f}  {:.1f} s  RSS {}\n",
               static_cast<int64_t>(m.round) * async_eval_every(sc), sc.num_global_epochs, m.virtual_seconds,
               m.train_loss, m.test_accuracy, m.round_seconds, format_bytes(static_cast<double>(m.rss_bytes)));
    std::fflush(stdout);
  };
  MEMFL_ASSIGN_OR_RETURN(AsyncSimulationResult run,
                         simulate_async(cfg, opts.run_dir, clients, workers.first(), sampler, on_eval));
  result->rounds = run.evaluations;
  sampler.mark(static_cast<int>(result->rounds.size()), "done");
  result->peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result->wall_seconds = seconds_since(t_start);
  const auto& rounds = result->rounds;
  nlohmann::ordered_json summary =
      async_summary_head("simulation", sc, sc.num_global_epochs, run.versions, run.mean_staleness, run.max_staleness);
  summary["virtual_seconds"] = rounds.empty() ? 0.0 : rounds.back().virtual_seconds;
  summary["final_test_accuracy"] = rounds.empty() ? 0.0 : rounds.back().test_accuracy;
  summary["final_test_loss"] = rounds.empty() ? 0.0 : rounds.back().test_loss;
  summary["peak_rss_bytes"] = result->peak_rss_bytes;
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["model_bytes"] = result->model_bytes;
  summary["num_params"] = result->num_params;
  summary["aggregator_state_bytes"] = run.aggregator_state_bytes;
  summary["peak_rss_over_model"] =
      static_cast<double>(result->peak_rss_bytes) / static_cast<double>(result->model_bytes);
  summary["peak_above_baseline_over_model"] =
      static_cast<double>(result->peak_rss_bytes - baseline_rss) / static_cast<double>(workers.layout().total_bytes());
  summary["wall_seconds"] = result->wall_seconds;
  summary["num_clients"] = sc.num_clients;
  return write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n");
}

}  // namespace

StatusOr<SimulationResult> run_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts) {
  const auto t_start = std::chrono::steady_clock::now();
  // Worker threads start every round; each would get a malloc arena that
  // keeps its own freed chunks. Two shared arenas keep the retained heap to a
  // few chunks (as the gRPC server does).
  mallopt(M_ARENA_MAX, 2);
  // Its workers train: each batch reuses the last one's activation memory.
  if (!is_spec_only(cfg)) tune_malloc_for_training();
  MemorySampler sampler("simulation", cfg.memory.sample_interval_ms);
  sampler.start();
  SimulationResult result;
  // Whatever happens below, memory.json is written: a failed run keeps what it measured.
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);

  sampler.mark(0, "setup");
  const auto& sc = cfg.server;
  MEMFL_ASSIGN_OR_RETURN(SimClients clients, SimClients::load(cfg, opts.run_dir));
  // What the process costs before any model exists (libtorch runtime, data
  // set): the memory bound is stated on top of this.
  const int64_t baseline_rss = read_rss_bytes();
  // One worker replica serves every client in turn; it is built with the
  // seed, so its initial weights are the initial global model.
  MEMFL_ASSIGN_OR_RETURN(auto workers, SimWorkers::create(cfg, clients, opts.run_dir, sampler));
  const Layout& layout = workers->layout();
  result.model_bytes = layout.payload_bytes();
  result.num_params = layout.num_params();
  spdlog::info("model {}: {} parameters, {} ({} tensors), layout {:016x}", cfg.model.model_name, layout.num_params(),
               format_bytes(static_cast<double>(layout.payload_bytes())), layout.size(), layout.hash());
  if (sc.is_async()) {
    MEMFL_RETURN_IF_ERROR(run_async(cfg, opts, sampler, clients, *workers, baseline_rss, t_start, &result));
    return result;
  }

  MEMFL_RETURN_IF_ERROR(workers->grow(baseline_rss));
  // The server's state: the global model and its aggregator. Workers read the
  // global model while updates fold, so the sum has an arena of its own.
  MEMFL_ASSIGN_OR_RETURN(auto global,
                         GlobalModel::create(cfg, clients.input, opts.run_dir, /*naive=*/false, /*sum_in_place=*/false,
                                             /*network_here=*/true));
  const size_t chunk = transfer_chunk_bytes(sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes());
  auto transport = workers->make_transport(chunk);

  SchedulerOptions so;
  so.num_clients = sc.num_clients;
  so.clients_per_round = sc.clients_per_round;
  so.seed = sc.seed;
  so.client_selection = sc.client_selection;
  so.selection = {sc.power_of_choice_d, sc.exploration, sc.fairness_penalty};
  so.client_samples = clients.sample_counts(cfg);
  MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(sc.scheduler, so));

  RoundDriverOptions dopts;
  dopts.run_dir = opts.run_dir;
  dopts.role = "simulation";
  dopts.resume = opts.resume;
  workers->attach(&dopts, *global, *scheduler, [&](const RoundMetrics& m) {
    if (opts.progress) print_progress(cfg, m, seconds_since(t_start));
  });
  // From the start to the first round: the global model made or read (a
  // checkpoint), the workers and their replicas.
  const double setup_seconds = seconds_since(t_start);
  RoundDriver driver(cfg, *global, *transport, *scheduler, sampler, std::move(dopts));
  MEMFL_RETURN_IF_ERROR(driver.run());
  result.rounds = driver.rounds();
  sampler.mark(sc.num_global_epochs, "done");
  result.peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result.wall_seconds = seconds_since(t_start);
  result.max_epsilon = workers->max_epsilon();
  result.dp_fedavg_epsilon = driver.dp_fedavg_epsilon();

  nlohmann::ordered_json summary;
  summary["role"] = "simulation";
  summary["compression"] = compression_summary(compression_settings(cfg));
  if (sc.dp_fedavg_clip_norm > 0) {
    summary["dp_fedavg"] = {{"clip_norm", sc.dp_fedavg_clip_norm},
                            {"noise_multiplier", sc.dp_fedavg_noise_multiplier},
                            {"delta", sc.dp_fedavg_delta},
                            {"epsilon", result.dp_fedavg_epsilon}};
  }
  if (cfg.train.dp.enabled) {
    summary["dp"] = {{"noise_multiplier", cfg.train.dp.noise_multiplier},
                     {"max_grad_norm", cfg.train.dp.max_grad_norm},
                     {"clipping", cfg.train.dp.clipping},
                     {"delta", cfg.train.dp.delta},
                     {"max_client_epsilon", result.max_epsilon}};
  }
  summary["rounds"] = result.rounds.size();
  if (cfg.secagg.enable) summary["secure_aggregation"] = secure_aggregation_summary(cfg);
  summary["final_test_accuracy"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_accuracy;
  summary["final_test_loss"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_loss;
  summary["peak_rss_bytes"] = result.peak_rss_bytes;
  summary["model_bytes"] = result.model_bytes;
  summary["num_params"] = result.num_params;
  summary["peak_rss_over_model"] = static_cast<double>(result.peak_rss_bytes) / static_cast<double>(result.model_bytes);
  summary["wall_seconds"] = result.wall_seconds;
  summary["setup_seconds"] = setup_seconds;
  summary["num_clients"] = sc.num_clients;
  summary["model_chunk_size"] = chunk;
  MEMFL_RETURN_IF_ERROR(workers->summarise(&summary, baseline_rss, result.peak_rss_bytes,
                                           static_cast<double>(global->aggregator().state_bytes())));
  summary["ledger_peak_bytes"] = nlohmann::json::object();
  for (size_t c = 0; c < static_cast<size_t>(MemoryCategory::kCount); ++c) {
    const auto cat = static_cast<MemoryCategory>(c);
    summary["ledger_peak_bytes"][std::string(memory_category_name(cat))] = Ledger::instance().peak(cat);
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
