#include "roles/simulation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "data/partition.h"
#include "memory/sampler.h"
#include "tensor/safetensors.h"
#include "train/trainer_backend.h"

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

StatusOr<DatasetSplits> load_data(const ExperimentConfig& cfg) {
  const auto& d = cfg.data;
  if (d.dataset_name == "SyntheticCIFAR10") {
    return make_synthetic_cifar10(static_cast<size_t>(d.num_train_samples), static_cast<size_t>(d.num_test_samples),
                                  cfg.server.seed);
  }
  return load_fashion_mnist(d.dataset_path, static_cast<size_t>(d.max_train_samples),
                            static_cast<size_t>(d.max_test_samples));
}

// model_kwargs that contradict the data set are config errors, named as such.
StatusOr<InputSpec> input_spec(const ExperimentConfig& cfg, const ImageDataset& train) {
  InputSpec in{train.channels, train.height, train.width, train.num_classes};
  const auto& m = cfg.model;
  const std::string prefix = "client_configs.model_configs.model_kwargs";
  if (m.num_channel != 0 && m.num_channel != in.channels) {
    return invalid_argument("{}: key '{}.num_channel' is {} but {} has {} channel(s)", cfg.source, prefix,
                            m.num_channel, train.name, in.channels);
  }
  if (m.num_pixel != 0 && (m.num_pixel != in.height || m.num_pixel != in.width)) {
    return invalid_argument("{}: key '{}.num_pixel' is {} but {} images are {}×{}", cfg.source, prefix, m.num_pixel,
                            train.name, in.height, in.width);
  }
  if (m.num_classes != 0 && m.num_classes != in.num_classes) {
    return invalid_argument("{}: key '{}.num_classes' is {} but {} has {} classes", cfg.source, prefix, m.num_classes,
                            train.name, in.num_classes);
  }
  return in;
}

PartitionStrategy strategy_of(const std::string& s) {
  if (s == "dirichlet") return PartitionStrategy::kDirichlet;
  if (s == "class_shards") return PartitionStrategy::kClassShards;
  return PartitionStrategy::kIid;
}

// Counts bytes and forwards: what "bytes moved" in metrics.csv measures.
class CountingSink final : public ChunkSink {
 public:
  explicit CountingSink(ChunkSink& inner) : inner_(inner) {}
  Status accept(const ChunkHeader& h, std::span<const std::byte> p) override {
    MEMFL_RETURN_IF_ERROR(inner_.accept(h, p));
    bytes_ += p.size();
    return Status::Ok();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  ChunkSink& inner_;
  uint64_t bytes_ = 0;
};

// The server's broadcast of the global model into a worker replica.
StatusOr<uint64_t> broadcast(const Layout& layout, const Arena& global, ModelReplica& replica, size_t chunk,
                             const std::string& peer) {
  ArenaWriter into(layout, replica.arena(), peer);
  MEMFL_ASSIGN_OR_RETURN(uint64_t n, stream_arena(layout, global, chunk, into));
  MEMFL_RETURN_IF_ERROR(into.finish());
  return n;
}

}  // namespace

StatusOr<SimulationResult> run_simulation(const ExperimentConfig& cfg, const SimulationOptions& opts) {
  const auto t_start = std::chrono::steady_clock::now();
  MemorySampler sampler("simulation", cfg.memory.sample_interval_ms);
  sampler.start();
  SimulationResult result;
  // Whatever happens below, memory.json is written: a failed run keeps what it measured.
  struct WriteOnExit {
    MemorySampler& s;
    const std::string& dir;
    ~WriteOnExit() {
      s.stop();
      Status st = s.write(dir);
      if (!st.ok()) spdlog::error("{}", st.message());
    }
  } write_on_exit{sampler, opts.run_dir};

  sampler.mark(0, "setup");
  MEMFL_ASSIGN_OR_RETURN(DatasetSplits data, load_data(cfg));
  MEMFL_ASSIGN_OR_RETURN(InputSpec input, input_spec(cfg, data.train));

  const auto& sc = cfg.server;
  PartitionSpec ps{strategy_of(cfg.data.partition_strategy), sc.num_clients, cfg.data.alpha,
                   cfg.data.shards_per_client, sc.seed};
  MEMFL_ASSIGN_OR_RETURN(auto parts, partition_indices(data.train.labels, data.train.num_classes, ps));
  auto clients = split_train_val(std::move(parts), cfg.data.val_ratio, sc.seed);
  {
    std::string csv = "client_id,train_samples,val_samples\n";
    size_t mn = SIZE_MAX, mx = 0;
    for (size_t c = 0; c < clients.size(); ++c) {
      csv += fmt::format("{},{},{}\n", c, clients[c].train.size(), clients[c].val.size());
      mn = std::min(mn, clients[c].train.size());
      mx = std::max(mx, clients[c].train.size());
    }
    MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "partition.csv").string(), csv));
    spdlog::info("{} partition of {} samples over {} clients: {}–{} training samples per client (partition.csv)",
                 cfg.data.partition_strategy, data.train.size(), clients.size(), mn, mx);
  }
  std::vector<uint32_t> test_idx(data.test.size());
  std::iota(test_idx.begin(), test_idx.end(), 0u);

  MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
  const int threads = cfg.train.num_threads > 0 ? cfg.train.num_threads
                                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  backend->set_num_threads(threads);
  // What the process costs before any model exists (libtorch runtime, data
  // set): the memory bound is stated on top of this.
  const int64_t baseline_rss = read_rss_bytes();
  // One worker replica serves every client in turn; it is built with the
  // seed, so its initial weights are the initial global model.
  MEMFL_ASSIGN_OR_RETURN(auto replica, backend->create_replica(cfg.model, input, cfg.train.device, sc.seed));
  const Layout& layout = replica->layout();
  result.model_bytes = layout.payload_bytes();
  result.num_params = layout.num_params();
  spdlog::info("model {}: {} parameters, {} ({} tensors), layout {:016x}; {}; {} thread(s)", cfg.model.model_name,
               layout.num_params(), format_bytes(static_cast<double>(layout.payload_bytes())), layout.size(),
               layout.hash(), backend->version(), threads);

  // ServerAgent state: the global model and the aggregator's running sum.
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  std::memcpy(global.data(), replica->arena().data(), layout.total_bytes());
  FedAvgAggregator aggregator(layout, sc.client_weights_mode == "sample_size" ? ClientWeightsMode::kSampleSize
                                                                               : ClientWeightsMode::kEqual);
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
      const auto& part = clients[static_cast<size_t>(c)];
      sampler.mark(round, "broadcast");
      MEMFL_ASSIGN_OR_RETURN(uint64_t down, broadcast(layout, global, *replica, chunk, peer));
      m.bytes_moved += down;

      sampler.mark(round, "train");
      const uint64_t seed = sc.seed * 1000003ULL + static_cast<uint64_t>(round) * 1009ULL + static_cast<uint64_t>(c);
      auto tr = replica->train(data.train, part.train, part.val, cfg.train, seed);
      if (!tr.ok()) return tr.status().with_context(fmt::format("round {}, {}", round, peer));

      // The update folds into the running sum chunk by chunk as it streams.
      sampler.mark(round, "upload");
      MEMFL_ASSIGN_OR_RETURN(auto update, aggregator.open_update(peer, static_cast<double>(part.train.size())));
      CountingSink counted(*update);
      auto up = stream_arena(layout, replica->arena(), chunk, counted);
      if (!up.ok()) return up.status().with_context(fmt::format("round {}, upload from {}", round, peer));
      MEMFL_RETURN_IF_ERROR(update->commit());
      m.bytes_moved += counted.bytes();

      const double w = static_cast<double>(part.train.size());
      wsum += w;
      m.train_loss += w * tr->train_loss;
      m.train_accuracy += w * tr->train_accuracy;
      if (tr->has_validation) {
        const double wv = static_cast<double>(part.val.size());
        vsum += wv;
        m.val_loss += wv * tr->val_loss;
        m.val_accuracy += wv * tr->val_accuracy;
      }
    }
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

    if (sc.do_server_eval) {
      sampler.mark(round, "evaluate");
      // The worker replica is free between clients: evaluate the global model on it.
      MEMFL_ASSIGN_OR_RETURN(uint64_t down, broadcast(layout, global, *replica, chunk, "server-eval"));
      (void)down;  // in-process evaluation is not traffic
      auto ev = replica->evaluate(data.test, test_idx, sc.eval_batch_size);
      if (!ev.ok()) return ev.status().with_context(fmt::format("round {}, server evaluation", round));
      m.test_loss = ev->loss;
      m.test_accuracy = ev->accuracy;
    }
    sampler.mark(round, "checkpoint");
    MEMFL_RETURN_IF_ERROR(write_safetensors(checkpoint, layout, global,
                                            {{"format", "memfl"}, {"round", std::to_string(round)},
                                             {"model_name", cfg.model.model_name}}));
    m.round_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_round).count();
    m.peak_rss_bytes = sampler.peak_rss();
    MEMFL_RETURN_IF_ERROR(metrics->append(m));
    result.rounds.push_back(m);
    if (opts.progress) {
      fmt::print("round {:>3}/{}  clients {:>3}  train_loss {:.4f}  val_acc {:.4f}  test_loss {:.4f}  test_acc {:.4f}"
                 "  moved {}  {:.1f} s  peak RSS {}\n",
                 round, sc.num_global_epochs, m.clients, m.train_loss, m.val_accuracy, m.test_loss, m.test_accuracy,
                 format_bytes(static_cast<double>(m.bytes_moved)), m.round_seconds,
                 format_bytes(static_cast<double>(m.peak_rss_bytes)));
      std::fflush(stdout);
    }
  }
  sampler.mark(sc.num_global_epochs, "done");
  result.peak_rss_bytes = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  nlohmann::ordered_json summary;
  summary["rounds"] = result.rounds.size();
  summary["final_test_accuracy"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_accuracy;
  summary["final_test_loss"] = result.rounds.empty() ? 0.0 : result.rounds.back().test_loss;
  summary["peak_rss_bytes"] = result.peak_rss_bytes;
  summary["model_bytes"] = result.model_bytes;
  summary["num_params"] = result.num_params;
  summary["peak_rss_over_model"] = static_cast<double>(result.peak_rss_bytes) / static_cast<double>(result.model_bytes);
  // The stated bound (docs/ARCHITECTURE.md): global + FedAvg sum + one worker
  // replica + its gradients + optimizer state, in model sizes M, whatever the
  // number of clients. Activations come on top and scale with the batch.
  const double m_bytes = static_cast<double>(layout.total_bytes());
  const double sum_bytes = static_cast<double>(aggregator.state_bytes());
  const double opt_models = cfg.train.optim.optim == "Adam" ? 2.0 : (cfg.train.optim.momentum > 0 ? 1.0 : 0.0);
  const double bound = m_bytes * (3.0 + opt_models) + sum_bytes;
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
  summary["wall_seconds"] = result.wall_seconds;
  summary["num_clients"] = sc.num_clients;
  summary["model_chunk_size"] = chunk;
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return result;
}

}  // namespace memfl
