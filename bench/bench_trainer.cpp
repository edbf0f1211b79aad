// memfl's trainer against a bare libtorch loop written
// for the comparison, side by side in one process: the same model (built by
// the plugin's registry, the same seed), the same data, batch, optimizer and
// threads, alternated REPS times. One JSON line per (model, run):
// images/s (min, median, max over the runs) and the page faults
// (ru_minflt) each took, so a malloc regression shows.
//
//   build/memfl_bench_trainer [REPS] [THREADS] [MODELS]
//
// MODELS: a comma-separated subset of CNN, ResNet18, llama-tiny (all three
// unless given), for many short pairs of one model.
//
// The pairs run in ABBA order (bare first in even pairs, memfl first in odd
// ones), so a machine that speeds up or slows down during the run favours
// neither. Each run also counts the process's CPU time (ru_utime + ru_stime,
// every thread), so a run whose threads sat idle would show beside one that
// was slow on busy cores (on the 2-core VM it stayed at 2 × wall: libtorch's
// OpenMP threads spin).
//
// Both loops run under the malloc policy of memfl's training roles
// (memory/malloc_policy.h: the heap is kept between batches);
// MEMFL_MALLOC_POLICY=glibc runs them under glibc's defaults instead, for
// the A/B. The JSON says which ("malloc_policy").
//
// The bare loop: batches built from the uint8 samples (normalised as memfl
// does), forward, mean cross-entropy, backward, optimizer step. memfl's:
// ModelReplica::train on the same indices (step mode) — what a client does
// in a round, fresh optimizer included. Both visit them in the same shuffled
// order (the bare loop in index order with MEMFL_BENCH_BARE_ORDER=sequential;
// the JSON's "bare_order" says which).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "client/client_work.h"
#include "config/config.h"
#include "memory/malloc_policy.h"
#include "model/llama.h"
#include "train/torch_models.h"
#include "train/trainer_backend.h"

namespace {

using memfl::ExperimentConfig;
using memfl::ImageDataset;

struct Case {
  std::string name, config;
  std::vector<std::string> sets;
};

int64_t minflt() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

void batch_of(const ImageDataset& d, const std::vector<uint32_t>& idx, size_t b, size_t n, bool tokens,
              torch::Tensor& x, torch::Tensor& y) {
  const size_t sb = d.sample_bytes();
  if (tokens) {
    auto all = torch::empty({static_cast<int64_t>(n), static_cast<int64_t>(sb)}, torch::kInt64);
    auto* p = all.data_ptr<int64_t>();
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* s = d.sample(idx[b + i]);
      for (size_t j = 0; j < sb; ++j) p[i * sb + j] = s[j];
    }
    x = all.narrow(1, 0, static_cast<int64_t>(sb) - 1).contiguous();
    y = all.narrow(1, 1, static_cast<int64_t>(sb) - 1).contiguous();
    return;
  }
  x = torch::empty({static_cast<int64_t>(n), d.channels, d.height, d.width}, torch::kFloat32);
  y = torch::empty({static_cast<int64_t>(n)}, torch::kInt64);
  float* xp = x.data_ptr<float>();
  const float scale = 1.0f / (255.0f * d.std), shift = d.mean / d.std;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* s = d.sample(idx[b + i]);
    for (size_t j = 0; j < sb; ++j) xp[i * sb + j] = static_cast<float>(s[j]) * scale - shift;
    y[static_cast<int64_t>(i)] = static_cast<int64_t>(d.labels[idx[b + i]]);
  }
}

std::unique_ptr<torch::optim::Optimizer> optimizer(const memfl::OptimConfig& o, std::vector<torch::Tensor> ps) {
  if (o.optim == "Adam") {
    return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}));
  }
  return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(o.lr).momentum(o.momentum));
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::string src = MEMFL_SOURCE_DIR;
  const char* bare_order = std::getenv("MEMFL_BENCH_BARE_ORDER");
  const bool bare_in_order = bare_order != nullptr && std::string(bare_order) == "sequential";
  if (bare_order != nullptr && !bare_in_order) {
    fmt::print(stderr, "MEMFL_BENCH_BARE_ORDER is '{}': the one value it takes is sequential\n", bare_order);
    return 2;
  }
  if (auto st = memfl::check_malloc_policy_env(); !st.ok()) {
    fmt::print(stderr, "{}\n", st.to_string());
    return 2;
  }
  memfl::tune_malloc_for_training();
  const std::vector<Case> cases = {
      {"CNN", src + "/configs/fedavg_fmnist_cnn.yaml", {"client_configs.train_configs.num_local_steps=100"}},
      {"ResNet18",
       src + "/configs/resnet18_synthetic_profile.yaml",
       {"client_configs.train_configs.num_local_steps=8"}},
      {"llama-tiny", src + "/configs/llama_tiny_tokens.yaml", {"client_configs.train_configs.num_local_steps=100"}},
  };
  auto backend = memfl::load_trainer_backend();
  if (!backend.ok()) {
    fmt::print(stderr, "{}\n", backend.status().to_string());
    return 1;
  }
  (*backend)->set_num_threads(threads);
  const std::string only = argc > 3 ? "," + std::string(argv[3]) + "," : "";
  auto picked = [&only](const Case& c) { return only.empty() || only.find("," + c.name + ",") != std::string::npos; };
  if (std::none_of(cases.begin(), cases.end(), picked)) {
    fmt::print(stderr, "MODELS '{}' names none of CNN, ResNet18, llama-tiny\n", argv[3]);
    return 2;
  }
  for (const auto& c : cases) {
    if (!picked(c)) continue;
    std::vector<std::string> sets = c.sets;
    sets.push_back("client_configs.train_configs.mode=step");
    sets.push_back("client_configs.train_configs.do_validation=false");
    auto cfg = memfl::load_config_file(c.config, sets);
    if (!cfg.ok()) {
      fmt::print(stderr, "{}\n", cfg.status().to_string());
      return 1;
    }
    auto data = memfl::load_data(*cfg);
    if (!data.ok()) {
      fmt::print(stderr, "{}\n", data.status().to_string());
      return 1;
    }
    auto input = memfl::input_spec(*cfg, data->train);
    const memfl::TrainConfig& tc = cfg->train;
    const size_t bs = static_cast<size_t>(tc.train_batch_size);
    const size_t steps = static_cast<size_t>(tc.num_local_steps);
    std::vector<uint32_t> idx(std::min(data->train.size(), bs * steps));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<uint32_t>(i);
    const bool tokens = memfl::is_llama_model(cfg->model.model_name);
    auto replica = (*backend)->create_replica(cfg->model, *input, "cpu", 1);
    auto bare = memfl::torch_internal::make_model(cfg->model, *input);
    if (!replica.ok() || !bare.ok()) {
      fmt::print(stderr, "{}\n", (!replica.ok() ? replica.status() : bare.status()).to_string());
      return 1;
    }
    (*bare)->train();
    std::vector<double> bare_ips, memfl_ips, bare_cpu, memfl_cpu;
    std::vector<int64_t> bare_flt, memfl_flt;
    const double images = static_cast<double>(steps * bs);
    for (int r = 0; r < reps; ++r) {
      const uint64_t seed = 7 + static_cast<uint64_t>(r);
      auto run_bare = [&] {
        const int64_t f0 = minflt();
        const double c0 = cpu_seconds();
        const auto t0 = std::chrono::steady_clock::now();
        auto opt = optimizer(tc.optim, (*bare)->parameters());
        // The samples in a shuffled order when the config shuffles, with
        // the seed memfl's run gets, as a user's loop over a shuffling data
        // loader would: both loops then train on the same batches. Read in
        // order (MEMFL_BENCH_BARE_ORDER=sequential, as this loop did before)
        // the bare loop was up to ≈ 1 % faster on the CNN: it was measuring
        // a cheaper loop (docs/BENCHMARKS.md).
        std::vector<uint32_t> order = idx;
        if (tc.train_data_shuffle && !bare_in_order) {
          std::mt19937_64 rng(seed);
          std::shuffle(order.begin(), order.end(), rng);
        }
        torch::Tensor x, y;
        for (size_t b = 0; b + bs <= order.size(); b += bs) {
          batch_of(data->train, order, b, bs, tokens, x, y);
          opt->zero_grad();
          auto logits = (*bare)->forward(x);
          auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
          loss.backward();
          opt->step();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bare_ips.push_back(images / s);
        bare_cpu.push_back(images / (cpu_seconds() - c0));
        bare_flt.push_back(minflt() - f0);
      };
      auto run_memfl = [&]() -> bool {
        const int64_t f0 = minflt();
        const double c0 = cpu_seconds();
        const auto t0 = std::chrono::steady_clock::now();
        auto res = (*replica)->train(data->train, idx, {}, tc, seed);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!res.ok()) {
          fmt::print(stderr, "{}\n", res.status().to_string());
          return false;
        }
        memfl_ips.push_back(images / s);
        memfl_cpu.push_back(images / (cpu_seconds() - c0));
        memfl_flt.push_back(minflt() - f0);
        return true;
      };
      if (r % 2 == 0) {
        run_bare();
        if (!run_memfl()) return 1;
      } else {
        if (!run_memfl()) return 1;
        run_bare();
      }
    }
    auto spread = [](std::vector<double> v, int digits) {
      std::sort(v.begin(), v.end());
      return fmt::format("{{\"min\": {:.{}f}, \"median\": {:.{}f}, \"max\": {:.{}f}}}", v.front(), digits,
                         v[v.size() / 2], digits, v.back(), digits);
    };
    auto stats = [&spread](const std::vector<double>& v) { return spread(v, 1); };
    auto median_flt = [](std::vector<int64_t> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    // Per pair, memfl's rate over the bare loop's; min, median, max of them.
    auto ratios = [reps, &spread](const std::vector<double>& m, const std::vector<double>& b) {
      std::vector<double> q;
      for (int r = 0; r < reps; ++r) q.push_back(m[static_cast<size_t>(r)] / b[static_cast<size_t>(r)]);
      return spread(std::move(q), 3);
    };
    fmt::print(
        "{{\"model\": \"{}\", \"batch\": {}, \"steps\": {}, \"threads\": {}, \"reps\": {}, \"order\": \"ABBA\", "
        "\"optimizer\": \"{}\", \"bare_images_per_s\": {}, \"memfl_images_per_s\": {}, \"memfl_over_bare\": {}, "
        "\"bare_images_per_cpu_s\": {}, \"memfl_images_per_cpu_s\": {}, \"memfl_over_bare_cpu\": {}, "
        "\"bare_minflt_median\": {}, \"memfl_minflt_median\": {}, \"malloc_policy\": \"{}\", \"bare_order\": "
        "\"{}\"}}\n",
        c.name, bs, steps, threads, reps, tc.optim.optim, stats(bare_ips), stats(memfl_ips),
        ratios(memfl_ips, bare_ips), stats(bare_cpu), stats(memfl_cpu), ratios(memfl_cpu, bare_cpu),
        median_flt(bare_flt), median_flt(memfl_flt), memfl::malloc_policy(),
        bare_in_order || !tc.train_data_shuffle ? "sequential" : "shuffled");
    std::fflush(stdout);
  }
  return 0;
}
