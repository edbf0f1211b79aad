// `memfl bench dp`, plugin side: per clipping mode and
// sequence length, peak memory and time per iteration of DP-SGD training of a
// Llama-style sequence classifier built from the DP layers (train/dp_sgd.h).
//
// The model: dp::Embedding → num_layers × [dp::RMSNorm, rotary causal
// attention (q/k/v/o: dp::Linear without bias, grouped-query heads), residual,
// dp::RMSNorm, SwiGLU MLP (gate/up/down: dp::Linear without bias), residual]
// → dp::RMSNorm → mean over tokens → dp::Linear head (with bias) to 2 classes.
// fp32. The attention itself has no parameters, so it is the same for every
// mode: libtorch ≥ 2 runs it as scaled_dot_product_attention (fused kernels,
// no T×T matrix kept on GPU), libtorch 1.13 as the explicit math of
// llama_module.cpp; the record says which ("attention").
//
// One run = one (seq_length, mode): a fresh model (seeded), one random token
// batch [batch, seq] and labels, SGD without momentum (no optimizer state);
// `warmup` untimed iterations, then `iters` timed ones. An iteration: grads
// dropped, forward, summed cross-entropy, backward, DpSgd::step(batch) for the
// DP modes (naive | ghost | fused; noise σ·C, C = max_grad_norm), optimizer
// step. no_dp is the same model with no DpSgd attached: its layers run the
// plain libtorch ops.
//
// Memory (peak_memory_bytes):
//   CUDA: the caching allocator's peak allocated bytes on the device, its peak
//         statistics reset after the model, batch, optimizer and DpSgd exist
//         (so the peak includes the weights, and libtorch's cuBLAS
//         workspaces, tens of MiB, allocated once by the first pass; the
//         record's memory.allocated_at_reset_bytes says what was there),
//         before the warm-up. The cache is emptied before each run.
//   CPU:  the RSS peak above the pre-model baseline: a MemorySampler (1 ms)
//         started before the model is built, peak_rss() minus the RSS read
//         just before the model is built; the kernel's VmHWM, reset for the
//         run through /proc/self/clear_refs where that is allowed, catches
//         what happens between two samples. malloc_trim before each run, so
//         the previous run's freed heap does not hide this one's growth.
// Time (avg_iteration_ms, min_iteration_ms): steady_clock around each timed
// iteration, with the device synchronised before and after it on CUDA (the
// DP step reads its statistics with .item(), a synchronisation anyway), so
// the time is the iteration's wall time, as CUDA events around it would give.
#include "train/dp_bench.h"

#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "memory/sampler.h"
#include "train/dp_llama.h"
#include "train/sharded_dp.h"

namespace memfl::torch_internal {

namespace {

using json = nlohmann::ordered_json;
using torch::Tensor;

constexpr double kLearningRate = 1e-3;

struct Measured {
  int64_t num_params = 0;
  int64_t peak_bytes = 0;
  int64_t peak_reserved_bytes = -1;       // CUDA only
  int64_t allocated_at_reset_bytes = -1;  // CUDA: model, batch and libtorch's own buffers (cuBLAS workspaces)
  int64_t baseline_bytes = 0;             // CPU: RSS before the model
  bool vm_hwm = false;                    // CPU: VmHWM was reset and read
  double avg_ms = 0, min_ms = 0, median_ms = 0;
  std::optional<dp::DpStepStats> last_step;
  std::string error;  // non-empty: the run failed with this message
};

// o.warmup untimed calls of `iterate`, then o.iters timed ones between
// device synchronisations (`before_each` runs first, untimed): m.avg_ms, m.min_ms,
// m.median_ms (a step now and then is slow on a shared host; the median is
// not moved by it).
template <typename F, typename G = void (*)()>
void time_iterations(
    const DpBenchOptions& o, const torch::Device& dev, Measured& m, F&& iterate, G&& before_each = [] {}) {
  for (int i = 0; i < o.warmup; ++i) iterate();
  double total = 0, best = std::numeric_limits<double>::infinity();
  std::vector<double> each;
  for (int i = 0; i < o.iters; ++i) {
    synchronize(dev);
    before_each();
    const auto t0 = std::chrono::steady_clock::now();
    iterate();
    synchronize(dev);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    total += ms;
    best = std::min(best, ms);
    each.push_back(ms);
  }
  m.avg_ms = total / o.iters;
  m.min_ms = best;
  std::sort(each.begin(), each.end());
  const size_t n = each.size();
  m.median_ms = n == 0 ? 0.0 : (n % 2 == 1 ? each[n / 2] : 0.5 * (each[n / 2 - 1] + each[n / 2]));
}

// One run; throws what libtorch throws (the caller turns it into a record or
// an error). Everything it allocates is freed when it returns or throws.
void train_run(const DpBenchOptions& o, const DpLlamaSpec& s, const std::string& mode, int seq,
               const torch::Device& dev, Measured& m) {
  torch::manual_seed(o.seed);
  auto net = std::make_shared<DpLlamaClassifier>(s);
  net->to(dev);
  net->init_weights();
  net->train();
  m.num_params = 0;
  for (const auto& p : net->parameters()) m.num_params += p.numel();
  const int64_t batch = o.batch_size;
  Tensor tokens = torch::randint(0, s.vocab_size, {batch, seq}, torch::kLong).to(dev);
  Tensor labels = torch::randint(0, s.num_classes, {batch}, torch::kLong).to(dev);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLearningRate));
  std::unique_ptr<dp::DpSgd> dpsgd;
  if (mode != "no_dp") {
    dp::DpOptions d;
    d.mode = *dp::parse_clip_mode(mode);
    d.max_grad_norm = o.max_grad_norm;
    d.noise_multiplier = o.noise_multiplier;
    auto created = dp::DpSgd::create(net, d);
    if (!created.ok()) throw std::runtime_error(created.status().to_string());
    dpsgd = std::move(*created);
  }
  auto params = net->parameters();
#ifdef MEMFL_HAVE_CUDA_STATS
  const c10::DeviceIndex index = dev.has_index() ? dev.index() : 0;
  if (dev.is_cuda()) {
    synchronize(dev);
    c10::cuda::CUDACachingAllocator::resetPeakStats(index);
    constexpr auto kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    m.allocated_at_reset_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[kAll].current;
  }
#endif
  auto iterate = [&] {
    for (auto& p : params) p.mutable_grad() = Tensor();
    {
      Tensor logits = net->forward(tokens);
      Tensor loss = torch::nn::functional::cross_entropy(
          logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss.backward();
    }  // the graph is gone before the DP step, as in a training loop
    if (dpsgd) {
      auto st = dpsgd->step(static_cast<double>(batch));
      if (!st.ok()) throw std::runtime_error(st.status().message());
      m.last_step = *st;
    }
    opt.step();
  };
  time_iterations(o, dev, m, iterate);
#ifdef MEMFL_HAVE_CUDA_STATS
  if (dev.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    constexpr auto kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    m.peak_bytes = stats.allocated_bytes[kAll].peak;
    m.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
  }
#endif
}

// Runs `run` with its memory measured as described at the top of this file;
// a failure becomes m.error.
template <typename F>
void measure_into(const torch::Device& dev, Measured& m, F&& run) {
  release_cached_memory(dev);
  MemorySampler sampler("bench-dp", 1);
  if (!dev.is_cuda()) {
    sampler.start();
    m.vm_hwm = reset_peak_rss();
    m.baseline_bytes = read_rss_bytes();
  }
  try {
    run();
  } catch (const c10::Error& e) {
    m.error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    m.error = e.what();
  }
  if (!dev.is_cuda()) {
    sampler.stop();
    int64_t peak = sampler.peak_rss();
    if (m.vm_hwm) peak = std::max(peak, read_peak_rss_bytes());
    m.peak_bytes = std::max<int64_t>(0, peak - m.baseline_bytes);
  }
  release_cached_memory(dev);
}

Measured measure(const DpBenchOptions& o, const DpLlamaSpec& s, const std::string& mode, int seq,
                 const torch::Device& dev) {
  Measured m;
  measure_into(dev, m, [&] { train_run(o, s, mode, seq, dev, m); });
  return m;
}

std::string device_name(const torch::Device& dev) {
  return dev.is_cuda() ? fmt::format("cuda:{}", dev.has_index() ? dev.index() : 0) : "cpu";
}

json make_record(const DpBenchOptions& o, const DpLlamaSpec& s, const std::string& mode, int seq,
                 const torch::Device& dev, const Measured& m) {
  json r;
  r["mode"] = mode;
  r["seq_length"] = seq;
  r["batch_size"] = o.batch_size;
  r["num_params"] = m.num_params > 0 ? m.num_params : s.num_params();
  if (m.error.empty()) {
    r["peak_memory_bytes"] = m.peak_bytes;
    r["avg_iteration_ms"] = m.avg_ms;
    r["min_iteration_ms"] = m.min_ms;
    r["median_iteration_ms"] = m.median_ms;
  } else {
    r["error"] = is_oom(m.error) ? std::string("out of memory") : first_line(m.error);
    r["error_detail"] = first_line(m.error);
  }
  r["warmup_iterations"] = o.warmup;
  r["timed_iterations"] = o.iters;
  r["device"] = device_name(dev);
  r["model"] = s.name;
  if (m.last_step) {
    r["mean_per_sample_norm"] = m.last_step->mean_norm;
    r["max_per_sample_norm"] = m.last_step->max_norm;
    r["clipped_fraction"] = m.last_step->clipped_fraction;
  }
  json mem;
  if (dev.is_cuda()) {
    mem["source"] = "CUDA caching allocator: peak allocated bytes, peak reset after the model was built";
    if (m.peak_reserved_bytes >= 0) mem["peak_reserved_bytes"] = m.peak_reserved_bytes;
    if (m.allocated_at_reset_bytes >= 0) mem["allocated_at_reset_bytes"] = m.allocated_at_reset_bytes;
  } else {
    mem["source"] = m.vm_hwm ? "RSS above the pre-model baseline: max(MemorySampler 1 ms, VmHWM reset per run)"
                             : "RSS above the pre-model baseline: MemorySampler 1 ms";
    mem["baseline_rss_bytes"] = m.baseline_bytes;
  }
  r["memory"] = mem;
  r["timer"] = dev.is_cuda() ? "steady_clock per iteration between device synchronisations" : "steady_clock";
  json c;
  c["hidden_size"] = s.hidden_size;
  c["num_layers"] = s.num_layers;
  c["num_heads"] = s.num_heads;
  c["num_kv_heads"] = s.num_kv_heads;
  c["head_dim"] = s.head_dim();
  c["vocab_size"] = s.vocab_size;
  c["intermediate_size"] = s.intermediate_size;
  c["num_classes"] = s.num_classes;
  c["dtype"] = "float32";
  c["attention"] = attention_kind();
  c["pooling"] = "mean";
  c["optimizer"] = fmt::format("SGD(lr={})", kLearningRate);
  c["max_grad_norm"] = o.max_grad_norm;
  c["noise_multiplier"] = o.noise_multiplier;
  if (mode != "no_dp") {
    const dp::DpOptions d;
    c["clipping_tile"] = d.tile;
    c["fused_route"] = "auto";
  }
  c["seed"] = o.seed;
  c["libtorch"] = fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  if (!dev.is_cuda()) c["threads"] = torch::get_num_threads();
  r["config"] = c;
  return r;
}

// ------------------------------------------------------------ sharded

// What every rank measured in one sharded run, gathered to rank 0.
struct RankFigures {
  double peak = 0, reserved = 0, resident = 0, avg_ms = 0, min_ms = 0, median_ms = 0, failed = 0;
};

torch::Dtype parse_dtype(const std::string& name) {
  return name == "bfloat16" || name == "bf16" ? torch::kBFloat16 : torch::kFloat32;
}

// One sharded run: every rank builds its shards of a fresh seeded model,
// trains on its own random batch, and measures its own peak, as train_run
// does for one process. Also reports what stays allocated between steps
// (parameter shards, their gradients, the optimizer state).
void sharded_run(const DpBenchOptions& o, const DpLlamaSpec& s, const std::string& mode, int seq,
                 const torch::Device& dev, sharded::ShardGroup* group, Measured& m, double& resident_bytes) {
  torch::manual_seed(o.seed);
  sharded::Options so;
  so.mode = mode;
  so.max_grad_norm = o.max_grad_norm;
  so.noise_multiplier = o.noise_multiplier;
  so.noise_seed = o.seed;
  so.optimizer = o.optimizer;
  so.lr = kLearningRate;
  so.dtype = parse_dtype(o.dtype);
  auto created = sharded::ShardedModel::create(
      group, dp_llama_num_units(s),
      [&](int i) {
        dp::InitDeviceGuard on(dev);  // built and initialised on its GPU: no host copy of a 6B model
        return make_dp_llama_unit(s, i);
      },
      so, dev);
  if (!created.ok()) throw std::runtime_error(created.status().to_string());
  auto& model = *created;
  m.num_params = model->num_params();
  const int64_t batch = o.batch_size;
  // Each rank its own samples.
  torch::manual_seed(o.seed + 1000 * static_cast<uint64_t>(group->rank() + 1));
  Tensor tokens = torch::randint(0, s.vocab_size, {batch, seq}, torch::kLong).to(dev);
  Tensor labels = torch::randint(0, s.num_classes, {batch}, torch::kLong).to(dev);
  const double global_batch = static_cast<double>(batch * group->world_size());
#ifdef MEMFL_HAVE_CUDA_STATS
  const c10::DeviceIndex index = dev.has_index() ? dev.index() : 0;
  constexpr auto kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
  if (dev.is_cuda()) {
    synchronize(dev);
    c10::cuda::CUDACachingAllocator::resetPeakStats(index);
    m.allocated_at_reset_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[kAll].current;
  }
#endif
  auto iterate = [&] {
    auto st = model->step(tokens, labels, global_batch);
    if (!st.ok()) throw std::runtime_error(st.status().message());
    if (mode != "no_dp") {
      dp::DpStepStats d;
      d.batch_size = st->batch_size;
      d.mean_norm = st->mean_norm;
      d.max_norm = st->max_norm;
      d.clipped_fraction = st->clipped_fraction;
      m.last_step = d;
    }
  };
  // The ranks start each timed step together.
  time_iterations(o, dev, m, iterate, [&] { group->barrier(); });
  if (!model->phase_ms().empty() && group->rank() == 0) {
    // MEMFL_DP_PHASES=1: warm-up and timed steps together, per step.
    const double steps = o.warmup + o.iters;
    for (const auto& [name, ms] : model->phase_ms()) {
      std::printf("phase %s seq %d %-28s %8.2f ms/step\n", mode.c_str(), seq, name.c_str(), ms / steps);
    }
    std::fflush(stdout);
  }
  resident_bytes = static_cast<double>(read_rss_bytes());
#ifdef MEMFL_HAVE_CUDA_STATS
  if (dev.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    m.peak_bytes = stats.allocated_bytes[kAll].peak;
    m.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
    resident_bytes = static_cast<double>(stats.allocated_bytes[kAll].current);
  }
#endif
}

RankFigures measure_sharded(const DpBenchOptions& o, const DpLlamaSpec& s, const std::string& mode, int seq,
                            const torch::Device& dev, sharded::ShardGroup* group, Measured& m) {
  double resident = 0;
  measure_into(dev, m, [&] { sharded_run(o, s, mode, seq, dev, group, m, resident); });
  if (!dev.is_cuda()) resident = std::max(0.0, resident - static_cast<double>(m.baseline_bytes));
  // Every rank's figures to every rank: one all-reduce of a world × 7 table.
  const int64_t w = group->world_size();
  Tensor table = torch::zeros({w, 7}, torch::kFloat64);
  table[group->rank()] = torch::tensor({static_cast<double>(m.peak_bytes), static_cast<double>(m.peak_reserved_bytes),
                                        resident, m.avg_ms, m.min_ms, m.error.empty() ? 0.0 : 1.0, m.median_ms},
                                       torch::kFloat64);
  Tensor on = dev.is_cuda() ? table.to(dev) : table;
  group->all_reduce_sum(on);
  table = on.to(torch::kCPU);
  RankFigures worst;
  for (int64_t r = 0; r < w; ++r) {
    auto row = table[r];
    worst.peak = std::max(worst.peak, row[0].item<double>());
    worst.reserved = std::max(worst.reserved, row[1].item<double>());
    worst.resident = std::max(worst.resident, row[2].item<double>());
    worst.avg_ms = std::max(worst.avg_ms, row[3].item<double>());
    worst.min_ms = std::max(worst.min_ms, row[4].item<double>());
    worst.failed += row[5].item<double>();
    worst.median_ms = std::max(worst.median_ms, row[6].item<double>());
  }
  m.peak_bytes = static_cast<int64_t>(worst.peak);
  m.peak_reserved_bytes = static_cast<int64_t>(worst.reserved);
  m.avg_ms = worst.avg_ms;
  m.min_ms = worst.min_ms;
  m.median_ms = worst.median_ms;
  if (m.error.empty() && worst.failed > 0) m.error = "another rank failed";
  return worst;
}

StatusOr<std::vector<std::string>> run_sharded_sweep(const DpBenchOptions& o, const DpLlamaSpec& spec,
                                                     torch::Device dev) {
  MEMFL_ASSIGN_OR_RETURN(auto env, sharded::rendezvous_from_env());
  sharded::Rendezvous where;
  if (env) {
    where = *env;
  } else if (o.gpus > 1) {
    return failed_precondition(
        "bench dp --gpus {}: no rank in the environment; run it as `memfl bench dp --gpus {} …` (which starts the "
        "ranks), or under mpirun/torchrun",
        o.gpus, o.gpus);
  } else {
    where.port = 29500 + static_cast<int>(::getpid() % 20000);
  }
  if (where.world_size != o.gpus) {
    return invalid_argument("bench dp: --gpus {} but the environment says world size {}", o.gpus, where.world_size);
  }
  if (o.optimizer != "sgd" && o.optimizer != "adam") {
    return invalid_argument("bench dp: --optimizer '{}' (sgd, adam)", o.optimizer);
  }
  if (o.dtype != "float32" && o.dtype != "bfloat16") {
    return invalid_argument("bench dp: --dtype '{}' (float32, bfloat16)", o.dtype);
  }
  if (dev.is_cuda()) {
    if (where.local_rank >= static_cast<int>(torch::cuda::device_count())) {
      return failed_precondition("bench dp: rank {} wants cuda:{} but libtorch sees {} device(s)", where.rank,
                                 where.local_rank, torch::cuda::device_count());
    }
    dev = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(where.local_rank));
  }
  std::optional<c10::DeviceGuard> on_device;
  if (dev.is_cuda()) on_device.emplace(dev);
  MEMFL_ASSIGN_OR_RETURN(auto group, sharded::ShardGroup::create(where, dev));
  // The unmeasured first pass per mode, as in the unsharded sweep.
  DpBenchOptions once = o;
  once.warmup = 0;
  once.iters = 1;
  for (const auto& mode : o.modes) {
    Measured m;
    measure_sharded(once, presets().front(), mode, 16, dev, group.get(), m);
    if (!m.error.empty() && !is_oom(m.error)) {
      return internal_error("bench dp: {} failed on the warm-up model: {}", mode, m.error);
    }
  }
  std::vector<std::string> records;
  for (int seq : o.seq_lengths) {
    for (const auto& mode : o.modes) {
      Measured m;
      const RankFigures worst = measure_sharded(o, spec, mode, seq, dev, group.get(), m);
      if (!m.error.empty() && !is_oom(m.error) && m.error != "another rank failed") {
        return internal_error("bench dp: {} at seq {} on rank {} failed: {}", mode, seq, where.rank, m.error);
      }
      if (where.rank != 0) continue;
      json r = make_record(o, spec, mode, seq, dev, m);
      r["gpus"] = o.gpus;
      r["sharded"] = true;
      r["peak_memory_is"] = "the largest of the ranks' peaks";
      if (m.error.empty()) r["resident_between_steps_bytes"] = static_cast<int64_t>(worst.resident);
      r["config"]["dtype"] = o.dtype;
      r["config"]["optimizer"] =
          o.optimizer == "adam" ? fmt::format("Adam(lr={})", kLearningRate) : fmt::format("SGD(lr={})", kLearningRate);
      r["config"]["backend"] = group->backend();
      r["config"]["sharding"] =
          "per unit (embedding, each decoder block, head): all-gather before forward and "
          "backward, free after; gradients reduce-scattered";
      records.push_back(r.dump());
    }
  }
  return records;
}
}  // namespace

StatusOr<std::vector<std::string>> run_dp_bench(const DpBenchOptions& o) {
  const DpLlamaSpec* spec = nullptr;
  std::string names;
  for (const auto& p : presets()) {
    if (p.name == o.model) spec = &p;
    names += (names.empty() ? "" : ", ") + p.name;
  }
  if (spec == nullptr) return invalid_argument("bench dp: unknown model '{}' (presets: {})", o.model, names);
  for (const auto& m : o.modes) {
    if (m != "no_dp" && !dp::parse_clip_mode(m)) {
      return invalid_argument("bench dp: unknown mode '{}' (no_dp, naive, ghost, fused)", m);
    }
  }
  if (o.modes.empty() || o.seq_lengths.empty()) return invalid_argument("bench dp: no modes or no sequence lengths");
  for (int t : o.seq_lengths) {
    if (t < 1) return invalid_argument("bench dp: sequence length {} must be positive", t);
  }
  if (o.batch_size < 1 || o.iters < 1 || o.warmup < 0) {
    return invalid_argument("bench dp: batch {} and iters {} must be >= 1, warmup {} >= 0", o.batch_size, o.iters,
                            o.warmup);
  }
  torch::Device dev(torch::kCPU);
  try {
    dev = torch::Device(o.device);
  } catch (const std::exception&) {
    return invalid_argument("bench dp: unknown device '{}' (cpu | cuda | cuda:N)", o.device);
  }
  if (dev.is_cuda()) {
    if (!torch::cuda::is_available()) {
      return failed_precondition("bench dp: device {} was asked for but libtorch sees no CUDA device", o.device);
    }
    if (dev.has_index() && dev.index() >= static_cast<int64_t>(torch::cuda::device_count())) {
      return invalid_argument("bench dp: device {}: libtorch sees {} CUDA device(s)", o.device,
                              torch::cuda::device_count());
    }
  } else if (!dev.is_cpu()) {
    return invalid_argument("bench dp: device '{}' is neither cpu nor cuda", o.device);
  }
  if (o.gpus > 1 || o.sharded) return run_sharded_sweep(o, *spec, dev);
  if (o.dtype != "float32" || o.optimizer != "sgd") {
    return invalid_argument("bench dp: --dtype {} and --optimizer {} need --sharded (the unsharded sweep is fp32 SGD)",
                            o.dtype, o.optimizer);
  }
  std::optional<c10::DeviceGuard> on_device;
  if (dev.is_cuda()) on_device.emplace(dev);

  // One unmeasured pass per mode on the tiny preset first, so libtorch's
  // one-time set-up (thread pools, kernel and cuBLAS initialisation, lazily
  // allocated buffers) is not charged to whichever run comes first.
  DpBenchOptions once = o;
  once.warmup = 0;
  once.iters = 1;
  for (const auto& mode : o.modes) {
    Measured m = measure(once, presets().front(), mode, 16, dev);
    if (!m.error.empty() && !is_oom(m.error)) {
      return internal_error("bench dp: {} failed on the warm-up model: {}", mode, m.error);
    }
  }

  std::vector<std::string> records;
  for (int seq : o.seq_lengths) {
    for (const auto& mode : o.modes) {
      Measured m = measure(o, *spec, mode, seq, dev);
      if (!m.error.empty() && !is_oom(m.error)) {
        return internal_error("bench dp: {} at seq {} failed: {}", mode, seq, m.error);
      }
      records.push_back(make_record(o, *spec, mode, seq, dev, m).dump());
    }
  }
  return records;
}

}  // namespace memfl::torch_internal
