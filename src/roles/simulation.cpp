#include "roles/simulation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "memory/sampler.h"
#include "roles/client_work.h"
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

}  // namespace

StatusOr<SimulationResult> run_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts) {
  const auto t_start = std::chrono::steady_clock::now();
  MemorySampler sampler("simulation", cfg.memory.sample_interval_ms);
  sampler.start();
  SimulationResult result;
  // Whatever happens below, memory.json is written: a failed run keeps what it measured.
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);

  sampler.mark(0, "setup");
  const auto& sc = cfg.server;
  const bool synthetic = is_synthetic(cfg);
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
  MEMFL_ASSIGN_OR_RETURN(LocalModel worker, make_local_model(cfg, input, /*fill=*/true, sc.seed));
  const Layout& layout = worker.layout();
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

  // ServerAgent state: the global model and the aggregator's running sum.
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  std::memcpy(global.data(), worker.arena().data(), layout.total_bytes());
  FedAvgAggregator aggregator(
      layout, sc.client_weights_mode == "sample_size" ? ClientWeightsMode::kSampleSize : ClientWeightsMode::kEqual);
  const size_t chunk = sc.use_model_chunking ? static_cast<size_t>(sc.model_chunk_size) : layout.total_bytes();
  MEMFL_ASSIGN_OR_RETURN(auto metrics, MetricsWriter::open((fs::path(opts.run_dir) / "metrics.csv").string()));
  const std::string checkpoint = (fs::path(opts.run_dir) / "global_model.safetensors").string();

  for (int round = 1; round <= sc.num_global_epochs; ++round) {
    const auto t_round = std::chrono::steady_clock::now();
    RoundMetrics m;
    m.round = round;
    const auto selected = select_clients(sc.num_clients, sc.clients_per_round, sc.seed, round);
    m.clients = static_cast<int>(selected.size());
    MEMFL_RETURN_IF_ERROR(aggregator.begin_round(round));
    double wsum = 0, vsum = 0;
    for (int c : selected) {
      const std::string peer = fmt::format("client_{}", c);
      const ClientPartition* part = synthetic ? nullptr : &clients[static_cast<size_t>(c)];
      sampler.mark(round, "broadcast");
      auto t = std::chrono::steady_clock::now();
      MEMFL_ASSIGN_OR_RETURN(uint64_t down, broadcast(layout, global, worker.arena(), chunk, peer));
      m.download_seconds += seconds_since(t);
      m.bytes_down += down;

      sampler.mark(round, "train");
      auto tr = local_update(worker, cfg, data ? &*data : nullptr, part, round, c);
      if (!tr.ok()) return tr.status().with_context(fmt::format("round {}, {}", round, peer));

      // The update folds into the running sum chunk by chunk as it streams.
      sampler.mark(round, "upload");
      t = std::chrono::steady_clock::now();
      const double samples = update_sample_count(cfg, part);
      MEMFL_ASSIGN_OR_RETURN(auto update, aggregator.open_update(peer, samples));
      CountingSink counted(*update);
      auto up = stream_arena(layout, worker.arena(), chunk, counted);
      if (!up.ok()) return up.status().with_context(fmt::format("round {}, upload from {}", round, peer));
      MEMFL_RETURN_IF_ERROR(update->commit());
      m.upload_seconds += seconds_since(t);
      m.bytes_up += counted.bytes();

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

    if (sc.do_server_eval && worker.replica() != nullptr) {
      sampler.mark(round, "evaluate");
      // The worker replica is free between clients: evaluate the global model on it.
      MEMFL_RETURN_IF_ERROR(broadcast(layout, global, worker.arena(), chunk, "server-eval").status());
      auto ev = worker.replica()->evaluate(data->test, test_idx, sc.eval_batch_size);
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
    MEMFL_RETURN_IF_ERROR(metrics->append(m));
    result.rounds.push_back(m);
    if (opts.progress) {
      fmt::print(
          "round {:>3}/{}  clients {:>3}  train_loss {:.4f}  val_acc {:.4f}  test_loss {:.4f}  test_acc {:.4f}"
          "  moved {}  {:.1f} s  peak RSS {}\n",
          round, sc.num_global_epochs, m.clients, m.train_loss, m.val_accuracy, m.test_loss, m.test_accuracy,
          format_bytes(static_cast<double>(m.bytes_moved)), m.round_seconds,
          format_bytes(static_cast<double>(m.peak_rss_bytes)));
      std::fflush(stdout);
    }
  }
  sampler.mark(sc.num_global_epochs, "done");
  result.peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result.wall_seconds = seconds_since(t_start);

  nlohmann::ordered_json summary;
  summary["role"] = "simulation";
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
  const bool trains = worker.replica() != nullptr && cfg.train.trainer != "DummyTrainer";
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
