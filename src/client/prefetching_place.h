// PrefetchingPlace: a framed ModelPlace (compress/update_encoder.h's
// EncodingPlace) whose next frame is coded on a thread of its own while the
// transport sends the current one. Coding a chunk and putting the one before
// it on the wire then overlap: on a slow link the upload takes the link's
// time rather than the link's plus the codec's.
//
// Frames are asked for in grid order (offset, then offset + length, ...), as
// every transport does; the place codes the next one ahead and hands it over
// when it is asked for. A request off that order waits for the frame coded
// ahead, drops it and asks the inner place itself. Each frame is copied into
// one of two buffers, so what the transport holds stays put while the next
// is coded (the ModelPlace contract: it lets go of a frame before asking for
// the next). Memory: two frames, at most 2 × (chunk + kMaxFrameOverhead).
//
//   auto place = std::make_unique<PrefetchingPlace>(std::move(encoding), layout.total_bytes());
//   transport.send(meta, *place);
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/client_transport.h"

namespace memfl {

class PrefetchingPlace final : public ModelPlace {
 public:
  PrefetchingPlace(std::unique_ptr<ModelPlace> inner, uint64_t total_bytes);
  ~PrefetchingPlace() override;  // waits for a frame being coded
  PrefetchingPlace(const PrefetchingPlace&) = delete;
  PrefetchingPlace& operator=(const PrefetchingPlace&) = delete;

  std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) override {
    return inner_->writer(layout, std::move(peer));
  }
  Status read(uint64_t offset, std::span<std::byte> into) override { return inner_->read(offset, into); }
  bool framed() const override { return true; }
  StatusOr<std::span<const std::byte>> frame(uint64_t offset, size_t length) override;

 private:
  struct Ahead {
    uint64_t offset = 0;
    size_t length = 0;
    Status status;
  };
  // Codes [offset, offset + length) into buffers_[slot] (caller: the worker).
  Status code_into(int slot, uint64_t offset, size_t length);
  void work();

  std::unique_ptr<ModelPlace> inner_;
  const uint64_t total_;
  std::vector<std::byte> buffers_[2];
  int current_ = 0;  // the buffer handed out last

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool requested_ = false, ready_ = false;  // a frame ahead asked for / coded
  Ahead ahead_;
  std::thread worker_;  // started on the first frame
};

}  // namespace memfl
