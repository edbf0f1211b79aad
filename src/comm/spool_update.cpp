#include "comm/spool_update.h"

namespace memfl {

Status SpoolSlotWriter::accept(const ChunkHeader& header, Payload payload) {
  MEMFL_RETURN_IF_ERROR(verify_chunk(header, payload, layout_, received_, peer_));
  MEMFL_RETURN_IF_ERROR(values_.check(header.offset, payload, peer_, -1));
  uint64_t at = header.offset;
  for (auto piece : payload) {
    MEMFL_RETURN_IF_ERROR(spool_.write(base_ + at, piece));
    at += piece.size();
  }
  received_ += header.length;
  return Status::Ok();
}

Status SpoolSlotWriter::commit() {
  if (received_ != layout_.total_bytes())
    return data_loss("update from {} ended after {} of {} bytes", peer_, received_, layout_.total_bytes());
  return Status::Ok();
}

size_t SpoolSlots::take() {
  if (free_.empty()) return next_++;
  const size_t slot = free_.back();
  free_.pop_back();
  return slot;
}

void SpoolSlots::give_back(size_t slot) {
  spool_.release(static_cast<uint64_t>(slot) * slot_bytes_, slot_bytes_);
  free_.push_back(slot);
}

void SpoolSlots::release(AsyncTripRecord& trip) {
  const auto* src = dynamic_cast<const SpoolSlotSource*>(trip.update.get());
  if (src != nullptr) give_back(src->slot());
  trip.update.reset();
}

}  // namespace memfl
