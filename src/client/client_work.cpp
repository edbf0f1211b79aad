#include <cassert>
#include "client/client_work.h"

#include "aggregate/async_aggregator.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "aggregate/dp_fedavg.h"
#include "comm/transport.h"
#include "dp/rdp_accountant.h"
#include "io/input_file.h"
#include "io/run_dir.h"
#include "model/llama.h"
#include "model/lora.h"
#include "model/synthetic.h"
#include "tensor/safetensors.h"
#include "tensor/sharded_safetensors.h"

namespace memfl {

bool is_spec_only(const ExperimentConfig& cfg) {
  return cfg.model.model_name == "synthetic" ||
         ((is_llama_model(cfg.model.model_name) || !cfg.model.initial_model.empty()) &&
          cfg.train.trainer == "DummyTrainer");
}

Status fill_initial_model(const ModelConfig& model, const Layout& layout, Arena& arena, uint64_t seed) {
  if (model.lora.enabled) {
    // The adapters are the model that travels; the base (hf_checkpoint or
    // the seed's) is the trainer's, never the server's.
    if (!model.lora.init_adapters.empty()) return load_peft_adapter(model.lora, layout, arena);
    fill_initial_adapters(layout, arena, seed);
    return Status::Ok();
  }
  if (!model.hf_checkpoint.empty()) {
    // By Hugging Face's tensor names, every name, dtype and shape checked
    // before a byte is copied, one shard mapped at a time.
    MEMFL_ASSIGN_OR_RETURN(auto ckpt, ShardedCheckpoint::open(model.hf_checkpoint));
    Status loaded = ckpt.load_into(layout, arena);
    if (!loaded.ok()) return loaded.with_context("client_configs.model_configs.hf_checkpoint");
    return Status::Ok();
  }
  if (model.initial_model.empty()) {
    fill_synthetic(layout, arena, seed);
    return Status::Ok();
  }
  MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(model.initial_model));
  return file->load_into(layout, arena);
}

LocalModel LocalModel::from_arena(Layout layout, Arena arena) {
  LocalModel m;
  m.layout_ = std::move(layout);
  m.arena_ = std::move(arena);
  return m;
}

void LocalModel::replace_arena(Arena&& arena) {
  assert(!replica_ && arena.size() >= layout_.total_bytes());
  arena_ = std::move(arena);
}

StatusOr<Arena> make_model_arena(const ExperimentConfig& cfg, size_t bytes, const std::string& run_dir,
                                 MemoryCategory category) {
  if (cfg.memory.arena_backing == "file") {
    std::string dir = cfg.memory.scratch_dir;
    if (dir.empty()) dir = run_dir.empty() ? std::filesystem::temp_directory_path().string() : run_dir;
    return Arena::scratch_file(dir, bytes, category);
  }
  return Arena(bytes, category, /*populate=*/true);
}

StatusOr<LocalModel> make_local_model(const ExperimentConfig& cfg, const InputSpec& input, bool fill, uint64_t seed,
                                      const std::string& run_dir) {
  LocalModel m;
  if (is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(m.layout_, layout_without_network(cfg.model));
    MEMFL_ASSIGN_OR_RETURN(m.arena_, make_model_arena(cfg, m.layout_.total_bytes(), run_dir));
    if (fill) MEMFL_RETURN_IF_ERROR(fill_initial_model(cfg.model, m.layout_, m.arena_, seed));
    return m;
  }
  MEMFL_ASSIGN_OR_RETURN(TrainerBackend * backend, load_trainer_backend());
  const int threads = cfg.train.num_threads > 0 ? cfg.train.num_threads
                                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  backend->set_num_threads(threads);
  if (cfg.train.num_gpus > 1) {
    MEMFL_ASSIGN_OR_RETURN(m.replica_, backend->create_sharded_replica(cfg, input, seed));
    return m;
  }
  MEMFL_ASSIGN_OR_RETURN(m.replica_, backend->create_replica(cfg.model, input, cfg.train.device, seed));
  if (fill && cfg.model.lora.enabled) {
    // The initial adapters as a server without libtorch draws them, so the
    // simulator's global model is the gRPC and MPI servers' too.
    MEMFL_RETURN_IF_ERROR(fill_initial_model(cfg.model, m.replica_->layout(), m.replica_->arena(), seed));
  }
  if (!cfg.model.initial_model.empty()) {
    // The file and the network must be the same model, or the server's
    // broadcasts would not fit this client.
    MEMFL_ASSIGN_OR_RETURN(Layout from_file, layout_without_network(cfg.model));
    if (from_file.hash() != m.replica_->layout().hash()) {
      return invalid_argument(
          "client_configs.model_configs.initial_model: {} holds a model of {} tensors (layout {:016x}), not the "
          "network's {} tensors (layout {:016x})",
          cfg.model.initial_model, from_file.size(), from_file.hash(), m.replica_->layout().size(),
          m.replica_->layout().hash());
    }
  }
  return m;
}

uint64_t client_train_seed(uint64_t seed, int round, int client) {
  return seed * 1000003ULL + static_cast<uint64_t>(round) * 1009ULL + static_cast<uint64_t>(client);
}

StatusOr<TrainResult> local_update(LocalModel& model, const ExperimentConfig& cfg, const DatasetSplits* data,
                                   const ClientPartition* part, int round, int client) {
  if (cfg.train.trainer == "DummyTrainer" || model.replica() == nullptr) {
    MEMFL_RETURN_IF_ERROR(dummy_update(cfg, model.layout(), model.arena(), round, client));
    return TrainResult{};
  }
  if (data == nullptr || part == nullptr) return failed_precondition("VanillaTrainer needs a data set and a partition");
  // A loss that is not finite means weights that are not either: the client
  // says so and sends nothing (the server would refuse the values anyway).
  auto finite_loss = [&](StatusOr<TrainResult> r) -> StatusOr<TrainResult> {
    if (r.ok() && !std::isfinite(r->train_loss)) {
      return Status(StatusCode::kRejected,
                    fmt::format("round {}: {}'s local training produced a non-finite loss ({}); its update is not sent",
                                round, client_id(client), r->train_loss));
    }
    return r;
  };
  if (cfg.server.dp_fedavg_clip_norm <= 0) {
    return finite_loss(model.replica()->train(data->train, part->train, part->val, cfg.train,
                                              client_train_seed(cfg.server.seed, round, client)));
  }
  // Client-level DP-FedAvg: the update is clipped before it leaves, against
  // a copy of the global model the client received (one model, freed after).
  Arena received(model.layout().total_bytes(), MemoryCategory::kCommBuffers);
  std::memcpy(received.data(), model.arena().data(), model.layout().total_bytes());
  MEMFL_ASSIGN_OR_RETURN(TrainResult r, model.replica()->train(data->train, part->train, part->val, cfg.train,
                                                               client_train_seed(cfg.server.seed, round, client)));
  MEMFL_ASSIGN_OR_RETURN(r, finite_loss(std::move(r)));
  clip_update(model.layout(), received, model.arena(), cfg.server.dp_fedavg_clip_norm);
  return r;
}

StatusOr<double> record_client_privacy(const ExperimentConfig& cfg, const std::string& run_dir, int round, int client,
                                       int64_t total_steps, double sample_rate) {
  const auto& dp = cfg.train.dp;
  // dp.accountant names the accountant; RDP of the subsampled Gaussian is
  // the one there is (the config's schema refuses other names first).
  if (dp.accountant != "rdp") {
    return invalid_argument("client_configs.train_configs.dp.accountant: unknown accountant '{}'; known: rdp",
                            dp.accountant);
  }
  auto eps = rdp_epsilon(dp.noise_multiplier, sample_rate, total_steps, dp.delta);
  const double e = eps.ok() ? *eps : std::numeric_limits<double>::infinity();
  const std::string path = (std::filesystem::path(run_dir) / "privacy.csv").string();
  if (!std::filesystem::exists(path)) {
    MEMFL_RETURN_IF_ERROR(write_text_file(path, "round,client,dp_steps,sample_rate,delta,epsilon\n"));
  }
  MEMFL_RETURN_IF_ERROR(append_text_file(
      path, fmt::format("{},{},{},{:.6f},{},{:.6f}\n", round, client, total_steps, sample_rate, dp.delta, e)));
  return e;
}

namespace {

// dummy_update_noise_values: the file's f32 values, standardised (mean 0,
// σ 1). Read whole: it is a small model's update, a few MB.
StatusOr<std::vector<float>> standardised_values(const std::string& path) {
  const std::string key = "client_configs.train_configs.dummy_update_noise_values";
  constexpr uint64_t kMax = uint64_t{1} << 30;
  // A regular file only: an ifstream on a FIFO waits for a writer forever.
  MEMFL_ASSIGN_OR_RETURN(InputFile in, open_input_file(path, key, kMax));
  const uint64_t size = in.size();
  if (size == 0 || size % 4 != 0) {
    return invalid_argument(
        "{}: {} holds {} bytes; it must hold little-endian f32 values (a multiple of 4 bytes, "
        "at least one, at most 1 GiB)",
        key, path, size);
  }
  std::vector<float> v(static_cast<size_t>(size / 4));
  auto* dst = reinterpret_cast<char*>(v.data());
  for (uint64_t got = 0; got < size;) {
    const ssize_t n = ::read(in.fd(), dst + got, static_cast<size_t>(size - got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return internal_error("{}: reading {} failed (it shrank or cannot be read)", key, path);
    got += static_cast<uint64_t>(n);
  }
  double sum = 0, sq = 0;
  for (float x : v) {
    if (!std::isfinite(x)) return invalid_argument("{}: {} holds a value that is not finite", key, path);
    sum += x;
  }
  const double mean = sum / static_cast<double>(v.size());
  for (float x : v) sq += (x - mean) * (x - mean);
  const double sd = std::sqrt(sq / static_cast<double>(v.size()));
  if (!(sd > 0)) return invalid_argument("{}: {}'s values are all equal: no spread to draw noise from", key, path);
  for (float& x : v) x = static_cast<float>((x - mean) / sd);
  return v;
}

// The same, read once per process: every client of every round draws from
// it, and the simulator runs them all in one process.
StatusOr<std::shared_ptr<const std::vector<float>>> cached_standardised_values(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const std::vector<float>>> read;
  std::lock_guard lock(mu);
  if (auto it = read.find(path); it != read.end()) return it->second;
  MEMFL_ASSIGN_OR_RETURN(std::vector<float> v, standardised_values(path));
  auto shared = std::make_shared<const std::vector<float>>(std::move(v));
  read.emplace(path, shared);
  return shared;
}

}  // namespace

Status dummy_update(const ExperimentConfig& cfg, const Layout& layout, Arena& arena, int round, int client) {
  if (!cfg.train.dummy_delay_s.empty()) {
    auto delays = parse_delays(cfg.train.dummy_delay_s);
    if (delays.ok() && !delays->empty()) {
      std::this_thread::sleep_for(
          std::chrono::duration<double>((*delays)[static_cast<size_t>(client) % delays->size()]));
    }
  }
  const double s = cfg.train.dummy_update_scale;
  if (s <= 0) return Status::Ok();
  const double sigma = s * cfg.train.dummy_update_noise;
  std::shared_ptr<const std::vector<float>> file;
  if (sigma > 0 && !cfg.train.dummy_update_noise_values.empty()) {
    MEMFL_ASSIGN_OR_RETURN(file, cached_standardised_values(cfg.train.dummy_update_noise_values));
  }
  const std::vector<float> none;
  const std::vector<float>& values = file ? *file : none;
  // Gaussian noise from a counter (splitmix64 of round, client, tensor and
  // pair of elements, then Box–Muller): the same on every run and transport.
  auto splitmix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  // One Box–Muller pair gives elements 2k and 2k + 1 (cos, then sin).
  auto gaussian_pair = [&](uint64_t stream, size_t pair) {
    const uint64_t r = splitmix(stream ^ splitmix(pair));
    const double u1 = (static_cast<double>(r >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(splitmix(r) >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1)), angle = 2.0 * M_PI * u2;
    return std::pair{radius * std::cos(angle), radius * std::sin(angle)};
  };
  for (size_t t = 0; t < layout.size(); ++t) {
    const auto& e = layout.entries()[t];
    if (!dtype_is_float(e.dtype)) continue;
    std::byte* base = arena.data() + e.offset;
    const size_t n = e.numel();
    const uint64_t stream = splitmix((static_cast<uint64_t>(round) << 40) ^ (static_cast<uint64_t>(client) << 20) ^ t);
    std::pair<double, double> pair{0, 0};
    // Element i's change: the pattern, plus noise (a value of the file picked
    // by the counter — multiply-high maps it onto the file without a divide —
    // or the Gaussian pair's half).
    auto change = [&](size_t i) {
      float d = static_cast<float>(s * (client + 1) * (1 + (i + static_cast<size_t>(round)) % 5));
      if (sigma > 0) {
        double z;
        if (!values.empty()) {
          __extension__ using U128 = unsigned __int128;
          const U128 pick = static_cast<U128>(splitmix(stream ^ splitmix(i))) * values.size();
          z = values[static_cast<size_t>(pick >> 64)];
        } else {
          if (i % 2 == 0) pair = gaussian_pair(stream, i / 2);
          z = i % 2 == 0 ? pair.first : pair.second;
        }
        d += static_cast<float>(sigma * z);
      }
      return d;
    };
    // Elements in order (the Gaussian pair is made at its even element), the
    // dtype chosen once per tensor.
    switch (e.dtype) {
      case DType::kF32:
        for (size_t i = 0; i < n; ++i) {
          float v;
          std::memcpy(&v, base + 4 * i, 4);
          v += change(i);
          std::memcpy(base + 4 * i, &v, 4);
        }
        break;
      case DType::kBF16:
        for (size_t i = 0; i < n; ++i) {
          uint16_t v;
          std::memcpy(&v, base + 2 * i, 2);
          v = f32_to_bf16(bf16_to_f32(v) + change(i));
          std::memcpy(base + 2 * i, &v, 2);
        }
        break;
      case DType::kF16:
        for (size_t i = 0; i < n; ++i) {
          uint16_t v;
          std::memcpy(&v, base + 2 * i, 2);
          v = f32_to_f16(f16_to_f32(v) + change(i));
          std::memcpy(base + 2 * i, &v, 2);
        }
        break;
      default:
        break;
    }
  }
  return Status::Ok();
}

int64_t local_steps_taken(const TrainConfig& train, const ClientPartition* part, int64_t reported) {
  if (reported > 0) return reported;
  const int64_t n = part != nullptr ? static_cast<int64_t>(part->train.size()) : 0;
  const int64_t bs = std::max(1, train.train_batch_size);
  return train.mode == "step" || n == 0 ? train.num_local_steps : train.num_local_epochs * ((n + bs - 1) / bs);
}

void keep_base(const Layout& layout, Arena& base, const Arena& received) {
  if (base.empty()) base = Arena(layout.total_bytes(), MemoryCategory::kCommBuffers);
  std::memcpy(base.data(), received.data(), layout.total_bytes());
}

ExperimentConfig with_local_steps(const ExperimentConfig& cfg, int local_steps) {
  ExperimentConfig out = cfg;
  if (local_steps > 0) {
    out.train.mode = "step";
    out.train.num_local_steps = local_steps;
  }
  return out;
}

Status change_from_base(const Layout& layout, Arena& base, const Arena& trained) {
  // In place: each block of g is written where the x_base it came from was.
  return write_gradient(layout, base, trained, 64 * 1024, [&](size_t off, std::span<const std::byte> bytes) {
    std::memmove(base.data() + off, bytes.data(), bytes.size());
    return Status::Ok();
  });
}

double update_sample_count(const ExperimentConfig& cfg, const ClientPartition* part, int client) {
  if (cfg.train.trainer == "DummyTrainer" && cfg.train.dummy_update_scale > 0) return 5.0 * (client + 1);
  if (cfg.train.trainer == "DummyTrainer" || part == nullptr) return 1.0;
  return static_cast<double>(part->train.size());
}

}  // namespace memfl
