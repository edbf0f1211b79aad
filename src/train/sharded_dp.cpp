// Sharded DP-SGD (see train/sharded_dp.h for the scheme).
#include "train/sharded_dp.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>

// Gloo's headers come from libgloo-dev on Debian; c10d declares its Gloo and
// NCCL groups only when told they were built in.
#if __has_include(<gloo/algorithm.h>)
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define MEMFL_HAVE_GLOO 1
#endif
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>) && \
    __has_include(<torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define MEMFL_HAVE_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace memfl::torch_internal::sharded {

using torch::Tensor;

namespace {

// Noise is drawn in fixed blocks of a unit's coordinates. Each block costs
// the host a generator reseed and a few launches (about 20 µs): with 2^20 on
// a GPU, the 618 M coordinates of a 1B model's shard took about 12 ms per
// step, longer than the draws themselves. A CPU draws every coordinate of a
// block itself, so there a smaller block wastes less on a unit's last block.
int64_t noise_block(const torch::Device& device) { return device.is_cuda() ? int64_t{1} << 22 : int64_t{1} << 20; }

// A parameter's name as the plain model has it: unit name first, when it has one.
std::string param_name(const Unit& u, const std::string& key) { return u.name.empty() ? key : u.name + "." + key; }

// An environment variable as an int; nullopt when unset.
StatusOr<std::optional<int>> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::optional<int>();
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < 0 || x > 1 << 20) {
    return invalid_argument("environment variable {}='{}' is not a non-negative integer", name, v);
  }
  return std::optional<int>(static_cast<int>(x));
}

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The flat buffer's storage is dropped and brought back in place, so every
// view of it (the parameters, and what autograd saved of them) follows.
void drop_storage(const Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
void restore_storage(const Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

}  // namespace

StatusOr<std::optional<Rendezvous>> rendezvous_from_env() {
  struct Names {
    const char *rank, *world, *local, *port;
    bool master_addr;  // MASTER_ADDR names rank 0's host (memfl's own launcher is always local)
  };
  const Names sources[] = {
      {"MEMFL_RANK", "MEMFL_WORLD_SIZE", "MEMFL_LOCAL_RANK", "MEMFL_MASTER_PORT", false},
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", true},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_PORT", true}};
  for (const Names& n : sources) {
    MEMFL_ASSIGN_OR_RETURN(auto rank, env_int(n.rank));
    if (!rank) continue;
    MEMFL_ASSIGN_OR_RETURN(auto world, env_int(n.world));
    if (!world || *world < 1) return invalid_argument("{} is set but {} is not", n.rank, n.world);
    if (*rank >= *world) return invalid_argument("{}={} is not below {}={}", n.rank, *rank, n.world, *world);
    MEMFL_ASSIGN_OR_RETURN(auto local, env_int(n.local));
    MEMFL_ASSIGN_OR_RETURN(auto port, env_int(n.port));
    Rendezvous r;
    r.rank = *rank;
    r.world_size = *world;
    r.local_rank = local.value_or(*rank);
    if (port) {
      if (*port < 1 || *port > 65535) return invalid_argument("{}={} is not a TCP port", n.port, *port);
      r.port = *port;
    }
    if (const char* addr = std::getenv("MASTER_ADDR"); n.master_addr && addr != nullptr && *addr != '\0') {
      r.host = addr;
    }
    return std::optional<Rendezvous>(r);
  }
  return std::optional<Rendezvous>();
}

// ------------------------------------------------------------------ group

struct ShardGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
#ifdef MEMFL_HAVE_GLOO
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#endif
#ifdef MEMFL_HAVE_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
};

StatusOr<std::unique_ptr<ShardGroup>> ShardGroup::create(const Rendezvous& where, const torch::Device& device) {
  if (where.world_size < 1 || where.rank < 0 || where.rank >= where.world_size) {
    return invalid_argument("sharded training: rank {} of world size {}", where.rank, where.world_size);
  }
  std::unique_ptr<ShardGroup> g(new ShardGroup());
  g->impl_ = std::make_unique<Impl>();
  g->rank_ = where.rank;
  g->world_ = where.world_size;
  const auto timeout = std::chrono::milliseconds(120000);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(where.port);
    so.isServer = where.rank == 0;
    so.numWorkers = static_cast<size_t>(where.world_size);
    so.waitWorkers = true;
    so.timeout = timeout;
    g->impl_->store = c10::make_intrusive<c10d::TCPStore>(where.host, so);
    if (device.is_cuda()) {
#ifdef MEMFL_HAVE_NCCL
      c10::cuda::set_device(device.has_index() ? device.index() : 0);
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      g->impl_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(g->impl_->store, where.rank, where.world_size, opts);
#else
      return failed_precondition("sharded training on {}: this libtorch has no NCCL process group", device.str());
#endif
    } else {
#ifdef MEMFL_HAVE_GLOO
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      g->impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(g->impl_->store, where.rank, where.world_size, opts);
#else
      return failed_precondition("sharded training on the CPU: this libtorch was built without Gloo headers");
#endif
    }
  } catch (const std::exception& e) {
    return failed_precondition("sharded training: rank {} of {} could not meet the others at {}:{}: {}", where.rank,
                               where.world_size, where.host, where.port, e.what());
  }
  g->barrier();
  return g;
}

ShardGroup::~ShardGroup() {
#if defined(MEMFL_HAVE_NCCL) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
  if (impl_ && impl_->nccl) impl_->nccl->shutdown();
#endif
}

const char* ShardGroup::backend() const {
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) return "nccl";
#endif
  return "gloo";
}

void ShardGroup::all_gather(Tensor& full, const Tensor& shard) {
  const int64_t n = shard.numel();
  TORCH_CHECK(full.numel() == n * world_, "all_gather: ", full.numel(), " != ", n, " x ", world_);
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) {
    Tensor in = shard;
    impl_->nccl->_allgather_base(full, in)->wait();
    return;
  }
#endif
#ifdef MEMFL_HAVE_GLOO
  std::vector<std::vector<Tensor>> out(1);
  for (int r = 0; r < world_; ++r) out[0].push_back(full.narrow(0, r * n, n));
  std::vector<Tensor> in{shard};
  impl_->gloo->allgather(out, in)->wait();
#endif
}

void ShardGroup::reduce_scatter_sum(Tensor& shard, Tensor& full) { reduce_scatter_sum_start(shard, full)(); }

std::function<void()> ShardGroup::reduce_scatter_sum_start(Tensor& shard, Tensor& full) {
  const int64_t n = shard.numel();
  TORCH_CHECK(full.numel() == n * world_, "reduce_scatter: ", full.numel(), " != ", n, " x ", world_);
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) {
    auto work = impl_->nccl->_reduce_scatter_base(shard, full);
    return [work] { work->wait(); };
  }
#endif
#ifdef MEMFL_HAVE_GLOO
  // Gloo 1.13 has no reduce-scatter: all-reduce, then keep this rank's slice
  // (the CPU path is for correctness in CI; NCCL does the real one).
  std::vector<Tensor> t{full};
  impl_->gloo->allreduce(t)->wait();
  shard.copy_(full.narrow(0, rank_ * n, n));
#endif
  return [] {};
}

void ShardGroup::all_reduce_sum(Tensor& t) {
  std::vector<Tensor> v{t};
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) {
    impl_->nccl->allreduce(v)->wait();
    return;
  }
#endif
#ifdef MEMFL_HAVE_GLOO
  impl_->gloo->allreduce(v)->wait();
#endif
}

void ShardGroup::broadcast(Tensor& t, int root) {
  std::vector<Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) {
    impl_->nccl->broadcast(v, o)->wait();
    return;
  }
#endif
#ifdef MEMFL_HAVE_GLOO
  impl_->gloo->broadcast(v, o)->wait();
#endif
}

void ShardGroup::store_set(const std::string& key, const std::string& value) {
  impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

StatusOr<std::string> ShardGroup::store_get(const std::string& key, std::chrono::milliseconds timeout) {
  try {
    impl_->store->wait({key}, timeout);
    const std::vector<uint8_t> v = impl_->store->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    return failed_precondition("rank {}: no '{}' from rank 0: {}", rank_, key, e.what());
  }
}

void ShardGroup::barrier() {
  // A one-element all-reduce: c10d's barrier() guesses a device for NCCL.
  Tensor t = torch::zeros({1});
#ifdef MEMFL_HAVE_NCCL
  if (impl_->nccl) t = t.cuda();
#endif
  all_reduce_sum(t);
  (void)t.item<float>();
}

// ------------------------------------------------------------------ model

Unit make_groupnorm_cnn_unit(int64_t channels, int64_t pixels, int64_t classes, int i, int64_t groups) {
  auto m = std::make_shared<torch::nn::Module>("CNN_GN unit");
  Unit u{"", m, nullptr};
  const int64_t side = ((pixels - 4) / 2 - 4) / 2;
  if (i == 0 || i == 1) {
    const std::string k = std::to_string(i + 1);
    auto conv = m->register_module("conv" + k, i == 0 ? dp::Conv2d(channels, 32, 5) : dp::Conv2d(32, 64, 5));
    auto gn = m->register_module("gn" + k, dp::GroupNorm(groups, i == 0 ? 32 : 64));
    u.forward = [conv, gn, i](const Tensor& x) {
      Tensor y = torch::max_pool2d(torch::relu(gn->forward(conv->forward(x))), 2);
      return i == 1 ? y.flatten(1) : y;
    };
  } else if (i == 2) {
    auto fc = m->register_module("fc1", dp::Linear(64 * side * side, 512));
    u.forward = [fc](const Tensor& x) { return torch::relu(fc->forward(x)); };
  } else {
    auto fc = m->register_module("fc2", dp::Linear(512, classes));
    u.forward = [fc](const Tensor& x) { return fc->forward(x); };
  }
  return u;
}

struct ShardedModel::Flat {
  std::vector<Tensor> params;  // the module's parameters: views of `full`
  std::vector<int64_t> offsets;
  int64_t total = 0, padded = 0, shard = 0;
  Tensor full;   // padded elements; storage empty unless gathered
  Tensor local;  // this rank's shard: a leaf the optimizer steps
  std::vector<dp::DpLayer*> layers;
  bool has_conv = false;  // its clipped gradient reads the weight: gathered for the DP step
  bool gathered = false;
  size_t bytes() const { return static_cast<size_t>(padded) * full.element_size(); }
};

ShardedModel::~ShardedModel() {
  dp_.reset();  // detach the layers before the modules go
}

StatusOr<std::unique_ptr<ShardedModel>> ShardedModel::create(ShardGroup* group, int num_units,
                                                             const std::function<Unit(int)>& make_unit,
                                                             const Options& options, const torch::Device& device) {
  if (group == nullptr || num_units < 1) return invalid_argument("sharded model: no group or no units");
  const bool dp_mode = options.mode != "no_dp";
  if (dp_mode && !dp::parse_clip_mode(options.mode)) {
    return invalid_argument("sharded model: unknown mode '{}' (no_dp, naive, ghost, fused)", options.mode);
  }
  if (options.optimizer != "sgd" && options.optimizer != "adam") {
    return invalid_argument("sharded model: unknown optimizer '{}' (sgd, adam)", options.optimizer);
  }
  std::unique_ptr<ShardedModel> m(new ShardedModel());
  m->group_ = group;
  m->options_ = options;
  const char* phases = std::getenv("MEMFL_DP_PHASES");
  m->time_phases_ = phases != nullptr && std::string(phases) == "1";
  m->device_ = device;
  m->root_ = std::make_shared<torch::nn::Module>("ShardedModel");
  const int64_t world = group->world_size(), rank = group->rank();
  try {
    for (int i = 0; i < num_units; ++i) {
      Unit u = make_unit(i);
      if (!u.module || !u.forward) return invalid_argument("sharded model: unit {} has no module or forward", i);
      u.module->to(device, options.dtype);
      auto f = std::make_unique<Flat>();
      for (auto& p : u.module->parameters()) {
        f->offsets.push_back(f->total);
        f->params.push_back(p);
        f->total += p.numel();
      }
      for (auto& mod : u.module->modules(/*include_self=*/true)) {
        if (auto* layer = dynamic_cast<dp::DpLayer*>(mod.get())) f->layers.push_back(layer);
        if (dynamic_cast<dp::Conv2dImpl*>(mod.get()) != nullptr) f->has_conv = true;
      }
      f->shard = (f->total + world - 1) / world;
      f->padded = f->shard * world;
      f->full = torch::zeros({f->padded}, torch::TensorOptions().dtype(options.dtype).device(device));
      {
        torch::NoGradGuard no_grad;
        for (size_t k = 0; k < f->params.size(); ++k) {
          Tensor& p = f->params[k];
          Tensor view = f->full.narrow(0, f->offsets[k], p.numel());
          view.copy_(p.reshape(-1));
          p.set_data(view.view(p.sizes()));
        }
      }
      f->local = f->full.narrow(0, rank * f->shard, f->shard).clone().requires_grad_(true);
      size_t k = 0;
      for (const auto& kv : u.module->named_parameters()) {
        m->param_index_[param_name(u, kv.key())] = {m->flats_.size(), k++};
      }
      drop_storage(f->full);
      m->num_params_ += f->total;
      std::string key = u.name.empty() ? fmt::format("unit{}", i) : u.name;
      std::replace(key.begin(), key.end(), '.', '_');  // libtorch refuses dots in submodule names
      m->root_->register_module(key, u.module);
      m->units_.push_back(std::move(u));
      m->flats_.push_back(std::move(f));
    }
    std::vector<Tensor> shards;
    for (auto& f : m->flats_) shards.push_back(f->local);
    if (options.optimizer == "adam") {
      m->optimizer_ = std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(options.lr));
    } else {
      m->optimizer_ = std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(options.lr));
    }
    if (device.is_cuda()) {
#ifdef MEMFL_HAVE_NCCL
      m->noise_gen_ = at::cuda::detail::createCUDAGenerator(device.has_index() ? device.index() : 0);
#endif
    } else {
      m->noise_gen_ = at::detail::createCPUGenerator(options.noise_seed);
    }
  } catch (const c10::Error& e) {
    return internal_error("sharded model: building unit {} failed: {}", m->units_.size(), e.what_without_backtrace());
  } catch (const std::exception& e) {
    return internal_error("sharded model: building unit {} failed: {}", m->units_.size(), e.what());
  }
  if (dp_mode) {
    dp::DpOptions d;
    d.mode = *dp::parse_clip_mode(options.mode);
    d.max_grad_norm = options.max_grad_norm;
    d.noise_multiplier = options.noise_multiplier;
    MEMFL_ASSIGN_OR_RETURN(m->dp_, dp::DpSgd::create(m->root_, d));
  }
  return m;
}

int64_t ShardedModel::shard_numel() const {
  int64_t n = 0;
  for (const auto& f : flats_) n += f->shard;
  return n;
}

void ShardedModel::gather(Flat& f) {
  if (f.gathered) return;
  restore_storage(f.full, f.bytes());
  group_->all_gather(f.full, f.local.detach());
  f.gathered = true;
}

void ShardedModel::phase(const std::string& name) {
  if (!time_phases_) return;
  // A one-element copy to the host waits for the device's queue (collectives
  // included: c10d makes the current stream wait on them).
  if (device_.is_cuda()) (void)torch::zeros({1}, torch::TensorOptions().device(device_)).item<float>();
  const auto now = std::chrono::steady_clock::now();
  phase_ms_[name] += std::chrono::duration<double, std::milli>(now - phase_start_).count();
  phase_start_ = now;
}

void ShardedModel::release(Flat& f) {
  if (!f.gathered) return;
  drop_storage(f.full);
  f.gathered = false;
}

void ShardedModel::add_noise(size_t unit, Tensor& grad, int64_t begin, double std) {
  // Straight into the gradient, block by block: no shard-sized noise buffer.
  // Drawn in the gradient's dtype: a bf16 block is half the bytes to write
  // and read again, and every rank still draws the same block.
  auto opts = torch::TensorOptions().dtype(grad.scalar_type()).device(device_);
  const int64_t len = grad.numel();
  const int64_t kNoiseBlock = noise_block(device_);
  for (int64_t b = begin / kNoiseBlock; b * kNoiseBlock < begin + len; ++b) {
    uint64_t seed = mix(options_.noise_seed);
    seed = mix(seed ^ static_cast<uint64_t>(step_));
    seed = mix(seed ^ (static_cast<uint64_t>(unit) << 32));
    seed = mix(seed ^ static_cast<uint64_t>(b));
    {
      std::lock_guard<std::mutex> lock(noise_gen_->mutex());
      noise_gen_->set_current_seed(seed);
    }
    Tensor block = at::randn({kNoiseBlock}, *noise_gen_, opts);
    const int64_t lo = std::max(begin, b * kNoiseBlock), hi = std::min(begin + len, (b + 1) * kNoiseBlock);
    Tensor part = block.narrow(0, lo - b * kNoiseBlock, hi - lo);
    grad.narrow(0, lo - begin, hi - lo).add_(part, std);
  }
}

// The unit's full gradient (from the parameters' .grad) → summed over ranks →
// this rank's slice, noised and divided, as the shard's gradient.
ShardedModel::Reduction ShardedModel::start_reduction(size_t unit) {
  Flat& f = *flats_[unit];
  Reduction r;
  r.unit = unit;
  r.flat = torch::zeros({f.padded}, f.full.options());
  for (size_t k = 0; k < f.params.size(); ++k) {
    Tensor& p = f.params[k];
    if (p.grad().defined()) r.flat.narrow(0, f.offsets[k], p.numel()).copy_(p.grad().reshape(-1));
    p.mutable_grad() = Tensor();
  }
  r.out = torch::empty({f.shard}, f.full.options());
  r.wait = group_->reduce_scatter_sum_start(r.out, r.flat);
  return r;
}

void ShardedModel::finish_reduction(Reduction& r, double divisor) {
  r.wait();
  r.flat = Tensor();
  Flat& f = *flats_[r.unit];
  const double noise_std = dp_ ? options_.noise_multiplier * options_.max_grad_norm : 0.0;
  if (noise_std > 0) add_noise(r.unit, r.out, group_->rank() * f.shard, noise_std);
  r.out.div_(divisor);
  f.local.mutable_grad() = std::move(r.out);
}

Tensor ShardedModel::dp_step(double divisor) {
  torch::NoGradGuard no_grad;
  const dp::DpOptions& o = dp_->options();
  Tensor sq;
  for (auto& f : flats_) {
    // Conv2d's norms and clipped gradient read its weight (shape and layout);
    // Linear, Embedding and the norms need only their records.
    if (f->has_conv) gather(*f);
    for (dp::DpLayer* layer : f->layers) {
      if (!layer->has_records()) continue;
      Tensor s = layer->per_sample_sq_norms(o).to(torch::kFloat32);
      sq = sq.defined() ? sq.add_(s) : s;
    }
  }
  phase("norms");
  Tensor clip, stats;
  if (sq.defined() && sq.size(0) > 0) {
    Tensor norms = sq.sqrt();
    clip = (o.max_grad_norm / (norms + 1e-6)).clamp_max(1.0);
    Tensor n64 = norms.to(torch::kFloat64);
    // Read by the host only once the step is queued: a read here would
    // drain the device before the clipped sums are launched.
    stats = torch::stack({n64.mean(), n64.max(), n64.gt(o.max_grad_norm).to(torch::kFloat64).mean()});
  }
  std::optional<Reduction> pending;
  for (size_t u = 0; u < flats_.size(); ++u) {
    Flat& f = *flats_[u];
    for (dp::DpLayer* layer : f.layers) {
      if (clip.defined() && layer->has_records()) {
        layer->write_clipped_grads(clip.to(device_), o);
      } else {
        for (auto& p : layer->dp_parameters()) {
          if (p.requires_grad()) p.mutable_grad() = Tensor();
        }
      }
      layer->clear_records();
    }
    // This unit's sum travels while the next unit's clipped sums are
    // computed; at most two units' full gradients exist at once.
    Reduction next = start_reduction(u);
    release(f);
    if (pending) finish_reduction(*pending, divisor);
    pending = std::move(next);
  }
  if (pending) finish_reduction(*pending, divisor);
  phase("clipped sums, reduce-scatter, noise");
  return stats;
}

StatusOr<StepStats> ShardedModel::step(const Tensor& input, const Tensor& labels, double expected_global_batch) {
  if (!(expected_global_batch > 0)) {
    return invalid_argument("sharded step: expected global batch must be > 0, got {}", expected_global_batch);
  }
  StepStats st;
  st.batch_size = input.size(0);
  ++step_;
  if (time_phases_) {
    phase_start_ = std::chrono::steady_clock::now();
    phase("(before the step)");
  }
  try {
    for (auto& f : flats_) f->local.mutable_grad() = Tensor();
    const size_t n = units_.size();
    std::vector<Tensor> ins(n), outs(n);
    Tensor x = input;
    // A rank with no samples this step (a small or empty Poisson batch) still
    // takes part in every collective, in the same order, and adds nothing.
    const bool idle = input.size(0) == 0;
    for (size_t u = 0; u < n; ++u) {
      gather(*flats_[u]);
      if (!idle) {
        ins[u] = x.is_floating_point() ? x.detach().requires_grad_(true) : x;
        outs[u] = units_[u].forward(ins[u]);
        x = outs[u];
      }
      release(*flats_[u]);
    }
    x = Tensor();
    phase("forward");
    Tensor loss, loss_sum, correct, dp_stats;
    if (!idle) {
      loss =
          torch::nn::functional::cross_entropy(outs.back().to(torch::kFloat32), labels,
                                               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      // Read at the end of the step, so the host queues backward meanwhile.
      loss_sum = loss.detach();
      correct = outs.back().argmax(1).eq(labels).sum();
    }
    Tensor grad;
    for (size_t i = n; i-- > 0;) {
      Flat& f = *flats_[i];
      gather(f);
      if (idle) {
        // no graph: nothing to run backward through
      } else if (i + 1 == n) {
        loss.backward();
        loss = Tensor();
      } else {
        torch::autograd::backward({outs[i]}, {grad});
      }
      grad = !idle && ins[i].requires_grad() ? ins[i].grad() : Tensor();
      ins[i] = Tensor();
      outs[i] = Tensor();
      if (!dp_) {
        Reduction r = start_reduction(i);
        finish_reduction(r, expected_global_batch);
      }
      release(f);
    }
    phase("backward");
    if (dp_) dp_stats = dp_step(expected_global_batch);
    optimizer_->step();
    phase("optimizer");
    if (loss_sum.defined()) {
      st.loss = loss_sum.item<double>();
      st.correct = correct.item<int64_t>();
    }
    if (dp_stats.defined()) {
      Tensor s = dp_stats.to(torch::kCPU);
      st.mean_norm = s[0].item<double>();
      st.max_norm = s[1].item<double>();
      st.clipped_fraction = s[2].item<double>();
    }
  } catch (const c10::Error& e) {
    if (dp_) dp_->clear();
    for (auto& f : flats_) release(*f);
    return internal_error("sharded step {} on rank {} failed in libtorch: {}", step_, group_->rank(),
                          e.what_without_backtrace());
  }
  return st;
}

void ShardedModel::load_from_rank0(const ReadParam& read) {
  torch::NoGradGuard no_grad;
  const bool root = group_->rank() == 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    Flat& f = *flats_[u];
    restore_storage(f.full, f.bytes());
    f.gathered = true;
    if (root) {
      f.full.zero_();
      for (const auto& kv : units_[u].module->named_parameters()) read(param_name(units_[u], kv.key()), kv.value());
    }
    group_->broadcast(f.full, 0);
    f.local.detach().copy_(f.full.narrow(0, group_->rank() * f.shard, f.shard));
    release(f);
  }
}

void ShardedModel::store_to_rank0(const WriteParam& write) {
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    gather(*flats_[u]);
    if (group_->rank() == 0) {
      for (const auto& kv : units_[u].module->named_parameters()) write(param_name(units_[u], kv.key()), kv.value());
    }
    release(*flats_[u]);
  }
}

template <typename F>
void ShardedModel::for_owned(const BytePiece& piece, F&& f) {
  auto it = param_index_.find(piece.name);
  TORCH_CHECK(it != param_index_.end(), "sharded model: no parameter named ", piece.name);
  Flat& flat = *flats_[it->second.first];
  const Tensor& p = flat.params[it->second.second];
  const int64_t esize = static_cast<int64_t>(flat.full.element_size());
  TORCH_CHECK(piece.param_byte >= 0 && piece.length >= 0 && piece.param_byte + piece.length <= p.numel() * esize,
              "sharded model: bytes [", piece.param_byte, ", ", piece.param_byte + piece.length, ") of ", piece.name,
              " lie outside its ", p.numel() * esize, " bytes");
  const int64_t begin = flat.offsets[it->second.second] * esize + piece.param_byte, end = begin + piece.length;
  const int64_t shard_bytes = flat.shard * esize, mine = group_->rank() * shard_bytes;
  const int64_t lo = std::max(begin, mine), hi = std::min(end, mine + shard_bytes);
  if (lo < hi) f(flat, lo - mine, piece.chunk_byte + (lo - begin), hi - lo);
}

void ShardedModel::write_bytes(const std::vector<BytePiece>& pieces, std::span<const std::byte> chunk,
                               int64_t chunk_len) {
  torch::NoGradGuard no_grad;
  const auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  Tensor buf = torch::empty({chunk_len}, u8.device(device_));
  if (group_->rank() == 0) {
    TORCH_CHECK(static_cast<int64_t>(chunk.size()) == chunk_len, "write_bytes: ", chunk.size(), " bytes, not ",
                chunk_len);
    buf.copy_(torch::from_blob(const_cast<std::byte*>(chunk.data()), {chunk_len}, u8));
  }
  group_->broadcast(buf, 0);
  for (const BytePiece& piece : pieces) {
    for_owned(piece, [&](Flat& f, int64_t shard_byte, int64_t chunk_byte, int64_t n) {
      f.local.detach().view(torch::kUInt8).narrow(0, shard_byte, n).copy_(buf.narrow(0, chunk_byte, n));
    });
  }
}

void ShardedModel::read_bytes(const std::vector<BytePiece>& pieces, std::span<std::byte> chunk, int64_t chunk_len) {
  torch::NoGradGuard no_grad;
  const auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  Tensor buf = torch::zeros({chunk_len}, u8.device(device_));
  for (const BytePiece& piece : pieces) {
    for_owned(piece, [&](Flat& f, int64_t shard_byte, int64_t chunk_byte, int64_t n) {
      buf.narrow(0, chunk_byte, n).copy_(f.local.detach().view(torch::kUInt8).narrow(0, shard_byte, n));
    });
  }
  group_->all_reduce_sum(buf);
  if (group_->rank() == 0) {
    TORCH_CHECK(static_cast<int64_t>(chunk.size()) == chunk_len, "read_bytes: ", chunk.size(), " bytes, not ",
                chunk_len);
    torch::from_blob(chunk.data(), {chunk_len}, u8).copy_(buf);
  }
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ShardedModel::parameter_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const Unit& u : units_) {
    for (const auto& kv : u.module->named_parameters())
      out.emplace_back(param_name(u, kv.key()), kv.value().sizes().vec());
  }
  return out;
}

void ShardedModel::reset_optimizer(const MakeOptimizer& make) {
  std::vector<Tensor> shards;
  for (auto& f : flats_) shards.push_back(f->local);
  optimizer_ = make(shards);
}

std::pair<double, int64_t> ShardedModel::evaluate_sums(const Tensor& input, const Tensor& labels) {
  torch::NoGradGuard no_grad;
  const bool idle = input.size(0) == 0;
  Tensor x = input;
  for (size_t u = 0; u < units_.size(); ++u) {
    gather(*flats_[u]);
    if (!idle) x = units_[u].forward(x);
    release(*flats_[u]);
  }
  if (idle) return {0.0, 0};
  Tensor logits = x.to(torch::kFloat32);
  const double loss = torch::nn::functional::cross_entropy(
                          logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                          .item<double>();
  return {loss, logits.argmax(1).eq(labels).sum().item<int64_t>()};
}

std::vector<std::pair<std::string, Tensor>> ShardedModel::gathered_parameters() {
  std::vector<std::pair<std::string, Tensor>> out;
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    gather(*flats_[u]);
    for (const auto& kv : units_[u].module->named_parameters()) {
      out.emplace_back(param_name(units_[u], kv.key()), kv.value().detach().clone());
    }
    release(*flats_[u]);
  }
  return out;
}

}  // namespace memfl::torch_internal::sharded
