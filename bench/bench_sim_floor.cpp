// the floor under the in-process simulator — the same
// images trained and evaluated by bare libtorch loops, with no FL around
// them. For the default experiment (Fashion-MNIST CNN, batch 64, SGD with
// momentum, one local epoch, each client validating on its val split, the
// server evaluating the global model on the test set every round) it trains
// and evaluates exactly what `memfl run` would for ROUNDS rounds of
// CLIENTS_PER_ROUND clients, on WORKERS threads with THREADS intra-op
// threads: each worker a bare model of its own, taking the round's clients
// from a shared counter, then all of them evaluating the test set in equal
// parts. Prints one JSON line: the wall seconds (data loading excluded) and
// the images each part saw.
//
//   build/memfl_bench_sim_floor [ROUNDS] [CLIENTS_PER_ROUND] [WORKERS] [THREADS] [NUM_CLIENTS] [SERVER_EVAL 0|1]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "client/client_work.h"
#include "config/config.h"
#include "train/torch_models.h"
#include "train/trainer_backend.h"

namespace {

using memfl::ImageDataset;

// A batch of samples idx[b, b + n), normalised as memfl does.
void batch_of(const ImageDataset& d, const std::vector<uint32_t>& idx, size_t b, size_t n, torch::Tensor& x,
              torch::Tensor& y) {
  const size_t sb = d.sample_bytes();
  x = torch::empty({static_cast<int64_t>(n), d.channels, d.height, d.width}, torch::kFloat32);
  y = torch::empty({static_cast<int64_t>(n)}, torch::kInt64);
  float* xp = x.data_ptr<float>();
  int64_t* yp = y.data_ptr<int64_t>();
  const float scale = 1.0f / (255.0f * d.std), shift = d.mean / d.std;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* s = d.sample(idx[b + i]);
    for (size_t j = 0; j < sb; ++j) xp[i * sb + j] = static_cast<float>(s[j]) * scale - shift;
    yp[i] = static_cast<int64_t>(d.labels[idx[b + i]]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 100;
  const int per_round = argc > 2 ? std::atoi(argv[2]) : 10;
  const int workers = argc > 3 ? std::atoi(argv[3]) : 2;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 1;
  const int num_clients = argc > 5 ? std::atoi(argv[5]) : 100;
  const bool server_eval = argc > 6 ? std::atoi(argv[6]) != 0 : true;  // server_configs.do_server_eval
  if (rounds < 1 || per_round < 1 || workers < 1 || threads < 1 || num_clients < per_round) {
    fmt::print(stderr,
               "memfl_bench_sim_floor: ROUNDS {}, CLIENTS_PER_ROUND {}, WORKERS {}, THREADS {} must be >= 1 and "
               "NUM_CLIENTS {} >= CLIENTS_PER_ROUND\n",
               rounds, per_round, workers, threads, num_clients);
    return 2;
  }
  auto cfg = memfl::load_config_file(std::string(MEMFL_SOURCE_DIR) + "/configs/fedavg_fmnist_cnn.yaml",
                                     {"server_configs.num_clients=" + std::to_string(num_clients)});
  if (!cfg.ok()) {
    fmt::print(stderr, "{}\n", cfg.status().to_string());
    return 1;
  }
  auto backend = memfl::load_trainer_backend();
  auto data = memfl::load_data(*cfg);
  if (!backend.ok() || !data.ok()) {
    fmt::print(stderr, "{}\n", (!backend.ok() ? backend.status() : data.status()).to_string());
    return 1;
  }
  (*backend)->set_num_threads(threads);
  auto input = memfl::input_spec(*cfg, data->train);
  auto parts = memfl::make_partitions(*cfg, data->train);
  if (!input.ok() || !parts.ok()) {
    fmt::print(stderr, "{}\n", (!input.ok() ? input.status() : parts.status()).to_string());
    return 1;
  }
  const memfl::TrainConfig& tc = cfg->train;
  const auto bs = static_cast<size_t>(tc.train_batch_size);
  const auto vbs = static_cast<size_t>(tc.val_batch_size);
  const auto ebs = static_cast<size_t>(cfg->server.eval_batch_size);
  std::vector<std::shared_ptr<memfl::torch_internal::Net>> nets;
  for (int w = 0; w < workers; ++w) {
    torch::manual_seed(42);
    auto net = memfl::torch_internal::make_model(cfg->model, *input);
    if (!net.ok()) {
      fmt::print(stderr, "{}\n", net.status().to_string());
      return 1;
    }
    nets.push_back(std::move(*net));
  }
  std::vector<uint32_t> test_idx(data->test.size());
  for (size_t i = 0; i < test_idx.size(); ++i) test_idx[i] = static_cast<uint32_t>(i);
  std::atomic<int64_t> trained{0}, validated{0}, evaluated{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
    std::atomic<int> next{0};
    std::vector<std::thread> pool;
    for (int w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        auto& net = *nets[static_cast<size_t>(w)];
        torch::Tensor x, y;
        for (int k = next++; k < per_round; k = next++) {
          const auto& part = (*parts)[static_cast<size_t>((r * per_round + k) % num_clients)];
          net.train();
          torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(tc.optim.lr).momentum(tc.optim.momentum));
          for (size_t b = 0; b < part.train.size(); b += bs) {
            const size_t n = std::min(bs, part.train.size() - b);
            batch_of(data->train, part.train, b, n, x, y);
            opt.zero_grad();
            torch::nn::functional::cross_entropy(net.forward(x), y).backward();
            opt.step();
          }
          trained += static_cast<int64_t>(part.train.size());
          torch::NoGradGuard no_grad;
          net.eval();
          for (size_t b = 0; b < part.val.size(); b += vbs) {
            const size_t n = std::min(vbs, part.val.size() - b);
            batch_of(data->train, part.val, b, n, x, y);
            auto logits = net.forward(x);  // loss and accuracy, as an evaluation reports them
            (void)torch::nn::functional::cross_entropy(
                logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                .item<double>();
            (void)logits.argmax(1).eq(y).sum().item<int64_t>();
          }
          validated += static_cast<int64_t>(part.val.size());
        }
      });
    }
    for (auto& t : pool) t.join();
    if (!server_eval) continue;
    // The server's evaluation of the new global model, the test set in equal parts.
    pool.clear();
    for (int w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        auto& net = *nets[static_cast<size_t>(w)];
        torch::NoGradGuard no_grad;
        net.eval();
        torch::Tensor x, y;
        const size_t lo = test_idx.size() * static_cast<size_t>(w) / static_cast<size_t>(workers);
        const size_t hi = test_idx.size() * static_cast<size_t>(w + 1) / static_cast<size_t>(workers);
        for (size_t b = lo; b < hi; b += ebs) {
          const size_t n = std::min(ebs, hi - b);
          batch_of(data->test, test_idx, b, n, x, y);
          auto logits = net.forward(x);
          (void)torch::nn::functional::cross_entropy(
              logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
              .item<double>();
          (void)logits.argmax(1).eq(y).sum().item<int64_t>();
        }
        evaluated += static_cast<int64_t>(hi - lo);
      });
    }
    for (auto& t : pool) t.join();
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(
      "{{\"floor\": \"bare libtorch\", \"rounds\": {}, \"clients_per_round\": {}, \"workers\": {}, "
      "\"intra_op_threads\": {}, \"trained_images\": {}, \"validated_images\": {}, \"evaluated_images\": {}, "
      "\"wall_seconds\": {:.3f}}}\n",
      rounds, per_round, workers, threads, trained.load(), validated.load(), evaluated.load(), wall);
  return 0;
}
