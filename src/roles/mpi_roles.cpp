#include "roles/mpi_roles.h"

#include <mpi.h>

#include <chrono>
#include <map>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "memory/sampler.h"
#include "roles/client_work.h"
#include "roles/global_model.h"
#include "roles/run_dir.h"
#include "roles/simulation.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

enum Tag : int { kTagRegister = 1, kTagModelBegin, kTagChunkHeader, kTagChunkData, kTagModelReceived, kTagUpdateMeta };

struct WireHeader {
  uint64_t layout_hash, offset, length, checksum;
};
struct WireModelBegin {
  int32_t round, finished, participate, pad;
  uint64_t layout_hash, total_bytes;
};
struct WireUpdateMeta {
  int32_t round, client;
  double sample_count, train_loss, val_accuracy;
};

// A peer's wrong bytes are not survivable in an MPI job (no rank can leave
// it alone): abort every rank with a message that names the culprit.
[[noreturn]] void abort_job(const std::string& why) {
  spdlog::critical("{}", why);
  std::fflush(nullptr);
  MPI_Abort(MPI_COMM_WORLD, 4);
  std::abort();
}

int rank_of_client(int client, int per_rank) { return 1 + client / per_rank; }

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The round's selection, known to every rank from the config and the seed.
std::vector<int> selection(const ExperimentConfig& cfg, int round) {
  return select_clients(cfg.server.num_clients, cfg.server.clients_per_round, cfg.server.seed, round);
}

struct RankState {
  MemorySampler sampler;
  std::string dir;
  WriteMemoryOnExit write_on_exit{sampler, dir};
  RankState(const std::string& role, int interval, std::string d) : sampler(role, interval), dir(std::move(d)) {
    sampler.start();
  }
};

Status run_server(const ExperimentConfig& cfg, int world, const std::string& dir, bool progress) {
  RankState st("server", cfg.memory.sample_interval_ms, dir);
  st.sampler.mark(0, "setup");
  const int64_t baseline = read_rss_bytes();
  std::optional<DatasetSplits> data;
  InputSpec input;
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(auto global, GlobalModel::create(cfg, input, dir, /*naive=*/false));
  LocalModel& model = global->model();
  const Layout& layout = model.layout();
  FedAvgAggregator* agg = &global->aggregator();
  const size_t chunk =
      cfg.server.use_model_chunking ? static_cast<size_t>(cfg.server.model_chunk_size) : layout.total_bytes();
  if (chunk > static_cast<size_t>(INT32_MAX))
    return invalid_argument("model_chunk_size must fit an MPI count (< 2 GiB)");
  // Register: every client rank says who it is and how many clients it runs.
  for (int r = 1; r < world; ++r) {
    int32_t reg[2];
    MPI_Recv(reg, 2, MPI_INT32_T, r, kTagRegister, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (reg[0] != r || reg[1] != cfg.server.clients_per_rank) {
      abort_job(fmt::format("rank {} registered as rank {} with {} clients; expected {}", r, reg[0], reg[1],
                            cfg.server.clients_per_rank));
    }
  }
  MEMFL_ASSIGN_OR_RETURN(auto metrics, MetricsWriter::open(dir + "/metrics.csv"));
  const int k = cfg.server.clients_per_rank;
  const size_t nchunks = (layout.total_bytes() + chunk - 1) / chunk;
  std::vector<std::byte> ring[2] = {std::vector<std::byte>(chunk), std::vector<std::byte>(chunk)};
  for (int round = 1; round <= cfg.server.num_global_epochs; ++round) {
    const auto t_round = Clock::now();
    RoundMetrics m;
    m.round = round;
    const auto selected = selection(cfg, round);
    std::vector<int> ranks;
    for (int c : selected) {
      if (ranks.empty() || ranks.back() != rank_of_client(c, k)) ranks.push_back(rank_of_client(c, k));
    }
    // Broadcast: every participating rank gets the same chunk at once
    // (non-blocking sends), one chunk in flight per rank.
    st.sampler.mark(round, "broadcast");
    auto t = Clock::now();
    for (int r = 1; r < world; ++r) {
      WireModelBegin b{
          round, 0, std::find(ranks.begin(), ranks.end(), r) != ranks.end(), 0, layout.hash(), layout.total_bytes()};
      MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
    }
    std::vector<MPI_Request> reqs;
    for (size_t i = 0; i < nchunks; ++i) {
      const size_t off = i * chunk, len = std::min(chunk, layout.total_bytes() - off);
      auto bytes = model.arena().bytes(off, len);
      WireHeader h{layout.hash(), off, len, chunk_checksum(bytes)};
      reqs.clear();
      for (int r : ranks) {
        reqs.emplace_back();
        MPI_Isend(&h, sizeof h, MPI_BYTE, r, kTagChunkHeader, MPI_COMM_WORLD, &reqs.back());
        reqs.emplace_back();
        MPI_Isend(bytes.data(), static_cast<int>(len), MPI_BYTE, r, kTagChunkData, MPI_COMM_WORLD, &reqs.back());
      }
      MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    }
    for (int r : ranks) {
      int32_t ok = 0;
      MPI_Recv(&ok, 1, MPI_INT32_T, r, kTagModelReceived, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      m.bytes_down +=
          layout.total_bytes() * static_cast<uint64_t>(std::count_if(selected.begin(), selected.end(),
                                                                     [&](int c) { return rank_of_client(c, k) == r; }));
    }
    m.download_seconds = since(t);
    // Every rank has its copy: the global arena becomes the running sum.
    MEMFL_RETURN_IF_ERROR(global->begin_round(round));
    st.sampler.mark(round, "upload");
    t = Clock::now();
    double wsum = 0;
    for (int c : selected) {
      const int r = rank_of_client(c, k);
      const std::string peer = fmt::format("client_{} (rank {})", c, r);
      WireUpdateMeta md{};
      MPI_Recv(&md, sizeof md, MPI_BYTE, r, kTagUpdateMeta, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (md.client != c || md.round != round) {
        abort_job(fmt::format("{} sent the update of client {} round {}; expected client {} round {}", peer, md.client,
                              md.round, c, round));
      }
      auto update = agg->open_update(peer, md.sample_count);
      if (!update.ok()) abort_job(update.status().message());
      // Two-chunk ring: the next chunk arrives while this one is folded.
      WireHeader hdr[2];
      MPI_Request rq[2][2];
      auto post = [&](size_t i) {
        MPI_Irecv(&hdr[i % 2], sizeof(WireHeader), MPI_BYTE, r, kTagChunkHeader, MPI_COMM_WORLD, &rq[i % 2][0]);
        MPI_Irecv(ring[i % 2].data(), static_cast<int>(chunk), MPI_BYTE, r, kTagChunkData, MPI_COMM_WORLD,
                  &rq[i % 2][1]);
      };
      post(0);
      for (size_t i = 0; i < nchunks; ++i) {
        MPI_Status status[2];
        MPI_Waitall(2, rq[i % 2], status);
        int got = 0;
        MPI_Get_count(&status[1], MPI_BYTE, &got);
        if (i + 1 < nchunks) post(i + 1);
        const WireHeader& h = hdr[i % 2];
        if (static_cast<uint64_t>(got) != h.length) {
          abort_job(fmt::format("chunk from {}: header says {} bytes but {} arrived", peer, h.length, got));
        }
        Status s = (*update)->accept({h.layout_hash, h.offset, h.length, h.checksum},
                                     std::span<const std::byte>(ring[i % 2].data(), static_cast<size_t>(got)));
        if (!s.ok()) abort_job(s.message());
        m.bytes_up += static_cast<uint64_t>(got);
      }
      MEMFL_RETURN_IF_ERROR((*update)->commit());
      m.clients++;
      wsum += md.sample_count;
      m.train_loss += md.sample_count * md.train_loss;
      m.val_accuracy += md.sample_count * md.val_accuracy;
    }
    m.upload_seconds = since(t);
    if (wsum > 0) {
      m.train_loss /= wsum;
      m.val_accuracy /= wsum;
    }
    st.sampler.mark(round, "aggregate");
    MEMFL_RETURN_IF_ERROR(global->finish_round(round));
    if (cfg.server.do_server_eval && model.replica() != nullptr) {
      st.sampler.mark(round, "evaluate");
      std::vector<uint32_t> idx(data->test.size());
      std::iota(idx.begin(), idx.end(), 0u);
      MEMFL_ASSIGN_OR_RETURN(EvalResult ev, model.replica()->evaluate(data->test, idx, cfg.server.eval_batch_size));
      m.test_loss = ev.loss;
      m.test_accuracy = ev.accuracy;
    }
    st.sampler.mark(round, "checkpoint");
    MEMFL_RETURN_IF_ERROR(global->write_checkpoint(round));
    m.bytes_moved = m.bytes_down + m.bytes_up;
    m.round_seconds = since(t_round);
    m.peak_rss_bytes = st.sampler.peak_rss();
    MEMFL_RETURN_IF_ERROR(metrics->append(m));
    if (progress) {
      fmt::print("mpi round {:>3}/{}  clients {:>3}  test_acc {:.4f}  down {:.2f} GB/s  up {:.2f} GB/s  {:.2f} s\n",
                 round, cfg.server.num_global_epochs, m.clients, m.test_accuracy,
                 m.download_seconds > 0 ? static_cast<double>(m.bytes_down) / m.download_seconds / 1e9 : 0.0,
                 m.upload_seconds > 0 ? static_cast<double>(m.bytes_up) / m.upload_seconds / 1e9 : 0.0,
                 m.round_seconds);
      std::fflush(stdout);
    }
  }
  for (int r = 1; r < world; ++r) {
    WireModelBegin b{0, 1, 0, 0, layout.hash(), layout.total_bytes()};
    MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
  }
  st.sampler.mark(cfg.server.num_global_epochs, "done");
  nlohmann::ordered_json summary;
  summary["role"] = "server";
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  summary["sum_in_place"] = agg->sums_in_place();
  return write_text_file(dir + "/summary.json", summary.dump(2) + "\n");
}

Status run_client_rank(const ExperimentConfig& cfg, int rank, const std::string& dir) {
  RankState st(fmt::format("rank_{}", rank), cfg.memory.sample_interval_ms, dir);
  st.sampler.mark(0, "setup");
  const int64_t baseline = read_rss_bytes();
  const int k = cfg.server.clients_per_rank;
  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> parts;
  InputSpec input;
  ExperimentConfig local = cfg;
  if (local.train.num_threads == 0) local.train.num_threads = 1;  // ranks share the machine's cores
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(local, input, /*fill=*/false, cfg.server.seed, dir));
  const Layout& layout = model.layout();
  std::map<int, int64_t> dp_steps;  // DP-SGD steps per virtual client of this rank, for its ε
  // With several virtual clients the rank keeps the round's global model and
  // starts each client from it; with one, the model is received in place.
  Arena global_copy;
  if (k > 1) {
    MEMFL_ASSIGN_OR_RETURN(global_copy,
                           make_model_arena(local, layout.total_bytes(), dir, MemoryCategory::kCommBuffers));
  }
  Arena& into = k > 1 ? global_copy : model.arena();
  int32_t reg[2] = {rank, k};
  MPI_Send(reg, 2, MPI_INT32_T, 0, kTagRegister, MPI_COMM_WORLD);
  const size_t chunk =
      cfg.server.use_model_chunking ? static_cast<size_t>(cfg.server.model_chunk_size) : layout.total_bytes();
  while (true) {
    WireModelBegin b{};
    MPI_Recv(&b, sizeof b, MPI_BYTE, 0, kTagModelBegin, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (b.finished) break;
    if (!b.participate) continue;
    if (b.layout_hash != layout.hash() || b.total_bytes != layout.total_bytes()) {
      abort_job(fmt::format("rank {}: the server's model (layout {:016x}) is not this rank's ({:016x})", rank,
                            b.layout_hash, layout.hash()));
    }
    st.sampler.mark(b.round, "broadcast");
    // Each chunk's header is checked before its bytes land, straight in the arena.
    for (uint64_t expect = 0; expect < layout.total_bytes();) {
      WireHeader h{};
      MPI_Recv(&h, sizeof h, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (h.layout_hash != layout.hash() || h.offset != expect || h.length == 0 || h.length > chunk ||
          h.length > layout.total_bytes() - h.offset) {
        abort_job(
            fmt::format("rank {}: bad chunk header from the server (offset {}, length {})", rank, h.offset, h.length));
      }
      MPI_Status status;
      MPI_Recv(into.data() + h.offset, static_cast<int>(h.length), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD, &status);
      int got = 0;
      MPI_Get_count(&status, MPI_BYTE, &got);
      if (static_cast<uint64_t>(got) != h.length || chunk_checksum(into.bytes(h.offset, h.length)) != h.checksum) {
        abort_job(fmt::format("rank {}: chunk [{}, {}) from the server failed its checksum", rank, h.offset,
                              h.offset + h.length));
      }
      expect += h.length;
    }
    int32_t ok = 1;
    MPI_Send(&ok, 1, MPI_INT32_T, 0, kTagModelReceived, MPI_COMM_WORLD);
    for (int c : selection(cfg, b.round)) {
      if (rank_of_client(c, k) != rank) continue;
      if (k > 1) std::memcpy(model.arena().data(), global_copy.data(), layout.total_bytes());
      st.sampler.mark(b.round, "train");
      const ClientPartition* part = parts.empty() ? nullptr : &parts[static_cast<size_t>(c)];
      MEMFL_ASSIGN_OR_RETURN(TrainResult tr, local_update(model, local, data ? &*data : nullptr, part, b.round, c));
      if (cfg.train.dp.enabled) {
        dp_steps[c] += tr.dp_steps;
        MEMFL_RETURN_IF_ERROR(record_client_privacy(cfg, dir, b.round, c, dp_steps[c], tr.dp_sample_rate).status());
      }
      st.sampler.mark(b.round, "upload");
      WireUpdateMeta md{b.round, c, update_sample_count(cfg, part), tr.train_loss, tr.val_accuracy};
      MPI_Send(&md, sizeof md, MPI_BYTE, 0, kTagUpdateMeta, MPI_COMM_WORLD);
      for (size_t off = 0; off < layout.total_bytes(); off += chunk) {
        const size_t len = std::min(chunk, layout.total_bytes() - off);
        auto bytes = model.arena().bytes(off, len);
        WireHeader h{layout.hash(), off, len, chunk_checksum(bytes)};
        MPI_Send(&h, sizeof h, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD);
        MPI_Send(bytes.data(), static_cast<int>(len), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD);
      }
    }
    st.sampler.mark(b.round, "idle");
    // Fault injection for the tests (MEMFL_FAULT=die_after_round_1 on rank
    // MEMFL_FAULT_RANK): the rank dies as a crashed node would.
    const char* fault = std::getenv("MEMFL_FAULT");
    const char* who = std::getenv("MEMFL_FAULT_RANK");
    if (fault != nullptr && std::string(fault) == "die_after_round_1" && b.round == 1 && who != nullptr &&
        std::atoi(who) == rank) {
      std::_Exit(9);
    }
  }
  nlohmann::ordered_json summary;
  summary["role"] = fmt::format("rank_{}", rank);
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  return write_text_file(dir + "/summary.json", summary.dump(2) + "\n");
}

}  // namespace

Status run_mpi(int* argc, char*** argv, const ExperimentConfig& cfg_in, const MpiOptions& opts) {
  MPI_Init(argc, argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world < 2) {
    MPI_Finalize();
    return invalid_argument("memfl mpi needs at least 2 ranks (server + a client): mpirun -np N+1 memfl mpi CONFIG");
  }
  if (cfg_in.server.client_selection != "random") {
    MPI_Finalize();
    return invalid_argument(
        "server_configs.client_selection: '{}' runs in the in-process simulation; every MPI "
        "rank computes the random selection from the seed",
        cfg_in.server.client_selection);
  }
  if (cfg_in.server.memory_mode != "streaming") {
    MPI_Finalize();
    return invalid_argument("server_configs.memory_mode: '{}' is built for gRPC only; memfl mpi streams",
                            cfg_in.server.memory_mode);
  }
  // APPFL's convention: the client count comes from the world size.
  ExperimentConfig cfg = cfg_in;
  cfg.server.num_clients = (world - 1) * cfg.server.clients_per_rank;
  if (cfg.server.clients_per_round > cfg.server.num_clients) cfg.server.clients_per_round = 0;
  // One run directory for all ranks: rank 0 names it.
  std::string run_dir = opts.run_dir;
  int len = static_cast<int>(run_dir.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  run_dir.resize(static_cast<size_t>(len));
  MPI_Bcast(run_dir.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string dir = fmt::format("{}/rank_{}", run_dir, rank);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/config.yaml", cfg.resolved_yaml));
  Status s = rank == 0 ? run_server(cfg, world, dir, opts.progress) : run_client_rank(cfg, rank, dir);
  if (!s.ok()) abort_job(fmt::format("rank {}: {}", rank, s.message()));
  MPI_Finalize();
  return s;
}

}  // namespace memfl
