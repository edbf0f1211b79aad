#include "secagg/wire.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <type_traits>

namespace memfl {

namespace {

// Little-endian fixed-width fields, length-prefixed byte strings.
class Writer {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const char*>(&v);
    out_.append(p, sizeof(T));
  }
  void bytes(std::span<const uint8_t> b) {
    put<uint32_t>(static_cast<uint32_t>(b.size()));
    out_.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  void ints(const std::vector<int>& v) {
    put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (int x : v) put<int32_t>(x);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(std::string_view in, std::string what) : in_(in), what_(std::move(what)) {}
  template <typename T>
  Status get(T* v) {
    if (in_.size() - at_ < sizeof(T)) return short_read(sizeof(T));
    std::memcpy(v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::Ok();
  }
  template <size_t N>
  Status get(std::array<uint8_t, N>* v) {
    if (in_.size() - at_ < N) return short_read(N);
    std::memcpy(v->data(), in_.data() + at_, N);
    at_ += N;
    return Status::Ok();
  }
  Status bytes(std::vector<uint8_t>* v, size_t max) {
    uint32_t n = 0;
    MEMFL_RETURN_IF_ERROR(get(&n));
    if (n > max) return data_loss("{}: a field of {} bytes (at most {})", what_, n, max);
    if (in_.size() - at_ < n) return short_read(n);
    v->assign(in_.data() + at_, in_.data() + at_ + n);
    at_ += n;
    return Status::Ok();
  }
  // A count of items of at least `item_bytes` each: checked against what
  // is left before anything is allocated for them.
  Status count(uint32_t* n, size_t item_bytes) {
    MEMFL_RETURN_IF_ERROR(get(n));
    if (static_cast<uint64_t>(*n) * item_bytes > in_.size() - at_) {
      return data_loss("{}: {} items do not fit the {} bytes left", what_, *n, in_.size() - at_);
    }
    return Status::Ok();
  }
  Status ints(std::vector<int>* v) {
    uint32_t n = 0;
    MEMFL_RETURN_IF_ERROR(count(&n, 4));
    v->resize(n);
    for (auto& x : *v) {
      int32_t y = 0;
      MEMFL_RETURN_IF_ERROR(get(&y));
      x = y;
    }
    return Status::Ok();
  }
  Status done() const {
    if (at_ != in_.size()) return data_loss("{}: {} bytes after the message", what_, in_.size() - at_);
    return Status::Ok();
  }

 private:
  Status short_read(size_t want) const {
    return data_loss("{}: the message ends {} bytes into a field of {}", what_, in_.size() - at_, want);
  }
  std::string_view in_;
  size_t at_ = 0;
  std::string what_;
};

constexpr size_t kMaxSealed = 4096;

void put_advert(Writer& w, const KeyAdvert& a) {
  w.put<int32_t>(a.round);
  w.put<int32_t>(a.client);
  for (uint8_t b : a.c_public) w.put(b);
  for (uint8_t b : a.s_public) w.put(b);
  for (uint8_t b : a.b_commitment) w.put(b);
}
Status get_advert(Reader& r, KeyAdvert* a) {
  int32_t round = 0, client = 0;
  MEMFL_RETURN_IF_ERROR(r.get(&round));
  MEMFL_RETURN_IF_ERROR(r.get(&client));
  a->round = round;
  a->client = client;
  MEMFL_RETURN_IF_ERROR(r.get(&a->c_public));
  MEMFL_RETURN_IF_ERROR(r.get(&a->s_public));
  return r.get(&a->b_commitment);
}
void put_shares(Writer& w, const std::vector<SealedShare>& v) {
  w.put<uint32_t>(static_cast<uint32_t>(v.size()));
  for (const auto& s : v) {
    w.put<int32_t>(s.round);
    w.put<int32_t>(s.from);
    w.put<int32_t>(s.to);
    w.bytes(s.sealed);
    for (uint8_t b : s.b_check) w.put(b);
    for (uint8_t b : s.sk_check) w.put(b);
  }
}
Status get_shares(Reader& r, std::vector<SealedShare>* v) {
  uint32_t n = 0;
  MEMFL_RETURN_IF_ERROR(r.count(&n, 16 + 64));
  v->resize(n);
  for (auto& s : *v) {
    int32_t round = 0, from = 0, to = 0;
    MEMFL_RETURN_IF_ERROR(r.get(&round));
    MEMFL_RETURN_IF_ERROR(r.get(&from));
    MEMFL_RETURN_IF_ERROR(r.get(&to));
    s.round = round;
    s.from = from;
    s.to = to;
    MEMFL_RETURN_IF_ERROR(r.bytes(&s.sealed, kMaxSealed));
    MEMFL_RETURN_IF_ERROR(r.get(&s.b_check));
    MEMFL_RETURN_IF_ERROR(r.get(&s.sk_check));
  }
  return Status::Ok();
}

// Every request: version, stage, client, round; every reply: version,
// stage, ok, then the payload or the error's text.
void request_head(SecAggStage stage, int client, int round, Writer* w) {
  w->put<uint8_t>(kSecAggWireVersion);
  w->put<uint8_t>(static_cast<uint8_t>(stage));
  w->put<int32_t>(client);
  w->put<int32_t>(round);
}

}  // namespace

const char* secagg_stage_name(SecAggStage s) {
  switch (s) {
    case SecAggStage::kRoundOver:
      return "round over";
    case SecAggStage::kAdvertise:
      return "advertise keys";
    case SecAggStage::kShareKeys:
      return "share keys";
    case SecAggStage::kDeliverShares:
      return "deliver shares";
    case SecAggStage::kUnmask:
      return "unmask";
  }
  return "unknown";
}

StatusOr<std::string> RemoteSecAggChannel::call(int client, SecAggStage stage, const std::string& request) {
  MEMFL_ASSIGN_OR_RETURN(std::string reply, exchange_(client, request));
  const std::string what = fmt::format("client_{}'s reply to '{}'", client, secagg_stage_name(stage));
  if (reply.size() > kMaxSecAggMessage) return data_loss("{}: {} bytes", what, reply.size());
  Reader r(reply, what);
  uint8_t version = 0, got = 0, ok = 0;
  MEMFL_RETURN_IF_ERROR(r.get(&version));
  if (version != kSecAggWireVersion) {
    return data_loss("{}: secure aggregation messages of version {}; this server speaks version {} (another memfl?)",
                     what, version, kSecAggWireVersion);
  }
  MEMFL_RETURN_IF_ERROR(r.get(&got));
  MEMFL_RETURN_IF_ERROR(r.get(&ok));
  if (got != static_cast<uint8_t>(stage)) {
    return data_loss("{}: it answers stage {} instead", what, static_cast<int>(got));
  }
  if (ok == 0) {
    std::vector<uint8_t> text;
    MEMFL_RETURN_IF_ERROR(r.bytes(&text, 4096));
    return failed_precondition("{}: {}", what, std::string(text.begin(), text.end()));
  }
  return reply.substr(3);
}

StatusOr<KeyAdvert> RemoteSecAggChannel::advertise(int client, int round, const std::vector<int>& selected,
                                                   const SecAggSettings& s) {
  round_ = round;
  Writer w;
  request_head(SecAggStage::kAdvertise, client, round, &w);
  w.ints(selected);
  w.put<uint64_t>(s.clients);
  w.put<uint64_t>(s.neighbours);
  w.put<uint64_t>(s.threshold);
  w.put<double>(s.max_weight);
  w.put<double>(s.clipping_range);
  w.put<uint64_t>(s.quantization_range);
  w.put<uint64_t>(s.modulus_range);
  for (uint8_t b : s.experiment) w.put(b);
  for (uint8_t b : s.server_public) w.put(b);
  MEMFL_ASSIGN_OR_RETURN(std::string body, call(client, SecAggStage::kAdvertise, w.take()));
  Reader r(body, fmt::format("client_{}'s key advert", client));
  KeyAdvert a;
  MEMFL_RETURN_IF_ERROR(get_advert(r, &a));
  MEMFL_RETURN_IF_ERROR(r.done());
  return a;  // SecAggServer::add_advert checks its round and client
}

StatusOr<std::vector<SealedShare>> RemoteSecAggChannel::share_keys(int client, const std::vector<KeyAdvert>& roster) {
  Writer w;
  request_head(SecAggStage::kShareKeys, client, round_, &w);
  w.put<uint32_t>(static_cast<uint32_t>(roster.size()));
  for (const auto& a : roster) put_advert(w, a);
  MEMFL_ASSIGN_OR_RETURN(std::string body, call(client, SecAggStage::kShareKeys, w.take()));
  Reader r(body, fmt::format("client_{}'s sealed shares", client));
  std::vector<SealedShare> shares;
  MEMFL_RETURN_IF_ERROR(get_shares(r, &shares));
  MEMFL_RETURN_IF_ERROR(r.done());
  return shares;  // SecAggServer::add_shares checks sender, recipient and round
}

StatusOr<std::vector<int>> RemoteSecAggChannel::deliver_shares(int client, std::vector<SealedShare> inbox) {
  Writer w;
  request_head(SecAggStage::kDeliverShares, client, round_, &w);
  put_shares(w, inbox);
  MEMFL_ASSIGN_OR_RETURN(std::string body, call(client, SecAggStage::kDeliverShares, w.take()));
  Reader r(body, fmt::format("client_{}'s receipt of its shares", client));
  std::vector<int> refused;
  MEMFL_RETURN_IF_ERROR(r.ints(&refused));
  MEMFL_RETURN_IF_ERROR(r.done());
  return refused;  // SecAggServer::shares_refused checks each sender
}

StatusOr<std::vector<RevealedShare>> RemoteSecAggChannel::unmask(int client, const UnmaskRequest& request) {
  Writer w;
  request_head(SecAggStage::kUnmask, client, request.round, &w);
  w.ints(request.survivors);
  w.ints(request.dropped);
  MEMFL_ASSIGN_OR_RETURN(std::string body, call(client, SecAggStage::kUnmask, w.take()));
  Reader r(body, fmt::format("client_{}'s revealed shares", client));
  uint32_t n = 0;
  MEMFL_RETURN_IF_ERROR(r.count(&n, 13 + 4 + 8 * kShamirPieces));
  std::vector<RevealedShare> out(n);
  for (auto& s : out) {
    int32_t round = 0, from = 0, subject = 0;
    uint8_t kind = 0;
    MEMFL_RETURN_IF_ERROR(r.get(&round));
    MEMFL_RETURN_IF_ERROR(r.get(&from));
    MEMFL_RETURN_IF_ERROR(r.get(&subject));
    MEMFL_RETURN_IF_ERROR(r.get(&kind));
    if (kind != static_cast<uint8_t>(SecretKind::kSelfMaskSeed) &&
        kind != static_cast<uint8_t>(SecretKind::kMaskingKey)) {
      return data_loss("client_{}'s revealed shares: unknown secret kind {}", client, kind);
    }
    s.round = round;
    s.from = from;
    s.subject = subject;
    s.kind = static_cast<SecretKind>(kind);
    MEMFL_RETURN_IF_ERROR(r.get(&s.share.x));
    for (auto& y : s.share.y) MEMFL_RETURN_IF_ERROR(r.get(&y));
  }
  MEMFL_RETURN_IF_ERROR(r.done());
  return out;  // SecAggServer::add_revealed checks round, sender and each share
}

StatusOr<std::string> serve_secagg_request(SecAggChannel& stages, std::string_view request, const std::string& peer,
                                           const std::vector<int>& plays, SecAggStage* stage) {
  const std::string what = "secure aggregation request from " + peer;
  *stage = SecAggStage::kRoundOver;
  if (request.empty()) return std::string();
  if (request.size() > kMaxSecAggMessage) return data_loss("{}: {} bytes", what, request.size());
  Reader r(request, what);
  uint8_t version = 0, st = 0;
  int32_t client = 0, round = 0;
  MEMFL_RETURN_IF_ERROR(r.get(&version));
  if (version != kSecAggWireVersion) {
    return data_loss("{}: secure aggregation messages of version {}; this client speaks version {} (another memfl?)",
                     what, version, kSecAggWireVersion);
  }
  MEMFL_RETURN_IF_ERROR(r.get(&st));
  MEMFL_RETURN_IF_ERROR(r.get(&client));
  MEMFL_RETURN_IF_ERROR(r.get(&round));
  if (st == 0 || st > static_cast<uint8_t>(SecAggStage::kUnmask)) return data_loss("{}: unknown stage {}", what, st);
  *stage = static_cast<SecAggStage>(st);
  if (std::find(plays.begin(), plays.end(), client) == plays.end()) {
    return data_loss("{}: a '{}' request for client_{}, which this process does not play this round", what,
                     secagg_stage_name(*stage), client);
  }

  Writer w;
  w.put<uint8_t>(kSecAggWireVersion);
  w.put<uint8_t>(st);
  auto answer = [&](const Status& s, const std::function<void(Writer&)>& body) -> std::string {
    w.put<uint8_t>(s.ok() ? 1 : 0);
    if (s.ok()) {
      body(w);
    } else {
      const std::string& m = s.message();
      w.bytes(std::span(reinterpret_cast<const uint8_t*>(m.data()), std::min<size_t>(m.size(), 4096)));
    }
    return w.take();
  };
  switch (*stage) {
    case SecAggStage::kAdvertise: {
      std::vector<int> selected;
      MEMFL_RETURN_IF_ERROR(r.ints(&selected));
      SecAggSettings s;
      uint64_t clients = 0, neighbours = 0, threshold = 0;
      MEMFL_RETURN_IF_ERROR(r.get(&clients));
      MEMFL_RETURN_IF_ERROR(r.get(&neighbours));
      MEMFL_RETURN_IF_ERROR(r.get(&threshold));
      MEMFL_RETURN_IF_ERROR(r.get(&s.max_weight));
      MEMFL_RETURN_IF_ERROR(r.get(&s.clipping_range));
      MEMFL_RETURN_IF_ERROR(r.get(&s.quantization_range));
      MEMFL_RETURN_IF_ERROR(r.get(&s.modulus_range));
      MEMFL_RETURN_IF_ERROR(r.get(&s.experiment));
      MEMFL_RETURN_IF_ERROR(r.get(&s.server_public));
      MEMFL_RETURN_IF_ERROR(r.done());
      if (clients != selected.size() || neighbours < 1 || neighbours > clients || threshold < 1 ||
          threshold > neighbours || !std::is_sorted(selected.begin(), selected.end())) {
        return data_loss("{}: settings that do not fit the round ({} selected, k {}, t {})", what, selected.size(),
                         neighbours, threshold);
      }
      s.clients = clients;
      s.neighbours = neighbours;
      s.threshold = threshold;
      auto a = stages.advertise(client, round, selected, s);
      return answer(a.status(), [&](Writer& out) { put_advert(out, *a); });
    }
    case SecAggStage::kShareKeys: {
      uint32_t n = 0;
      MEMFL_RETURN_IF_ERROR(r.count(&n, 104));
      std::vector<KeyAdvert> roster(n);
      for (auto& a : roster) MEMFL_RETURN_IF_ERROR(get_advert(r, &a));
      MEMFL_RETURN_IF_ERROR(r.done());
      auto shares = stages.share_keys(client, roster);
      return answer(shares.status(), [&](Writer& out) { put_shares(out, *shares); });
    }
    case SecAggStage::kDeliverShares: {
      std::vector<SealedShare> inbox;
      MEMFL_RETURN_IF_ERROR(get_shares(r, &inbox));
      MEMFL_RETURN_IF_ERROR(r.done());
      auto refused = stages.deliver_shares(client, std::move(inbox));
      return answer(refused.status(), [&](Writer& out) { out.ints(*refused); });
    }
    case SecAggStage::kUnmask: {
      UnmaskRequest req;
      req.round = round;
      MEMFL_RETURN_IF_ERROR(r.ints(&req.survivors));
      MEMFL_RETURN_IF_ERROR(r.ints(&req.dropped));
      MEMFL_RETURN_IF_ERROR(r.done());
      auto revealed = stages.unmask(client, req);
      return answer(revealed.status(), [&](Writer& out) {
        out.put<uint32_t>(static_cast<uint32_t>(revealed->size()));
        for (const auto& s : *revealed) {
          out.put<int32_t>(s.round);
          out.put<int32_t>(s.from);
          out.put<int32_t>(s.subject);
          out.put<uint8_t>(static_cast<uint8_t>(s.kind));
          out.put<uint32_t>(s.share.x);
          for (uint64_t y : s.share.y) out.put<uint64_t>(y);
        }
      });
    }
    case SecAggStage::kRoundOver:
      break;
  }
  return std::string();
}

}  // namespace memfl
