// An asynchronous update's bytes between their arrival and their
// application: a slot of a SpoolFile (io/spool_file.h), one model long.
// SpoolSlotWriter takes a client's chunks — each checked against the layout,
// in order, with its checksum, and its values finite — into the slot; SpoolSlotSource reads the
// whole, checked update back for the aggregator. Every transport that serves
// asynchronous FL (the simulator, gRPC, MPI) keeps updates so.
#pragma once

#include <cstdint>
#include <string>

#include "comm/chunk.h"
#include "comm/transport.h"
#include "comm/update_check.h"
#include "io/spool_file.h"
#include "tensor/layout.h"

namespace memfl {

class SpoolSlotSource final : public UpdateSource {
 public:
  SpoolSlotSource(const SpoolFile& spool, size_t slot, uint64_t slot_bytes)
      : spool_(spool), slot_(slot), base_(static_cast<uint64_t>(slot) * slot_bytes) {}
  Status read(size_t offset, std::span<std::byte> into) const override { return spool_.read(base_ + offset, into); }
  size_t slot() const { return slot_; }

 private:
  const SpoolFile& spool_;
  size_t slot_;
  uint64_t base_;
};

class SpoolSlotWriter final : public UpdateStream {
 public:
  SpoolSlotWriter(SpoolFile& spool, size_t slot, const Layout& layout, std::string peer)
      : spool_(spool),
        base_(static_cast<uint64_t>(slot) * layout.total_bytes()),
        layout_(layout),
        peer_(std::move(peer)),
        values_(layout) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& header, Payload payload) override;
  // Fails unless the whole model arrived.
  Status commit() override;
  uint64_t received() const { return received_; }

 private:
  SpoolFile& spool_;
  uint64_t base_;
  const Layout& layout_;
  std::string peer_;
  uint64_t received_ = 0;
  FiniteValueCheck values_;  // an update with a NaN or Inf never reaches the model
};

// Slots of one model each in a spool: taken and given back (the disk
// blocks too) as updates come and go.
class SpoolSlots {
 public:
  SpoolSlots(std::string what, uint64_t slot_bytes) : spool_(std::move(what)), slot_bytes_(slot_bytes) {}
  Status open(const std::string& dir) { return spool_.open(dir); }
  size_t take();
  void give_back(size_t slot);
  // An update that is no longer needed (applied, or folded into FedBuff's
  // buffer) gives its slot back and the trip lets go of it: what every
  // asynchronous driver hands AsyncUpdateHandler::set_release.
  void release(AsyncTripRecord& trip);
  SpoolFile& spool() { return spool_; }
  uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  SpoolFile spool_;
  uint64_t slot_bytes_;
  std::vector<size_t> free_;
  size_t next_ = 0;
};

}  // namespace memfl
