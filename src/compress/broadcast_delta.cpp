#include "compress/broadcast_delta.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "comm/chunk.h"
#include "comm/client_transport.h"

namespace memfl {

BroadcastDelta::BroadcastDelta(const Layout& layout, CompressionSettings settings, std::string dir, size_t chunk_bytes)
    : layout_(layout), settings_(std::move(settings)), dir_(std::move(dir)), chunk_(std::max<size_t>(1, chunk_bytes)) {
  // The server keeps no residual of its own: what the codec loses is left
  // out of the model every side holds (compress/broadcast_delta.h).
  settings_.error_feedback = false;
}

Status BroadcastDelta::prepare(int round, Arena& global) {
  const uint64_t total = layout_.total_bytes();
  if (global.size() < total)
    return internal_error("broadcast: the global arena holds {} of {} bytes", global.size(), total);
  if (reference_.empty()) {
    MEMFL_ASSIGN_OR_RETURN(reference_, Arena::scratch_file(dir_, total, MemoryCategory::kCommBuffers));
  }
  MEMFL_RETURN_IF_ERROR(frames_.open(dir_));
  stats_ = {};
  if (reference_round_ < 0 || round != reference_round_ + 1) {
    // Nothing the clients hold to code against: this model goes as its
    // bytes and becomes the reference.
    for (uint64_t off = 0; off < total; off += chunk_) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(chunk_, total - off));
      std::memcpy(reference_.data() + off, global.data() + off, len);
      reference_.release_pages(off, len);
    }
    reference_round_ = round;
    from_round_ = to_round_ = -1;
    return Status::Ok();
  }
  // The frames of the last prepare() are about to be overwritten.
  from_round_ = to_round_ = -1;
  ArenaPlace model(global);
  auto release = [this](uint64_t offset, size_t length) { reference_.release_pages(offset, length); };
  // The first coder works out each tensor's tolerance (REL reads the whole
  // change once); the others take them from it.
  std::vector<UpdateEncoder> coders;
  coders.reserve(4);
  coders.emplace_back(layout_, settings_);
  coders[0].set_base_done(release);
  MEMFL_RETURN_IF_ERROR(coders[0].begin(model, &reference_, nullptr));
  const uint64_t chunks = (total + chunk_ - 1) / chunk_;
  const uint64_t parts = std::min<uint64_t>({4, chunks, std::max<uint64_t>(1, std::thread::hardware_concurrency())});
  for (uint64_t p = 1; p < parts; ++p) {
    coders.emplace_back(layout_, settings_);
    coders[p].set_base_done(release);
    MEMFL_RETURN_IF_ERROR(coders[p].begin(model, &reference_, nullptr, coders[0].tolerances()));
  }
  frame_size_.assign(chunks, 0);
  const uint64_t slot = chunk_ + kMaxFrameOverhead;
  // Part p codes chunks [p·chunks/parts, (p+1)·chunks/parts): disjoint
  // ranges of the model, the reference and the file.
  auto code = [&](uint64_t p) -> Status {
    for (uint64_t i = p * chunks / parts; i < (p + 1) * chunks / parts; ++i) {
      const uint64_t off = i * chunk_;
      const size_t len = static_cast<size_t>(std::min<uint64_t>(chunk_, total - off));
      MEMFL_ASSIGN_OR_RETURN(std::span<const std::byte> frame, coders[p].encode(off, len));
      MEMFL_RETURN_IF_ERROR(frames_.write(i * slot, frame));
      frame_size_[i] = frame.size();
      // Every side now holds the rebuilt bytes: the server's model, the
      // reference for the next round, and each client that decodes the frame.
      const std::span<const std::byte> rebuilt = coders[p].rebuilt();
      std::memcpy(global.data() + off, rebuilt.data(), len);
      std::memcpy(reference_.data() + off, rebuilt.data(), len);
      reference_.release_pages(off, len);
    }
    return Status::Ok();
  };
  std::vector<Status> done(parts);
  std::vector<std::thread> threads;
  for (uint64_t p = 1; p < parts; ++p) threads.emplace_back([&, p] { done[p] = code(p); });
  done[0] = code(0);
  for (auto& t : threads) t.join();
  for (const Status& st : done) MEMFL_RETURN_IF_ERROR(st);
  stats_ = {};
  for (const auto& c : coders) {
    stats_.raw_bytes += c.stats().raw_bytes;
    stats_.frame_bytes += c.stats().frame_bytes;
    stats_.lossy_elements += c.stats().lossy_elements;
    stats_.zeroed_elements += c.stats().zeroed_elements;
  }
  if (const std::string w = zeroed_changes_warning(stats_, fmt::format("round {}: the broadcast", round)); !w.empty())
    spdlog::warn("{}", w);
  from_round_ = reference_round_;
  to_round_ = round;
  reference_round_ = round;
  spdlog::info("round {}: broadcast coded as its change since round {}: {:.4g} MB → {:.4g} MB", round, from_round_,
               static_cast<double>(stats_.raw_bytes) / 1e6, static_cast<double>(stats_.frame_bytes) / 1e6);
  return Status::Ok();
}

StatusOr<std::span<const std::byte>> BroadcastDelta::frame(uint64_t offset, std::vector<std::byte>* buffer) const {
  const uint64_t i = offset / chunk_;
  if (offset % chunk_ != 0 || i >= frame_size_.size() || to_round_ < 0) {
    return internal_error("broadcast: no frame for the chunk at model offset {}", offset);
  }
  buffer->resize(frame_size_[i]);
  MEMFL_RETURN_IF_ERROR(frames_.read(i * (chunk_ + kMaxFrameOverhead), *buffer));
  return std::span<const std::byte>(*buffer);
}

}  // namespace memfl
