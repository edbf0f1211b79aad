// The client's side of compression: turns an update into frames
// (compress/frame.h) one chunk at a time, as a transport asks for them.
//
// Lossy tensors (CompressionSettings::lossy_tensor) travel as their change
// d = f32(model) − f32(base) (+ the residual, with error feedback), coded
// within each tensor's tolerance; everything else travels as its bytes,
// through the lossless stage. With error feedback the residual becomes what
// the server will not have: r ← f32(base) + d − f32(rebuilt), element by
// element, as each chunk is encoded.
//
// bf16/f16 tensors are widened to f32 per chunk, coded in f32 (the bound
// holds on the f32 change), and the receiver rounds base + d̃ back to the
// tensor's dtype: half a unit in the last place of bf16/f16 on top of the
// bound, the rounding every 16-bit update takes.
//
//   EncodingPlace framed(std::make_unique<ArenaPlace>(model), layout, settings);
//   MEMFL_RETURN_IF_ERROR(framed.begin(&base, residual));   // REL: each tensor's tolerance
//   MEMFL_RETURN_IF_ERROR(transport.send(meta, framed));   // frame(offset, length) per chunk
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/client_transport.h"
#include "compress/frame.h"
#include "compress/settings.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// Bytes of one update, for the log and metrics.
struct EncodedStats {
  uint64_t raw_bytes = 0, frame_bytes = 0;
  uint64_t lossy_elements = 0;  // elements that went through a lossy codec
  // Of those, the ones whose change was not zero and arrives as zero: all of
  // them when an ABS error_bound is larger than every change.
  uint64_t zeroed_elements = 0;
  double zeroed_share() const {
    return lossy_elements == 0 ? 0.0 : static_cast<double>(zeroed_elements) / static_cast<double>(lossy_elements);
  }
};

// The log line of an update or broadcast whose lossy changes mostly arrived
// as zero ("" when fewer than half did): the error bound is larger than
// the changes and the receiver learns nothing from them.
std::string zeroed_changes_warning(const EncodedStats& stats, std::string_view what);

class UpdateEncoder {
 public:
  UpdateEncoder(const Layout& layout, CompressionSettings settings);

  // Starts an update read from `model`. `base`: the model the lossy deltas
  // are against (null: a zero one — the update is a change already, or no
  // tensor goes lossy). `residual`: error feedback's, in the model's layout
  // (null: off). Lossy tensors need `model` to have an arena.
  Status begin(ModelPlace& model, const Arena* base, Arena* residual);
  // The same, with each tensor's tolerance already worked out by another
  // encoder of the same update (tolerances()): coders that split one update's
  // chunks between threads read REL's ranges once.
  Status begin(ModelPlace& model, const Arena* base, Arena* residual, std::span<const double> tolerances);
  // The frame for model bytes [offset, offset + length): chunks in order,
  // each once (an encoder may start at any chunk of the grid when its model
  // has an arena). Valid until the next call.
  StatusOr<std::span<const std::byte>> encode(uint64_t offset, size_t length);
  const EncodedStats& stats() const { return stats_; }
  // The bytes the receiver rebuilds from the last frame (their checksum is
  // the frame's raw checksum, so a receiver that checks it holds these).
  std::span<const std::byte> rebuilt() const { return recon_; }
  // Called with each range of the base the encoder has just read (it reads
  // a lossy tensor's twice: for REL's range in begin(), then to code each
  // chunk): a file-backed base can drop those pages at once — the server's
  // broadcast keeps the model its clients hold that way, outside its RSS.
  void set_base_done(std::function<void(uint64_t offset, size_t length)> done) { base_done_ = std::move(done); }
  // Each lossy tensor's tolerance for this update (0: not lossy this time).
  const std::vector<double>& tolerances() const { return tolerance_; }

 private:
  // The bytes the server should end up with for [from, to): the model's,
  // or with error feedback, for lossy tensors, dtype(base + d).
  void write_target(uint64_t from, uint64_t to, std::byte* out);
  // The update's places (both begin()s).
  Status attach(ModelPlace& model, const Arena* base, Arena* residual);
  // d for elements [k0, k1) of entry `e` into `out`.
  void deltas(size_t e, size_t k0, size_t k1, float* out) const;
  const std::byte* model_at(uint64_t offset) const;
  void add_raw(uint64_t from, uint64_t to, uint64_t chunk_offset);
  void update_residual(uint64_t offset, size_t length);

  const Layout& layout_;
  CompressionSettings s_;
  ModelPlace* model_ = nullptr;
  const std::byte* y_ = nullptr;  // the model's arena, when it has one
  const std::byte* x_ = nullptr;  // base, or null
  std::byte* r_ = nullptr;        // residual, or null
  uint64_t window_ = 0;           // no arena: ybuf_ holds the chunk from here
  std::vector<bool> lossy_;
  std::vector<double> tolerance_;
  EncodedStats stats_;
  // One chunk's worth each: what a stream in flight costs the client.
  std::vector<std::byte> ybuf_, inner_, recon_, body_, frame_, payload_, target_;
  std::vector<float> delta_, decoded_, target_delta_;
  std::function<void(uint64_t, size_t)> base_done_;
  size_t open_raw_ = SIZE_MAX;  // inner_ offset of the raw segment being extended
  uint32_t segments_ = 0;
};

// A ModelPlace that sends its model as frames: what ClientDriver hands a
// transport when compression is on. Owns the place it reads from.
class EncodingPlace final : public ModelPlace {
 public:
  // `sender` names the update in the log ("client_3").
  EncodingPlace(std::unique_ptr<ModelPlace> source, const Layout& layout, CompressionSettings settings,
                std::string sender = "the update")
      : source_(std::move(source)),
        encoder_(layout, std::move(settings)),
        total_bytes_(layout.total_bytes()),
        sender_(std::move(sender)) {}
  Status begin(const Arena* base, Arena* residual) { return encoder_.begin(*source_, base, residual); }
  std::unique_ptr<ModelWriter> writer(const Layout&, std::string) override { return nullptr; }
  Status read(uint64_t offset, std::span<std::byte> into) override { return source_->read(offset, into); }
  bool framed() const override { return true; }
  // Once the last frame is coded, says so in the log if the bound left the
  // update's changes mostly zero (zeroed_changes_warning): the receiver
  // cannot tell such an update from an unchanged model.
  StatusOr<std::span<const std::byte>> frame(uint64_t offset, size_t length) override;
  const EncodedStats& stats() const { return encoder_.stats(); }

 private:
  std::unique_ptr<ModelPlace> source_;
  UpdateEncoder encoder_;
  uint64_t total_bytes_ = 0;
  std::string sender_;
};

}  // namespace memfl
