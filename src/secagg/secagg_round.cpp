#include "secagg/secagg_round.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <spdlog/spdlog.h>

#include "secagg/masking_place.h"

namespace memfl {

// One client's masked upload: each frame's header and checksum checked,
// then its tag, then its words added into the sum under the round's lock.
// A frame is the chunk's masked words, the masked weight after the model's
// last chunk, then the frame's 16-byte tag (SecAggClient::tag).
class SecAggRound::Stream final : public UpdateStream {
 public:
  Stream(SecAggRound& round, int client) : round_(round), client_(client) {}
  Status accept(const ChunkHeader& h, Payload payload) override {
    const uint64_t total = round_.layout_.total_bytes();
    if (h.layout_hash != round_.layout_.hash()) {
      return data_loss("client_{}: masked chunk for another model (layout hash {:#x})", client_, h.layout_hash);
    }
    if (h.offset != next_) {
      return data_loss("client_{}: masked chunk at byte {}, expected {}", client_, h.offset, next_);
    }
    size_t bytes = 0;
    for (auto piece : payload) bytes += piece.size();
    constexpr size_t kTag = sizeof(UploadTag);
    const bool last = bytes >= 4 + kTag && h.offset + bytes - 4 - kTag == total;
    const uint64_t model_bytes = bytes >= kTag + 4 ? bytes - kTag - (last ? 4 : 0) : 0;
    if (bytes != h.length || bytes % 4 != 0 || model_bytes == 0 || h.offset + model_bytes > total) {
      return data_loss(
          "client_{}: masked chunk at byte {} of {} bytes does not fit a model of {} bytes (masked words, the weight "
          "after the last, then a {}-byte tag)",
          client_, h.offset, bytes, total, kTag);
    }
    // One aligned piece (a transport's whole message) is summed where it
    // lies; otherwise the pieces are copied together, checksummed on the way.
    std::span<const uint32_t> words;
    const std::byte* one = payload.size() == 1 ? payload[0].data() : nullptr;
    if (one != nullptr && reinterpret_cast<uintptr_t>(one) % alignof(uint32_t) == 0) {
      if (chunk_checksum(payload) != h.checksum) {
        return data_loss("client_{}: masked chunk at byte {}: checksum mismatch", client_, h.offset);
      }
      words = std::span(reinterpret_cast<const uint32_t*>(one), bytes / 4);
    } else {
      words_.resize(bytes / 4);
      if (copy_with_checksum(reinterpret_cast<std::byte*>(words_.data()), payload) != h.checksum) {
        return data_loss("client_{}: masked chunk at byte {}: checksum mismatch", client_, h.offset);
      }
      words = words_;
    }
    UploadTag tag;
    std::memcpy(tag.data(), words.data() + words.size() - kTag / 4, kTag);
    // The tag outside the lock: clients' frames are checked side by side.
    auto checked = round_.server_->check_tag(client_, h.offset / 4, words.first(words.size() - kTag / 4), tag);
    std::lock_guard lock(round_.mu_);
    if (!checked.ok()) {
      // Words not made for this round, run and client: it is out for the
      // rest of the run, as a client whose shares do not open.
      if (checked.status().code() == StatusCode::kRejected &&
          std::find(round_.culprits_.begin(), round_.culprits_.end(), client_) == round_.culprits_.end()) {
        round_.culprits_.push_back(client_);
      }
      return checked.status();
    }
    MEMFL_RETURN_IF_ERROR(round_.server_->add_masked_chunk(*checked));
    next_ = h.offset + model_bytes;
    return Status::Ok();
  }
  Status commit() override {
    std::lock_guard lock(round_.mu_);
    return round_.server_->finish_upload(client_);
  }

 private:
  SecAggRound& round_;
  int client_;
  uint64_t next_ = 0;
  std::vector<uint32_t> words_;
};

SecAggRound::SecAggRound(int round, std::vector<int> selected, SecAggSettings settings, const Layout& layout,
                         std::span<uint32_t> sum_words)
    : round_(round), selected_(std::move(selected)), layout_(layout) {
  uint32_t* weight = &weight_word_;
  if (sum_words.empty()) {
    own_.resize(layout_.total_bytes() / 4 + 1);
    body_ = std::span(own_).first(own_.size() - 1);
    weight = &own_.back();
  } else {
    body_ = sum_words;
  }
  server_ = std::make_unique<SecAggServer>(round_, selected_, settings, body_, weight);
  settings_ = server_->settings();  // with the server's key of the round
}

StatusOr<std::unique_ptr<SecAggRound>> SecAggRound::start(int round, std::vector<int> selected,
                                                          const SecAggParams& params, const ExperimentId& experiment,
                                                          const Layout& layout, std::span<uint32_t> sum_words) {
  MEMFL_RETURN_IF_ERROR(check_secagg_layout(layout));
  if (!sum_words.empty() && sum_words.size() != layout.total_bytes() / 4) {
    return internal_error("secure aggregation: a sum of {} words for a model of {} bytes", sum_words.size(),
                          layout.total_bytes());
  }
  std::sort(selected.begin(), selected.end());
  MEMFL_ASSIGN_OR_RETURN(SecAggSettings s, SecAggSettings::resolve(params, selected.size()));
  s.experiment = experiment;
  return std::unique_ptr<SecAggRound>(new SecAggRound(round, std::move(selected), s, layout, sum_words));
}

Status SecAggRound::exchange_keys(SecAggChannel& channel, std::vector<int>* failed) {
  std::vector<int> in;
  const auto out = [&](int c, const Status& why) {
    spdlog::warn("round {}: secure aggregation: {} is out of the round: {}", round_, client_id(c), why.message());
    failed->push_back(c);
    out_.push_back(c);
    channel.drop(c, why);
  };
  for (int c : selected_) {
    auto a = channel.advertise(c, round_, selected_, settings_);
    Status st = a.ok() ? server_->add_advert(*a) : a.status();
    if (st.ok()) {
      in.push_back(c);
    } else {
      out(c, st);
    }
  }
  std::vector<int> shared;
  for (int c : in) {
    auto shares = channel.share_keys(c, server_->roster_for(c));
    Status st = shares.ok() ? server_->add_shares(c, *shares) : shares.status();
    if (st.ok()) {
      shared.push_back(c);
    } else {
      out(c, st);
    }
  }
  std::vector<std::pair<int, int>> refused;  // (sender, recipient)
  for (int c : shared) {
    auto r = channel.deliver_shares(c, server_->inbox_for(c));
    StatusOr<std::vector<int>> senders = r.ok() ? server_->shares_refused(c, *r) : r.status();
    if (!senders.ok()) {
      out(c, senders.status());
      continue;
    }
    for (int from : *senders) refused.emplace_back(from, c);
  }
  // A share that does not open names both its ends, and only they hold its
  // key, so the server cannot tell which of the two lies. The client in
  // the most such pairs is out first — one keyed for another run or round
  // fails with every neighbour, as does one that claims every neighbour's
  // share failed — and the pairs it is in are settled; between two clients
  // equally involved, the sender goes (the one that can spoil everyone's
  // unmasking). The round goes on with the others, the pairwise masks of
  // those out taken out as a dropped client's.
  const auto is_out = [&](int c) { return std::find(out_.begin(), out_.end(), c) != out_.end(); };
  while (true) {
    std::erase_if(refused, [&](const auto& p) { return is_out(p.first) || is_out(p.second); });
    if (refused.empty()) break;
    std::map<int, std::pair<size_t, size_t>> involved;  // client → (pairs, pairs as the sender)
    for (const auto& [from, to] : refused) {
      ++involved[from].first;
      ++involved[from].second;
      ++involved[to].first;
    }
    int pick = -1;
    std::pair<size_t, size_t> most{0, 0};
    for (const auto& [c, n] : involved) {
      if (n > most) {
        most = n;
        pick = c;
      }
    }
    std::string for_whom, whose;
    for (const auto& [from, to] : refused) {
      if (from == pick) for_whom += (for_whom.empty() ? "" : ", ") + client_id(to);
      if (to == pick) whose += (whose.empty() ? "" : ", ") + client_id(from);
    }
    std::string why;
    if (!for_whom.empty()) why = fmt::format("its shares for {} do not open or do not match their checks", for_whom);
    if (!whose.empty()) {
      why += fmt::format("{}it reports the shares of {} as not opening", why.empty() ? "" : "; ", whose);
    }
    culprits_.push_back(pick);
    out(pick, Status{StatusCode::kRejected, why});
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<UpdateStream>> SecAggRound::open_update(const std::string& peer, double /*sample_count*/) {
  for (int c : selected_) {
    if (client_id(c) != peer) continue;
    if (std::find(out_.begin(), out_.end(), c) != out_.end()) {
      return failed_precondition("{}: a masked update from a client that missed round {}'s key exchange", peer, round_);
    }
    return std::unique_ptr<UpdateStream>(std::make_unique<Stream>(*this, c));
  }
  return invalid_argument("{}: a masked update from a client not selected for round {}", peer, round_);
}

StatusOr<size_t> SecAggRound::unmask_into(SecAggChannel& channel, UpdateOpener& into, const std::string& name,
                                          size_t chunk) {
  std::lock_guard lock(mu_);
  MEMFL_ASSIGN_OR_RETURN(UnmaskRequest req, server_->unmask_request());
  for (int c : req.survivors) {
    auto revealed = channel.unmask(c, req);
    Status st = revealed.ok() ? server_->add_revealed(c, *revealed) : revealed.status();
    // A survivor silent now is tolerated as long as t shares of each secret
    // still come back (reconstruct says when not); one whose shares are
    // wrong is left out of later rounds too.
    if (!st.ok()) {
      spdlog::warn("round {}: secure aggregation: {} did not unmask: {}", round_, client_id(c), st.message());
      if (st.code() == StatusCode::kRejected) culprits_.push_back(c);
    }
  }
  Status rec = server_->reconstruct();
  for (int c : server_->wrong_revealers()) culprits_.push_back(c);
  if (!rec.ok()) {
    return aborted("round {}: secure aggregation cannot unmask: {}", round_, rec.message());
  }
  const uint64_t elements = body_.size();
  uint32_t& weight_word = own_.empty() ? weight_word_ : own_.back();
  MEMFL_RETURN_IF_ERROR(server_->unmask_chunk(elements, std::span(&weight_word, 1)));
  // Every unmasked word is a sum of n quantised values, so at most
  // n·(q − 1). A word above it means a client's masked words were not made
  // with its masks of this round although their tags checked: the client
  // itself tagged words it did not mask so (a replay or random words under
  // its own tag key), the masks did not cancel and the mean would be noise.
  // Which client did it the sum cannot tell; the round is redone.
  const uint64_t top = static_cast<uint64_t>(req.survivors.size()) * (settings_.quantization_range - 1);
  const auto out_of_range = [&](uint64_t at, uint32_t word) {
    return aborted(
        "round {}: secure aggregation: unmasked word {} is {}, above {} survivors × (quantization_range − 1) = {}: "
        "a client's masked words were not made with its masks of this round, though it tagged them (which client, "
        "the sum cannot tell)",
        round_, at, word, req.survivors.size(), top);
  };
  if (weight_word > top) return out_of_range(elements, weight_word);
  const double weight = server_->total_weight(weight_word);
  if (!(weight > 0)) return aborted("round {}: secure aggregation: the unmasked weights sum to {}", round_, weight);
  // Chunk by chunk: the sum's words unmasked in place, the mean's f32s in
  // one chunk-sized buffer, straight on to the aggregator.
  MEMFL_ASSIGN_OR_RETURN(auto stream, into.open_update(name, 1.0));
  const size_t words_per_chunk = std::max<size_t>(chunk / 4, 1);
  std::vector<float> mean(std::min<uint64_t>(words_per_chunk, elements));
  for (uint64_t e = 0; e < elements; e += words_per_chunk) {
    const size_t n = std::min<uint64_t>(words_per_chunk, elements - e);
    // In place: the aggregator's one update then writes the mean over the
    // words just read (it writes a round's first update, never reads it).
    auto words = body_.subspan(e, n);
    MEMFL_RETURN_IF_ERROR(server_->unmask_chunk(e, words));
    for (size_t i = 0; i < n; ++i) {
      if (words[i] > top) return out_of_range(e + i, words[i]);
    }
    server_->dequantize(words, weight, std::span(mean).first(n));
    auto bytes = std::as_bytes(std::span(mean).first(n));
    MEMFL_RETURN_IF_ERROR(
        stream->accept(ChunkHeader{layout_.hash(), e * 4, bytes.size(), chunk_checksum(bytes)}, bytes));
  }
  MEMFL_RETURN_IF_ERROR(stream->commit());
  return req.survivors.size();
}

}  // namespace memfl
