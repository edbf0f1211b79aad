#include "server/sim_workers.h"

#include "model/llama.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <span>
#include <thread>

#include <spdlog/spdlog.h>

#include "io/run_dir.h"
#include "memory/malloc_policy.h"
#include "server/async_driver.h"

namespace memfl {

namespace fs = std::filesystem;

StatusOr<SimClients> SimClients::load(const ExperimentConfig& cfg, const std::string& run_dir) {
  SimClients out;
  out.parts.resize(static_cast<size_t>(cfg.server.num_clients));
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(out.data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(out.input, input_spec(cfg, out.data->train));
    MEMFL_ASSIGN_OR_RETURN(out.parts, make_partitions(cfg, out.data->train));
    std::string csv = "client_id,train_samples,val_samples\n";
    size_t mn = SIZE_MAX, mx = 0;
    for (size_t c = 0; c < out.parts.size(); ++c) {
      csv += fmt::format("{},{},{}\n", c, out.parts[c].train.size(), out.parts[c].val.size());
      mn = std::min(mn, out.parts[c].train.size());
      mx = std::max(mx, out.parts[c].train.size());
    }
    MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(run_dir) / "partition.csv").string(), csv));
    spdlog::info("{} partition of {} samples over {} clients: {}–{} training samples per client (partition.csv)",
                 cfg.data.partition_strategy, out.data->train.size(), out.parts.size(), mn, mx);
  }
  out.test_idx.resize(out.data ? out.data->test.size() : 0);
  std::iota(out.test_idx.begin(), out.test_idx.end(), 0u);
  return out;
}

std::vector<double> SimClients::sample_counts(const ExperimentConfig& cfg) const {
  std::vector<double> out;
  for (size_t c = 0; c < parts.size(); ++c)
    out.push_back(update_sample_count(cfg, data ? &parts[c] : nullptr, static_cast<int>(c)));
  return out;
}

SimWorkers::SimWorkers(const ExperimentConfig& cfg, const SimClients& clients, std::string run_dir,
                       MemorySampler& sampler, int64_t budget, int cores)
    : cfg_(cfg), clients_(clients), run_dir_(std::move(run_dir)), sampler_(sampler), budget_(budget), cores_(cores) {}

StatusOr<std::unique_ptr<SimWorkers>> SimWorkers::create(const ExperimentConfig& cfg, const SimClients& clients,
                                                         const std::string& run_dir, MemorySampler& sampler) {
  const auto& sc = cfg.server;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  MEMFL_ASSIGN_OR_RETURN(const int64_t budget,
                         parse_memory_budget(sc.memory_budget, total_ram_bytes(/*log_source=*/true)));
  std::unique_ptr<SimWorkers> w(new SimWorkers(cfg, clients, run_dir, sampler, budget, cores));
  w->workers_.reserve(static_cast<size_t>(sc.parallel_clients > 0 ? sc.parallel_clients : cores));
  MEMFL_ASSIGN_OR_RETURN(LocalModel first, make_local_model(cfg, clients.input, /*fill=*/true, sc.seed, run_dir));
  w->workers_.push_back(std::move(first));
  if (cfg.train.device == "cuda") {
    // The GPU's memory joins the timeline (the CUDA caching allocator's view).
    auto backend = load_trainer_backend();
    if (backend.ok()) {
      TrainerBackend* b = *backend;
      sampler.set_gpu_probe([b](int64_t* a, int64_t* r, int64_t* p) { return b->gpu_memory(a, r, p); });
    }
  }
  return w;
}

double SimWorkers::optimizer_models() {
  const bool trains_here = workers_[0].replica() != nullptr && cfg_.train.trainer != "DummyTrainer";
  if (!trains_here) return 0.0;
  const auto& o = cfg_.train.optim;
  if (o.optim != "Adam") return o.momentum > 0 ? 1.0 : 0.0;
  // Two moments, each the model's size, or 4 bytes an element in float32.
  // (LoRA's adapters are float32 whatever the base's dtype.)
  const double element = cfg_.model.dtype == "f32" || cfg_.model.lora.enabled ? 4.0 : 2.0;
  return o.state_dtype == "float32" ? 2.0 * 4.0 / element : 2.0;
}

Status SimWorkers::grow(int64_t baseline_rss) {
  const auto& sc = cfg_.server;
  // parallel_clients: -1 — as many workers as the budget holds, from the
  // measured cost of the first replica plus its training state.
  k_workers_ = sc.parallel_clients;
  {
    const int64_t after_first = read_rss_bytes();
    const bool trains_here = workers_[0].replica() != nullptr && cfg_.train.trainer != "DummyTrainer";
    const int64_t opt_models = static_cast<int64_t>(optimizer_models());
    const int64_t m_bytes = static_cast<int64_t>(layout().total_bytes());
    const int64_t replica_cost =
        std::max<int64_t>(after_first - baseline_rss, m_bytes) + (trains_here ? m_bytes * (1 + opt_models) : 0);
    if (k_workers_ < 0) {
      k_workers_ = choose_parallel_clients(budget_, after_first + 2 * m_bytes, replica_cost, cores_);
      spdlog::info("parallel_clients: -1 → {} worker(s): budget {}, in use {}, one replica ≈ {}", k_workers_,
                   format_bytes(static_cast<double>(budget_)),
                   format_bytes(static_cast<double>(after_first + 2 * m_bytes)),
                   format_bytes(static_cast<double>(replica_cost)));
    }
  }
  // More workers (parallel_clients: K), each one replica; the intra-op
  // threads are split among them so K × threads ≤ cores.
  for (int k = 1; k < k_workers_; ++k) {
    MEMFL_ASSIGN_OR_RETURN(LocalModel extra, make_local_model(cfg_, clients_.input, /*fill=*/false, sc.seed, run_dir_));
    workers_.push_back(std::move(extra));
  }
  // The intra-op threads each worker trains with (make_local_model set
  // num_threads, or every core, for one worker).
  intra_op_threads_ = cfg_.train.num_threads > 0 ? cfg_.train.num_threads : cores_;
  if (k_workers_ > 1 && !is_spec_only(cfg_)) {
    MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
    const int total = cfg_.train.num_threads > 0 ? cfg_.train.num_threads * k_workers_ : cores_;
    intra_op_threads_ = std::max(1, total / k_workers_);
    backend->set_num_threads(intra_op_threads_);
  }
  spdlog::info("{} worker(s) × {} intra-op thread(s) on {} core(s)", k_workers_, intra_op_threads_, cores_);
  governor_.emplace(budget_, k_workers_);
  return Status::Ok();
}

bool SimWorkers::keep_worker(int worker_index) {
  // The governor: warn at 85 % of the budget, one worker fewer at 90 %.
  std::lock_guard glock(governor_mu_);
  const int64_t rss = read_rss_bytes();
  switch (governor_->observe(rss)) {
    case WorkerGovernor::Action::kWarn:
      spdlog::warn("memory: RSS {} is {:.0f} % of the {} budget (server_configs.memory_budget)",
                   format_bytes(static_cast<double>(rss)),
                   100.0 * static_cast<double>(rss) / static_cast<double>(budget_),
                   format_bytes(static_cast<double>(budget_)));
      break;
    case WorkerGovernor::Action::kShed:
      spdlog::warn("memory: RSS {} is {:.0f} % of the {} budget: shedding a worker, {} left",
                   format_bytes(static_cast<double>(rss)),
                   100.0 * static_cast<double>(rss) / static_cast<double>(budget_),
                   format_bytes(static_cast<double>(budget_)), governor_->active());
      break;
    case WorkerGovernor::Action::kNone:
      break;
  }
  return worker_index < governor_->active();
}

std::unique_ptr<InProcessTransport> SimWorkers::make_transport(size_t chunk) {
  std::vector<InProcessTransport::Worker> pool;
  for (auto& w : workers_) pool.push_back({&w.arena()});
  step_times_ = client_step_times(cfg_.server);
  // The clients' side, as every transport's: the round's privacy spending
  // is recorded after the round, in client order (the workers finish in any
  // order), from what the scheduler gathered. The driver keeps no base
  // copy: the workers train at once, and one copy written by all of them
  // would be a data race; the round's global model, which the upload below
  // encodes against, is the base already.
  client_driver_ = std::make_unique<ClientDriver>(cfg_, run_dir_, clients_.splits(), clients_.parts,
                                                  /*record_privacy=*/false, /*keep_base=*/false);
  trips_.assign(workers_.size(), TripUpdate{});
  InProcessTransport::Upload upload;
  if (cfg_.compressor.enable_compression || cfg_.secagg.enable) {
    // A worker's update leaves as frames (compressed, or secure aggregation's
    // masked words); lossy tensors as their change
    // from the round's global model, which the simulator keeps anyway.
    upload = [this](int w, int c, const Arena& global) {
      return client_driver_->upload_place(trips_[static_cast<size_t>(w)], c, &global);
    };
  }
  return std::make_unique<InProcessTransport>(
      layout(), chunk, std::move(pool),
      [this](int w, int c, int round, ClientUpdateInfo* info) { return train(w, c, round, info); },
      [this](int w) { return keep_worker(w); }, std::move(upload));
}

Status SimWorkers::train(int w, int c, int round, ClientUpdateInfo* info) {
  sampler_.mark(round, "train");
  MEMFL_ASSIGN_OR_RETURN(TripUpdate up, client_driver_->train(workers_[static_cast<size_t>(w)], c, round));
  trips_[static_cast<size_t>(w)] = up;
  // The report a client over any transport would send, as the server there
  // would read it.
  *info = update_info(c, trip_report(up));
  {
    // Simulated time: the round lasts as long as its slowest client.
    const double d = static_cast<double>(up.local_steps) * step_times_[static_cast<size_t>(c)];
    std::lock_guard vlock(virtual_mu_);
    round_virtual_[round] = std::max(round_virtual_[round], d);
  }
  sampler_.mark(round, "upload");
  return Status::Ok();
}

double SimWorkers::take_round_virtual_seconds(int round) {
  std::lock_guard vlock(virtual_mu_);
  const double d = round_virtual_[round];
  round_virtual_.erase(round);
  return d;
}

StatusOr<EvalResult> SimWorkers::evaluate(LocalModel& global, Arena& global_model) {
  const auto& test = clients_.data->test;
  const auto& test_idx = clients_.test_idx;
  const int batch = cfg_.server.eval_batch_size;
  // With K workers the test set is cut in K parts, each evaluated by a
  // worker replica holding the new global model, at once: the cores stay
  // as busy as in training (one replica would evaluate on one worker's
  // threads). Worker replicas are free between rounds; a sharded one
  // (num_gpus) is left to the global replica.
  const size_t k = std::min(static_cast<size_t>(governor_->active()), workers_.size());
  const bool plain =
      k > 1 && std::all_of(workers_.begin(), workers_.begin() + static_cast<std::ptrdiff_t>(k), [](LocalModel& w) {
        return w.replica() != nullptr && w.replica()->sharded_io() == nullptr;
      });
  if (!plain) return global.replica()->evaluate(test, test_idx, batch);
  std::vector<StatusOr<EvalResult>> parts(k, EvalResult{});
  std::vector<std::thread> evaluators;
  for (size_t w = 0; w < k; ++w) {
    evaluators.emplace_back([&, w] {
      const size_t lo = test_idx.size() * w / k, hi = test_idx.size() * (w + 1) / k;
      std::memcpy(workers_[w].arena().data(), global_model.data(), layout().total_bytes());
      parts[w] = workers_[w].replica()->evaluate(test, std::span<const uint32_t>(test_idx).subspan(lo, hi - lo), batch);
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
}

void SimWorkers::record_round(int round, const Scheduler& scheduler) {
  if (cfg_.train.dp.enabled) {
    // Each client's ε over the rounds it took part in (privacy.csv, as every
    // transport's client writes it), and the largest one for the summary.
    const auto& stats = scheduler.stats();
    for (size_t c = 0; c < stats.size(); ++c) {
      if (stats[c].last_round != round) continue;
      auto e =
          record_client_privacy(cfg_, run_dir_, round, static_cast<int>(c), stats[c].dp_steps, stats[c].dp_sample_rate);
      if (e.ok()) max_epsilon_ = std::max(max_epsilon_, *e);
    }
  }
}

void SimWorkers::attach(RoundDriverOptions* dopts, GlobalModel& global, const Scheduler& scheduler,
                        std::function<void(const RoundMetrics&)> on_round) {
  // Secure aggregation's key exchange reaches the virtual clients' stages
  // directly: the clients' side is the same ClientDriver as on every transport.
  if (client_driver_ != nullptr) dopts->secure_aggregation = client_driver_->secure_aggregation();
  if (cfg_.server.do_server_eval && global.model().replica() != nullptr)
    dopts->evaluate = [this, &global](int, Arena& global_model) { return evaluate(global.model(), global_model); };
  dopts->on_round = [this, &scheduler, on_round = std::move(on_round)](const RoundMetrics& m) {
    record_round(m.round, scheduler);
    if (on_round) on_round(m);
  };
  // A shed worker's replica goes between rounds, when no worker trains.
  dopts->between_rounds = [this](int) {
    for (size_t k = static_cast<size_t>(governor_->active()); k < workers_.size(); ++k) workers_[k] = LocalModel();
  };
  dopts->round_virtual_seconds = [this](int round) { return take_round_virtual_seconds(round); };
  dopts->save_extra = [this] { return nlohmann::json{{"max_client_epsilon", max_epsilon_}}; };
  dopts->load_extra = [this](const nlohmann::json& j) {
    max_epsilon_ = j.value("max_client_epsilon", 0.0);
    return Status::Ok();
  };
}

Status SimWorkers::summarise(nlohmann::ordered_json* summary, int64_t baseline_rss, int64_t peak_rss,
                             double sum_bytes) {
  nlohmann::ordered_json& s = *summary;
  s["parallel_clients"] = k_workers_;
  s["intra_op_threads"] = intra_op_threads_;  // per worker: workers × threads is what the cores run
  s["cores"] = cores_;
  s["malloc_policy"] = malloc_policy();  // "training" unless synthetic or MEMFL_MALLOC_POLICY=glibc
  if (!is_spec_only(cfg_)) {
    // 1 unless the user set OPENBLAS_NUM_THREADS; 0: not OpenBLAS.
    MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
    s["blas_threads_per_call"] = backend->blas_threads_per_call();
  }
  // The stated bound (docs/ARCHITECTURE.md): global + FedAvg sum + one worker
  // replica + its gradients + optimizer state, in model sizes M, whatever the
  // number of clients. Activations come on top and scale with the batch.
  const double m_bytes = static_cast<double>(layout().total_bytes());
  const bool trains = workers_[0].replica() != nullptr && cfg_.train.trainer != "DummyTrainer";
  // With LoRA M is the adapters, and the frozen base comes on top once:
  // every worker's network shares the process's one copy.
  double base = 0;
  if (cfg_.model.lora.enabled && trains) {
    auto spec = llama_spec_from_config(cfg_.model);
    auto dtype = dtype_from_name(cfg_.model.dtype);
    if (spec.ok() && dtype) base = static_cast<double>(llama_num_params(*spec)) * static_cast<double>(dtype_size(*dtype));
    s["lora_base_bytes"] = base;
  }
  const double bound = m_bytes * (2.0 + (trains ? 1.0 : 0.0) + optimizer_models()) + sum_bytes + base;
  s["baseline_rss_bytes"] = baseline_rss;
  s["model_state_bound_bytes"] = bound;
  s["peak_above_baseline_bytes"] = peak_rss - baseline_rss;
  s["peak_above_baseline_over_model"] = static_cast<double>(peak_rss - baseline_rss) / m_bytes;
  s["peak_above_baseline_over_bound"] = static_cast<double>(peak_rss - baseline_rss) / bound;
  return Status::Ok();
}

}  // namespace memfl
