// The clients' side of secure aggregation (secagg/channel.h,
// secagg/masking_place.h).
#include <cstring>

#include "secagg/channel.h"
#include "secagg/masking_place.h"

namespace memfl {

StatusOr<KeyAdvert> SecAggClientStages::advertise(int client, int round, const std::vector<int>& selected,
                                                  const SecAggSettings& settings) {
  if (!std::binary_search(selected.begin(), selected.end(), client)) {
    return invalid_argument("client_{}: asked for keys for round {} without being selected", client, round);
  }
  auto c = std::make_unique<SecAggClient>(client, round, selected, settings);
  KeyAdvert a = c->advertise();
  std::lock_guard lock(mu_);
  clients_[client] = std::move(c);  // a new round's keys replace the last
  return a;
}

SecAggClient* SecAggClientStages::client(int client) {
  std::lock_guard lock(mu_);
  auto it = clients_.find(client);
  return it == clients_.end() ? nullptr : it->second.get();
}

StatusOr<std::vector<SealedShare>> SecAggClientStages::share_keys(int client, const std::vector<KeyAdvert>& roster) {
  SecAggClient* c = this->client(client);
  if (c == nullptr) return failed_precondition("client_{}: shares asked for before its keys", client);
  return c->share_keys(roster);
}

StatusOr<std::vector<int>> SecAggClientStages::deliver_shares(int client, std::vector<SealedShare> inbox) {
  SecAggClient* c = this->client(client);
  if (c == nullptr) return failed_precondition("client_{}: shares delivered before its keys", client);
  return c->receive_shares(std::move(inbox));
}

StatusOr<std::vector<RevealedShare>> SecAggClientStages::unmask(int client, const UnmaskRequest& request) {
  SecAggClient* c = this->client(client);
  if (c == nullptr) return failed_precondition("client_{}: asked to unmask without keys", client);
  return c->unmask(request);
}

void SecAggClientStages::end_round(int /*round*/) {
  std::lock_guard lock(mu_);
  clients_.clear();  // the secrets go with their SecAggClient (zeroed)
}

Status check_secagg_layout(const Layout& layout) {
  for (const LayoutEntry& e : layout.entries()) {
    if (e.dtype != DType::kF32) {
      return invalid_argument(
          "server_configs.secure_aggregation.enable: entry '{}' is {}; secure aggregation quantises f32 entries "
          "only",
          e.name, dtype_name(e.dtype));
    }
  }
  if (layout.total_bytes() % 4 != 0) {
    return invalid_argument("server_configs.secure_aggregation.enable: the model's {} bytes are not whole f32 words",
                            layout.total_bytes());
  }
  return Status::Ok();
}

Status MaskingPlace::begin(double sample_count) {
  MEMFL_RETURN_IF_ERROR(check_secagg_layout(layout_));
  return client_.begin_update(layout_.total_bytes() / 4, sample_count);
}

StatusOr<std::span<const std::byte>> MaskingPlace::frame(uint64_t offset, size_t length) {
  const uint64_t total = layout_.total_bytes();
  const bool last = offset + length == total;
  if (offset % 4 != 0 || (length % 4 != 0 && !last) || offset + length > total) {
    return invalid_argument(
        "client_{}: a masked chunk at byte {} of {} bytes cuts an f32 element; secure aggregation needs "
        "client_configs.comm_configs.model_chunk_size (or the transport's chunk) to be a multiple of 4",
        client_.client(), offset, length);
  }
  const size_t n = length / 4;
  // Buffers kept across frames and never zeroed (every element is read or
  // written before use): zeroing a chunk per client cost more than its
  // quantisation. Read straight into the f32s (the model's little-endian
  // f32 bytes; whole elements, checked above).
  constexpr size_t kTagWords = sizeof(UploadTag) / 4;
  const size_t words = n + (last ? 1 : 0);
  if (words + kTagWords > capacity_) {
    values_.reset(new float[words]);
    words_.reset(new uint32_t[words + kTagWords]);
    capacity_ = words + kTagWords;
  }
  MEMFL_RETURN_IF_ERROR(source_->read(offset, std::as_writable_bytes(std::span(values_.get(), n))));
  MEMFL_RETURN_IF_ERROR(client_.mask_chunk(offset / 4, std::span(values_.get(), n), std::span(words_.get(), n)));
  if (last) words_[n] = client_.masked_weight();
  // The frame's tag after its words: the server checks it before a word
  // is summed.
  MEMFL_ASSIGN_OR_RETURN(UploadTag tag, client_.tag(offset / 4, std::span<const uint32_t>(words_.get(), words)));
  std::memcpy(words_.get() + words, tag.data(), tag.size());
  return std::span<const std::byte>(reinterpret_cast<const std::byte*>(words_.get()), (words + kTagWords) * 4);
}

}  // namespace memfl
