#include "roles/simulation.h"

#include "aggregate/dp_fedavg.h"
#include "dp/rdp_accountant.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
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

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "memory/budget.h"
#include "memory/sampler.h"
#include "roles/client_work.h"
#include "schedule/client_selection.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

std::vector<int> select_clients(int num_clients, int clients_per_round, uint64_t seed, int round) {
  std::vector<int> all(static_cast<size_t>(num_clients));
  std::iota(all.begin(), all.end(), 0);
  if (clients_per_round <= 0 || clients_per_round >= num_clients) return all;
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(round));
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(clients_per_round));
  std::sort(all.begin(), all.end());
  return all;
}

namespace {

// Counts bytes and forwards: what "bytes moved" in metrics.csv measures.
class CountingSink final : public ChunkSink {
 public:
  explicit CountingSink(ChunkSink& inner) : inner_(inner) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload p) override {
    MEMFL_RETURN_IF_ERROR(inner_.accept(h, p));
    bytes_ += payload_size(p);
    return Status::Ok();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  ChunkSink& inner_;
  uint64_t bytes_ = 0;
};

// The server's broadcast of the global model into a worker's arena.
StatusOr<uint64_t> broadcast(const Layout& layout, const Arena& global, Arena& into_arena, size_t chunk,
                             const std::string& peer) {
  ArenaWriter into(layout, into_arena, peer);
  MEMFL_ASSIGN_OR_RETURN(uint64_t n, stream_arena(layout, global, chunk, into));
  MEMFL_RETURN_IF_ERROR(into.finish());
  return n;
}

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

}  // namespace

StatusOr<SimulationResult> run_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts) {
  const auto t_start = std::chrono::steady_clock::now();
  // Worker threads start every round; each would get a malloc arena that
  // keeps its own freed chunks. Two shared arenas keep the retained heap to a
  // few chunks (as the gRPC server does).
  mallopt(M_ARENA_MAX, 2);
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
  if (k_workers > 1 && !synthetic) {
    MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
    const int total = cfg.train.num_threads > 0 ? cfg.train.num_threads * k_workers : cores;
    backend->set_num_threads(std::max(1, total / k_workers));
  }

  WorkerGovernor governor(budget, k_workers);

  // ServerAgent state: the global model and the aggregator's running sum.
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  std::memcpy(global.data(), worker0.arena().data(), layout.total_bytes());
  FedAvgAggregator aggregator(
      layout, sc.client_weights_mode == "sample_size" ? ClientWeightsMode::kSampleSize : ClientWeightsMode::kEqual);
  const size_t chunk = sc.use_model_chunking ? static_cast<size_t>(sc.model_chunk_size) : layout.total_bytes();
  MEMFL_ASSIGN_OR_RETURN(auto metrics, MetricsWriter::open((fs::path(opts.run_dir) / "metrics.csv").string()));
  // Client selection: `random` is select_clients (the same on every
  // transport); the others learn from each client's last loss.
  MEMFL_ASSIGN_OR_RETURN(auto method, make_client_selection(sc.client_selection, {sc.power_of_choice_d, sc.exploration,
                                                                                  sc.fairness_penalty}));
  std::vector<ClientStats> stats(static_cast<size_t>(sc.num_clients));
  for (size_t c = 0; c < stats.size(); ++c)
    stats[c].samples = update_sample_count(cfg, synthetic ? nullptr : &clients[c]);
  std::mt19937_64 selection_rng(sc.seed * 7919 + 17);
  const std::string checkpoint = (fs::path(opts.run_dir) / "global_model.safetensors").string();
  double max_epsilon = 0;
  double dp_fedavg_epsilon = 0;

  for (int round = 1; round <= sc.num_global_epochs; ++round) {
    const auto t_round = std::chrono::steady_clock::now();
    RoundMetrics m;
    m.round = round;
    const bool all = sc.clients_per_round <= 0 || sc.clients_per_round >= sc.num_clients;
    const auto selected = all || sc.client_selection == "random"
                              ? select_clients(sc.num_clients, sc.clients_per_round, sc.seed, round)
                              : method->select(round, sc.clients_per_round, stats, selection_rng);
    m.clients = static_cast<int>(selected.size());
    MEMFL_RETURN_IF_ERROR(aggregator.begin_round(round));
    double wsum = 0, vsum = 0;
    // Clients take turns on the K workers: a worker receives the global
    // model, trains, and folds its update when its turn in client order
    // comes — so the sum, and the model, are the same as with one worker.
    std::mutex mu;
    std::condition_variable turn;
    size_t next_fold = 0;
    std::atomic<size_t> next_client{0};
    Status first_error = Status::Ok();
    auto work = [&](LocalModel& w, int worker_index) {
      while (true) {
        {
          // The governor: warn at 85 % of the budget, one worker fewer at 90 %.
          std::lock_guard glock(mu);
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
          if (worker_index >= governor.active()) return;  // shed: the others take its clients
        }
        const size_t i = next_client.fetch_add(1);
        if (i >= selected.size()) return;
        const int c = selected[i];
        const std::string peer = fmt::format("client_{}", c);
        const ClientPartition* part = synthetic ? nullptr : &clients[static_cast<size_t>(c)];
        Status st = Status::Ok();
        sampler.mark(round, "broadcast");
        auto t = std::chrono::steady_clock::now();
        auto down = broadcast(layout, global, w.arena(), chunk, peer);
        const double down_s = seconds_since(t);
        std::optional<TrainResult> tr;
        if (!down.ok()) {
          st = down.status();
        } else {
          sampler.mark(round, "train");
          auto r = local_update(w, cfg, data ? &*data : nullptr, part, round, c);
          if (r.ok()) {
            tr = *r;
          } else {
            st = r.status().with_context(fmt::format("round {}, {}", round, peer));
          }
        }
        std::unique_lock lock(mu);
        turn.wait(lock, [&] { return next_fold == i; });
        lock.unlock();
        // The update folds into the running sum chunk by chunk as it streams.
        const double samples = update_sample_count(cfg, part);
        double up_s = 0;
        uint64_t up_bytes = 0;
        if (st.ok()) {
          sampler.mark(round, "upload");
          t = std::chrono::steady_clock::now();
          auto update = aggregator.open_update(peer, samples);
          if (!update.ok()) {
            st = update.status();
          } else {
            CountingSink counted(**update);
            auto up = stream_arena(layout, w.arena(), chunk, counted);
            st = up.ok() ? (*update)->commit()
                         : up.status().with_context(fmt::format("round {}, upload from {}", round, peer));
            up_bytes = counted.bytes();
          }
          up_s = seconds_since(t);
        }
        lock.lock();
        if (!st.ok() && first_error.ok()) first_error = st;
        if (st.ok()) {
          m.download_seconds += down_s;
          m.bytes_down += *down;
          m.upload_seconds += up_s;
          m.bytes_up += up_bytes;
          auto& cs = stats[static_cast<size_t>(c)];
          cs.last_loss = tr->train_loss;
          cs.times_picked++;
          cs.last_round = round;
          cs.dp_steps += tr->dp_steps;
          if (tr->dp_steps > 0) cs.dp_sample_rate = tr->dp_sample_rate;
          wsum += samples;
          m.train_loss += samples * tr->train_loss;
          m.train_accuracy += samples * tr->train_accuracy;
          if (tr->has_validation) {
            const double wv = static_cast<double>(part->val.size());
            vsum += wv;
            m.val_loss += wv * tr->val_loss;
            m.val_accuracy += wv * tr->val_accuracy;
          }
        }
        next_fold++;  // a failed client still passes its turn on, so no worker waits forever
        turn.notify_all();
      }
    };
    {
      std::vector<std::thread> threads;
      const size_t active = static_cast<size_t>(governor.active());
      for (size_t k = 1; k < active; ++k) threads.emplace_back([&, k] { work(workers[k], static_cast<int>(k)); });
      work(workers[0], 0);
      for (auto& th : threads) th.join();
      // A shed worker's replica goes now, between rounds.
      for (size_t k = static_cast<size_t>(governor.active()); k < workers.size(); ++k) workers[k] = LocalModel();
    }
    MEMFL_RETURN_IF_ERROR(first_error);
    m.bytes_moved = m.bytes_down + m.bytes_up;
    if (wsum > 0) {
      m.train_loss /= wsum;
      m.train_accuracy /= wsum;
    }
    if (vsum > 0) {
      m.val_loss /= vsum;
      m.val_accuracy /= vsum;
    }

    sampler.mark(round, "aggregate");
    MEMFL_RETURN_IF_ERROR(aggregator.finalize(global));
    if (sc.dp_fedavg_clip_norm > 0) {
      const int n = aggregator.num_committed();
      add_gaussian_noise(layout, global, sc.dp_fedavg_noise_multiplier * sc.dp_fedavg_clip_norm / n,
                         sc.seed * 1000003ULL + static_cast<uint64_t>(round));
      const double q = all ? 1.0 : static_cast<double>(sc.clients_per_round) / sc.num_clients;
      auto eps = rdp_epsilon(sc.dp_fedavg_noise_multiplier, q, round, sc.dp_fedavg_delta);
      dp_fedavg_epsilon = eps.ok() ? *eps : std::numeric_limits<double>::infinity();
      spdlog::info("round {}: client-level DP-FedAvg ε = {:.3f} (δ = {}, σ = {}, q = {:.4f})", round, dp_fedavg_epsilon,
                   sc.dp_fedavg_delta, sc.dp_fedavg_noise_multiplier, q);
    }
    if (cfg.train.dp.enabled) {
      // Each client's ε over the rounds it took part in (privacy.csv, as every
      // transport's client writes it), and the largest one for the summary.
      for (int c : selected) {
        const auto& cs = stats[static_cast<size_t>(c)];
        MEMFL_ASSIGN_OR_RETURN(double e,
                               record_client_privacy(cfg, opts.run_dir, round, c, cs.dp_steps, cs.dp_sample_rate));
        max_epsilon = std::max(max_epsilon, e);
      }
    }

    if (sc.do_server_eval && worker0.replica() != nullptr) {
      sampler.mark(round, "evaluate");
      // The worker replica is free between clients: evaluate the global model on it.
      MEMFL_RETURN_IF_ERROR(broadcast(layout, global, worker0.arena(), chunk, "server-eval").status());
      auto ev = worker0.replica()->evaluate(data->test, test_idx, sc.eval_batch_size);
      if (!ev.ok()) return ev.status().with_context(fmt::format("round {}, server evaluation", round));
      m.test_loss = ev->loss;
      m.test_accuracy = ev->accuracy;
    }
    sampler.mark(round, "checkpoint");
    MEMFL_RETURN_IF_ERROR(write_safetensors(
        checkpoint, layout, global,
        {{"format", "memfl"}, {"round", std::to_string(round)}, {"model_name", cfg.model.model_name}}));
    m.round_seconds = seconds_since(t_round);
    m.peak_rss_bytes = sampler.peak_rss();
    m.rss_bytes = read_rss_bytes();
    MEMFL_RETURN_IF_ERROR(metrics->append(m));
    result.rounds.push_back(m);
    if (opts.progress) print_progress(cfg, m, seconds_since(t_start));
  }
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
  // The stated bound (docs/ARCHITECTURE.md): global + FedAvg sum + one worker
  // replica + its gradients + optimizer state, in model sizes M, whatever the
  // number of clients. Activations come on top and scale with the batch.
  const double m_bytes = static_cast<double>(layout.total_bytes());
  const double sum_bytes = static_cast<double>(aggregator.state_bytes());
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
