#include "aggregate/server_optimizer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/chunk.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

void server_opt_step(ServerOptKind kind, const ServerOptParams& p, float* x, const float* prev, float* m, float* v,
                     size_t n) {
  const float lr = static_cast<float>(p.lr), b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2),
              tau = static_cast<float>(p.tau);
  for (size_t i = 0; i < n; ++i) {
    const float delta = x[i] - prev[i];
    if (kind == ServerOptKind::kAvgM) {
      m[i] = b1 * m[i] + delta;
      x[i] = prev[i] + lr * m[i];
      continue;
    }
    m[i] = b1 * m[i] + (1 - b1) * delta;
    const float d2 = delta * delta;
    switch (kind) {
      case ServerOptKind::kAdagrad:
        v[i] += d2;
        break;
      case ServerOptKind::kAdam:
        v[i] = b2 * v[i] + (1 - b2) * d2;
        break;
      case ServerOptKind::kYogi: {
        const float s = v[i] > d2 ? 1.0f : (v[i] < d2 ? -1.0f : 0.0f);
        v[i] = v[i] - (1 - b2) * d2 * s;
        break;
      }
      case ServerOptKind::kAvgM:
        break;
    }
    x[i] = prev[i] + lr * m[i] / (std::sqrt(v[i]) + tau);
  }
}

ServerOptAggregator::ServerOptAggregator(std::string name, ServerOptKind kind, ServerOptParams params,
                                         std::unique_ptr<Aggregator> inner, const Layout& layout, Arena m, Arena v,
                                         std::string previous_model)
    : name_(std::move(name)),
      kind_(kind),
      params_(params),
      inner_(std::move(inner)),
      layout_(layout),
      m_(std::move(m)),
      v_(std::move(v)),
      previous_model_(std::move(previous_model)) {}

size_t ServerOptAggregator::state_bytes() const {
  // File-backed moments are page cache, not the server's memory.
  size_t own = 0;
  if (!m_.file_backed()) own += m_.size();
  if (!v_.file_backed()) own += v_.size();
  return inner_->state_bytes() + own;
}

Status ServerOptAggregator::finalize(Arena& global) {
  MEMFL_RETURN_IF_ERROR(inner_->finalize(global));  // global = weighted mean x̄
  MEMFL_ASSIGN_OR_RETURN(auto prev, SafetensorsFile::open(previous_model_));
  // The pre-round model streams from the file's pages a block at a time
  // (copied: a tensor's bytes in the file need not be 4-byte aligned).
  constexpr size_t kBlock = size_t{1} << 16;
  std::vector<float> block(kBlock);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (const auto& e : layout_.entries()) {
    if (e.dtype != DType::kF32) continue;
    const SafetensorsTensor* t = prev->find(e.name);
    if (t == nullptr || t->data.size() != e.numel() * sizeof(float)) {
      return data_loss("{}: the pre-round model has no f32 tensor '{}' of {} elements", previous_model_, e.name,
                       e.numel());
    }
    auto* x = reinterpret_cast<float*>(global.data() + e.offset);
    auto* m = reinterpret_cast<float*>(m_.data() + e.offset);
    float* v = v_.size() > 0 ? reinterpret_cast<float*>(v_.data() + e.offset) : nullptr;
    for (size_t i = 0; i < e.numel(); i += kBlock) {
      const size_t n = std::min(kBlock, e.numel() - i);
      const std::byte* src = t->data.data() + i * sizeof(float);
      std::memcpy(block.data(), src, n * sizeof(float));
      server_opt_step(kind_, params_, x + i, block.data(), m + i, v != nullptr ? v + i : nullptr, n);
      // The file's pages leave this process once read (they stay in the
      // page cache): the mapping would otherwise add a model to the RSS.
      const auto lo = reinterpret_cast<uintptr_t>(src) & ~(page - 1);
      const auto hi = (reinterpret_cast<uintptr_t>(src) + n * sizeof(float)) & ~(page - 1);
      if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    }
  }
  return Status::Ok();
}

namespace {

std::string state_file(int round) { return fmt::format("aggregator-round-{:06d}.bin", round); }

// xxh3 of m and of v, as the commit checksums the model.
std::string moments_checksum(const Arena& m, const Arena& v) {
  return fmt::format("{:016x}{:016x}", chunk_checksum(m.bytes()), chunk_checksum(v.bytes()));
}

}  // namespace

Status ServerOptAggregator::save_state(const std::string& state_dir, int round, std::string* record) {
  std::error_code made;
  fs::create_directories(state_dir, made);
  const std::string name = state_file(round);
  const std::string path = (fs::path(state_dir) / name).string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return internal_error("{}: cannot write the server optimizer's state: {}", path, std::strerror(errno));
  for (const Arena* a : {&m_, &v_}) {
    for (size_t off = 0; off < a->size();) {
      const ssize_t w = ::write(fd, a->data() + off, a->size() - off);
      if (w <= 0) {
        ::close(fd);
        return internal_error("{}: write failed: {}", path, std::strerror(errno));
      }
      off += static_cast<size_t>(w);
    }
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) return internal_error("{}: fsync failed: {}", path, std::strerror(errno));
  nlohmann::json j;
  j["file"] = name;
  j["bytes"] = m_.size() + v_.size();
  j["checksum"] = moments_checksum(m_, v_);
  *record = j.dump();
  // Older rounds' files are dropped by the commit (server/server_state.cpp),
  // which knows which commits server_configs.checkpoint_keep keeps.
  return Status::Ok();
}

Status ServerOptAggregator::load_state(const std::string& state_dir, const std::string& record) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(record);
  } catch (const std::exception& e) {
    return data_loss("{}: the committed state's aggregator record is not JSON: {}", state_dir, e.what());
  }
  if (!j.contains("file") || !j.contains("bytes") || !j.contains("checksum")) {
    return data_loss("{}: the committed state has no {} moments (was the run started with another aggregator?)",
                     state_dir, name_);
  }
  const fs::path path = fs::path(state_dir) / j["file"].get<std::string>();
  if (j["file"].get<std::string>().find('/') != std::string::npos)
    return data_loss("{}: bad state file name", path.string());
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec || size != m_.size() + v_.size() || j["bytes"].get<uint64_t>() != size) {
    return data_loss("{}: {} bytes, expected {} (the server optimizer's moments)", path.string(), ec ? 0 : size,
                     m_.size() + v_.size());
  }
  std::ifstream in(path, std::ios::binary);
  for (Arena* a : {&m_, &v_}) in.read(reinterpret_cast<char*>(a->data()), static_cast<std::streamsize>(a->size()));
  if (!in) return data_loss("{}: short read", path.string());
  const std::string sum = moments_checksum(m_, v_);
  if (sum != j["checksum"].get<std::string>()) {
    return data_loss("{}: checksum {} does not match the commit's {}", path.string(), sum,
                     j["checksum"].get<std::string>());
  }
  return Status::Ok();
}

}  // namespace memfl
