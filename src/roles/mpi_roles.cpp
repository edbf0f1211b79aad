// `memfl mpi`: every rank starts here; rank 0 is the server
// (roles/mpi_server.cpp), the others client ranks. Wiring only: a client
// rank's rounds are ClientDriver's over MpiClientTransport.
#include "roles/mpi_roles.h"

#include <mpi.h>

#include <sys/prctl.h>

#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "client/client_driver.h"
#include "client/client_work.h"
#include "comm/fault_plan.h"
#include "comm/mpi/mpi_client_transport.h"
#include "io/run_dir.h"
#include "memory/malloc_policy.h"
#include "roles/mpi_ranks.h"
#include "schedule/scheduler.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

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
    // that moves a synthetic model (the transfer figures) keeps glibc's
    // defaults, under which those were measured.
    tune_malloc_for_training();
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(local, input, /*fill=*/false, cfg.server.seed, dir));
  const Layout& layout = model.layout();
  // A rank the server excluded for a stall is told so at the end (SIGUSR1):
  // it leaves through MPI_Finalize (comm/mpi/mpi_transport.h).
  install_exclusion_notice();
  const WireRegister reg = this_rank_registration(rank, k);
  MPI_Send(&reg, sizeof reg, MPI_BYTE, 0, kTagRegister, MPI_COMM_WORLD);
  const size_t chunk =
      transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  // Which of this rank's clients train in a round: asynchronous runs have
  // one client per rank; synchronous ones the seed's selection.
  auto clients_of_round = [&cfg, rank, k](int round) {
    std::vector<int> mine;
    if (cfg.server.is_async()) return std::vector<int>{rank - 1};
    for (int c : select_clients(cfg.server.num_clients, cfg.server.clients_per_round, cfg.server.seed, round)) {
      if (rank_of_client(c, k) == rank) mine.push_back(c);
    }
    return mine;
  };
  // The fault tests' misbehaving rank, when the environment names this one.
  const auto faults = transfer_faults_from_env(rank, "MEMFL_FAULT_RANK");
  MpiClientTransport transport(layout, chunk, shm, rank, clients_of_round, faults.get());
  ClientDriver driver(local, dir, data ? &*data : nullptr, parts);
  MEMFL_ASSIGN_OR_RETURN(const int rounds,
                         driver.run(transport, model, {.sampler = &st.sampler, .clients_per_process = k}));
  nlohmann::ordered_json summary;
  summary["role"] = fmt::format("rank_{}", rank);
  summary["rounds"] = rounds;
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  summary["malloc_policy"] = malloc_policy();  // "training", or "glibc" for a synthetic model
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/summary.json", summary.dump(2) + "\n"));
  return transport.close();  // outputs written: the server may end the job
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
  // Each rank holds its own directory for the job's length: a second job on
  // the same --out (or --resume) is refused before it writes a byte.
  auto lock = RunDirLock::acquire(dir);
  if (!lock.ok()) abort_job(fmt::format("rank {}: {}", rank, lock.status().message()));
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/config.yaml", cfg.resolved_yaml));
  if (rank == 0 && opts.on_server_start) {
    if (Status h = opts.on_server_start(dir); !h.ok()) abort_job(fmt::format("rank 0: {}", h.message()));
  }
  SharedRing shm = open_shared_ring(cfg, rank);
  Status s;
  try {
    s = rank == 0 ? run_mpi_server(cfg, world, dir, opts.progress, opts.resume, shm)
                  : run_client_rank(cfg, rank, dir, shm);
  } catch (const RankExcluded&) {
    spdlog::warn("rank {}: the server excluded this rank (a stall, or an update it refused); leaving the job", rank);
  }
  if (!s.ok()) abort_job(fmt::format("rank {}: {}", rank, s.message()));
  close_shared_ring(shm);
  MPI_Finalize();
  return s;
}

}  // namespace memfl
