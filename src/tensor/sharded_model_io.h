// The interface between a model sharded over ranks and the transports that
// move it (here, below both, so that comm/ need not know train/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/status.h"

namespace memfl {

// A model that no single process holds whole: its parameters are sharded
// over ranks (train/sharded_dp.h, train_configs.num_gpus > 1). A client's
// transport streams each chunk straight into and out of the shards, so no
// rank gathers the model.
class ShardedModelIo {
 public:
  virtual ~ShardedModelIo() = default;
  // Bytes [offset, offset + bytes.size()) of layout(), as received.
  virtual Status write(uint64_t offset, std::span<const std::byte> bytes) = 0;
  // Bytes [offset, offset + into.size()) of layout(), as trained.
  virtual Status read(uint64_t offset, std::span<std::byte> into) = 0;
};

}  // namespace memfl
