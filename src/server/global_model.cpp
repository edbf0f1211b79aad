#include "server/global_model.h"

#include "model/lora.h"

#include <cstdio>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "aggregate/dp_fedavg.h"
#include "aggregate/registry.h"
#include "compress/decoding_opener.h"
#include "memory/budget.h"
#include "model/llama.h"
#include "model/synthetic.h"
#include "server/model_worker.h"
#include "tensor/safetensors.h"
#include "tensor/safetensors_arena.h"

namespace memfl {

namespace fs = std::filesystem;

AccumulationChoice choose_accumulation(const ExperimentConfig& cfg, const Layout& layout, int64_t budget) {
  if (cfg.server.accumulator == "model_dtype") return {Accumulation::kRunningMean, "accumulator: model_dtype"};
  if (cfg.server.accumulator == "f32") return {Accumulation::kSum, "accumulator: f32"};
  if (FedAvgAggregator::can_sum_in_place(layout)) return {Accumulation::kSum, "the model's dtypes sum in place"};
  // A 16-bit model under file backing is one that does not fit twice: its
  // sum would be another model-sized file beside the mapped checkpoint.
  if (cfg.memory.arena_backing == "file") {
    return {Accumulation::kRunningMean, "memory_configs.arena_backing is file"};
  }
  // The f32 sum is exact up to one rounding at the end, so it is the choice
  // whenever it fits; what it needs is what check_server_memory_bound will
  // hold it to: the global arena + the sum + the aggregator's working bytes.
  const size_t model = layout.total_bytes();
  const size_t sum = FedAvgAggregator::sum_bytes(layout);
  const size_t need = model + sum + FedAvgAggregator::kSpoolBlock;
  // Clients on this host hold a model each out of the same memory.
  const int64_t others = static_cast<int64_t>(cfg.colocated_model_copies) * static_cast<int64_t>(model);
  std::string against = fmt::format("server_configs.memory_budget {}", format_bytes(static_cast<double>(budget)));
  if (others > 0) {
    against += fmt::format(" less {} for the {} clients on this host", format_bytes(static_cast<double>(others)),
                           cfg.colocated_model_copies);
    budget -= others;
  }
  const std::string numbers = fmt::format(
      "global {} + f32 sum {} + {} working = {} against {}", format_bytes(static_cast<double>(model)),
      format_bytes(static_cast<double>(sum)), format_bytes(static_cast<double>(FedAvgAggregator::kSpoolBlock)),
      format_bytes(static_cast<double>(need)), against);
  if (static_cast<int64_t>(need) <= budget) return {Accumulation::kSum, numbers + ": fits"};
  return {Accumulation::kRunningMean, numbers + ": does not fit"};
}

Accumulation resolve_accumulation(const ExperimentConfig& cfg, const Layout& layout) {
  // The budget's syntax was checked with the config; a bad one here means
  // "no room known": the choice that needs the least.
  auto budget = parse_memory_budget(cfg.server.memory_budget, total_ram_bytes());
  const AccumulationChoice c = choose_accumulation(cfg, layout, budget.ok() ? *budget : 0);
  if (cfg.server.accumulator == "auto" && !FedAvgAggregator::can_sum_in_place(layout)) {
    spdlog::info("server: accumulator auto → {} ({})",
                 c.accumulation == Accumulation::kSum ? "f32 running sum" : "running mean in the model's dtype",
                 c.reason);
  }
  return c.accumulation;
}

StatusOr<std::unique_ptr<GlobalModel>> GlobalModel::create(const ExperimentConfig& cfg, const InputSpec& input,
                                                           const std::string& run_dir, bool naive, bool sum_in_place,
                                                           bool network_here) {
  std::unique_ptr<GlobalModel> g(new GlobalModel());
  g->cfg_ = cfg;
  g->checkpoint_ = (fs::path(run_dir) / "global_model.safetensors").string();
  const bool file = cfg.memory.arena_backing == "file";
  const std::map<std::string, std::string> meta = {
      {"format", "memfl"}, {"round", "0"}, {"model_name", cfg.model.model_name}};
  if (file && !naive && sum_in_place && is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(Layout layout, layout_without_network(cfg.model));
    if (layout_is_dense(layout)) {
      // Round 0's file is the initial model, written in place, renamed when whole.
      const std::string tmp = g->checkpoint_ + ".tmp";
      MEMFL_ASSIGN_OR_RETURN(Arena a, create_safetensors_arena(tmp, layout, meta));
      MEMFL_RETURN_IF_ERROR(fill_initial_model(cfg.model, layout, a, cfg.server.seed));
      MEMFL_RETURN_IF_ERROR(a.sync());
      if (std::rename(tmp.c_str(), g->checkpoint_.c_str()) != 0) {
        return internal_error("{}: rename from {} failed", g->checkpoint_, tmp);
      }
      g->model_ = LocalModel::from_arena(std::move(layout), std::move(a));
      g->mapped_ = true;
    }
  }
  // LoRA's federated model, the adapters, is described by the config alone.
  const bool described = has_initial_weights(cfg.model) || cfg.model.lora.enabled;
  if (!g->mapped_ && !is_spec_only(cfg) && described && !network_here) {
    // The layout and initial weights from the user's file (with LoRA: the
    // adapters, never the base): no model worker, no libtorch (a worker
    // still evaluates, where the config asks for it).
    MEMFL_ASSIGN_OR_RETURN(Layout layout, layout_without_network(cfg.model));
    MEMFL_ASSIGN_OR_RETURN(Arena arena, make_model_arena(cfg, layout.total_bytes(), run_dir));
    MEMFL_RETURN_IF_ERROR(fill_initial_model(cfg.model, layout, arena, cfg.server.seed));
    g->model_ = LocalModel::from_arena(std::move(layout), std::move(arena));
  } else if (!g->mapped_ && !is_spec_only(cfg) && !network_here) {
    // The network's initial weights, from the model worker: the layout and
    // the bytes come from the file it writes (run_dir/config.yaml is the
    // experiment), so no libtorch here.
    const std::string init = (fs::path(run_dir) / "initial_model.safetensors").string();
    MEMFL_RETURN_IF_ERROR(write_initial_model((fs::path(run_dir) / "config.yaml").string(), init,
                                              (fs::path(run_dir) / "model_worker.log").string()));
    MEMFL_ASSIGN_OR_RETURN(auto initial, SafetensorsFile::open(init));
    MEMFL_ASSIGN_OR_RETURN(Layout layout, initial->layout());
    MEMFL_ASSIGN_OR_RETURN(Arena arena, make_model_arena(cfg, layout.total_bytes(), run_dir));
    MEMFL_RETURN_IF_ERROR(initial->load_into(layout, arena));
    initial.reset();
    std::remove(init.c_str());
    g->model_ = LocalModel::from_arena(std::move(layout), std::move(arena));
  } else if (!g->mapped_) {
    MEMFL_ASSIGN_OR_RETURN(g->model_, make_local_model(cfg, input, /*fill=*/true, cfg.server.seed, run_dir));
    if (g->model_.replica() != nullptr && has_initial_weights(cfg.model) && !cfg.model.lora.enabled) {
      // A network here (the simulator): the user's initial weights into it
      // (LoRA's adapters: make_local_model drew them).
      MEMFL_RETURN_IF_ERROR(fill_initial_model(cfg.model, g->model_.layout(), g->model_.arena(), cfg.server.seed));
    }
  }
  const Layout& layout = g->model_.layout();
  const auto mode =
      cfg.server.client_weights_mode == "sample_size" ? ClientWeightsMode::kSampleSize : ClientWeightsMode::kEqual;
  AggregatorContext ctx;
  ctx.layout = &layout;
  ctx.weights = mode;
  // naive keeps whole client copies elsewhere and averages them at the end
  // of the upload phase into a sum of its own.
  ctx.in_place = naive || !sum_in_place ? nullptr : &g->model_.arena();
  // A mapped global model is the checkpoint file: each round folds a running
  // mean into the next one (no second model-sized buffer, no f32 sum). An
  // aggregator that does not share the global arena keeps a sum of its own
  // whatever the accumulator, so only one that does resolves (and logs) it.
  ctx.accumulation = g->mapped_                ? Accumulation::kRunningMean
                     : ctx.in_place != nullptr ? resolve_accumulation(cfg, layout)
                                               : Accumulation::kSum;
  ctx.server_opt = {cfg.server.server_learning_rate, cfg.server.server_momentum_param_1,
                    cfg.server.server_momentum_param_2, cfg.server.server_adapt_param};
  ctx.previous_model = g->checkpoint_;
  ctx.make_state_arena = [&](size_t bytes) {
    return naive ? StatusOr<Arena>(Arena(bytes, MemoryCategory::kAggregation))
                 : make_model_arena(cfg, bytes, run_dir, MemoryCategory::kAggregation);
  };
  MEMFL_ASSIGN_OR_RETURN(g->aggregator_, make_aggregator(cfg.server.aggregator, ctx));
  const bool in_place = g->aggregator_->sums_in_place();
  g->description_ = naive        ? "naive"
                    : g->mapped_ ? "running mean into the next checkpoint file"
                    : in_place && ctx.accumulation == Accumulation::kRunningMean ? "in-place running mean"
                    : in_place                                                   ? "in-place streaming"
                                                                                 : "streaming (f32 sum)";
  if (file) g->description_ += ", file-backed";
  // Updates that arrive before their turn to fold wait in a spool file here.
  g->aggregator_->set_spool_dir(cfg.memory.scratch_dir.empty() ? run_dir : cfg.memory.scratch_dir);
  // Round 0 on disk is the undo of round 1 (and the server optimizers' pre-round
  // model). Weights drawn from the seed need no file to come back: the plain
  // FedAvg family regenerates them instead.
  // Lossy compressed updates are rebuilt against the round's model, which
  // an in-place fold reads from that file (round_base), so they keep it.
  const bool lossy_updates = cfg.compressor.enable_compression && cfg.compressor.lossy_compressor != "none";
  g->seeded_start_ = !g->mapped_ && !naive && is_spec_only(cfg) && !has_initial_weights(cfg.model) &&
                     g->aggregator_->name() == "FedAvgAggregator" && !lossy_updates;
  if (!g->mapped_ && !g->seeded_start_) {
    MEMFL_RETURN_IF_ERROR(write_safetensors(g->checkpoint_, layout, g->model_.arena(), meta));
  }
  return g;
}

Status GlobalModel::begin_round(int round, std::vector<std::string> fold_order) {
  if (mapped_) {
    next_.reset();
    MEMFL_ASSIGN_OR_RETURN(Arena next, create_safetensors_arena(checkpoint_ + ".next", layout(),
                                                                {{"format", "memfl"},
                                                                 {"round", std::to_string(round)},
                                                                 {"model_name", cfg_.model.model_name}}));
    next_.emplace(std::move(next));
    MEMFL_RETURN_IF_ERROR(aggregator_->retarget(*next_));
  }
  return aggregator_->begin_round(round, std::move(fold_order));
}

Status GlobalModel::restore() {
  if (mapped_) {
    // The current file was never written this round: drop the next one.
    next_.reset();
    std::remove((checkpoint_ + ".next").c_str());
    return aggregator_->retarget(model_.arena());
  }
  if (seeded_start_) return fill_initial_model(cfg_.model, model_.layout(), model_.arena(), cfg_.server.seed);
  MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(checkpoint_));
  return file->load_into(model_.layout(), model_.arena());
}

Status GlobalModel::finish_round(int round, int contributors) {
  Arena& into = mapped_ && next_ ? *next_ : model_.arena();
  Status fin = aggregator_->finalize(into);
  if (!fin.ok()) {
    MEMFL_RETURN_IF_ERROR(restore().with_context(fmt::format("round {}: restoring the pre-round model", round)));
    return fin;
  }
  if (cfg_.server.dp_fedavg_clip_norm > 0) {
    // Client-level DP-FedAvg: noise on the mean, in place (no extra state).
    add_gaussian_noise(layout(), into,
                       cfg_.server.dp_fedavg_noise_multiplier * cfg_.server.dp_fedavg_clip_norm /
                           (contributors > 0 ? contributors : aggregator_->num_committed()),
                       cfg_.server.seed * 1000003ULL + static_cast<uint64_t>(round));
  }
  if (mapped_) {
    MEMFL_RETURN_IF_ERROR(next_->sync());
    const std::string next_path = checkpoint_ + ".next";
    if (std::rename(next_path.c_str(), checkpoint_.c_str()) != 0) {
      return internal_error("{}: rename from {} failed", checkpoint_, next_path);
    }
    // The old file's mapping goes; its blocks are freed with it.
    model_.replace_arena(std::move(*next_));
    next_.reset();
    MEMFL_RETURN_IF_ERROR(aggregator_->retarget(model_.arena()));
  }
  return Status::Ok();
}

Status GlobalModel::write_checkpoint(int round) {
  if (cfg_.model.lora.enabled) {
    // The global adapters as PEFT writes them, beside the checkpoint: what
    // a user loads onto the base with PeftModel.from_pretrained.
    MEMFL_RETURN_IF_ERROR(write_peft_adapter((fs::path(checkpoint_).parent_path() / "adapter").string(), cfg_.model,
                                             model_.layout(), model_.arena()));
  }
  if (mapped_) return Status::Ok();
  seeded_start_ = false;
  return write_safetensors(
      checkpoint_, model_.layout(), model_.arena(),
      {{"format", "memfl"}, {"round", std::to_string(round)}, {"model_name", cfg_.model.model_name}});
}

StatusOr<std::unique_ptr<BaseModel>> GlobalModel::round_base() {
  // A mapped model folds into the next file; a sum of its own leaves the arena.
  if (mapped_ || !aggregator_->sums_in_place()) {
    return std::unique_ptr<BaseModel>(std::make_unique<ArenaBaseModel>(model_.arena()));
  }
  MEMFL_ASSIGN_OR_RETURN(auto file, FileBaseModel::open(checkpoint_, layout()));
  return std::unique_ptr<BaseModel>(std::move(file));
}

std::string GlobalModel::description() const { return description_; }

}  // namespace memfl
