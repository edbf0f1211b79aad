#include "roles/mpi_roles.h"

#include <mpi.h>

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/chunk.h"
#include "comm/mpi/mpi_transport.h"
#include "memory/malloc_policy.h"
#include "memory/sampler.h"
#include "client/client_driver.h"
#include "client/client_work.h"
#include "roles/async_server.h"
#include "server/global_model.h"
#include "server/model_worker.h"
#include "io/run_dir.h"
#include "schedule/scheduler.h"
#include "server/round_driver.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

// The round's selection, known to every rank from the config and the seed.
std::vector<int> selection(const ExperimentConfig& cfg, int round) {
  return select_clients(cfg.server.num_clients, cfg.server.clients_per_round, cfg.server.seed, round);
}

// A client rank's registration (kTagRegister): who it is, and where it
// runs — the server lets a rank it excluded go (SIGCONT) before the job
// ends, parked (SIGUSR1): OpenMPI's mpirun was seen to hang ending a job
// around a stopped process, and to deadlock when the woken rank went on.
struct WireRegister {
  int32_t rank, clients, pid, pad;
  uint64_t host;  // a hash of the host name
};

WireRegister this_rank_registration(int rank, int clients) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return {rank, clients, static_cast<int32_t>(getpid()), 0, std::hash<std::string>{}(name)};
}

struct RankState {
  MemorySampler sampler;
  std::string dir;
  WriteMemoryOnExit write_on_exit{sampler, dir};
  RankState(const std::string& role, int interval, std::string d) : sampler(role, interval), dir(std::move(d)) {
    sampler.start();
  }
};

Status run_server(const ExperimentConfig& cfg, int world, const std::string& dir, bool progress, bool resume,
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
    MEMFL_ASSIGN_OR_RETURN(global, GlobalModel::create(cfg, InputSpec{}, dir, /*naive=*/false));
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
  ServerStreams streams(layout, chunk, shm);
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
    return Status::Ok();
  }
  RoundDriverOptions dopts;
  dopts.run_dir = dir;
  dopts.role = "mpi server";
  dopts.resume = resume;
  std::unique_ptr<ModelWorker> evaluator;
  if (cfg.server.do_server_eval && !is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(evaluator,
                           ModelWorker::start(dir + "/config.yaml", layout, chunk, dir + "/model_worker.log"));
    dopts.evaluate = [&](int round, Arena& g) { return evaluator->evaluate(round, g); };
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
  summary["chunk_path"] = shm.enabled() ? "shared_ring" : "point_to_point";
  summary["excluded_ranks"] = excluded;
  summary["updates_received_together"] = transport.most_received_together();
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/summary.json", summary.dump(2) + "\n"));
  if (!excluded.empty()) {
    // Every round is committed and every rank still in has written its
    // outputs (Bye). A stalled rank would hang MPI_Finalize: it is told it is
    // out and let go, and leaves through MPI_Finalize too.
    spdlog::warn("mpi server: the run finished without rank(s) {}, which missed a deadline; letting them go",
                 fmt::join(excluded, ", "));
    const WireRegister me = this_rank_registration(0, 0);
    for (int r : excluded) {
      const WireRegister& reg = registered[static_cast<size_t>(r)];
      if (reg.host != me.host || reg.pid <= 0) continue;
      ::kill(reg.pid, SIGUSR1);  // first: the notice is pending when it runs again
      ::kill(reg.pid, SIGCONT);
    }
  }
  return Status::Ok();
}

Status run_client_rank(const ExperimentConfig& cfg, int rank, const std::string& dir, const SharedRing& shm) {
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
    // A rank that trains keeps its activation memory between batches. One
    // that moves a synthetic model (part 4's transfer figures) keeps glibc's
    // defaults, under which those were measured.
    tune_malloc_for_training();
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(local, input, /*fill=*/false, cfg.server.seed, dir));
  const Layout& layout = model.layout();
  ClientDriver driver(local, dir, data ? &*data : nullptr, parts);
  // With several virtual clients the rank keeps the round's global model and
  // starts each client from it; with one, the model is received in place.
  Arena global_copy;
  if (k > 1) {
    MEMFL_ASSIGN_OR_RETURN(global_copy,
                           make_model_arena(local, layout.total_bytes(), dir, MemoryCategory::kCommBuffers));
  }
  // (Named lazily: asking a sharded model for its arena gathers it.)
  auto into = [&]() -> Arena& { return k > 1 ? global_copy : model.arena(); };
  // A rank the server excluded for a stall is told so at the end (SIGUSR1):
  // it leaves through MPI_Finalize (comm/mpi/mpi_transport.h).
  install_exclusion_notice();
  const WireRegister reg = this_rank_registration(rank, k);
  MPI_Send(&reg, sizeof reg, MPI_BYTE, 0, kTagRegister, MPI_COMM_WORLD);
  const size_t chunk =
      transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  ClientStreams streams(layout, chunk, shm, rank);
  // Fault injection for the tests: MEMFL_FAULT=stop_in_broadcast or
  // stop_mid_upload stops rank MEMFL_FAULT_RANK (SIGSTOP) once, as a stalled
  // node would.
  const char* fault_kind = std::getenv("MEMFL_FAULT");
  const char* fault_rank = std::getenv("MEMFL_FAULT_RANK");
  bool stopped_once = false;
  auto stop_here = [&](const char* kind) {
    if (stopped_once || fault_kind == nullptr || std::string(fault_kind) != kind || fault_rank == nullptr ||
        std::atoi(fault_rank) != rank)
      return;
    stopped_once = true;
    std::raise(SIGSTOP);
  };
  // Asynchronous (one client per rank): each trip trains from the model as
  // the server sends it, for the steps it says (FedCompass), and sends the
  // model or — gradient_based — its change from the model received.
  const bool async = cfg.server.is_async();
  while (async) {
    WireModelBegin b{};
    quiet_recv(&b, sizeof b, 0, kTagModelBegin);
    if (b.finished) break;
    if (b.layout_hash != layout.hash() || b.total_bytes != layout.total_bytes()) {
      abort_job(fmt::format("rank {}: the server's model (layout {:016x}) is not this rank's ({:016x})", rank,
                            b.layout_hash, layout.hash()));
    }
    st.sampler.mark(b.round, "broadcast");
    ShardedModelIo* shards = ClientDriver::receive_shards(model);
    if (shards != nullptr) {
      streams.receive_model(*shards);
    } else {
      streams.receive_model(model.arena());
    }
    int32_t ok = 1;
    MPI_Send(&ok, 1, MPI_INT32_T, 0, kTagModelReceived, MPI_COMM_WORLD);
    const int c = rank - 1;
    st.sampler.mark(b.round, "train");
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, driver.train(model, c, b.round, b.local_steps));
    const Arena* upload = up.upload;
    shards = up.shards;
    st.sampler.mark(b.round, "upload");
    WireUpdateMeta md{b.round,
                      c,
                      up.sample_count,
                      up.trained.train_loss,
                      up.trained.val_accuracy,
                      static_cast<double>(up.local_steps)};
    MPI_Send(&md, sizeof md, MPI_BYTE, 0, kTagUpdateMeta, MPI_COMM_WORLD);
    if (upload != nullptr) {
      streams.send_update(*upload);
    } else {
      streams.send_update(*shards);
    }
  }
  while (!async) {
    WireModelBegin b{};
    quiet_recv(&b, sizeof b, 0, kTagModelBegin);
    if (b.finished) break;
    if (!b.participate) continue;
    if (b.layout_hash != layout.hash() || b.total_bytes != layout.total_bytes()) {
      abort_job(fmt::format("rank {}: the server's model (layout {:016x}) is not this rank's ({:016x})", rank,
                            b.layout_hash, layout.hash()));
    }
    st.sampler.mark(b.round, "broadcast");
    stop_here("stop_in_broadcast");
    // One client on this rank with its model sharded over ranks: the chunks
    // go straight to the shards. (With several, the rank keeps the global
    // model to restart each from, so it is gathered here anyway.)
    ShardedModelIo* shards = k == 1 ? ClientDriver::receive_shards(model) : nullptr;
    if (shards != nullptr) {
      streams.receive_model(*shards);
    } else {
      streams.receive_model(into());  // every chunk checked: no byte is used before this returns
    }
    int32_t ok = 1;
    MPI_Send(&ok, 1, MPI_INT32_T, 0, kTagModelReceived, MPI_COMM_WORLD);
    for (int c : selection(cfg, b.round)) {
      if (rank_of_client(c, k) != rank) continue;
      if (k > 1) std::memcpy(model.arena().data(), global_copy.data(), layout.total_bytes());
      st.sampler.mark(b.round, "train");
      MEMFL_ASSIGN_OR_RETURN(TripUpdate up, driver.train(model, c, b.round));
      st.sampler.mark(b.round, "upload");
      WireUpdateMeta md{b.round, c, up.sample_count, up.trained.train_loss, up.trained.val_accuracy, 0.0};
      MPI_Send(&md, sizeof md, MPI_BYTE, 0, kTagUpdateMeta, MPI_COMM_WORLD);
      stop_here("stop_mid_upload");
      // One client per rank with its model in its shards sends from them.
      shards = k == 1 ? up.shards : nullptr;
      if (shards != nullptr) {
        streams.send_update(*shards);
      } else {
        streams.send_update(model.arena());
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
  summary["malloc_policy"] = malloc_policy();  // "training", or "glibc" for a synthetic model
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/summary.json", summary.dump(2) + "\n"));
  int32_t bye = 1;  // outputs written: the server may end the job
  MPI_Send(&bye, 1, MPI_INT32_T, 0, kTagBye, MPI_COMM_WORLD);
  return Status::Ok();
}

}  // namespace

Status run_mpi(int* argc, char*** argv, const ExperimentConfig& cfg_in, const MpiOptions& opts) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);  // the server's fold worker calls no MPI
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    return failed_precondition("this MPI library offers no MPI_THREAD_FUNNELED; memfl mpi needs it");
  }
  // Quiet waits sleep a few microseconds at a time: the default 50 µs timer
  // slack would stretch every one of them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
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
  // Every rank must run the same experiment (the selection, the data split
  // and the model come from each rank's own config): rank 0's is the one.
  std::string reference = cfg_in.resolved_yaml;
  int ref_len = static_cast<int>(reference.size());
  MPI_Bcast(&ref_len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  reference.resize(static_cast<size_t>(ref_len));
  MPI_Bcast(reference.data(), ref_len, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (rank != 0) {
    const std::string diff = first_config_difference(cfg_in.resolved_yaml, reference);
    if (!diff.empty()) {
      abort_job(
          fmt::format("rank {} runs another experiment than rank 0 (the server): {} (on rank 0); every rank "
                      "must be started with the same config and --set",
                      rank, diff));
    }
  }
  const std::string dir = fmt::format("{}/rank_{}", run_dir, rank);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/config.yaml", cfg.resolved_yaml));
  SharedRing shm = open_shared_ring(cfg, rank);
  Status s;
  try {
    s = rank == 0 ? run_server(cfg, world, dir, opts.progress, opts.resume, shm) : run_client_rank(cfg, rank, dir, shm);
  } catch (const RankExcluded&) {
    spdlog::warn("rank {}: the server excluded this rank for a stall; leaving the job", rank);
  }
  if (!s.ok()) abort_job(fmt::format("rank {}: {}", rank, s.message()));
  close_shared_ring(shm);
  MPI_Finalize();
  return s;
}

}  // namespace memfl
