// DP-SGD with parameters sharded over several processes: the
// FSDP idea (Zhao et al. 2023, "PyTorch FSDP"), written for memfl's DP layers.
//
// A model is a chain of units (Llama: the embedding, each decoder block, the
// head). Every unit's parameters are laid end to end in one flat buffer,
// padded to a multiple of N ranks; rank r keeps only elements [r·S, (r+1)·S)
// (S = padded/N) of it, with that shard's gradient and optimizer state. The
// unit's parameters stay registered in its module as views of the flat
// buffer, whose storage is empty except while the unit runs:
//
//   forward, unit by unit:  all-gather the flat buffer → forward → free it.
//                           Autograd keeps the activations as in ordinary
//                           training; what it saved of the weights are views
//                           of the freed storage (no copy is kept).
//   backward, unit by unit, last first: all-gather again → backward of this
//                           unit alone (each unit's input is a detached leaf,
//                           so the gradient at its input is handed to the
//                           unit before it) → free.
//   no_dp:  right after a unit's backward its gradient is reduce-scattered
//           (summed over ranks) into the shard's gradient and dropped, so at
//           most one unit's full gradient exists at a time.
//   DP:     the layers record as in train/dp_sgd.h (input A and output
//           gradient G, or per-sample gradients: naive, ghost, fused). Every
//           sample lives on one rank and its layers ran on gathered
//           parameters, so each rank gets the per-sample norms of its own
//           samples locally, with no gathered per-sample gradient of a whole
//           model. Then unit by unit: the clipped sum Σ c_i g_i is written by
//           book-keeping, reduce-scattered, and the unit's records dropped.
//   Noise:  σ·C per coordinate of the global sum, added by the rank that owns
//           the coordinate. It is drawn in fixed blocks (2^22 coordinates on a GPU, 2^20 on a CPU) of
//           a unit, each from a generator seeded by (seed, step, unit, block),
//           so coordinate j gets the same draw whatever N is.
//   Divide: by the expected global batch (every rank's samples).
//
// Each rank trains on its own samples (data parallel): the global batch is
// the ranks' batches together, which is what an accountant must be given.
//
// Collectives go through c10d, which libtorch ships: NCCL on CUDA, Gloo on the
// CPU (CI). Ranks meet through a c10d::TCPStore on 127.0.0.1.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "train/dp_sgd.h"

namespace memfl::torch_internal::sharded {

// Who this process is among the ranks and where rank 0's store listens.
struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the CUDA device this rank uses
  std::string host = "127.0.0.1";
  int port = 29500;
};

// From memfl's launcher (MEMFL_RANK, MEMFL_WORLD_SIZE, MEMFL_LOCAL_RANK,
// MEMFL_MASTER_PORT), else torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT), else mpirun's (OMPI_COMM_WORLD_RANK, _SIZE,
// _LOCAL_RANK, with MASTER_PORT or 29500); nullopt when none is set. A value
// that is not a number, or a rank outside the world, is an error naming it.
StatusOr<std::optional<Rendezvous>> rendezvous_from_env();

// The ranks of one sharded model: c10d process group plus store.
class ShardGroup {
 public:
  // Blocks until all world_size ranks have joined (timeout: 120 s).
  static StatusOr<std::unique_ptr<ShardGroup>> create(const Rendezvous& where, const torch::Device& device);
  ~ShardGroup();
  ShardGroup(const ShardGroup&) = delete;
  ShardGroup& operator=(const ShardGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const char* backend() const;
  // full (world·n elements) ← every rank's shard (n elements), in rank order.
  void all_gather(torch::Tensor& full, const torch::Tensor& shard);
  // shard ← this rank's n-element slice of Σ_ranks full. May overwrite full.
  void reduce_scatter_sum(torch::Tensor& shard, torch::Tensor& full);
  // The same, started: NCCL runs it on its own stream while the caller goes
  // on queueing work; the returned function makes the current stream wait
  // for it and must run before shard is read or full is dropped. (Gloo: done
  // before returning.)
  std::function<void()> reduce_scatter_sum_start(torch::Tensor& shard, torch::Tensor& full);
  void all_reduce_sum(torch::Tensor& t);
  void broadcast(torch::Tensor& t, int root);
  void barrier();
  // The rendezvous store, for small messages between ranks (commands).
  void store_set(const std::string& key, const std::string& value);
  // Waits up to `timeout` for the key; an error when it does not come.
  StatusOr<std::string> store_get(const std::string& key, std::chrono::milliseconds timeout);

 private:
  struct Impl;
  ShardGroup() = default;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, world_ = 1;
};

// One link of the chain: its module (parameters registered in it) and how it
// maps the previous unit's output to its own.
struct Unit {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

// dp::make_groupnorm_cnn (the registry's CNN_GN) as four units — conv1+gn1,
// conv2+gn2, fc1, fc2 — whose parameters carry the plain model's names
// (conv1.weight, gn1.bias, …), so a sharded client reads and writes the same
// arena layout as an unsharded one.
constexpr int kGroupNormCnnUnits = 4;
Unit make_groupnorm_cnn_unit(int64_t channels, int64_t pixels, int64_t classes, int i, int64_t groups = 8);

struct Options {
  std::string mode = "fused";  // no_dp | naive | ghost | fused
  double max_grad_norm = 1.0;
  double noise_multiplier = 0.0;
  uint64_t noise_seed = 0;
  std::string optimizer = "sgd";  // sgd | adam
  double lr = 1e-3;
  torch::Dtype dtype = torch::kFloat32;  // of parameters, gradients and optimizer state
};

struct StepStats {
  double loss = 0;  // Σ of this rank's per-sample losses
  int64_t batch_size = 0;
  int64_t correct = 0;                                       // this rank's samples whose argmax was the label
  double mean_norm = 0, max_norm = 0, clipped_fraction = 0;  // this rank's samples (DP modes)
};

class ShardedModel {
 public:
  // Builds the units one at a time with make_unit(0..num_units-1) (on any
  // device; every rank must build the same values, e.g. from one seed),
  // moves each to `device` and `options.dtype`, keeps this rank's shard and
  // frees the rest before building the next, so building never holds more
  // than one whole unit.
  static StatusOr<std::unique_ptr<ShardedModel>> create(ShardGroup* group, int num_units,
                                                        const std::function<Unit(int)>& make_unit,
                                                        const Options& options, const torch::Device& device);
  ~ShardedModel();

  // One training step on this rank's batch (input: what unit 0 takes;
  // labels: class indices), loss = Σ cross-entropy; every rank must call it.
  // The gradient is divided by expected_global_batch (Σ over ranks).
  StatusOr<StepStats> step(const torch::Tensor& input, const torch::Tensor& labels, double expected_global_batch);

  // Every parameter, gathered (name "unit.param", or "param" for a unit
  // without a name), in unit order: for tests; every rank must call it.
  std::vector<std::pair<std::string, torch::Tensor>> gathered_parameters();

  // The model from rank 0, unit by unit: rank 0's `read(name, dst)` fills
  // each parameter of a unit, the unit is broadcast, and every rank keeps its
  // shard. Every rank calls it (read is used on rank 0 only).
  using ReadParam = std::function<void(const std::string& name, torch::Tensor dst)>;
  using WriteParam = std::function<void(const std::string& name, const torch::Tensor& src)>;
  void load_from_rank0(const ReadParam& read);
  // The model to rank 0, unit by unit (one unit gathered at a time): rank
  // 0's `write(name, src)` stores each parameter. Every rank calls it.
  void store_to_rank0(const WriteParam& write);
  // The model as bytes, without gathering it anywhere: a range of a flat
  // layout of the parameters (an FL client's arena layout) cut into pieces
  // that each lie in one parameter — `param_byte` bytes into parameter
  // `name`, `chunk_byte` bytes into the chunk, `length` bytes.
  struct BytePiece {
    std::string name;
    int64_t param_byte = 0, chunk_byte = 0, length = 0;
  };
  // Every rank calls these with the same pieces and chunk_len.
  // write_bytes: rank 0's `chunk` is broadcast (one chunk's bytes on each
  // rank) and every rank keeps the bytes that fall in its shards.
  // read_bytes: every rank puts its shards' bytes in place in a zeroed chunk,
  // the ranks' chunks are summed as bytes (each byte has one owner, so the
  // sum is that byte), and rank 0's `chunk` receives them; bytes no piece
  // names read as 0. `chunk` is used on rank 0 only.
  void write_bytes(const std::vector<BytePiece>& pieces, std::span<const std::byte> chunk, int64_t chunk_len);
  void read_bytes(const std::vector<BytePiece>& pieces, std::span<std::byte> chunk, int64_t chunk_len);
  // Every parameter's name and shape, in unit order (names as
  // gathered_parameters gives them): the layout a client's arena has.
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes() const;
  torch::Dtype dtype() const { return options_.dtype; }

  // A fresh optimizer over the shards (each client turn starts afresh).
  using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  void reset_optimizer(const MakeOptimizer& make);
  // Σ loss and Σ correct predictions of this rank's batch, forward only
  // (parameters gathered unit by unit); every rank calls it, even with none.
  std::pair<double, int64_t> evaluate_sums(const torch::Tensor& input, const torch::Tensor& labels);

  // With MEMFL_DP_PHASES=1 in the environment, step() drains the device at
  // each phase boundary and adds the phase's milliseconds here (forward,
  // backward, norms by layer kind, clipped sums, reduce, optimizer): to find
  // where a step's time goes. Off, nothing is timed or drained.
  const std::map<std::string, double>& phase_ms() const { return phase_ms_; }

  int64_t num_params() const { return num_params_; }
  // Elements this rank holds of parameters (its shards, padding included).
  int64_t shard_numel() const;

 private:
  struct Flat;
  ShardedModel() = default;
  void gather(Flat& f);
  void release(Flat& f);
  // A unit's gradient on its way to the shard: the full gradient (from the
  // parameters' .grad) in a flat buffer, being reduce-scattered into `out`.
  struct Reduction {
    size_t unit = 0;
    torch::Tensor flat, out;
    std::function<void()> wait;
  };
  Reduction start_reduction(size_t unit);
  // Waits for the sum, then noises (DP) and divides it into the shard's gradient.
  void finish_reduction(Reduction& r, double divisor);
  // grad += std · N(0, 1) drawn for coordinates [begin, begin + numel) of the unit.
  void add_noise(size_t unit, torch::Tensor& grad, int64_t begin, double std);
  // Clips, sums, reduces and noises the recorded step; returns this rank's
  // (mean, max, fraction clipped) of the per-sample norms, on the device
  // (undefined with no samples).
  torch::Tensor dp_step(double divisor);

  ShardGroup* group_ = nullptr;
  Options options_;
  torch::Device device_{torch::kCPU};
  std::vector<Unit> units_;
  std::vector<std::unique_ptr<Flat>> flats_;
  std::map<std::string, std::pair<size_t, size_t>> param_index_;  // name → (unit, parameter in it)
  // For each part of `piece` that lies in this rank's shard: f(flat, byte in
  // the shard, byte in the chunk, length).
  template <typename F>
  void for_owned(const BytePiece& piece, F&& f);
  std::shared_ptr<torch::nn::Module> root_;  // every unit, for DpSgd to attach to
  std::unique_ptr<dp::DpSgd> dp_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<at::Generator> noise_gen_;
  int64_t num_params_ = 0;
  int64_t step_ = 0;
  bool time_phases_ = false;
  std::map<std::string, double> phase_ms_;
  std::chrono::steady_clock::time_point phase_start_;
  void phase(const std::string& name);  // closes the running phase under `name`
};

}  // namespace memfl::torch_internal::sharded
