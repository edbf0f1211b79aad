// memfl command line. Exit codes (also in `memfl --help`):
//   0 success, 1 the run failed, 2 bad usage or config, 3 missing data set,
//   file or plugin.
#include <fmt/ranges.h>  // fmt::join (its home since fmt 11; here on 9 too)
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "config/config.h"
#include "dp/rdp_accountant.h"
#include "default_config.h"
#include "io/process.h"
#include "io/run_dir.h"
#include "roles/simulation.h"
#include "server/model_worker.h"
#include "memory/alloc_tracker.h"
#include "memory/malloc_policy.h"
#include "report/report.h"
#include "experiments/compare_methods.h"
#include "schedule/client_selection.h"
#include "tensor/safetensors.h"
#include "model/llama.h"
#include "tensor/sharded_safetensors.h"
#ifdef MEMFL_HAVE_MPI
#include "roles/mpi_roles.h"
#endif
#include "report/dp_sweep.h"
#include "train/trainer_backend.h"
#ifdef MEMFL_HAVE_GRPC
#include "experiments/bench_transfer.h"
#include "roles/grpc_roles.h"
#endif

namespace {

constexpr int kExitOk = 0;
constexpr int kExitRunFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMissing = 3;

int exit_code_for(const memfl::Status& s) {
  switch (s.code()) {
    case memfl::StatusCode::kOk:
      return kExitOk;
    case memfl::StatusCode::kInvalidArgument:
      return kExitUsage;
    case memfl::StatusCode::kNotFound:
      return kExitMissing;
    default:
      return kExitRunFailed;
  }
}

int fail(const memfl::Status& s) {
  fmt::print(stderr, "memfl: error: {}\n", s.message());
  return exit_code_for(s);
}

// --profile / memory_configs.profile: the tracker streams into DIR/profile.bin.
void start_profiler(const memfl::ExperimentConfig& cfg, const std::string& dir, const std::string& role) {
  if (!cfg.memory.profile) return;
  if (!memfl::alloc_tracker_start(dir + "/profile.bin", role, static_cast<size_t>(cfg.memory.profile_threshold))) {
    fmt::print(stderr,
               "memfl: warning: the allocation tracker is not available in this build (sanitizers?) or {} "
               "cannot be written; running without it\n",
               dir + "/profile.bin");
  }
}

// memfl inspect MODEL: a llama preset (or "synthetic"), described from its
// spec alone — parameters, bytes per dtype, and the predicted peak per role
// from the bounds in docs/ARCHITECTURE.md with the constants measured in
// docs/BENCHMARKS.md (2-core machine, 16 MiB chunks).
int inspect_model(const std::string& name, const std::string& dtype, int64_t chunk) {
  memfl::ModelConfig m;
  m.model_name = name;
  m.dtype = dtype;
  auto layout = memfl::layout_without_network(m);
  if (!layout.ok()) return fail(layout.status());
  const double model = static_cast<double>(layout->payload_bytes());
  const double c = static_cast<double>(chunk);
  constexpr double kMiB = 1 << 20;
  const double server_base = 16.5 * kMiB, client_base = 21 * kMiB;  // measured baselines (no libtorch)
  const bool wide = dtype == "f32";
  fmt::print("{}: {} parameters ({:.2f} B), {} tensors, {} as {}\n", name, layout->num_params(),
             static_cast<double>(layout->num_params()) / 1e9, layout->size(), memfl::format_bytes(model), dtype);
  fmt::print("predicted peak per role (model M = {}, chunk {}):\n", memfl::format_bytes(model), memfl::format_bytes(c));
  auto row = [](const char* role, const char* formula, double anon, double file, double disk) {
    fmt::print("  {:<44} {:<34} anon {:>10}  file-backed {:>10}  disk {:>10}\n", role, formula,
               memfl::format_bytes(anon), memfl::format_bytes(file), memfl::format_bytes(disk));
  };
  row("server, memory, in-place (f32 / model_dtype)", "base + M + 4·chunk", server_base + model + 4 * c, 0, model);
  if (!wide) row("server, memory, f32 accumulator", "base + 3·M + 4·chunk", server_base + 3 * model + 4 * c, 0, model);
  row("server, arena_backing: file", "base + 6·chunk; disk 2·M", server_base + 6 * c, model, 2 * model);
  row("client (DummyTrainer), memory", "base + M + 2·chunk", client_base + model + 2 * c, 0, 0);
  row("client (DummyTrainer), arena_backing: file", "base + 2·chunk; disk M", client_base + 2 * c, model, model);
  const double f32_model = static_cast<double>(layout->num_params()) * 4;
  row("client training, f32 weights + Adam", "4·M(f32) + activations", client_base + 4 * f32_model, 0, 0);
  // Per-byte costs measured here with 2 clients (docs/BENCHMARKS.md): memory
  // 0.92 GB/s down, 0.76 GB/s up (llama-1b); files 0.80 / 0.28 GB/s (llama-8b).
  const double mem_round = 2 * model / 0.92e9 + 2 * model / 0.76e9;
  const double file_round = 2 * model / 0.80e9 + 2 * model / 0.28e9;
  fmt::print(
      "predicted round time with 2 DummyTrainer clients at the rates measured here: {:.0f} s in memory, "
      "{:.0f} s file-backed\n",
      mem_round, file_round);
  return 0;
}

// memfl inspect PATH: a .safetensors file, an index.json of shards, or a
// directory holding either. Reads headers only.
int inspect_checkpoint(const std::string& path) {
  auto ckpt = memfl::ShardedCheckpoint::open(path);
  if (!ckpt.ok()) return fail(ckpt.status());
  size_t params = 0, bytes = 0;
  std::map<memfl::DType, size_t> bytes_per_dtype;
  for (const auto& t : ckpt->tensors()) {
    params += t.numel();
    bytes += t.nbytes;
    bytes_per_dtype[t.dtype] += t.nbytes;
    if (ckpt->sharded()) {
      fmt::print("{:<48} {:<5} {:<20} {}\n", t.name, memfl::dtype_name(t.dtype),
                 fmt::format("[{}]", fmt::join(t.shape, ", ")),
                 std::filesystem::path(ckpt->shard_of(t)).filename().string());
    } else {
      fmt::print("{:<48} {:<5} [{}]\n", t.name, memfl::dtype_name(t.dtype), fmt::join(t.shape, ", "));
    }
  }
  fmt::print("{} tensors, {} parameters, {}\n", ckpt->tensors().size(), params,
             memfl::format_bytes(static_cast<double>(bytes)));
  std::vector<std::string> per_dtype;
  for (const auto& [dtype, n] : bytes_per_dtype) {
    per_dtype.push_back(fmt::format("{} {}", memfl::dtype_name(dtype), memfl::format_bytes(static_cast<double>(n))));
  }
  fmt::print("bytes per dtype: {}\n", fmt::join(per_dtype, ", "));
  if (ckpt->sharded()) fmt::print("{} shards, index {}\n", ckpt->shards().size(), ckpt->index_path());
  return kExitOk;
}

// memfl privacy: the (ε, δ) of DP-SGD / DP-FedAvg run for `steps` steps of the
// Poisson-subsampled Gaussian (σ, q), by the RDP accountant (Opacus's orders
// and conversion).
struct PrivacyArgs {
  double noise_multiplier = 0, sample_rate = 0, delta = 0;
  int64_t steps = 0;
  bool json = false;
};

int privacy_command(const PrivacyArgs& a) {
  memfl::RdpAccountant accountant;
  memfl::Status st = accountant.step(a.noise_multiplier, a.sample_rate, a.steps);
  if (!st.ok()) return fail(st.with_context("privacy"));
  auto spent = accountant.privacy_spent(a.delta);
  if (!spent.ok()) return fail(spent.status().with_context("privacy"));
  const std::vector<double>& orders = accountant.orders();
  const bool at_edge = a.steps > 0 && (spent->order == orders.front() || spent->order == orders.back());
  if (a.json) {
    nlohmann::json j;
    j["accountant"] = "rdp";
    j["conversion"] = "balle2020";
    j["noise_multiplier"] = a.noise_multiplier;
    j["sample_rate"] = a.sample_rate;
    j["steps"] = a.steps;
    j["delta"] = a.delta;
    j["order_at_edge"] = at_edge;
    // JSON has no infinity: an unbounded ε is null.
    j["epsilon"] = std::isfinite(spent->epsilon) ? nlohmann::json(spent->epsilon) : nlohmann::json(nullptr);
    j["order"] = spent->order > 0 ? nlohmann::json(spent->order) : nlohmann::json(nullptr);
    fmt::print("{}\n", j.dump());
    return kExitOk;
  }
  std::string eps = fmt::format("{:.2f}", spent->epsilon);
  if (spent->epsilon == 0) {
    eps = "0";
  } else if (spent->epsilon < 0.01) {
    eps = fmt::format("{:.3g}", spent->epsilon);
  }
  std::string order = fmt::format("order {:.1f}", spent->order);
  if (a.steps == 0) {
    order = "no steps";
  } else if (spent->order == 0) {
    order = "no order gives a finite bound";
  }
  fmt::print("epsilon = {} ({}, delta {}, sigma {}, q {:.3g}, steps {})\n", eps, order, a.delta, a.noise_multiplier,
             a.sample_rate, a.steps);
  if (at_edge) {
    fmt::print(stderr, "memfl: note: the best order is the {} one tried ({}); epsilon may be looser than it could be\n",
               spent->order == orders.front() ? "smallest" : "largest", spent->order);
  }
  return kExitOk;
}

memfl::StatusOr<memfl::ExperimentConfig> load(const std::string& path, const std::vector<std::string>& sets) {
  if (path.empty()) return memfl::load_config_text(memfl::kDefaultConfigYaml, memfl::kDefaultConfigName, sets);
  return memfl::load_config_file(path, sets);
}

// An --out directory, created now: a path that cannot be one is an error
// naming it, before any work is done (not an exception from deep inside).
memfl::Status make_out_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return memfl::invalid_argument("--out {}: cannot create it: {}", dir,
                                   ec ? ec.message() : std::string("not a directory"));
  }
  return memfl::Status::Ok();
}

// An accuracy to reach: a number in (0, 1].
memfl::Status check_target(double t, const std::string& text) {
  if (std::isfinite(t) && t > 0 && t <= 1) return memfl::Status::Ok();
  return memfl::invalid_argument("--target: '{}' is not an accuracy in (0, 1]", text);
}

// --resume: the config must be the run's own experiment (committed in
// `committed_path`), checked before anything is written or listened on.
memfl::Status check_resume(const std::string& committed_path, const memfl::ExperimentConfig& cfg) {
  auto committed = memfl::load_config_file(committed_path);
  if (!committed.ok()) return committed.status().with_context("--resume");
  return memfl::check_resume_config(committed->resolved_yaml, committed_path, cfg);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "memfl — memory-efficient federated learning\n\n"
      "Exit codes: 0 success, 1 run failed, 2 bad usage or config, 3 missing data set, file or plugin."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "memfl 0.1.0");

  std::string config_path, out_dir, resume_dir;
  std::vector<std::string> sets;
  bool quiet = false;
  const char* resume_doc =
      "continue the run in DIR after its newest committed round (config: DIR's config.yaml unless CONFIG is given)";

  auto* run = app.add_subcommand("run", "Run an in-process federated simulation (server + virtual clients)");
  run->add_option("CONFIG", config_path, "YAML config (default: the embedded configs/fedavg_fmnist_cnn.yaml)");
  run->add_option("--out", out_dir, "run directory (default: <logging_output_dirname>/<timestamp>-<pid>)");
  run->add_option("--set", sets, "override a config key: --set server_configs.num_global_epochs=2 (repeatable)");
  run->add_flag("-q,--quiet", quiet, "no per-round progress lines");
  run->add_option("--resume", resume_dir, resume_doc);
  bool profile = false;
  run->add_flag("--profile", profile, "record allocations with stacks (profile.bin; see memfl report)");

  // The server's model worker (server/model_worker.h): started by a gRPC or
  // MPI server for what needs the network, so the server never maps libtorch.
  std::string write_initial;
  auto* model_worker = app.add_subcommand("model-worker", "");  // internal: no help line
  model_worker->add_option("CONFIG", config_path, "the run's config.yaml")->required();
  model_worker->add_option("--write-initial", write_initial, "write the initial model here and exit");
  auto* validate = app.add_subcommand("validate", "Check a config and print it with every default resolved");
  validate->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  validate->add_option("--set", sets, "override a config key (repeatable)");

  app.add_subcommand("config-keys", "List every config key with its type, default and meaning");
  app.add_subcommand("list-models", "List the models of the registry");
  app.add_subcommand("list-methods", "List the client selection methods");
  PrivacyArgs privacy_args;
  auto* privacy = app.add_subcommand(
      "privacy", "Epsilon of DP-SGD / DP-FedAvg: RDP accountant of the Poisson-subsampled Gaussian mechanism");
  privacy->add_option("--noise-multiplier", privacy_args.noise_multiplier, "sigma: noise std / clipping norm, > 0")
      ->required();
  privacy->add_option("--sample-rate", privacy_args.sample_rate, "q: chance a record is in a step, (0, 1]")->required();
  privacy->add_option("--steps", privacy_args.steps, "number of steps (rounds), >= 0")->required();
  privacy->add_option("--delta", privacy_args.delta, "target delta, (0, 1), e.g. 1e-5")->required();
  privacy->add_flag("--json", privacy_args.json, "print one JSON object instead of a sentence");
  memfl::CompareMethodsOptions cm;
  std::string methods_csv;
  memfl::CompareAlgorithmsOptions ca;
  std::string algorithms_csv;
  auto* compare_algorithms = app.add_subcommand(
      "compare-algorithms",
      "Run FL algorithms (FedAvg, FedAsync, FedBuff, FedCompass, ...) on the same clients and compare them");
  compare_algorithms->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  compare_algorithms
      ->add_option("--algorithms", algorithms_csv, "comma-separated, e.g. FedAvg,FedAsync,FedBuff,FedCompass")
      ->required();
  std::string targets_csv = "0.8";
  compare_algorithms->add_option("--target", targets_csv, "accuracies for 'time to target', comma-separated")
      ->capture_default_str();
  compare_algorithms->add_flag("--equal-time", ca.equal_time,
                               "asynchronous algorithms run as long in virtual time as the synchronous ones took");
  compare_algorithms->add_option("--out", out_dir, "output directory (default: runs/compare-algorithms-<pid>)");
  compare_algorithms->add_option("--set", sets, "override a config key (repeatable)");
  auto* compare_methods =
      app.add_subcommand("compare-methods", "Run client selection methods one after another and compare them");
  compare_methods->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  compare_methods->add_option("--methods", methods_csv, "comma-separated, e.g. random,topk_loss,oort")->required();
  compare_methods->add_option("--repeats", cm.repeats, "runs per method (seeds seed, seed+1, ...)")
      ->capture_default_str();
  compare_methods->add_option("--target", cm.target_accuracy, "accuracy for 'rounds to target'")->capture_default_str();
  compare_methods->add_option("--out", out_dir, "output directory (default: runs/compare-methods-<pid>)");
  compare_methods->add_option("--set", sets, "override a config key (repeatable)");

  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  memfl::DpBenchOptions dpb;
  std::string dp_json = "dp_sweep.json", dp_report;
  // A rank > 0 of a sharded client, started by rank 0 (train_configs.num_gpus).
  auto* shard_rank = app.add_subcommand("shard-rank", "");
  shard_rank->group("");  // hidden: only a sharded client starts it
  auto* bench_dp =
      bench->add_subcommand("dp", "DP-SGD clipping modes: peak memory and time per mode and sequence length");
  bench_dp
      ->add_option("--model", dpb.model, "llama-dp-tiny | llama-dp-0.5b | llama-3.2-1b-dp | llama-dp-6b | llama-dp-11b")
      ->capture_default_str();
  bench_dp->add_option("--seq", dpb.seq_lengths, "sequence lengths, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  bench_dp->add_option("--batch", dpb.batch_size, "samples per batch")->capture_default_str();
  bench_dp->add_option("--modes", dpb.modes, "no_dp,naive,ghost,fused")->delimiter(',')->capture_default_str();
  bench_dp->add_option("--warmup", dpb.warmup, "untimed iterations per run")->capture_default_str();
  bench_dp->add_option("--iters", dpb.iters, "timed iterations per run")->capture_default_str();
  bench_dp->add_option("--device", dpb.device, "cpu | cuda")->capture_default_str();
  bench_dp->add_option("--json", dp_json, "records (one per run) as a JSON array")->capture_default_str();
  bench_dp->add_option("--report", dp_report, "directory for dp_sweep.html and .csv (default: beside --json)");
  bench_dp
      ->add_option("--gpus", dpb.gpus,
                   "ranks of a sharded model: one process per GPU (per process on the CPU), started by memfl")
      ->capture_default_str();
  bench_dp->add_flag("--sharded", dpb.sharded,
                     "shard the model even on one rank (the 1-GPU figure of a sharded sweep)");
  bench_dp->add_option("--optimizer", dpb.optimizer, "sgd | adam (sharded runs)")->capture_default_str();
  bench_dp->add_option("--noise-multiplier", dpb.noise_multiplier, "sigma: noise std / max_grad_norm (0: no noise)")
      ->capture_default_str();
  bench_dp->add_option("--dtype", dpb.dtype, "float32 | bfloat16 parameters (sharded runs)")->capture_default_str();
#ifdef MEMFL_HAVE_GRPC
  int client_id = -1, num_clients = 0;
  auto* server = app.add_subcommand("server", "Run the federated server over gRPC");
  server->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  server->add_option("--out", out_dir, "run directory");
  server->add_option("--set", sets, "override a config key (repeatable)");
  server->add_flag("-q,--quiet", quiet, "no per-round progress lines");
  server->add_option("--resume", resume_dir, resume_doc);
  server->add_flag("--profile", profile, "record allocations with stacks (profile.bin)");
  auto* client = app.add_subcommand("client", "Run one federated client over gRPC");
  client->add_option("CONFIG", config_path, "YAML config: how to reach the server (the server sends the experiment)");
  client->add_option("--client-id", client_id, "this client's id, 0..num_clients-1")->required();
  client->add_option("--out", out_dir, "run directory");
  client->add_option("--set", sets, "override a config key (repeatable)");
  client->add_flag("-q,--quiet", quiet, "quiet");
  client->add_flag("--profile", profile, "record allocations with stacks (profile.bin)");
  auto* launch = app.add_subcommand("launch", "Start a server and N client processes here, gather their run dirs");
  launch->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  launch->add_option("--clients", num_clients, "number of client processes")->required();
  launch->add_option("--out", out_dir, "run directory (server/, client_0/, ...)");
  launch->add_option("--set", sets, "override a config key (repeatable)");
  launch->add_flag("-q,--quiet", quiet, "no per-round progress lines");
  launch->add_flag("--profile", profile, "profile every process (profile.bin in each run dir)");
  auto* transfer = bench->add_subcommand("transfer", "Peak RSS per role and GB/s per direction, DummyTrainer");
  memfl::TransferBenchOptions tb;
  transfer->add_option("--transport", tb.transport, "grpc")->capture_default_str();
  transfer->add_option("--model-mb", tb.model_mb, "model size in MiB")->capture_default_str();
  transfer
      ->add_option("--data-channel", tb.data_channel,
                   "gRPC: where chunks travel, auto (grpc_configs.data_channel's default: the Unix socket on one "
                   "host) | grpc (in the stream) | tcp (grpc_configs.data_channel: tcp, its TCP port) | unix (the "
                   "same, its Unix socket)")
      ->capture_default_str();
  transfer->add_option("--clients", tb.clients, "client processes")->capture_default_str();
  transfer->add_option("--dtype", tb.dtype, "f32 | bf16 | f16")->capture_default_str();
  transfer->add_option("--chunk-mb", tb.chunk_mb, "chunk size in MiB")->capture_default_str();
  transfer->add_option("--memory-mode", tb.memory_mode, "streaming | naive")->capture_default_str();
  transfer->add_option("--aggregator", tb.aggregator, "server_configs.aggregator")->capture_default_str();
  transfer->add_option("--arena-backing", tb.arena_backing, "memory_configs.arena_backing: memory | file")
      ->capture_default_str();
  transfer
      ->add_option("--mpi-path", tb.mpi_path,
                   "MPI on one node: shared_ring (chunks through a shared-memory ring) | point_to_point")
      ->capture_default_str();
  transfer->add_option("--dummy-delays", tb.dummy_delays,
                       "train_configs.dummy_delay_s: seconds each client spends in its local update (e.g. 1.5,0.5)");
  transfer->add_option("--json", tb.json_out, "write the JSON here too");
  transfer->add_option("--keep", tb.run_dir, "keep the run directory here");
#endif

#ifdef MEMFL_HAVE_MPI
  auto* mpi =
      app.add_subcommand("mpi", "Run as a rank of an MPI job: mpirun -np N+1 memfl mpi CONFIG (rank 0 = server)");
  mpi->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  mpi->add_option("--out", out_dir, "run directory (rank_0/, rank_1/, ...)");
  mpi->add_option("--set", sets, "override a config key (repeatable)");
  mpi->add_flag("-q,--quiet", quiet, "no per-round progress lines");
  mpi->add_option("--resume", resume_dir,
                  "continue the MPI run in DIR (config: DIR/rank_0/config.yaml unless CONFIG is given)");
  mpi->add_flag("--profile", profile, "record allocations with stacks (profile.bin per rank)");
#endif
  std::string report_dir, compare_out;
  std::vector<std::string> compare_dirs;
  auto* report = app.add_subcommand("report", "Write RUN_DIR/report/index.html (+ summary.txt, CSV, folded stacks)");
  report->add_option("RUN_DIR", report_dir, "a run directory")->required();
  auto* compare =
      app.add_subcommand("compare", "Compare runs: peaks with % change, timelines, differential flamegraphs");
  compare->add_option("RUNS", compare_dirs, "run directories; the first is the baseline")->required()->expected(2, -1);
  compare->add_option("--out", compare_out, "output directory (default: <first run>/compare)");

  std::string st_path, inspect_dtype = "bf16";
  int64_t inspect_chunk = 16 << 20;
  auto* inspect = app.add_subcommand(
      "inspect", "Describe a model preset (llama-1b, llama-70b, ...) or a safetensors checkpoint (one file or shards)");
  inspect
      ->add_option("MODEL_OR_PATH", st_path,
                   "a model name (llama-tiny|llama-1b|llama-8b|llama-70b), a .safetensors file, a "
                   "model.safetensors.index.json, or a directory of either")
      ->required();
  inspect->add_option("--dtype", inspect_dtype, "model name: dtype of the weights (f32, bf16, f16)");
  inspect->add_option("--chunk", inspect_chunk, "model name: model_chunk_size in bytes for the prediction");
  std::string write_layout;
  inspect->add_option("--write-layout", write_layout,
                      "a TorchScript file (.pt): write its tensors (layout and weights) to this safetensors file, "
                      "for client_configs.model_configs.initial_model");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  // Before any role starts, so a misspelt value loses nothing.
  if (auto st = memfl::check_malloc_policy_env(); !st.ok()) return fail(st);
  if (profile) sets.push_back("memory_configs.profile=true");
  if (app.got_subcommand("report")) {
    auto r = memfl::write_report(report_dir);
    if (!r.ok()) return fail(r.status());
    fmt::print("report: {}/index.html\n", *r);
    return kExitOk;
  }
  if (app.got_subcommand("compare")) {
    const std::string out = compare_out.empty() ? compare_dirs[0] + "/compare" : compare_out;
    if (memfl::Status d = make_out_dir(out); !d.ok()) return fail(d);
    auto r = memfl::write_comparison(compare_dirs, out);
    if (!r.ok()) return fail(r.status());
    fmt::print("comparison: {}/index.html\n", *r);
    return kExitOk;
  }
  if (app.got_subcommand("config-keys")) {
    fmt::print("{}", memfl::describe_config_keys());
    return kExitOk;
  }
  if (app.got_subcommand("privacy")) return privacy_command(privacy_args);
  if (app.got_subcommand("list-methods")) {
    for (const auto& m : memfl::client_selection_methods()) fmt::print("{:<18} {}\n", m.name, m.description);
    return kExitOk;
  }
  if (app.got_subcommand("compare-algorithms")) {
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    std::stringstream ss(algorithms_csv);
    std::string a;
    while (std::getline(ss, a, ',')) {
      if (!a.empty()) ca.algorithms.push_back(a);
    }
    ca.targets.clear();
    std::stringstream ts(targets_csv);
    for (std::string t; std::getline(ts, t, ',');) {
      if (t.empty()) continue;
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(t, &used);
      } catch (...) {
        return fail(memfl::invalid_argument("--target: '{}' is not a number", t));
      }
      if (used != t.size()) return fail(memfl::invalid_argument("--target: '{}' is not a number", t));
      if (memfl::Status c = check_target(v, t); !c.ok()) return fail(c);
      ca.targets.push_back(v);
    }
    ca.out_dir = out_dir.empty() ? fmt::format("runs/compare-algorithms-{}", getpid()) : out_dir;
    if (memfl::Status d = make_out_dir(ca.out_dir); !d.ok()) return fail(d);
    auto r = memfl::run_compare_algorithms(*cfg, ca);
    if (!r.ok()) return fail(r.status());
    fmt::print(
        "{}\nresults: {}/compare.html, results.md, results.csv, curves.csv, accuracy_vs_time.svg, "
        "accuracy_vs_rounds.svg\n",
        *r, ca.out_dir);
    return kExitOk;
  }
  if (app.got_subcommand("compare-methods")) {
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    std::stringstream ss(methods_csv);
    std::string m;
    while (std::getline(ss, m, ',')) {
      if (!m.empty()) cm.methods.push_back(m);
    }
    if (memfl::Status c = check_target(cm.target_accuracy, fmt::format("{}", cm.target_accuracy)); !c.ok())
      return fail(c);
    cm.out_dir = out_dir.empty() ? fmt::format("runs/compare-methods-{}", getpid()) : out_dir;
    if (memfl::Status d = make_out_dir(cm.out_dir); !d.ok()) return fail(d);
    auto r = memfl::run_compare_methods(*cfg, cm);
    if (!r.ok()) return fail(r.status());
    fmt::print("{}\nresults: {}/results.md, results.csv, accuracy.svg\n", *r, cm.out_dir);
    return kExitOk;
  }
  if (app.got_subcommand("list-models")) {
    for (const auto& n : memfl::known_model_names()) fmt::print("{}\n", n);
    return kExitOk;
  }
  if (app.got_subcommand("inspect")) {
    if (!write_layout.empty()) {
      // The one place a TorchScript model's layout needs libtorch: here, once,
      // so servers and DummyTrainer clients can take it from the file.
      auto backend = memfl::load_trainer_backend();
      if (!backend.ok()) return fail(backend.status());
      memfl::ModelConfig mc;
      mc.model_name = "TorchScript";
      mc.torchscript_path = st_path;
      auto replica = (*backend)->create_replica(mc, memfl::InputSpec{}, "cpu", 0);
      if (!replica.ok()) return fail(replica.status());
      const memfl::Layout& layout = (*replica)->layout();
      memfl::Status st =
          memfl::write_safetensors(write_layout, layout, (*replica)->arena(),
                                   {{"format", "memfl"}, {"model_name", "TorchScript"}, {"source", st_path}});
      if (!st.ok()) return fail(st);
      fmt::print("wrote {}: {} tensors, {} parameters, layout {:016x} (from {})\n", write_layout, layout.size(),
                 layout.num_params(), layout.hash(), st_path);
      return kExitOk;
    }
    if (memfl::is_llama_model(st_path) && !std::filesystem::exists(st_path)) {
      return inspect_model(st_path, inspect_dtype, inspect_chunk);
    }
    return inspect_checkpoint(st_path);
  }
  if (model_worker->parsed()) {
    spdlog::set_default_logger(spdlog::stderr_color_mt("model-worker"));
    memfl::Status st = memfl::run_model_worker(config_path, write_initial);
    if (!st.ok()) return fail(st);
    return kExitOk;
  }
  if (app.got_subcommand("validate")) {
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    fmt::print("# {} — valid\n{}", cfg->source, cfg->resolved_yaml);
    return kExitOk;
  }

#ifdef MEMFL_HAVE_MPI
  if (app.got_subcommand("mpi")) {
    if (!resume_dir.empty() && config_path.empty()) config_path = resume_dir + "/rank_0/config.yaml";
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    if (!resume_dir.empty()) {
      if (memfl::Status c = check_resume(resume_dir + "/rank_0/config.yaml", *cfg); !c.ok()) return fail(c);
    }
    std::string dir = !resume_dir.empty() ? resume_dir
                      : out_dir.empty()   ? fmt::format("runs/mpi-{}", getpid())
                                          : out_dir;
    memfl::Status st = memfl::run_mpi(&argc, &argv, *cfg, {dir, !quiet, !resume_dir.empty()});
    if (!st.ok()) return fail(st);
    return kExitOk;
  }
#endif
  if (shard_rank->parsed()) {
    memfl::tune_malloc_for_training();  // a shard rank trains its cut of the model
    auto backend = memfl::load_trainer_backend();
    if (!backend.ok()) return fail(backend.status());
    memfl::Status st = (*backend)->run_shard_rank();
    if (!st.ok()) return fail(st);
    return kExitOk;
  }
  if (bench_dp->parsed()) {
    for (const auto& m : dpb.modes) {
      if (m != "no_dp" && m != "naive" && m != "ghost" && m != "fused") {
        return fail(memfl::invalid_argument("bench dp: --modes: unknown mode '{}' (no_dp, naive, ghost, fused)", m));
      }
    }
    if (dpb.seq_lengths.empty() || dpb.batch_size < 1 || dpb.iters < 1) {
      return fail(memfl::invalid_argument("bench dp: --seq, --batch and --iters must be positive"));
    }
    if (dpb.gpus < 1) return fail(memfl::invalid_argument("bench dp: --gpus {} must be >= 1", dpb.gpus));
    // A sharded sweep on N ranks: this process starts them (one process per
    // GPU, each this command again with its rank in the environment) unless a
    // launcher (mpirun, torchrun, or this one) already did.
    const bool is_rank = std::getenv("MEMFL_RANK") != nullptr || std::getenv("RANK") != nullptr ||
                         std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
    if (dpb.gpus > 1 && !is_rank) {
      auto st = memfl::launch_ranks(dpb.gpus, argc, argv, dp_json + ".rank");
      if (!st.ok()) return fail(st);
      return kExitOk;
    }
    auto backend = memfl::load_trainer_backend();
    if (!backend.ok()) return fail(backend.status());
    auto recs = (*backend)->bench_dp(dpb);
    if (!recs.ok()) return fail(recs.status());
    if (recs->empty()) return kExitOk;  // a rank other than 0: rank 0 writes the records
    std::vector<nlohmann::ordered_json> records;
    for (const auto& r : *recs) records.push_back(nlohmann::ordered_json::parse(r));
    const std::string dir =
        dp_report.empty() ? (std::filesystem::path(dp_json).parent_path() / "dp_sweep").string() : dp_report;
    memfl::Status st = memfl::write_dp_sweep(records, dp_json, dir);
    if (!st.ok()) return fail(st);
    fmt::print("{:<7} {:>6} {:>12} {:>8} {:>10} {:>8}\n", "mode", "seq", "peak MiB", "x no_dp", "ms/iter", "x no_dp");
    for (const auto& r : records) {
      const std::string m = r.value("mode", "");
      const int sl = r.value("seq_length", 0);
      fmt::print("{:<7} {:>6} {:>12.1f} {:>8.3f} {:>10.2f} {:>8.3f}\n", m, sl,
                 static_cast<double>(r.value("peak_memory_bytes", int64_t{0})) / (1 << 20),
                 memfl::dp_overhead(records, m, sl, "peak_memory_bytes"), r.value("avg_iteration_ms", 0.0),
                 memfl::dp_overhead(records, m, sl, "avg_iteration_ms"));
    }
    fmt::print("wrote {} and {}/dp_sweep.html\n", dp_json, dir);
    return kExitOk;
  }
#ifdef MEMFL_HAVE_GRPC
  if (app.got_subcommand("bench")) {
    auto r = memfl::run_bench_transfer(tb);
    if (!r.ok()) return fail(r.status());
    fmt::print("{}", *r);
    return kExitOk;
  }
  if (app.got_subcommand("launch")) {
    std::string path = config_path;
    std::string dir = out_dir.empty() ? fmt::format("runs/launch-{}", getpid()) : out_dir;
    // A second launch into one --out would find the first run's port file and
    // state: refuse it rather than mix two runs.
    if (std::filesystem::exists(dir + "/server/metrics.csv") || std::filesystem::exists(dir + "/server/state")) {
      return fail(memfl::invalid_argument(
          "run directory {} already holds a launched run; choose another --out (or resume its server with "
          "`memfl server --resume {}/server`)",
          dir, dir));
    }
    if (path.empty()) {  // the clients and server read the embedded default from a file
      std::error_code dir_ec;
      std::filesystem::create_directories(dir, dir_ec);
      if (dir_ec) return fail(memfl::invalid_argument("--out {}: cannot create it: {}", dir, dir_ec.message()));
      path = dir + "/config.yaml";
      memfl::Status w = memfl::write_text_file(path, memfl::kDefaultConfigYaml);
      if (!w.ok()) return fail(w);
    }
    auto cfg = load(path, sets);  // fail before starting any process
    if (!cfg.ok()) return fail(cfg.status());
    memfl::Status st = memfl::run_launch(path, sets, num_clients, dir, !quiet);
    if (!st.ok()) return fail(st);
    fmt::print("launch: server and {} clients finished — {}\n", num_clients, dir);
    return kExitOk;
  }
  if (app.got_subcommand("server") || app.got_subcommand("client")) {
    if (!resume_dir.empty() && config_path.empty()) config_path = resume_dir + "/config.yaml";
    if (!resume_dir.empty()) out_dir = resume_dir;
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    const bool is_server = app.got_subcommand("server");
    if (is_server && !resume_dir.empty()) {
      if (memfl::Status c = check_resume(resume_dir + "/config.yaml", *cfg); !c.ok()) return fail(c);
    }
    std::string dir = out_dir;
    if (dir.empty())
      dir = fmt::format("runs/{}-{}", is_server ? "server" : "client_" + std::to_string(client_id), getpid());
    // A used run directory holds a run's committed state: starting afresh
    // there would overwrite its checkpoint and metrics. --resume continues it.
    if (is_server && resume_dir.empty() &&
        (std::filesystem::exists(dir + "/metrics.csv") || std::filesystem::exists(dir + "/state"))) {
      return fail(memfl::invalid_argument(
          "run directory {} already holds a server run (metrics.csv, state/); continue it with --resume {}, or "
          "choose another --out",
          dir, dir));
    }
    std::error_code dir_ec;
    std::filesystem::create_directories(dir, dir_ec);
    if (dir_ec) return fail(memfl::invalid_argument("--out {}: cannot create it: {}", dir, dir_ec.message()));
    spdlog::set_pattern(
        fmt::format("[%H:%M:%S.%e] [{}] [%l] %v", is_server ? "server" : "client_" + std::to_string(client_id)));
    memfl::Status st = memfl::write_text_file(dir + "/config.yaml", cfg->resolved_yaml);
    const std::string role = is_server ? "server" : "client_" + std::to_string(client_id);
    start_profiler(*cfg, dir, role);
    if (st.ok()) {
      st = is_server ? memfl::run_grpc_server(*cfg, {dir, !quiet, !resume_dir.empty()})
                     : memfl::run_grpc_client(*cfg, client_id, {dir, !quiet});
    }
    memfl::alloc_tracker_stop();
    if (!st.ok()) return fail(st);
    return kExitOk;
  }
#endif

  // run
  const bool resume = !resume_dir.empty();
  if (resume && config_path.empty()) config_path = resume_dir + "/config.yaml";
  auto cfg = load(config_path, sets);
  if (!cfg.ok()) return fail(cfg.status());
  if (resume) {
    if (memfl::Status c = check_resume(resume_dir + "/config.yaml", *cfg); !c.ok()) return fail(c);
  }
  auto dir = resume ? memfl::StatusOr<std::string>(resume_dir) : memfl::prepare_run_dir(out_dir, *cfg);
  if (!dir.ok()) return fail(dir.status());
  memfl::Status st = resume ? memfl::Status::Ok()
                            : memfl::write_text_file(*dir + "/config.yaml",
                                                     "# resolved from " + cfg->source + "\n" + cfg->resolved_yaml);
  if (!st.ok()) return fail(st);
  spdlog::set_pattern("[%H:%M:%S.%e] [%l] %v");
  spdlog::info("run directory {}", *dir);
  start_profiler(*cfg, *dir, "simulation");
  auto result = memfl::run_simulation(*cfg, {*dir, !quiet, resume});
  memfl::alloc_tracker_stop();
  if (!result.ok()) {
    fmt::print(stderr, "memfl: run failed; what was measured so far is in {}\n", *dir);
    return fail(result.status());
  }
  // An asynchronous run whose virtual time ends before its first evaluation
  // has no rounds to report.
  const double last_accuracy = result->rounds.empty() ? std::nan("") : result->rounds.back().test_accuracy;
  fmt::print("done: {} rounds, test accuracy {:.4f}, peak RSS {} ({:.1f}× the {} model), {:.1f} s — {}\n",
             result->rounds.size(), last_accuracy, memfl::format_bytes(static_cast<double>(result->peak_rss_bytes)),
             static_cast<double>(result->peak_rss_bytes) / static_cast<double>(result->model_bytes),
             memfl::format_bytes(static_cast<double>(result->model_bytes)), result->wall_seconds, *dir);
  return kExitOk;
}
