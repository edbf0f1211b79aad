// memfl bench: benchmarks. bench dp sweeps the DP-SGD clipping modes (the
// plugin runs them); bench llm times the trainer on a Llama shape (or writes
// the logits of given weights, the oracle comparison's memfl side); bench transfer measures a gRPC run's peak RSS per
// role and GB/s per direction with DummyTrainer clients.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "io/process.h"
#include "model/lora.h"
#include "report/dp_sweep.h"
#include "train/trainer_backend.h"
#ifdef MEMFL_HAVE_GRPC
#include "experiments/bench_transfer.h"
#endif

namespace memfl::cli {

namespace {

struct BenchDpArgs {
  memfl::DpBenchOptions dpb;
  std::string dp_json = "dp_sweep.json", dp_report;
};

int bench_dp(const BenchDpArgs& a, int argc, char** argv) {
  const memfl::DpBenchOptions& dpb = a.dpb;
  const std::string& dp_json = a.dp_json;
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
      a.dp_report.empty() ? (std::filesystem::path(dp_json).parent_path() / "dp_sweep").string() : a.dp_report;
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

void add_bench_dp_options(CLI::App& dp, BenchDpArgs& a) {
  memfl::DpBenchOptions& dpb = a.dpb;
  dp.add_option("--model", dpb.model, "llama-dp-tiny | llama-dp-0.5b | llama-3.2-1b-dp | llama-dp-6b | llama-dp-11b")
      ->capture_default_str();
  dp.add_option("--seq", dpb.seq_lengths, "sequence lengths, comma separated")->delimiter(',')->capture_default_str();
  dp.add_option("--batch", dpb.batch_size, "samples per batch")->capture_default_str();
  dp.add_option("--modes", dpb.modes, "no_dp,naive,ghost,fused")->delimiter(',')->capture_default_str();
  dp.add_option("--warmup", dpb.warmup, "untimed iterations per run")->capture_default_str();
  dp.add_option("--iters", dpb.iters, "timed iterations per run")->capture_default_str();
  dp.add_option("--device", dpb.device, "cpu | cuda")->capture_default_str();
  dp.add_option("--json", a.dp_json, "records (one per run) as a JSON array")->capture_default_str();
  dp.add_option("--report", a.dp_report, "directory for dp_sweep.html and .csv (default: beside --json)");
  dp.add_option("--gpus", dpb.gpus,
                "ranks of a sharded model: one process per GPU (per process on the CPU), started by memfl")
      ->capture_default_str();
  dp.add_flag("--sharded", dpb.sharded, "shard the model even on one rank (the 1-GPU figure of a sharded sweep)");
  dp.add_option("--optimizer", dpb.optimizer, "sgd | adam (sharded runs)")->capture_default_str();
  dp.add_option("--noise-multiplier", dpb.noise_multiplier, "sigma: noise std / max_grad_norm (0: no noise)")
      ->capture_default_str();
  dp.add_option("--dtype", dpb.dtype, "float32 | bfloat16 parameters (sharded runs)")->capture_default_str();
}

#ifdef MEMFL_HAVE_GRPC
int bench_transfer(const memfl::TransferBenchOptions& tb) {
  auto r = memfl::run_bench_transfer(tb);
  if (!r.ok()) return fail(r.status());
  fmt::print("{}", *r);
  return kExitOk;
}

void add_bench_transfer_options(CLI::App& transfer, memfl::TransferBenchOptions& tb) {
  transfer.add_option("--transport", tb.transport, "grpc")->capture_default_str();
  transfer.add_option("--model-mb", tb.model_mb, "model size in MiB")->capture_default_str();
  transfer
      .add_option("--data-channel", tb.data_channel,
                  "gRPC: where chunks travel, auto (grpc_configs.data_channel's default: the Unix socket on one "
                  "host) | grpc (in the stream) | tcp (grpc_configs.data_channel: tcp, its TCP port) | unix (the "
                  "same, its Unix socket)")
      ->capture_default_str();
  transfer.add_option("--clients", tb.clients, "client processes")->capture_default_str();
  transfer.add_option("--dtype", tb.dtype, "f32 | bf16 | f16")->capture_default_str();
  transfer.add_option("--chunk-mb", tb.chunk_mb, "chunk size in MiB")->capture_default_str();
  transfer.add_option("--memory-mode", tb.memory_mode, "streaming | naive")->capture_default_str();
  transfer.add_option("--aggregator", tb.aggregator, "server_configs.aggregator")->capture_default_str();
  transfer.add_option("--arena-backing", tb.arena_backing, "memory_configs.arena_backing: memory | file")
      ->capture_default_str();
  transfer
      .add_option("--mpi-path", tb.mpi_path,
                  "MPI on one node: shared_ring (chunks through a shared-memory ring) | point_to_point")
      ->capture_default_str();
  transfer.add_option("--dummy-delays", tb.dummy_delays,
                      "train_configs.dummy_delay_s: seconds each client spends in its local update (e.g. 1.5,0.5)");
  transfer.add_option("--json", tb.json_out, "write the JSON here too");
  transfer.add_option("--keep", tb.run_dir, "keep the run directory here");
}
#endif

}  // namespace

struct BenchLlmArgs {
  memfl::LlmBenchOptions o;
  std::string json_out;
  int lora_r = 0;
  std::string target_modules = "all-linear";
};

void add_bench_llm_options(CLI::App& llm, BenchLlmArgs& a) {
  auto& o = a.o;
  o.model.model_name = "llama-8b";
  o.model.dtype = "bf16";
  llm.add_option("--model", o.model.model_name, "a llama preset (llama-tiny, llama-1b, llama-8b, ...) or llama")
      ->capture_default_str();
  llm.add_option("--hidden", o.model.hidden_size,
                 "--model llama: hidden size (with --layers, --heads, --kv-heads, --intermediate, --vocab)");
  llm.add_option("--layers", o.model.num_layers, "--model llama: decoder layers");
  llm.add_option("--heads", o.model.num_heads, "--model llama: attention heads");
  llm.add_option("--kv-heads", o.model.num_kv_heads, "--model llama: key/value heads");
  llm.add_option("--intermediate", o.model.intermediate_size, "--model llama: MLP width");
  llm.add_option("--vocab", o.model.vocab_size, "--model llama: vocabulary");
  llm.add_flag("--tied", o.model.tie_word_embeddings, "--model llama: LM head tied to the embedding");
  llm.add_option("--dtype", o.model.dtype, "f32 | bf16 | f16")->capture_default_str();
  llm.add_option("--batch", o.batch_size, "sequences per step")->capture_default_str();
  llm.add_option("--seq", o.seq_length, "tokens per sequence")->capture_default_str();
  llm.add_option("--steps", o.steps, "timed steps")->capture_default_str();
  llm.add_option("--warmup", o.warmup, "untimed steps after the first")->capture_default_str();
  llm.add_option("--device", o.device, "cpu | cuda")->capture_default_str();
  llm.add_option("--optimizer", o.optimizer, "Adam | SGD")->capture_default_str();
  llm.add_option("--state-dtype", o.state_dtype, "Adam's moments: param (the weights' dtype) | float32")
      ->capture_default_str();
  llm.add_option("--lr", o.lr, "learning rate")->capture_default_str();
  llm.add_flag("--gradient-checkpointing", o.gradient_checkpointing, "recompute each decoder block in the backward");
  llm.add_option("--seed", o.seed, "initial weights and tokens")->capture_default_str();
  llm.add_option("--weights", o.weights, "safetensors in the model's layout (with --lora-r: the adapters, as PEFT's adapter_model.safetensors): "
                 "write its logits instead of timing");
  llm.add_option("--tokens", o.tokens, "with --weights: raw int64 tokens, batch × (seq + 1)");
  llm.add_option("--logits-out", o.logits_out, "with --weights: the logits as raw f32 [batch, seq, vocab]");
  llm.add_option("--json", a.json_out, "append the JSON line here too");
  llm.add_option("--hf-checkpoint", o.model.hf_checkpoint,
                 "with --lora-r: the frozen base's weights from this Hugging Face folder (its shape given by --model "
                 "or --hidden …); empty: the seed's");
  llm.add_option("--lora-r", a.lora_r, "LoRA: train rank-r adapters over a frozen base (0: the whole model)")
      ->capture_default_str();
  llm.add_option("--lora-alpha", o.model.lora.lora_alpha, "LoRA: lora_alpha (the adapters' scale is lora_alpha / r)")
      ->capture_default_str();
  llm.add_option("--lora-dropout", o.model.lora.lora_dropout, "LoRA: dropout on the adapters' input")
      ->capture_default_str();
  llm.add_option("--target-modules", a.target_modules,
                 "LoRA: PEFT's module names, comma-separated (q_proj,v_proj,…), or all-linear")
      ->capture_default_str();
}

int bench_llm(BenchLlmArgs a) {
  if (a.o.batch_size < 1 || a.o.seq_length < 1 || a.o.steps < 1 || a.o.warmup < 0) {
    return fail(memfl::invalid_argument("bench llm: --batch, --seq and --steps must be positive"));
  }
  if (a.o.state_dtype != "param" && a.o.state_dtype != "float32") {
    return fail(memfl::invalid_argument("bench llm: --state-dtype is param or float32, got '{}'", a.o.state_dtype));
  }
  if (a.lora_r < 0) return fail(memfl::invalid_argument("bench llm: --lora-r must be 0 (no LoRA) or more"));
  if (a.lora_r > 0) {
    auto& l = a.o.model.lora;
    l.enabled = true;
    l.r = a.lora_r;
    std::vector<std::string> names;
    std::stringstream ss(a.target_modules);
    for (std::string m; std::getline(ss, m, ',');) names.push_back(m);
    auto modules = memfl::resolve_target_modules(names);
    if (!modules.ok()) return fail(modules.status());
    l.target_modules = *modules;
    if (!(l.lora_dropout >= 0 && l.lora_dropout < 1)) {
      return fail(memfl::invalid_argument("bench llm: --lora-dropout must lie in [0, 1)"));
    }
  } else if (!a.o.model.hf_checkpoint.empty()) {
    return fail(memfl::invalid_argument("bench llm: --hf-checkpoint is the base of --lora-r; give both"));
  }
  if (!a.o.weights.empty() && (a.o.tokens.empty() || a.o.logits_out.empty())) {
    return fail(memfl::invalid_argument("bench llm: --weights needs --tokens and --logits-out"));
  }
  auto backend = memfl::load_trainer_backend();
  if (!backend.ok()) return fail(backend.status());
  auto line = (*backend)->bench_llm(a.o);
  if (!line.ok()) return fail(line.status());
  fmt::print("{}\n", *line);
  if (!a.json_out.empty()) {
    std::ofstream out(a.json_out, std::ios::app);
    out << *line << "\n";
    if (!out) return fail(memfl::internal_error("bench llm: cannot write {}", a.json_out));
  }
  return kExitOk;
}

CommandFn add_bench(CLI::App& cmd, SharedOptions&) {
  const int64_t started = std::chrono::steady_clock::now().time_since_epoch().count();
  cmd.require_subcommand(1);
  auto dp_args = std::make_shared<BenchDpArgs>();
  CLI::App* dp = cmd.add_subcommand("dp", "DP-SGD clipping modes: peak memory and time per mode and sequence length");
  add_bench_dp_options(*dp, *dp_args);
  auto llm_args = std::make_shared<BenchLlmArgs>();
  CLI::App* llm = cmd.add_subcommand("llm", "memfl's trainer on a Llama shape: tokens/s, GPU peak, set-up time");
  add_bench_llm_options(*llm, *llm_args);
#ifdef MEMFL_HAVE_GRPC
  auto tb = std::make_shared<memfl::TransferBenchOptions>();
  CLI::App* transfer = cmd.add_subcommand("transfer", "Peak RSS per role and GB/s per direction, DummyTrainer");
  add_bench_transfer_options(*transfer, *tb);
#endif
  return [=](int& argc, char**& argv) {
    if (dp->parsed()) return bench_dp(*dp_args, argc, argv);
    if (llm->parsed()) {
      BenchLlmArgs a = *llm_args;
      a.o.started_ns = started;
      return bench_llm(a);
    }
#ifdef MEMFL_HAVE_GRPC
    return bench_transfer(*tb);
#else
    return kExitUsage;  // not reached: bench requires one of its commands
#endif
  };
}

}  // namespace memfl::cli
