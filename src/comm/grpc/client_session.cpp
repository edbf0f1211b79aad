#include "comm/grpc/client_session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include <fmt/ranges.h>

#include "comm/client_tokens.h"
#include "comm/update_check.h"
#include "config/config.h"
#include "tensor/dtype.h"

namespace memfl {

namespace {

std::string shape_text(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// The caller's tensors as a model: chunks are scattered into them (padding
// between tensors dropped) once checked, and gathered from them (padding
// zero) to be sent.
class TensorPlace final : public ModelPlace {
 public:
  TensorPlace(const Layout& layout, std::vector<const TensorBuffer*> ordered)
      : layout_(layout), ordered_(std::move(ordered)) {}

  std::unique_ptr<ModelWriter> writer(const Layout& layout, std::string peer) override {
    return std::make_unique<Writer>(layout, *this, std::move(peer));
  }

  Status read(uint64_t offset, std::span<std::byte> into) override {
    std::memset(into.data(), 0, into.size());
    const auto& entries = layout_.entries();
    const size_t end = offset + into.size();
    for (size_t i = layout_.entry_at_or_after(offset); i < entries.size() && entries[i].offset < end; ++i) {
      const auto& e = entries[i];
      const size_t from = std::max<size_t>(offset, e.offset), to = std::min(e.end(), end);
      if (to > from) std::memcpy(into.data() + (from - offset), ordered_[i]->data + (from - e.offset), to - from);
    }
    return Status::Ok();
  }

 private:
  class Writer final : public ModelWriter {
   public:
    Writer(const Layout& layout, TensorPlace& place, std::string peer)
        : ModelWriter(layout, std::move(peer)), place_(place) {}

   private:
    // Checked before a byte reaches the caller's tensors.
    Status store(const ChunkHeader& h, Payload payload) override {
      if (chunk_checksum(payload) != h.checksum) return checksum_mismatch(h, peer());
      size_t at = h.offset;
      for (auto piece : payload) {
        place_.scatter(at, piece);
        at += piece.size();
      }
      return Status::Ok();
    }
    TensorPlace& place_;
  };

  void scatter(size_t at, std::span<const std::byte> piece) {
    const auto& entries = layout_.entries();
    const size_t end = at + piece.size();
    for (size_t i = layout_.entry_at_or_after(at); i < entries.size() && entries[i].offset < end; ++i) {
      const auto& e = entries[i];
      const size_t from = std::max(at, e.offset), to = std::min(e.end(), end);
      if (to > from) std::memcpy(ordered_[i]->data + (from - e.offset), piece.data() + (from - at), to - from);
    }
  }

  const Layout& layout_;
  std::vector<const TensorBuffer*> ordered_;
};

}  // namespace

StatusOr<std::vector<const TensorBuffer*>> match_layout(const Layout& layout, std::span<const TensorBuffer> tensors) {
  std::map<std::string_view, const TensorBuffer*> by_name;
  for (const auto& t : tensors) {
    if (!by_name.emplace(t.name, &t).second) return invalid_argument("tensor '{}' is given twice", t.name);
  }
  std::vector<const TensorBuffer*> ordered;
  for (const auto& e : layout.entries()) {
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      return invalid_argument("the state_dict has no tensor '{}' (the server's model has it: {} {})", e.name,
                              dtype_name(e.dtype), shape_text(e.shape));
    }
    const TensorBuffer& t = *it->second;
    if (t.shape != e.shape) {
      return invalid_argument("tensor '{}' has shape {}; the server's model has {}", e.name, shape_text(t.shape),
                              shape_text(e.shape));
    }
    if (t.dtype != dtype_name(e.dtype)) {
      return invalid_argument("tensor '{}' is {}; the server's model has {}", e.name, t.dtype, dtype_name(e.dtype));
    }
    if (t.nbytes != e.nbytes() || t.data == nullptr) {
      return invalid_argument("tensor '{}': {} bytes of storage for {} expected", e.name, t.nbytes, e.nbytes());
    }
    ordered.push_back(&t);
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return invalid_argument("tensor '{}' is not in the server's model ({} tensors)", by_name.begin()->first,
                            layout.size());
  }
  return ordered;
}

StatusOr<std::unique_ptr<GrpcClientSession>> GrpcClientSession::connect(const SessionOptions& o) {
  // The server's parser, so an id it would refuse (" 1", "+1", "01") is
  // refused here first; the range is the server's to check.
  const std::optional<int> parsed = parse_client_id(o.client_id, std::numeric_limits<int>::max());
  if (!parsed) {
    return invalid_argument("client_id '{}': a client id is a number from 0, in decimal without sign, spaces or "
                            "leading zeros",
                            printable_peer_text(o.client_id));
  }
  const auto id = static_cast<uint32_t>(*parsed);
  auto s = std::make_unique<GrpcClientSession>();
  s->client_id_ = id;
  MEMFL_ASSIGN_OR_RETURN(s->transport_, GrpcClientTransport::connect({.server_uri = o.server_uri,
                                                                      .client_id = id,
                                                                      .token = o.token,
                                                                      .use_ssl = !o.root_cert.empty(),
                                                                      .root_cert = o.root_cert,
                                                                      .connect_timeout_s = o.connect_timeout_s}));
  // Compressed updates are encoded by the client core (ClientDriver), which
  // this session's caller-driven steps do not run: a server that expects
  // frames is told so now, not with a refused update after training.
  auto cfg = load_config_text(s->transport_->config_yaml(), "configuration from server " + o.server_uri);
  if (cfg.ok() && cfg->compressor.enable_compression) {
    (void)s->transport_->close();
    return failed_precondition(
        "server {} asks for compressed updates (client_configs.comm_configs.compressor_configs.enable_compression); "
        "the Python client sends them uncompressed — run the server with enable_compression: false, or the C++ "
        "client (memfl client)",
        o.server_uri);
  }
  if (cfg.ok() && cfg->secagg.enable) {
    (void)s->transport_->close();
    return failed_precondition(
        "server {} runs secure aggregation (server_configs.secure_aggregation.enable); the Python client does not "
        "mask its updates — use the C++ client (memfl client)",
        o.server_uri);
  }
  return s;
}

StatusOr<int> GrpcClientSession::next_round() {
  MEMFL_ASSIGN_OR_RETURN(RoundOffer offer, transport_->next_round());
  round_ = offer.round;
  local_steps_ = offer.local_steps;
  return offer.round;
}

Status GrpcClientSession::receive(std::span<const TensorBuffer> tensors) {
  MEMFL_ASSIGN_OR_RETURN(auto ordered, match_layout(layout(), tensors));
  TensorPlace place(layout(), std::move(ordered));
  return transport_->receive(place);
}

Status GrpcClientSession::send(std::span<const TensorBuffer> tensors, double num_samples,
                               const std::map<std::string, double>& metrics) {
  if (round_ < 0 || !transport_->in_round()) {
    return failed_precondition("send() before this round's model was received");
  }
  MEMFL_ASSIGN_OR_RETURN(auto ordered, match_layout(layout(), tensors));
  // What the server would refuse is refused here, before a byte leaves:
  // the caller gets the reason at once, and the round's stream stays usable.
  if (!(std::isfinite(num_samples) && num_samples > 0)) {
    return invalid_argument("send(num_samples={}): the sample count must be a finite number above 0", num_samples);
  }
  for (size_t i = 0; i < ordered.size(); ++i) {
    const auto& e = layout().entries()[i];
    const size_t bad = first_non_finite(e.dtype, ordered[i]->data, e.numel());
    if (bad < e.numel()) {
      return invalid_argument("send(): tensor '{}' element {} is not finite (NaN or Inf); the update is not sent",
                              e.name, bad);
    }
  }
  TensorPlace place(layout(), std::move(ordered));
  MEMFL_RETURN_IF_ERROR(transport_->send(
      {.round = round_, .client = static_cast<int>(client_id_), .sample_count = num_samples, .metrics = metrics},
      place));
  round_ = -1;
  return Status::Ok();
}

}  // namespace memfl
