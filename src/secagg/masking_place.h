// The client's side of secure aggregation's upload: a ModelPlace whose
// frames are the update's masked 32-bit words (secagg/secagg.h), one chunk
// at a time — what ClientDriver hands a transport when
// server_configs.secure_aggregation.enable is on. The model's f32 elements
// are read chunk by chunk, weighted, clipped, quantised and masked; the
// last frame carries the masked weight as one more word, and every frame
// ends with its tag (16 bytes, SecAggClient::tag). Nothing model-sized is
// allocated.
//
//   MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *stages.client(c));
//   MEMFL_RETURN_IF_ERROR(masked.begin(sample_count));
//   MEMFL_RETURN_IF_ERROR(transport.send(meta, masked));
#pragma once

#include <memory>
#include <vector>

#include "comm/client_transport.h"
#include "secagg/secagg.h"
#include "tensor/layout.h"

namespace memfl {

// Secure aggregation sums f32 elements: refuses a layout with another dtype,
// naming the entry.
Status check_secagg_layout(const Layout& layout);

class MaskingPlace final : public ModelPlace {
 public:
  MaskingPlace(std::unique_ptr<ModelPlace> source, const Layout& layout, SecAggClient& client)
      : source_(std::move(source)), layout_(layout), client_(client) {}
  Status begin(double sample_count);
  std::unique_ptr<ModelWriter> writer(const Layout&, std::string) override { return nullptr; }
  Status read(uint64_t offset, std::span<std::byte> into) override { return source_->read(offset, into); }
  bool framed() const override { return true; }
  // The masked words of model bytes [offset, offset + length): whole f32
  // elements (chunks are cut at multiples of 4 bytes), plus the masked
  // weight after the model's last chunk, then the frame's tag.
  StatusOr<std::span<const std::byte>> frame(uint64_t offset, size_t length) override;

 private:
  std::unique_ptr<ModelPlace> source_;
  const Layout& layout_;
  SecAggClient& client_;
  std::unique_ptr<float[]> values_;
  std::unique_ptr<uint32_t[]> words_;
  size_t capacity_ = 0;  // words of words_ (values_ has at most as many)
};

}  // namespace memfl
