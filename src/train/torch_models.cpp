#include "train/torch_models.h"

#include <fmt/ranges.h>  // fmt::join

#include <torch/csrc/jit/python/update_graph_executor_opt.h>
#include <torch/script.h>

#include "train/dp_sgd.h"  // CNN_GN
#include "train/llama_module.h"

#include <cstring>
#include <map>
#include <mutex>

#include "model/lora.h"
#include "tensor/safetensors.h"
#include "tensor/sharded_safetensors.h"

#include "common/parallel.h"

namespace memfl::torch_internal {

namespace {

// APPFL's CNN: two 5×5 convolutions with max-pooling, then two linear layers.
struct CNN : Net {
  CNN(int64_t channels, int64_t pixels, int64_t classes) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 32, 5)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 5)));
    const int64_t side = ((pixels - 4) / 2 - 4) / 2;
    fc1 = register_module("fc1", torch::nn::Linear(64 * side * side, 512));
    fc2 = register_module("fc2", torch::nn::Linear(512, classes));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    x = torch::relu(fc1->forward(x.flatten(1)));
    return fc2->forward(x);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct MLP : Net {
  MLP(int64_t in, int64_t hidden, int64_t classes) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, classes));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(fc1->forward(x.flatten(1)));
    x = torch::relu(fc2->forward(x));
    return fc3->forward(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// ResNet-18 for 32×32 inputs (He et al. 2016, CIFAR variant: 3×3 stem, no
// max-pool), with BatchNorm, as APPFL's resnet.py.
struct BasicBlock : torch::nn::Module {
  BasicBlock(int64_t in, int64_t out, int64_t stride) {
    conv1 = register_module(
        "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2",
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).stride(1).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    shortcut = register_module("shortcut", torch::nn::Sequential());
    if (stride != 1 || in != out) {
      shortcut->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      shortcut->push_back(torch::nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(bn1->forward(conv1->forward(x)));
    y = bn2->forward(conv2->forward(y));
    auto s = shortcut->is_empty() ? x : shortcut->forward(x);
    return torch::relu(y + s);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential shortcut{nullptr};
};

struct ResNet18 : Net {
  ResNet18(int64_t channels, int64_t classes) {
    conv1 = register_module(
        "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 64, 3).stride(1).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(64));
    int64_t in = 64;
    const int64_t widths[4] = {64, 128, 256, 512};
    for (int l = 0; l < 4; ++l) {
      auto seq = torch::nn::Sequential();
      for (int b = 0; b < 2; ++b) {
        const int64_t stride = (b == 0 && l > 0) ? 2 : 1;
        seq->push_back(std::make_shared<BasicBlock>(in, widths[l], stride));
        in = widths[l];
      }
      layers[l] = register_module("layer" + std::to_string(l + 1), seq);
    }
    linear = register_module("linear", torch::nn::Linear(512, classes));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(bn1->forward(conv1->forward(x)));
    for (auto& layer : layers) x = layer->forward(x);
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return linear->forward(x);
  }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layers[4];
  torch::nn::Linear linear{nullptr};
};

}  // namespace

namespace {

// A user's TorchScript module (torch.jit.save, scripted or traced) as a Net:
// its parameters and buffers are registered here as the same tensors (one
// TensorImpl each), so binding them to the arena rebinds the script's too,
// and the optimizer, train/eval and device moves see them; the checkpoint
// keeps the script's own names.
struct ScriptNet final : Net {
  explicit ScriptNet(torch::jit::Module module) : script(std::move(module)) {
    int i = 0;
    for (const auto& p : script.named_parameters(/*recurse=*/true)) {
      register_parameter(fmt::format("p{}", i++), p.value, p.value.requires_grad());
      names.emplace_back(p.name, p.value);
    }
    i = 0;
    for (const auto& b : script.named_buffers(/*recurse=*/true)) {
      register_buffer(fmt::format("b{}", i++), b.value);
      names.emplace_back(b.name, b.value);
    }
  }
  torch::Tensor forward(torch::Tensor x) override { return script.forward({x}).toTensor(); }
  bool is_torchscript() const override { return true; }
  void train(bool on) override {
    script.train(on);
    Net::train(on);
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_tensors() override { return names; }
  torch::jit::Module script;
  std::vector<std::pair<std::string, torch::Tensor>> names;
};

}  // namespace

namespace {

// LoRA's frozen base: its tensors by Hugging Face name, and the checkpoint
// files they may be mapped from (kept open while the tensors live).
struct LoraBase {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, torch::Tensor> tensors;
};

// The base from hf_checkpoint: every tensor of the spec's layout, by name,
// shape checked. On the host in the checkpoint's own dtype it is the file's
// mapped pages (read-only; nothing writes a frozen weight); otherwise a copy
// on `o`'s device and dtype.
StatusOr<std::shared_ptr<LoraBase>> read_lora_base(const ModelConfig& m, const LlamaSpec& spec,
                                                    const torch::TensorOptions& o) {
  const std::string key = "client_configs.model_configs.hf_checkpoint";
  MEMFL_ASSIGN_OR_RETURN(auto ckpt, ShardedCheckpoint::open(m.hf_checkpoint));
  const DType want = *dtype_from_name(m.dtype);
  MEMFL_ASSIGN_OR_RETURN(Layout layout, llama_layout(spec, want));
  auto base = std::make_shared<LoraBase>();
  for (const auto& path : ckpt.shards()) {
    MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    for (const auto& t : file->tensors()) {
      const LayoutEntry* e = layout.find(t.name);
      if (e == nullptr) {
        return invalid_argument("{}: {} holds '{}', which a Llama of this config.json does not have", key, path,
                                t.name);
      }
      if (t.shape != e->shape) {
        return invalid_argument("{}: {}: '{}' has shape [{}], config.json's Llama [{}]", key, path, t.name,
                                fmt::join(t.shape, ", "), fmt::join(e->shape, ", "));
      }
      if (!dtype_is_float(t.dtype)) {
        return invalid_argument("{}: {}: '{}' is {}, not a float type", key, path, t.name, dtype_name(t.dtype));
      }
      auto mapped = torch::from_blob(const_cast<std::byte*>(t.data.data()), t.shape,
                                     torch::TensorOptions().dtype(scalar_type_of(t.dtype)));
      const bool as_is = !o.device().is_cuda() && t.dtype == want;
      base->tensors[t.name] = as_is ? mapped : mapped.to(o.device(), o.dtype().toScalarType());
    }
    base->files.push_back(std::move(file));
  }
  for (const auto& e : layout.entries()) {
    if (!base->tensors.count(e.name)) return invalid_argument("{}: {} lacks '{}'", key, m.hf_checkpoint, e.name);
  }
  return base;
}

// Built once per process for each (checkpoint or seed, spec, dtype,
// device) and shared by every network over it: K simulator workers hold
// one base and K sets of adapters.
StatusOr<std::shared_ptr<LoraBase>> shared_lora_base(const ModelConfig& m, const LlamaSpec& spec,
                                                      const torch::TensorOptions& o, uint64_t seed) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<LoraBase>> built;
  const std::string key =
      fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", m.hf_checkpoint, m.hf_checkpoint.empty() ? seed : 0, spec.hidden_size,
                  spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size,
                  m.dtype, o.device().str());
  std::lock_guard lock(mu);
  if (auto it = built.find(key); it != built.end()) return it->second;
  std::shared_ptr<LoraBase> base;
  if (!m.hf_checkpoint.empty()) {
    MEMFL_ASSIGN_OR_RETURN(base, read_lora_base(m, spec, o));
  } else {
    // The seed's weights, as a full-model run of this seed starts from.
    base = std::make_shared<LoraBase>();
    torch::manual_seed(seed);
    LlamaOptions plain;
    plain.tensors = o;
    auto net = make_llama(spec, plain);
    for (auto& kv : net->named_parameters(true)) base->tensors[kv.key()] = kv.value().detach();
  }
  built.emplace(key, base);
  return base;
}

}  // namespace

StatusOr<std::shared_ptr<Net>> make_model(const ModelConfig& m, const InputSpec& in, torch::Device device,
                                          uint64_t seed) {
  if (m.model_name == "TorchScript") {
    torch::jit::Module module;
    try {
      // The graph executor's profiling and autodiff passes slow training
      // here (measured: 88–91 % of the built-in ResNet18's images/s with
      // them); unoptimised, the interpreter runs libtorch's own kernels and
      // autograd, as a built-in model does.
      torch::jit::setGraphExecutorOptimize(false);
      module = torch::jit::load(m.torchscript_path);
    } catch (const std::exception& e) {
      return invalid_argument("client_configs.model_configs.torchscript_path: cannot load {} as TorchScript: {}",
                              m.torchscript_path, e.what());
    }
    auto net = std::make_shared<ScriptNet>(std::move(module));
    if (net->names.empty())
      return invalid_argument("client_configs.model_configs.torchscript_path: {} has no parameters to train",
                              m.torchscript_path);
    return std::shared_ptr<Net>(net);
  }
  if (m.model_name == "CNN") {
    if (in.height != in.width) return invalid_argument("model CNN needs square inputs, got {}×{}", in.height, in.width);
    if (in.height < 16) return invalid_argument("model CNN needs inputs of at least 16×16, got {}", in.height);
    return std::shared_ptr<Net>(std::make_shared<CNN>(in.channels, in.height, in.num_classes));
  }
  if (m.model_name == "MLP") {
    return std::shared_ptr<Net>(
        std::make_shared<MLP>(in.channels * in.height * in.width, m.hidden_size, in.num_classes));
  }
  if (m.model_name == "CNN_GN") {  // the CNN with GroupNorm, from DP layers (train/dp_sgd.h)
    if (in.height != in.width || in.height < 16) {
      return invalid_argument("model CNN_GN needs square inputs of at least 16×16, got {}×{}", in.height, in.width);
    }
    return dp::make_groupnorm_cnn(in.channels, in.height, in.num_classes);
  }
  if (m.model_name == "ResNet18") {
    return std::shared_ptr<Net>(std::make_shared<ResNet18>(in.channels, in.num_classes));
  }
  if (is_llama_model(m.model_name)) {
    MEMFL_ASSIGN_OR_RETURN(LlamaSpec spec, llama_spec_from_config(m));
    if (in.num_classes > spec.vocab_size) {
      return invalid_argument("model {}: the data's tokens go up to {} but the vocabulary has {}", m.model_name,
                              in.num_classes, spec.vocab_size);
    }
    LlamaOptions opt;
    const auto dt = dtype_from_name(m.dtype);
    if (!dt) return invalid_argument("model {}: unknown dtype '{}'", m.model_name, m.dtype);
    opt.tensors = torch::TensorOptions().dtype(scalar_type_of(*dt)).device(device);
    if (m.lora.enabled) {
      MEMFL_ASSIGN_OR_RETURN(auto base, shared_lora_base(m, spec, opt.tensors, seed));
      opt.lora = &m.lora;
      opt.base = &base->tensors;
      try {
        return make_llama(spec, opt);
      } catch (const std::invalid_argument& e) {
        return invalid_argument("client_configs.model_configs.hf_checkpoint: {}: {}", m.hf_checkpoint, e.what());
      }
    }
    return make_llama(spec, opt);
  }
  return invalid_argument("unknown model '{}'; known models: {}", m.model_name, fmt::join(known_model_names(), ", "));
}

StatusOr<DType> dtype_of(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32:
      return DType::kF32;
    case torch::kBFloat16:
      return DType::kBF16;
    case torch::kFloat16:
      return DType::kF16;
    case torch::kInt64:
      return DType::kI64;
    case torch::kInt32:
      return DType::kI32;
    case torch::kUInt8:
      return DType::kU8;
    default:
      return invalid_argument("tensor dtype {} has no arena dtype", c10::toString(t));
  }
}

torch::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::kF32:
      return torch::kFloat32;
    case DType::kBF16:
      return torch::kBFloat16;
    case DType::kF16:
      return torch::kFloat16;
    case DType::kI64:
      return torch::kInt64;
    case DType::kI32:
      return torch::kInt32;
    case DType::kU8:
      return torch::kUInt8;
  }
  return torch::kFloat32;
}

#ifdef MEMFL_HAVE_CUDA_COPY
PinnedArena::PinnedArena(Arena& arena) : arena_(arena) {
  if (arena.file_backed() || arena.size() == 0) return;
  pinning_ = std::thread([this] {
    if (cudaHostRegister(arena_.data(), arena_.size(), cudaHostRegisterDefault) == cudaSuccess) {
      ready_.store(true, std::memory_order_release);
    } else {
      (void)cudaGetLastError();  // not sticky: the copies stage instead
    }
  });
}

PinnedArena::~PinnedArena() {
  if (pinning_.joinable()) pinning_.join();
  if (ready()) (void)cudaHostUnregister(arena_.data());
}

void copy_cuda_arena(std::vector<torch::Tensor>& tensors, const Layout& layout, Arena& arena, bool to_device,
                     bool arena_pinned) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (arena_pinned) {
    // Page-locked: each tensor in one DMA, queued back to back.
    for (size_t i = 0; i < tensors.size(); ++i) {
      auto& t = tensors[i];
      if (!t.is_cuda()) continue;
      auto* host = reinterpret_cast<uint8_t*>(arena.data()) + layout.entries()[i].offset;
      auto* dev = static_cast<uint8_t*>(t.data_ptr());
      C10_CUDA_CHECK(to_device ? cudaMemcpyAsync(dev, host, t.nbytes(), cudaMemcpyHostToDevice, stream)
                               : cudaMemcpyAsync(host, dev, t.nbytes(), cudaMemcpyDeviceToHost, stream));
    }
    stream.synchronize();
    return;
  }
  // Two pinned staging buffers: while the GPU copies one, the host threads
  // fill (or drain) the other. A pageable copy stages through the driver's
  // small buffers on one thread, 3-4 × slower for a model of many GB.
  constexpr size_t kStage = size_t{256} << 20;
  const auto pinned = torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true);
  torch::Tensor stage[2] = {torch::empty({static_cast<int64_t>(kStage)}, pinned),
                            torch::empty({static_cast<int64_t>(kStage)}, pinned)};
  at::cuda::CUDAEvent done[2];
  bool used[2] = {false, false};
  int b = 0;
  auto host_copy = [](uint8_t* dst, const uint8_t* src, size_t n) { parallel_copy(dst, src, n); };
  // Device to host: the GPU copy of piece k overlaps the host's drain of piece k − 1.
  struct Pending {
    uint8_t* dst = nullptr;
    size_t n = 0;
  } pending[2];
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& t = tensors[i];
    if (!t.is_cuda()) continue;
    auto* host = reinterpret_cast<uint8_t*>(arena.data()) + layout.entries()[i].offset;
    auto* dev = static_cast<uint8_t*>(t.data_ptr());
    const size_t bytes = t.nbytes();
    for (size_t off = 0; off < bytes; off += kStage) {
      const size_t n = std::min(kStage, bytes - off);
      auto* buf = stage[b].data_ptr<uint8_t>();
      if (used[b]) done[b].synchronize();
      if (to_device) {
        host_copy(buf, host + off, n);
        C10_CUDA_CHECK(cudaMemcpyAsync(dev + off, buf, n, cudaMemcpyHostToDevice, stream));
      } else {
        if (pending[b].n > 0) host_copy(pending[b].dst, buf, pending[b].n);
        C10_CUDA_CHECK(cudaMemcpyAsync(buf, dev + off, n, cudaMemcpyDeviceToHost, stream));
        pending[b] = {host + off, n};
      }
      done[b].record(stream);
      used[b] = true;
      b ^= 1;
    }
  }
  for (int j : {b, b ^ 1}) {  // the older piece first
    if (!used[j]) continue;
    done[j].synchronize();
    if (!to_device && pending[j].n > 0) host_copy(pending[j].dst, stage[j].data_ptr<uint8_t>(), pending[j].n);
  }
}
#endif

StatusOr<BoundModel> bind_to_arena(Net& net) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors = net.named_tensors();
  LayoutBuilder b;
  for (auto& [name, t] : tensors) {
    MEMFL_ASSIGN_OR_RETURN(DType d, dtype_of(t.scalar_type()));
    b.add(name, d, t.sizes().vec());
  }
  BoundModel bound;
  MEMFL_ASSIGN_OR_RETURN(bound.layout, std::move(b).build());
  bound.arena = Arena(bound.layout.total_bytes(), MemoryCategory::kModel);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> on_gpu(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const LayoutEntry& e = bound.layout.entries()[i];
    auto& t = tensors[i].second;
#ifdef MEMFL_HAVE_CUDA_COPY
    if (t.is_cuda() && t.is_contiguous()) {
      on_gpu[i] = t;  // copied below, in one pipelined pass
      continue;
    }
#endif
    torch::Tensor view =
        torch::from_blob(bound.arena.data() + e.offset, t.sizes(), torch::TensorOptions().dtype(t.scalar_type()));
    view.copy_(t);
    if (!t.is_cuda()) t.set_data(view);  // the module now computes on the arena's bytes
  }
#ifdef MEMFL_HAVE_CUDA_COPY
  copy_cuda_arena(on_gpu, bound.layout, bound.arena, /*to_device=*/false);
#endif
  return bound;
}

}  // namespace memfl::torch_internal
