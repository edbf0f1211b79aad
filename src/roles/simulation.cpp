#include "roles/simulation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <malloc.h>
#include <unistd.h>
#include <condition_variable>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "client/client_driver.h"
#include "comm/inproc.h"
#include "memory/budget.h"
#include "memory/malloc_policy.h"
#include "aggregate/async_aggregator.h"
#include "server/async_core.h"
#include "server/async_driver.h"
#include "server/global_model.h"
#include "server/round_driver.h"
#include "memory/sampler.h"
#include "client/client_work.h"
#include "schedule/scheduler.h"
#include "tensor/safetensors.h"

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

// Asynchronous FL (AsyncScheduler, CompassScheduler) in virtual time: one
// worker replica trains each client when it is sent off; server/async_driver.h
// plays the clock.
StatusOr<SimulationResult> run_async_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts,
                                                MemorySampler& sampler, const DatasetSplits* data,
                                                const std::vector<ClientPartition>& clients, const InputSpec& input,
                                                LocalModel& worker, const std::vector<uint32_t>& test_idx,
                                                int64_t baseline_rss, std::chrono::steady_clock::time_point t_start) {
  const auto& sc = cfg.server;
  if (opts.resume)
    return failed_precondition("--resume: an asynchronous run ({}) cannot be resumed yet; start it again",
                               sc.scheduler);
  SimulationResult result;
  const bool synthetic = data == nullptr;
  // The global model: built with the seed, as the worker was, so it is the
  // initial model; with a network, its replica evaluates it in place.
  MEMFL_ASSIGN_OR_RETURN(LocalModel global, make_local_model(cfg, input, /*fill=*/true, sc.seed, opts.run_dir));
  const Layout& layout = global.layout();
  result.model_bytes = layout.payload_bytes();
  result.num_params = layout.num_params();
  MEMFL_ASSIGN_OR_RETURN(auto aggregator, make_async_aggregator(cfg, layout, opts.run_dir));

  AsyncDriverOptions dopts;
  dopts.run_dir = opts.run_dir;
  dopts.step_time_s = client_step_times(sc);
  double total_samples = 0;
  std::vector<double> samples;
  for (size_t c = 0; c < static_cast<size_t>(sc.num_clients); ++c) {
    samples.push_back(update_sample_count(cfg, synthetic ? nullptr : &clients[c], static_cast<int>(c)));
    total_samples += samples.back();
  }
  for (double n : samples)
    dopts.weights.push_back(sc.client_weights_mode == "sample_size" ? n / total_samples : 1.0 / sc.num_clients);
  std::string speeds = "client,step_time_s,weight\n";
  for (size_t c = 0; c < dopts.step_time_s.size(); ++c)
    speeds += fmt::format("{},{:.6f},{:.9g}\n", c, dopts.step_time_s[c], dopts.weights[c]);
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "client_speeds.csv").string(), speeds));
  // The clients' side, as every transport's; the driver (AsyncDriver) still
  // holds the global model each trip started from and writes a
  // gradient_based change against it into the spool, so no base is kept.
  ClientDriver client_driver(cfg, opts.run_dir, data, clients, /*record_privacy=*/true, /*keep_base=*/false);
  dopts.train = [&](int c, int local_steps, const Arena& g, AsyncTrip* trip) -> StatusOr<const Arena*> {
    std::memcpy(worker.arena().data(), g.data(), layout.total_bytes());
    const int version = static_cast<int>(trip->version);
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, client_driver.train(worker, c, version, local_steps));
    trip->train_loss = up.trained.train_loss;
    trip->steps = up.local_steps;
    return up.upload;
  };
  if (sc.do_server_eval && global.replica() != nullptr) {
    dopts.evaluate = [&](Arena&) { return global.replica()->evaluate(data->test, test_idx, sc.eval_batch_size); };
  }
  dopts.on_eval = [&](const RoundMetrics& m) {
    if (opts.progress) {
      fmt::print("updates {:>6}/{}  virtual {:.1f} s  train_loss {:.4f}  test_acc {:.4f}  {:.1f} s  RSS {}\n",
                 static_cast<int64_t>(m.round) * (sc.async_eval_every > 0 ? sc.async_eval_every : sc.num_clients),
                 sc.num_global_epochs, m.virtual_seconds, m.train_loss, m.test_accuracy, m.round_seconds,
                 format_bytes(static_cast<double>(m.rss_bytes)));
      std::fflush(stdout);
    }
  };
  spdlog::info("{} with {}: {} clients, {} updates, speeds {} (client_speeds.csv)", sc.scheduler, sc.aggregator,
               sc.num_clients, sc.num_global_epochs, sc.client_speed_distribution);
  AsyncDriver driver(cfg, layout, global.arena(), *aggregator, sampler, std::move(dopts));
  MEMFL_RETURN_IF_ERROR(driver.run());
  MEMFL_RETURN_IF_ERROR(write_safetensors(
      (fs::path(opts.run_dir) / "global_model.safetensors").string(), layout, global.arena(),
      {{"format", "memfl"}, {"updates", std::to_string(sc.num_global_epochs)}, {"model_name", cfg.model.model_name}}));
  result.rounds = driver.evaluations();
  sampler.mark(static_cast<int>(result.rounds.size()), "done");
  result.peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result.wall_seconds = seconds_since(t_start);

  nlohmann::ordered_json summary;
  summary["role"] = "simulation";
  summary["scheduler"] = sc.scheduler;
  summary["aggregator"] = sc.aggregator;
  summary["updates"] = sc.num_global_epochs;
  summary["global_versions"] = driver.versions();
  summary["mean_staleness"] = driver.mean_staleness();
  summary["max_staleness"] = driver.max_staleness();
  summary["virtual_seconds"] = result.rounds.empty() ? 0.0 : result.rounds.back().virtual_seconds;
  summary["final_test_accuracy"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_accuracy;
  summary["final_test_loss"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_loss;
  summary["peak_rss_bytes"] = result.peak_rss_bytes;
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["model_bytes"] = result.model_bytes;
  summary["num_params"] = result.num_params;
  summary["aggregator_state_bytes"] = aggregator->state_bytes();
  summary["peak_rss_over_model"] = static_cast<double>(result.peak_rss_bytes) / static_cast<double>(result.model_bytes);
  summary["peak_above_baseline_over_model"] =
      static_cast<double>(result.peak_rss_bytes - baseline_rss) / static_cast<double>(layout.total_bytes());
  summary["wall_seconds"] = result.wall_seconds;
  summary["num_clients"] = sc.num_clients;
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
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
  const bool synthetic = is_spec_only(cfg);
  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> clients(static_cast<size_t>(sc.num_clients));
  InputSpec input;
  if (!synthetic) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(clients, make_partitions(cfg, data->train));
    std::string csv = "client_id,train_samples,val_samples\n";
    size_t mn = SIZE_MAX, mx = 0;
    for (size_t c = 0; c < clients.size(); ++c) {
      csv += fmt::format("{},{},{}\n", c, clients[c].train.size(), clients[c].val.size());
      mn = std::min(mn, clients[c].train.size());
      mx = std::max(mx, clients[c].train.size());
    }
    MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "partition.csv").string(), csv));
    spdlog::info("{} partition of {} samples over {} clients: {}–{} training samples per client (partition.csv)",
                 cfg.data.partition_strategy, data->train.size(), clients.size(), mn, mx);
  }
  std::vector<uint32_t> test_idx(data ? data->test.size() : 0);
  std::iota(test_idx.begin(), test_idx.end(), 0u);

  // What the process costs before any model exists (libtorch runtime, data
  // set): the memory bound is stated on top of this.
  const int64_t baseline_rss = read_rss_bytes();
  // One worker replica serves every client in turn; it is built with the
  // seed, so its initial weights are the initial global model.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  MEMFL_ASSIGN_OR_RETURN(const int64_t budget, parse_memory_budget(sc.memory_budget, total_ram_bytes()));
  // (reserved: the layout reference below must not move with the vector)
  std::vector<LocalModel> workers;
  workers.reserve(static_cast<size_t>(sc.parallel_clients > 0 ? sc.parallel_clients : cores));
  {
    MEMFL_ASSIGN_OR_RETURN(LocalModel first, make_local_model(cfg, input, /*fill=*/true, sc.seed, opts.run_dir));
    workers.push_back(std::move(first));
  }
  LocalModel& worker0 = workers[0];
  const Layout& layout = worker0.layout();
  if (cfg.train.device == "cuda") {
    // The GPU's memory joins the timeline (the CUDA caching allocator's view).
    auto backend = load_trainer_backend();
    if (backend.ok()) {
      TrainerBackend* b = *backend;
      sampler.set_gpu_probe([b](int64_t* a, int64_t* r, int64_t* p) { return b->gpu_memory(a, r, p); });
    }
  }
  result.model_bytes = layout.payload_bytes();
  result.num_params = layout.num_params();
  spdlog::info("model {}: {} parameters, {} ({} tensors), layout {:016x}", cfg.model.model_name, layout.num_params(),
               format_bytes(static_cast<double>(layout.payload_bytes())), layout.size(), layout.hash());

  if (sc.is_async()) {
    return run_async_simulation(cfg, opts, sampler, data ? &*data : nullptr, clients, input, worker0, test_idx,
                                baseline_rss, t_start);
  }

  // parallel_clients: -1 — as many workers as the budget holds, from the
  // measured cost of the first replica plus its training state.
  int k_workers = sc.parallel_clients;
  {
    const int64_t after_first = read_rss_bytes();
    const bool trains_here = worker0.replica() != nullptr && cfg.train.trainer != "DummyTrainer";
    const int64_t opt_models =
        !trains_here ? 0 : (cfg.train.optim.optim == "Adam" ? 2 : (cfg.train.optim.momentum > 0 ? 1 : 0));
    const int64_t m_bytes = static_cast<int64_t>(layout.total_bytes());
    const int64_t replica_cost =
        std::max<int64_t>(after_first - baseline_rss, m_bytes) + (trains_here ? m_bytes * (1 + opt_models) : 0);
    if (k_workers < 0) {
      k_workers = choose_parallel_clients(budget, after_first + 2 * m_bytes, replica_cost, cores);
      spdlog::info("parallel_clients: -1 → {} worker(s): budget {}, in use {}, one replica ≈ {}", k_workers,
                   format_bytes(static_cast<double>(budget)),
                   format_bytes(static_cast<double>(after_first + 2 * m_bytes)),
                   format_bytes(static_cast<double>(replica_cost)));
    }
  }
  // More workers (parallel_clients: K), each one replica; the intra-op
  // threads are split among them so K × threads ≤ cores.
  for (int k = 1; k < k_workers; ++k) {
    MEMFL_ASSIGN_OR_RETURN(LocalModel extra, make_local_model(cfg, input, /*fill=*/false, sc.seed, opts.run_dir));
    workers.push_back(std::move(extra));
  }
  // The intra-op threads each worker trains with (make_local_model set
  // num_threads, or every core, for one worker).
  int intra_op_threads = cfg.train.num_threads > 0 ? cfg.train.num_threads : cores;
  if (k_workers > 1 && !synthetic) {
    MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
    const int total = cfg.train.num_threads > 0 ? cfg.train.num_threads * k_workers : cores;
    intra_op_threads = std::max(1, total / k_workers);
    backend->set_num_threads(intra_op_threads);
  }
  spdlog::info("{} worker(s) × {} intra-op thread(s) on {} core(s)", k_workers, intra_op_threads, cores);

  WorkerGovernor governor(budget, k_workers);
  std::mutex governor_mu;
  auto keep_worker = [&](int worker_index) {
    // The governor: warn at 85 % of the budget, one worker fewer at 90 %.
    std::lock_guard glock(governor_mu);
    const int64_t rss = read_rss_bytes();
    switch (governor.observe(rss)) {
      case WorkerGovernor::Action::kWarn:
        spdlog::warn("memory: RSS {} is {:.0f} % of the {} budget (server_configs.memory_budget)",
                     format_bytes(static_cast<double>(rss)),
                     100.0 * static_cast<double>(rss) / static_cast<double>(budget),
                     format_bytes(static_cast<double>(budget)));
        break;
      case WorkerGovernor::Action::kShed:
        spdlog::warn("memory: RSS {} is {:.0f} % of the {} budget: shedding a worker, {} left",
                     format_bytes(static_cast<double>(rss)),
                     100.0 * static_cast<double>(rss) / static_cast<double>(budget),
                     format_bytes(static_cast<double>(budget)), governor.active());
        break;
      case WorkerGovernor::Action::kNone:
        break;
    }
    return worker_index < governor.active();
  };

  // ServerAgent state: the global model and its aggregator. Workers read the
  // global model while updates fold, so the sum has an arena of its own.
  MEMFL_ASSIGN_OR_RETURN(auto global,
                         GlobalModel::create(cfg, input, opts.run_dir, /*naive=*/false, /*sum_in_place=*/false,
                                             /*network_here=*/true));
  const size_t chunk = transfer_chunk_bytes(sc.use_model_chunking, sc.model_chunk_size, layout.total_bytes());

  std::vector<InProcessTransport::Worker> pool;
  for (auto& w : workers) pool.push_back({&w.arena()});
  const std::vector<double> step_times = client_step_times(sc);
  std::mutex virtual_mu;
  std::map<int, double> round_virtual;
  // The clients' side, as every transport's: the round's privacy spending
  // is recorded after the round, in client order (the workers finish in any
  // order), from what the scheduler gathered.
  ClientDriver client_driver(cfg, opts.run_dir, data ? &*data : nullptr, clients, /*record_privacy=*/false);
  auto train = [&](int w, int c, int round, ClientUpdateInfo* info) -> Status {
    const ClientPartition* part = synthetic ? nullptr : &clients[static_cast<size_t>(c)];
    sampler.mark(round, "train");
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, client_driver.train(workers[static_cast<size_t>(w)], c, round));
    const TrainResult& tr = up.trained;
    info->sample_count = up.sample_count;
    info->train_loss = tr.train_loss;
    info->train_accuracy = tr.train_accuracy;
    info->has_validation = tr.has_validation;
    info->val_weight = part != nullptr ? static_cast<double>(part->val.size()) : 0.0;
    info->val_loss = tr.val_loss;
    info->val_accuracy = tr.val_accuracy;
    info->dp_steps = tr.dp_steps;
    info->dp_sample_rate = tr.dp_sample_rate;
    {
      // Simulated time: the round lasts as long as its slowest client.
      const double d = static_cast<double>(up.local_steps) * step_times[static_cast<size_t>(c)];
      std::lock_guard vlock(virtual_mu);
      round_virtual[round] = std::max(round_virtual[round], d);
    }
    sampler.mark(round, "upload");
    return Status::Ok();
  };
  InProcessTransport transport(layout, chunk, std::move(pool), train, keep_worker);

  SchedulerOptions so;
  so.num_clients = sc.num_clients;
  so.clients_per_round = sc.clients_per_round;
  so.seed = sc.seed;
  so.client_selection = sc.client_selection;
  so.selection = {sc.power_of_choice_d, sc.exploration, sc.fairness_penalty};
  for (size_t c = 0; c < clients.size(); ++c)
    so.client_samples.push_back(update_sample_count(cfg, synthetic ? nullptr : &clients[c], static_cast<int>(c)));
  MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(sc.scheduler, so));

  double max_epsilon = 0;
  RoundDriverOptions dopts;
  dopts.run_dir = opts.run_dir;
  dopts.role = "simulation";
  dopts.resume = opts.resume;
  if (sc.do_server_eval && global->model().replica() != nullptr) {
    dopts.evaluate = [&](int, Arena& global_model) -> StatusOr<EvalResult> {
      // With K workers the test set is cut in K parts, each evaluated by a
      // worker replica holding the new global model, at once: the cores stay
      // as busy as in training (one replica would evaluate on one worker's
      // threads). Worker replicas are free between rounds; a sharded one
      // (num_gpus) is left to the global replica.
      const size_t k = std::min(static_cast<size_t>(governor.active()), workers.size());
      const bool plain =
          k > 1 && std::all_of(workers.begin(), workers.begin() + static_cast<std::ptrdiff_t>(k), [](LocalModel& w) {
            return w.replica() != nullptr && w.replica()->sharded_io() == nullptr;
          });
      if (!plain) return global->model().replica()->evaluate(data->test, test_idx, sc.eval_batch_size);
      std::vector<StatusOr<EvalResult>> parts(k, EvalResult{});
      std::vector<std::thread> evaluators;
      for (size_t w = 0; w < k; ++w) {
        evaluators.emplace_back([&, w] {
          const size_t lo = test_idx.size() * w / k, hi = test_idx.size() * (w + 1) / k;
          std::memcpy(workers[w].arena().data(), global_model.data(), layout.total_bytes());
          parts[w] = workers[w].replica()->evaluate(
              data->test, std::span<const uint32_t>(test_idx).subspan(lo, hi - lo), sc.eval_batch_size);
        });
      }
      for (auto& t : evaluators) t.join();
      EvalResult all;
      for (auto& p : parts) {
        MEMFL_RETURN_IF_ERROR(p.status());
        all.num_samples += p->num_samples;
      }
      for (auto& p : parts) {
        const double share =
            static_cast<double>(p->num_samples) / static_cast<double>(std::max<int64_t>(1, all.num_samples));
        all.loss += p->loss * share;
        all.accuracy += p->accuracy * share;
      }
      return all;
    };
  }
  dopts.on_round = [&](const RoundMetrics& m) {
    if (cfg.train.dp.enabled) {
      // Each client's ε over the rounds it took part in (privacy.csv, as every
      // transport's client writes it), and the largest one for the summary.
      const auto& stats = scheduler->stats();
      for (size_t c = 0; c < stats.size(); ++c) {
        if (stats[c].last_round != m.round) continue;
        auto e = record_client_privacy(cfg, opts.run_dir, m.round, static_cast<int>(c), stats[c].dp_steps,
                                       stats[c].dp_sample_rate);
        if (e.ok()) max_epsilon = std::max(max_epsilon, *e);
      }
    }
    // A shed worker's replica goes now, between rounds.
    for (size_t k = static_cast<size_t>(governor.active()); k < workers.size(); ++k) workers[k] = LocalModel();
    if (opts.progress) print_progress(cfg, m, seconds_since(t_start));
  };
  dopts.round_virtual_seconds = [&](int round) {
    std::lock_guard vlock(virtual_mu);
    const double d = round_virtual[round];
    round_virtual.erase(round);
    return d;
  };
  dopts.save_extra = [&] { return nlohmann::json{{"max_client_epsilon", max_epsilon}}; };
  dopts.load_extra = [&](const nlohmann::json& j) {
    max_epsilon = j.value("max_client_epsilon", 0.0);
    return Status::Ok();
  };
  RoundDriver driver(cfg, *global, transport, *scheduler, sampler, std::move(dopts));
  MEMFL_RETURN_IF_ERROR(driver.run());
  result.rounds = driver.rounds();
  const double dp_fedavg_epsilon = driver.dp_fedavg_epsilon();
  sampler.mark(sc.num_global_epochs, "done");
  result.peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result.wall_seconds = seconds_since(t_start);
  result.max_epsilon = max_epsilon;
  result.dp_fedavg_epsilon = dp_fedavg_epsilon;

  nlohmann::ordered_json summary;
  summary["role"] = "simulation";
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
  summary["final_test_accuracy"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_accuracy;
  summary["final_test_loss"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_loss;
  summary["peak_rss_bytes"] = result.peak_rss_bytes;
  summary["model_bytes"] = result.model_bytes;
  summary["num_params"] = result.num_params;
  summary["peak_rss_over_model"] = static_cast<double>(result.peak_rss_bytes) / static_cast<double>(result.model_bytes);
  summary["wall_seconds"] = result.wall_seconds;
  summary["num_clients"] = sc.num_clients;
  summary["model_chunk_size"] = chunk;
  summary["parallel_clients"] = k_workers;
  summary["intra_op_threads"] = intra_op_threads;  // per worker: workers × threads is what the cores run
  summary["cores"] = cores;
  summary["malloc_policy"] = malloc_policy();  // "training" unless synthetic or MEMFL_MALLOC_POLICY=glibc
  if (!synthetic) {
    // 1 unless the user set OPENBLAS_NUM_THREADS; 0: not OpenBLAS.
    MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
    summary["blas_threads_per_call"] = backend->blas_threads_per_call();
  }
  // The stated bound (docs/ARCHITECTURE.md): global + FedAvg sum + one worker
  // replica + its gradients + optimizer state, in model sizes M, whatever the
  // number of clients. Activations come on top and scale with the batch.
  const double m_bytes = static_cast<double>(layout.total_bytes());
  const double sum_bytes = static_cast<double>(global->aggregator().state_bytes());
  const bool trains = worker0.replica() != nullptr && cfg.train.trainer != "DummyTrainer";
  const double opt_models =
      !trains ? 0.0 : (cfg.train.optim.optim == "Adam" ? 2.0 : (cfg.train.optim.momentum > 0 ? 1.0 : 0.0));
  const double bound = m_bytes * (2.0 + (trains ? 1.0 : 0.0) + opt_models) + sum_bytes;
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["model_state_bound_bytes"] = bound;
  summary["peak_above_baseline_bytes"] = result.peak_rss_bytes - baseline_rss;
  summary["peak_above_baseline_over_model"] = static_cast<double>(result.peak_rss_bytes - baseline_rss) / m_bytes;
  summary["peak_above_baseline_over_bound"] = static_cast<double>(result.peak_rss_bytes - baseline_rss) / bound;
  summary["ledger_peak_bytes"] = nlohmann::json::object();
  for (size_t c = 0; c < static_cast<size_t>(MemoryCategory::kCount); ++c) {
    const auto cat = static_cast<MemoryCategory>(c);
    summary["ledger_peak_bytes"][std::string(memory_category_name(cat))] = Ledger::instance().peak(cat);
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
