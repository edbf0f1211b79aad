// The model registry (libtorch side) and the binding of a module's tensors to
// an arena. Only the trainer plugin includes this.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <thread>

// CUDA builds of libtorch (the GPU machine's): pinned, pipelined copies
// between a module on the GPU and its arena.
#if __has_include(<ATen/cuda/CUDAEvent.h>) && __has_include(<cuda_runtime_api.h>)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#define MEMFL_HAVE_CUDA_COPY 1
#endif

#include "config/config.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "train/trainer_backend.h"

namespace memfl::torch_internal {

// Every registry model is a module with a forward over N×C×H×W batches.
struct Net : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor x) = 0;
  // Language models take token ids [B, T] and return logits [B, T, vocab];
  // they are trained on next-token loss.
  virtual bool is_language_model() const { return false; }
  // A user's TorchScript module: no DP layers, so DP-SGD takes the naive
  // route (one backward per sample).
  virtual bool is_torchscript() const { return false; }
  // Mean loss of a batch and its correct predictions (per token for a
  // language model). The Llama computes it from its hidden states a chunk of
  // the vocabulary's logits at a time (train/llama_module.h); the rest from
  // their logits.
  virtual std::pair<torch::Tensor, torch::Tensor> loss_and_correct(const torch::Tensor& x, const torch::Tensor& y) {
    auto logits = forward(x);
    auto flat = logits.dim() == 3 ? logits.reshape({-1, logits.size(-1)}) : logits;
    auto targets = y.reshape({-1});
    auto loss = torch::nn::functional::cross_entropy(flat.to(torch::kFloat32), targets);
    return {loss, flat.argmax(-1).eq(targets).sum()};
  }
  // Activation checkpointing per block, where the network has blocks.
  virtual void set_gradient_checkpointing(bool /*on*/) {}
  // The tensors the arena holds, with the names a checkpoint gives them:
  // parameters, then buffers (a TorchScript module keeps its own names).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_tensors() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto& kv : named_parameters(true)) out.emplace_back(kv.key(), kv.value());
    for (auto& kv : named_buffers(true)) out.emplace_back(kv.key(), kv.value());
    return out;
  }
};

// Builds `model.model_name` for `input`; unknown names fail with the list.
// A Llama is created and initialised on `device` in the model's dtype; the
// other networks on the host (the caller moves them). With LoRA
// (model.lora) the Llama's base is this process's one copy of
// model.hf_checkpoint's weights, or of the weights `seed` draws, shared by
// every network built over it; only its adapters train.
StatusOr<std::shared_ptr<Net>> make_model(const ModelConfig& model, const InputSpec& input,
                                          torch::Device device = torch::kCPU, uint64_t seed = 0);

StatusOr<DType> dtype_of(torch::ScalarType t);
torch::ScalarType scalar_type_of(DType d);

// Moves every parameter and buffer of `net` into one arena (in
// named_parameters, then named_buffers order) and makes the module's tensors
// views of it (set_data), so the arena *is* the model.
struct BoundModel {
  Layout layout;
  Arena arena;
};
// A module on a GPU keeps its tensors there: the arena gets a copy of them
// (the host side that travels) and the module is left as it is.
StatusOr<BoundModel> bind_to_arena(Net& net);

#ifdef MEMFL_HAVE_CUDA_COPY
// tensors[i] (contiguous, on the GPU; others are skipped) ↔ the arena bytes of
// layout entry i, on the current stream; returns when the copy is done.
// Straight between the arena and the GPU when `arena_pinned` (the arena is page-
// locked: PinnedArena), at the link's speed; otherwise through two pinned
// staging buffers that host threads fill or drain.
void copy_cuda_arena(std::vector<torch::Tensor>& tensors, const Layout& layout, Arena& arena, bool to_device,
                     bool arena_pinned = false);

// Page-locks an arena for the GPU's copy engines (cudaHostRegister), on a
// thread of its own: pinning a model of many GB takes seconds, which the
// first turn's copies must not wait for (they stage until it is done).
// Unpinned when it goes. An arena that cannot be pinned (file-backed, or the
// driver refuses) stays as it is, and copies keep staging.
class PinnedArena {
 public:
  explicit PinnedArena(Arena& arena);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;
  // True once the arena is page-locked.
  bool ready() const { return ready_.load(std::memory_order_acquire); }

 private:
  Arena& arena_;
  std::atomic<bool> ready_{false};
  std::thread pinning_;
};
#endif

}  // namespace memfl::torch_internal
