#include "compress/broadcast_delta.h"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

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
  UpdateEncoder encoder(layout_, settings_);
  encoder.set_base_done([this](uint64_t offset, size_t length) { reference_.release_pages(offset, length); });
  MEMFL_RETURN_IF_ERROR(encoder.begin(model, &reference_, nullptr));
  frame_at_.assign(1, 0);
  for (uint64_t off = 0; off < total; off += chunk_) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(chunk_, total - off));
    MEMFL_ASSIGN_OR_RETURN(std::span<const std::byte> frame, encoder.encode(off, len));
    MEMFL_RETURN_IF_ERROR(frames_.write(frame_at_.back(), frame));
    frame_at_.push_back(frame_at_.back() + frame.size());
    // Every side now holds the rebuilt bytes: the server's model, the
    // reference for the next round, and each client that decodes the frame.
    const std::span<const std::byte> rebuilt = encoder.rebuilt();
    std::memcpy(global.data() + off, rebuilt.data(), len);
    std::memcpy(reference_.data() + off, rebuilt.data(), len);
    reference_.release_pages(off, len);
  }
  stats_ = encoder.stats();
  from_round_ = reference_round_;
  to_round_ = round;
  reference_round_ = round;
  spdlog::info("round {}: broadcast coded as its change since round {}: {:.4g} MB → {:.4g} MB", round, from_round_,
               static_cast<double>(stats_.raw_bytes) / 1e6, static_cast<double>(stats_.frame_bytes) / 1e6);
  return Status::Ok();
}

StatusOr<std::span<const std::byte>> BroadcastDelta::frame(uint64_t offset, std::vector<std::byte>* buffer) const {
  const uint64_t i = offset / chunk_;
  if (offset % chunk_ != 0 || i + 1 >= frame_at_.size() || to_round_ < 0) {
    return internal_error("broadcast: no frame for the chunk at model offset {}", offset);
  }
  const uint64_t at = frame_at_[i];
  buffer->resize(frame_at_[i + 1] - at);
  MEMFL_RETURN_IF_ERROR(frames_.read(at, *buffer));
  return std::span<const std::byte>(*buffer);
}

}  // namespace memfl
