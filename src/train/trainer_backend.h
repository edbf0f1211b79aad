// The boundary between memfl and libtorch. Everything that needs a network
// (build a model, train, evaluate) sits behind TrainerBackend, implemented by
// libmemfl_torch.so and loaded with dlopen only when a config trains or
// evaluates: a server or a DummyTrainer client never maps libtorch (whose
// static initialisers alone cost ~43 MB of heap).
//
//   MEMFL_ASSIGN_OR_RETURN(TrainerBackend* backend, load_trainer_backend());
//   MEMFL_ASSIGN_OR_RETURN(auto replica, backend->create_replica(cfg.model, input_shape, seed));
//   // replica->arena() holds the parameters; libtorch uses them in place.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/config.h"
#include "data/dataset.h"
#include "data/experiment_data.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "tensor/sharded_model_io.h"

namespace memfl {

struct TrainResult {
  double train_loss = 0;
  double train_accuracy = 0;
  int64_t num_samples = 0;  // samples seen in training (what FedAvg weighs by)
  int64_t num_steps = 0;
  double step_seconds = 0;  // the optimisation steps alone (no copies in or out)
  double val_loss = 0;
  double val_accuracy = 0;
  bool has_validation = false;
  int64_t val_samples = 0;  // the held-out samples validation scored
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  // DP-SGD (train_configs.dp): the steps taken and their Poisson rate q, what
  // the accountant composes over rounds.
  int64_t dp_steps = 0;
  double dp_sample_rate = 0;
};

struct EvalResult {
  double loss = 0;
  double accuracy = 0;
  int64_t num_samples = 0;
};

// A libtorch module whose parameters and buffers are views into arena().
// Writing a new model into the arena (a broadcast) changes the module;
// reading the arena (an upload) reads the trained weights. One replica serves
// every virtual client in turn, so no client keeps a model between rounds.
class ModelReplica {
 public:
  virtual ~ModelReplica() = default;
  virtual const Layout& layout() const = 0;
  virtual Arena& arena() = 0;
  // Non-null while the model lives only in shards over ranks: move it with
  // this, not arena(). The first call of arena() gathers the model into this
  // process for good (the simulator combines models in-process and does);
  // from then on this returns null and arena() is the model.
  virtual ShardedModelIo* sharded_io() { return nullptr; }
  // Trains on `train_indices` of `data` (a fresh optimizer each call, as
  // APPFL's VanillaTrainer does), then validates on `val_indices`.
  virtual StatusOr<TrainResult> train(const ImageDataset& data, std::span<const uint32_t> train_indices,
                                      std::span<const uint32_t> val_indices, const TrainConfig& cfg, uint64_t seed) = 0;
  virtual StatusOr<EvalResult> evaluate(const ImageDataset& data, std::span<const uint32_t> indices,
                                        int batch_size) = 0;
};

// `memfl bench dp`: DP-SGD clipping modes on a Llama-style classifier built
// from the DP layers (train/dp_sgd.h), one record per (mode, seq_length).
struct DpBenchOptions {
  std::string model = "llama-dp-tiny";  // llama-dp-tiny | llama-dp-0.5b
  std::vector<int> seq_lengths = {64, 128};
  int batch_size = 2;
  std::vector<std::string> modes = {"no_dp", "naive", "ghost", "fused"};
  int warmup = 2, iters = 5;
  std::string device = "cpu";
  double max_grad_norm = 1.0, noise_multiplier = 1.0;
  uint64_t seed = 42;
  // Sharded DP-SGD: ranks (one process and one GPU each; on the
  // CPU, processes); with gpus > 1 or sharded, every run shards the model
  // (train/sharded_dp.h). The ranks find each other through the environment
  // (memfl's launcher, torchrun's or mpirun's variables).
  int gpus = 1;
  bool sharded = false;
  std::string optimizer = "sgd";  // sgd | adam
  std::string dtype = "float32";  // float32 | bfloat16: parameters, gradients, optimizer state
};

// `memfl bench llm`: memfl's trainer (the replica a client trains) on a
// Llama shape, steps of batch_size × seq_length random tokens: set-up time,
// time to the first step, tokens/s of the timed steps, the CUDA allocator's
// peak. With `weights` and `tokens`: instead, the logits and loss of those
// weights (a safetensors file in the model's layout) on those tokens (raw
// int64 [batch, seq_length + 1]), written to `logits_out` as raw f32: the
// oracle comparison's memfl side.
struct LlmBenchOptions {
  ModelConfig model;
  int batch_size = 4, seq_length = 512, steps = 10, warmup = 3;
  std::string device = "cuda";
  std::string optimizer = "Adam";  // Adam | SGD
  std::string state_dtype = "param";  // Adam's moments: param | float32
  double lr = 1e-5;
  bool gradient_checkpointing = false;
  uint64_t seed = 42;
  int64_t started_ns = 0;  // steady_clock time the command started
  std::string weights, tokens, logits_out;
};

class TrainerBackend {
 public:
  virtual ~TrainerBackend() = default;
  virtual std::vector<std::string> model_names() const = 0;
  // Builds the model (seeded init) with its tensors moved into an arena.
  virtual StatusOr<std::unique_ptr<ModelReplica>> create_replica(const ModelConfig& model, const InputSpec& input,
                                                                 const std::string& device, uint64_t seed) = 0;
  // libtorch's intra-op threads; each BLAS call then runs on one thread
  // unless OPENBLAS_NUM_THREADS says otherwise (torch_trainer.cpp).
  virtual void set_num_threads(int threads) = 0;
  // The threads OpenBLAS gives each call now; 0 when the BLAS is not
  // OpenBLAS (it then has no pool of its own to report).
  virtual int blas_threads_per_call() const = 0;
  virtual std::string version() const = 0;
  // The CUDA caching allocator's bytes on device 0 (allocated now, reserved
  // now, peak allocated); false on a CPU build or without a GPU.
  virtual bool gpu_memory(int64_t* allocated, int64_t* reserved, int64_t* peak_allocated) = 0;
  // One JSON object (text) per run: mode, seq_length, batch_size, num_params,
  // peak_memory_bytes, avg_iteration_ms, warmup/timed iterations, device,
  // config. Peak memory: the CUDA caching allocator on GPU, the RSS sampler
  // on CPU; time: CUDA events on GPU.
  // A client whose model is sharded over cfg.train.num_gpus ranks: this
  // process is rank 0 and starts the others (`memfl shard-rank`);
  // the replica's arena is the whole model, read into the shards before each
  // turn and written back after it, one unit at a time.
  virtual StatusOr<std::unique_ptr<ModelReplica>> create_sharded_replica(const ExperimentConfig& cfg,
                                                                         const InputSpec& input, uint64_t seed) {
    (void)cfg, (void)input, (void)seed;
    return failed_precondition("this trainer plugin cannot shard a model");
  }
  // `memfl shard-rank`: a rank > 0 of a sharded client, until rank 0 ends it.
  virtual Status run_shard_rank() { return failed_precondition("this trainer plugin cannot shard a model"); }
  virtual StatusOr<std::vector<std::string>> bench_dp(const DpBenchOptions& options) {
    (void)options;
    return failed_precondition("this trainer plugin has no DP benchmark");
  }
  // One JSON object (text); see LlmBenchOptions.
  virtual StatusOr<std::string> bench_llm(const LlmBenchOptions& options) {
    (void)options;
    return failed_precondition("this trainer plugin has no LLM benchmark");
  }
};

// Finds libmemfl_torch.so (MEMFL_PLUGIN_DIR, else next to the executable),
// loads it once and returns its backend. Fails with a message naming the path
// tried when it is missing.
StatusOr<TrainerBackend*> load_trainer_backend();

}  // namespace memfl

// The plugin's one exported symbol.
extern "C" memfl::TrainerBackend* memfl_trainer_backend();
