#include "secagg/secagg.h"

#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/parallel.h"

namespace memfl {

// Words of a chunk one core masks or unmasks at least (64 KiB): a 1 MiB
// chunk is then 16 pieces, enough for every core of a 16-core host (with
// 256 KiB pieces, 4 cores took all the work there).
constexpr size_t kParallelMaskWords = size_t{1} << 14;

namespace {

template <typename... Args>
Status rejected(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kRejected, fmt::format(f, std::forward<Args>(args)...)};
}

// "run=<the experiment id in hex> round=<r>": the part of every context
// that ties what it names to one round of one run.
std::string run_context(const SecAggSettings& s, int round) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "run=";
  for (uint8_t b : s.experiment) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out + " round=" + std::to_string(round);
}

Secret32 commit(const Secret32& b, const SecAggSettings& s, int round, int client) {
  const std::string ctx = "memfl-secagg-b-commitment " + run_context(s, round) + " client=" + std::to_string(client);
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(ctx.data()), ctx.size());
  crypto_generichash_update(&st, b.data(), b.size());
  Secret32 h{};
  crypto_generichash_final(&st, h.data(), h.size());
  return h;
}

// What the key of client u's upload tags is agreed for (with the server's
// key of the round).
std::string tag_purpose(const SecAggSettings& s, int round, int u) {
  return "memfl-secagg-upload-tag " + run_context(s, round) + " client=" + std::to_string(u);
}
constexpr std::string_view kTagKeyStream = "memfl-secagg-upload-tag-keys";

// The plaintext of a sealed share: the subject, the share's x, then the
// five pieces of its shares of b and of the s secret key.
constexpr size_t kSharePlain = 4 + 4 + 2 * kShamirPieces * 8;

std::vector<uint8_t> encode_share(int subject, const ShamirShare& b, const ShamirShare& sk) {
  std::vector<uint8_t> out(kSharePlain);
  uint8_t* p = out.data();
  const auto put32 = [&](uint32_t v) { std::memcpy(p, &v, 4), p += 4; };
  const auto put64 = [&](uint64_t v) { std::memcpy(p, &v, 8), p += 8; };
  put32(static_cast<uint32_t>(subject));
  put32(b.x);
  for (uint64_t y : b.y) put64(y);
  for (uint64_t y : sk.y) put64(y);
  return out;
}

// The public check of one share: BLAKE2b of its x and pieces, keyed by
// what it is a share of (run, round, sender, recipient, which secret). Shares
// are uniform field elements (t ≥ 2), so the check tells nothing about the
// secret; it only pins the share down.
Secret32 share_check(const SecAggSettings& s, int round, int from, int to, SecretKind kind, const ShamirShare& share) {
  const std::string ctx =
      secagg_internal::share_context(s, round, from, to) + (kind == SecretKind::kSelfMaskSeed ? " b" : " sk");
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(ctx.data()), ctx.size());
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(&share.x), sizeof share.x);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(share.y.data()),
                            share.y.size() * sizeof(share.y[0]));
  Secret32 h{};
  crypto_generichash_final(&st, h.data(), h.size());
  return h;
}

// The two shares in an opened share's plaintext (encode_share's layout).
void decode_share(const std::vector<uint8_t>& plain, ShamirShare* b, ShamirShare* sk) {
  uint32_t x = 0;
  std::memcpy(&x, plain.data() + 4, 4);
  b->x = sk->x = x;
  for (size_t k = 0; k < kShamirPieces; ++k) {
    std::memcpy(&b->y[k], plain.data() + 8 + 8 * k, 8);
    std::memcpy(&sk->y[k], plain.data() + 8 + kShamirPieces * 8 + 8 * k, 8);
  }
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The quantiser's clones: AVX-512 (x86-64-v4: 8 doubles and native 64-bit
// multiplies a vector), AVX2 (4, the multiplies pieced together), and the
// default for older machines. Sanitizer builds take the plain function.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define MEMFL_QUANTISE_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MEMFL_QUANTISE_CLONES
#endif

// Index of the first non-finite value of v[0, n), or n.
MEMFL_QUANTISE_CLONES size_t first_non_finite(const float* v, size_t n) {
  // All-ones exponent: ±inf or NaN. Checked a block at a time so that the
  // common case (none) is one vectorised pass.
  constexpr size_t kBlock = 1024;
  for (size_t a = 0; a < n; a += kBlock) {
    const size_t b = std::min(n, a + kBlock);
    uint32_t any = 0;
    for (size_t i = a; i < b; ++i) {
      uint32_t bits;
      std::memcpy(&bits, v + i, 4);
      any |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
    }
    if (any) {
      for (size_t i = a; i < b; ++i) {
        if (!std::isfinite(v[i])) return i;
      }
    }
  }
  return n;
}

// out[i] = ⌊(clamp(ratio·v[i], −c, c) + c)·scale + u_i⌋, capped at `top`:
// adding u uniform in [0, 1) before the floor rounds up with probability
// equal to the fraction, i.e. stochastic rounding, unbiased. u_i is
// splitmix64 of counter state + (i + 1)·γ (its top 31 bits), so no value
// carries from one element to the next and the loop vectorises. The sum is
// below 2^31 (top < 2^31, checked by the caller), so the conversion is
// to int32, which every vector width has.
MEMFL_QUANTISE_CLONES void quantise_block(const float* v, size_t n, double ratio, double c, double scale, int32_t top,
                                          uint64_t state, uint32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = state + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(static_cast<int32_t>(z >> 33)) * 0x1.0p-31;
    double x = ratio * static_cast<double>(v[i]);
    x = x < -c ? -c : x;
    x = x > c ? c : x;
    const int32_t q = static_cast<int32_t>((x + c) * scale + u);
    out[i] = static_cast<uint32_t>(q < top ? q : top);
  }
}

size_t position(const std::vector<int>& sorted, int client) {
  return static_cast<size_t>(std::lower_bound(sorted.begin(), sorted.end(), client) - sorted.begin());
}

bool contains(const std::vector<int>& sorted, int client) {
  return std::binary_search(sorted.begin(), sorted.end(), client);
}

}  // namespace

namespace secagg_internal {

MaskStream self_mask(const Secret32& b, const SecAggSettings& s, int round, int u) {
  return MaskStream(b, "memfl-secagg-self-mask " + run_context(s, round) + " client=" + std::to_string(u));
}

MaskStream pairwise_mask(const Secret32& seed, const SecAggSettings& s, int round, int u, int v) {
  return MaskStream(seed, "memfl-secagg-pairwise-mask " + run_context(s, round) +
                              " pair=" + std::to_string(std::min(u, v)) + "," + std::to_string(std::max(u, v)));
}

std::string share_context(const SecAggSettings& s, int round, int from, int to) {
  return "memfl-secagg-share " + run_context(s, round) + " from=" + std::to_string(from) + " to=" + std::to_string(to);
}

}  // namespace secagg_internal

ExperimentId secagg_experiment_id(const std::map<std::string, std::string>& identity) {
  const Secret32 nonce = random_secret();
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  const char tag[] = "memfl-secagg-experiment";
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(tag), sizeof tag - 1);
  crypto_generichash_update(&st, nonce.data(), nonce.size());
  // Length-prefixed, so no two identities hash the same bytes.
  const auto put = [&](const std::string& text) {
    const uint64_t n = text.size();
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(&n), sizeof n);
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  };
  for (const auto& [key, value] : identity) {
    put(key);
    put(value);
  }
  ExperimentId id{};
  crypto_generichash_final(&st, id.data(), id.size());
  return id;
}

StatusOr<SecAggSettings> SecAggSettings::resolve(const SecAggParams& p, size_t clients) {
  if (clients == 0) return invalid_argument("secure aggregation with no clients selected");
  if (clients > 65535) return invalid_argument("secure aggregation supports at most 65535 clients a round");
  SecAggSettings s;
  s.clients = clients;
  s.max_weight = p.max_weight;
  s.clipping_range = p.clipping_range;
  s.quantization_range = p.quantization_range;
  s.modulus_range = p.modulus_range;
  const uint64_t m = p.modulus_range;
  if (m < 2 || m > (uint64_t{1} << 32) || (m & (m - 1)) != 0) {
    return invalid_argument("secure_aggregation.modulus_range {} is not a power of two in [2, 2^32]", m);
  }
  if (p.quantization_range < 2 || p.quantization_range > m) {
    return invalid_argument("secure_aggregation.quantization_range {} must be in [2, modulus_range {}]",
                            p.quantization_range, m);
  }
  if (static_cast<double>(clients) * static_cast<double>(p.quantization_range - 1) >= static_cast<double>(m)) {
    return invalid_argument(
        "secure_aggregation: {} clients × (quantization_range {} − 1) reaches modulus_range {}: the sum would wrap",
        clients, p.quantization_range, m);
  }
  if (!(p.clipping_range >= 1.0) || !(p.max_weight > 0)) {
    // The weight ratio (≤ 1) is quantised with the same clipping range.
    return invalid_argument("secure_aggregation: clipping_range must be at least 1 and max_weight positive");
  }
  // The protocol's minimums (Bell et al.; Flower's SecAggPlusWorkflow
  // refuses the same): with k < 3 a client shares only with itself and at
  // most one other, and with t < 2 one share is the secret, so the server
  // could strip a client's masks from what a single client tells it.
  if (clients < 3) {
    return invalid_argument(
        "server_configs.secure_aggregation.enable: secure aggregation needs at least 3 clients a round ({} selected): "
        "with fewer, the sum tells each "
        "client the other's update",
        clients);
  }
  size_t k = p.num_shares <= 1 ? static_cast<size_t>(std::ceil(p.num_shares * static_cast<double>(clients)))
                               : static_cast<size_t>(p.num_shares);
  k = std::min(k, clients);
  if (k < clients && k % 2 == 0) ++k;  // a ring centred on each client: odd
  if (k < 3) {
    return invalid_argument(
        "server_configs.secure_aggregation.num_shares: {} resolves to k = {} with {} clients a round; SecAgg+ needs k "
        ">= 3 "
        "(each client's secrets shared with at least two others)",
        p.num_shares, k, clients);
  }
  s.neighbours = k;
  size_t t = p.reconstruction_threshold <= 1
                 ? static_cast<size_t>(std::ceil(p.reconstruction_threshold * static_cast<double>(s.neighbours)))
                 : static_cast<size_t>(p.reconstruction_threshold);
  if (t < 2 || t > s.neighbours) {
    return invalid_argument(
        "server_configs.secure_aggregation.reconstruction_threshold: {} resolves to t = {} with k = {} shares ({} "
        "clients a "
        "round); it must be in [2, k]",
        p.reconstruction_threshold, t, s.neighbours, clients);
  }
  s.threshold = t;
  return s;
}

std::vector<size_t> neighbourhood(size_t i, const SecAggSettings& s) {
  std::vector<size_t> out;
  if (s.neighbours >= s.clients) {
    for (size_t j = 0; j < s.clients; ++j) out.push_back(j);
    return out;
  }
  const size_t half = (s.neighbours - 1) / 2;
  for (size_t d = 0; d <= 2 * half; ++d) out.push_back((i + s.clients - half + d) % s.clients);
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------- client

SecAggClient::SecAggClient(int client, int round, std::vector<int> selected, SecAggSettings settings)
    : client_(client), round_(round), selected_(std::move(selected)), s_(settings) {
  x_ = static_cast<uint32_t>(position(selected_, client_) + 1);
  c_keys_ = X25519KeyPair::generate();
  s_keys_ = X25519KeyPair::generate();
  b_ = random_secret();
  randombytes_buf(&rng_state_, sizeof rng_state_);
}

SecAggClient::~SecAggClient() {
  sodium_memzero(b_.data(), b_.size());
  sodium_memzero(c_keys_.secret_key.data(), 32);
  sodium_memzero(s_keys_.secret_key.data(), 32);
}

KeyAdvert SecAggClient::advertise() const {
  return KeyAdvert{round_, client_, c_keys_.public_key, s_keys_.public_key, commit(b_, s_, round_, client_)};
}

StatusOr<std::vector<SealedShare>> SecAggClient::share_keys(const std::vector<KeyAdvert>& roster) {
  if (!contains(selected_, client_)) return failed_precondition("client_{} is not selected this round", client_);
  const std::vector<size_t> hood = neighbourhood(x_ - 1, s_);
  std::set<int> expected;
  for (size_t j : hood) expected.insert(selected_[j]);
  std::set<int> seen;
  bool saw_self = false;
  for (const KeyAdvert& a : roster) {
    if (a.round != round_) {
      return invalid_argument("client_{}: the roster has client_{}'s keys of round {} in round {}", client_, a.client,
                              a.round, round_);
    }
    if (!expected.count(a.client)) {
      return invalid_argument("client_{}: the roster has client_{}, not a neighbour", client_, a.client);
    }
    if (!seen.insert(a.client).second) {
      return invalid_argument("client_{}: the roster has client_{} twice", client_, a.client);
    }
    if (a.client == client_) {
      const KeyAdvert mine = advertise();
      if (a.c_public != mine.c_public || a.s_public != mine.s_public || a.b_commitment != mine.b_commitment) {
        return invalid_argument("client_{}: the roster carries other keys under this client's name", client_);
      }
      saw_self = true;
      continue;
    }
    if (a.c_public == a.s_public) {
      return invalid_argument("client_{}: client_{} advertised the same key twice", client_, a.client);
    }
    neighbours_[a.client] = a;
  }
  if (!saw_self) return invalid_argument("client_{}: the roster lacks this client's own keys", client_);
  // Dropping below t neighbours now would leave the client's secrets
  // unrecoverable, and the server could learn too much from the rest.
  if (neighbours_.size() + 1 < s_.threshold) {
    return failed_precondition("client_{}: {} neighbours with keys, fewer than the threshold {}", client_,
                               neighbours_.size() + 1, s_.threshold);
  }
  std::vector<uint32_t> xs;
  std::vector<int> owners;
  for (const auto& [v, a] : neighbours_) {
    xs.push_back(static_cast<uint32_t>(position(selected_, v) + 1));
    owners.push_back(v);
  }
  xs.push_back(x_);
  owners.push_back(client_);
  MEMFL_ASSIGN_OR_RETURN(std::vector<ShamirShare> b_shares, shamir_split(b_, s_.threshold, xs));
  MEMFL_ASSIGN_OR_RETURN(std::vector<ShamirShare> sk_shares, shamir_split(s_keys_.secret_key, s_.threshold, xs));
  std::vector<SealedShare> out;
  for (size_t i = 0; i < owners.size(); ++i) {
    const int v = owners[i];
    if (v == client_) {
      // Its own share goes through the server like any other, sealed to
      // itself, so unmasking treats every share alike.
      MEMFL_ASSIGN_OR_RETURN(Secret32 self_key, agree(c_keys_.secret_key, c_keys_.public_key, c_keys_.public_key,
                                                      "memfl-secagg-share-key"));
      share_keys_[v] = self_key;
    } else {
      const KeyAdvert& a = neighbours_[v];
      MEMFL_ASSIGN_OR_RETURN(Secret32 k,
                             agree(c_keys_.secret_key, c_keys_.public_key, a.c_public, "memfl-secagg-share-key"));
      share_keys_[v] = k;
      MEMFL_ASSIGN_OR_RETURN(Secret32 seed,
                             agree(s_keys_.secret_key, s_keys_.public_key, a.s_public, "memfl-secagg-pairwise-mask"));
      pairwise_.emplace_back(v, secagg_internal::pairwise_mask(seed, s_, round_, client_, v));
      sodium_memzero(seed.data(), seed.size());
    }
    std::vector<uint8_t> plain = encode_share(client_, b_shares[i], sk_shares[i]);
    out.push_back(SealedShare{round_, client_, v,
                              seal(share_keys_[v], plain, secagg_internal::share_context(s_, round_, client_, v)),
                              share_check(s_, round_, client_, v, SecretKind::kSelfMaskSeed, b_shares[i]),
                              share_check(s_, round_, client_, v, SecretKind::kMaskingKey, sk_shares[i])});
    sodium_memzero(plain.data(), plain.size());
  }
  self_mask_.emplace(secagg_internal::self_mask(b_, s_, round_, client_));
  return out;
}

StatusOr<std::vector<int>> SecAggClient::receive_shares(std::vector<SealedShare> inbox) {
  std::vector<int> refused;
  for (SealedShare& s : inbox) {
    if (s.round != round_) {
      return invalid_argument("client_{}: a share from client_{} of round {} in round {}", client_, s.from, s.round,
                              round_);
    }
    if (s.to != client_) {
      return invalid_argument("client_{}: a share from client_{} addressed to client_{}", client_, s.from, s.to);
    }
    if (s.from != client_ && !neighbours_.count(s.from)) {
      return invalid_argument("client_{}: a share from client_{}, not a neighbour", client_, s.from);
    }
    if (s.sealed.size() != kSharePlain + kSealOverhead) {
      return invalid_argument("client_{}: the share from client_{} is {} bytes, not {}", client_, s.from,
                              s.sealed.size(), kSharePlain + kSealOverhead);
    }
    const int from = s.from;
    if (inbox_.count(from) || std::find(refused.begin(), refused.end(), from) != refused.end()) {
      return invalid_argument("client_{}: client_{} sent it two shares", client_, from);
    }
    // Opened now, not at unmasking: a share that does not open (or does
    // not match the checks the server routes with it) names its sender
    // while the round can still go on without it.
    auto key = share_keys_.find(from);
    if (key == share_keys_.end()) {
      return failed_precondition("client_{}: a share from client_{} before this client shared its keys", client_, from);
    }
    auto opened = open_sealed(key->second, s.sealed, secagg_internal::share_context(s_, round_, from, client_));
    bool good = opened.ok();
    if (good) {
      std::vector<uint8_t> plain = std::move(opened).value();
      uint32_t subject = 0;
      std::memcpy(&subject, plain.data(), 4);
      ShamirShare b, sk;
      decode_share(plain, &b, &sk);
      good = static_cast<int>(subject) == from && b.x == x_ &&
             share_check(s_, round_, from, client_, SecretKind::kSelfMaskSeed, b) == s.b_check &&
             share_check(s_, round_, from, client_, SecretKind::kMaskingKey, sk) == s.sk_check;
      sodium_memzero(plain.data(), plain.size());
      sodium_memzero(b.y.data(), sizeof b.y);
      sodium_memzero(sk.y.data(), sizeof sk.y);
    }
    if (!good) {
      refused.push_back(from);
      continue;
    }
    inbox_.emplace(from, std::move(s));
  }
  return refused;
}

Status SecAggClient::begin_update(uint64_t model_elements, double sample_count) {
  if (!self_mask_) return failed_precondition("client_{}: masking before the keys were shared", client_);
  if (!std::isfinite(sample_count) || sample_count < 0) {
    return invalid_argument("client_{}: sample count {} is not a finite non-negative number", client_, sample_count);
  }
  // Masks pair only with neighbours whose shares arrived: a neighbour that
  // advertised keys but never shared is not among the clients the server
  // can unmask for (Bell et al.'s U2), so no mask of it may enter the sum.
  std::erase_if(pairwise_, [&](const auto& pm) { return inbox_.count(pm.first) == 0; });
  // The tags' key: agreed with the server's key of this round, for this
  // run, round and client, so nobody else (another client, whoever replays
  // an upload of another round) can tag words in this client's name.
  auto key = agree(c_keys_.secret_key, c_keys_.public_key, s_.server_public, tag_purpose(s_, round_, client_));
  if (!key.ok()) {
    return key.status().with_context(fmt::format("client_{}: the server's key of round {}", client_, round_));
  }
  tag_keys_.emplace(*key, kTagKeyStream);
  sodium_memzero(key->data(), key->size());
  model_elements_ = model_elements;
  ratio_ = std::min(sample_count, s_.max_weight) / s_.max_weight;
  return Status::Ok();
}

StatusOr<UploadTag> SecAggClient::tag(uint64_t element_offset, std::span<const uint32_t> words) const {
  if (!tag_keys_) return failed_precondition("client_{}: a tag asked for before its upload began", client_);
  return upload_tag(*tag_keys_, element_offset, words);
}

uint32_t SecAggClient::quantise(double v) {
  const double c = s_.clipping_range;
  const double scaled = (std::clamp(v, -c, c) + c) * s_.scale();
  const double fl = std::floor(scaled);
  // Stochastic rounding: up with probability (scaled − floor), so the
  // quantised value is unbiased.
  const double u = static_cast<double>(splitmix64(rng_state_) >> 11) * 0x1.0p-53;
  double q = fl + (u < scaled - fl ? 1.0 : 0.0);
  q = std::min(q, static_cast<double>(s_.quantization_range - 1));
  return static_cast<uint32_t>(q);
}

void SecAggClient::add_masks(uint64_t element_offset, std::span<uint32_t> out) const {
  // The keystreams are the cost (4–6 GB/s a core each): a big chunk is cut
  // among the cores; each word gets the same masks whatever the cut.
  parallel_for(out.size(), kParallelMaskWords,
               [&](size_t a, size_t b) { apply_masks(element_offset + a, out.subspan(a, b - a)); });
}

void SecAggClient::apply_masks(uint64_t element_offset, std::span<uint32_t> out) const {
  self_mask_->apply(element_offset, out, +1);
  for (const auto& [v, mask] : pairwise_) mask.apply(element_offset, out, client_ < v ? +1 : -1);
}

Status SecAggClient::mask_chunk(uint64_t element_offset, std::span<const float> values, std::span<uint32_t> out) {
  if (out.size() != values.size())
    return internal_error("mask_chunk: {} values into {} words", values.size(), out.size());
  if (element_offset + values.size() > model_elements_) {
    return internal_error("mask_chunk: elements up to {} of an update of {}", element_offset + values.size(),
                          model_elements_);
  }
  // A non-finite value would quantise to an edge and hide a broken update;
  // the client refuses to send it.
  if (const size_t bad = first_non_finite(values.data(), values.size()); bad < values.size()) {
    return rejected("client_{}: element {} of its update is not finite", client_, element_offset + bad);
  }
  const uint64_t top = s_.quantization_range - 1;
  if (top >= (uint64_t{1} << 31) - 1) {
    for (size_t i = 0; i < values.size(); ++i) out[i] = quantise(ratio_ * static_cast<double>(values[i]));
    add_masks(element_offset, out);
    return Status::Ok();
  }
  // Quantised and masked together, a cache-sized block at a time, the
  // chunk cut among the cores: each block's words stay in cache while its
  // k masks are added. Element i's rounding draw is counter i of this
  // chunk, so the words are the same whatever the cut.
  constexpr size_t kBlock = 16384;
  const uint64_t state = rng_state_;
  parallel_for(values.size(), kParallelMaskWords, [&](size_t a, size_t b) {
    for (size_t lo = a; lo < b; lo += kBlock) {
      const size_t n = std::min(kBlock, b - lo);
      quantise_block(values.data() + lo, n, ratio_, s_.clipping_range, s_.scale(), static_cast<int32_t>(top),
                     state + static_cast<uint64_t>(lo) * 0x9E3779B97F4A7C15ull, out.data() + lo);
      apply_masks(element_offset + lo, out.subspan(lo, n));
    }
  });
  rng_state_ += static_cast<uint64_t>(values.size()) * 0x9E3779B97F4A7C15ull;
  return Status::Ok();
}

uint32_t SecAggClient::masked_weight() {
  uint32_t w = quantise(ratio_);
  add_masks(model_elements_, std::span<uint32_t>(&w, 1));
  return w;
}

StatusOr<std::vector<RevealedShare>> SecAggClient::unmask(const UnmaskRequest& request) {
  if (request.round != round_) {
    return invalid_argument("client_{}: an unmask request of round {} in round {}", client_, request.round, round_);
  }
  if (revealed_) return failed_precondition("client_{}: asked to unmask twice in round {}", client_, round_);
  std::set<int> survivors(request.survivors.begin(), request.survivors.end());
  std::set<int> dropped(request.dropped.begin(), request.dropped.end());
  if (survivors.size() != request.survivors.size() || dropped.size() != request.dropped.size()) {
    return invalid_argument("client_{}: the unmask request lists a client twice", client_);
  }
  for (int d : dropped) {
    // Revealing both b and the s key of one client would unmask its update.
    if (survivors.count(d)) {
      return invalid_argument("client_{}: the unmask request has client_{} both surviving and dropped", client_, d);
    }
  }
  if (!survivors.count(client_)) return invalid_argument("client_{}: the unmask request drops this client", client_);
  size_t surviving_neighbours = 1;
  for (const auto& [v, a] : neighbours_) surviving_neighbours += survivors.count(v);
  if (surviving_neighbours < s_.threshold) {
    return failed_precondition("client_{}: {} surviving neighbours, fewer than the threshold {}", client_,
                               surviving_neighbours, s_.threshold);
  }
  std::vector<RevealedShare> out;
  for (const auto& [from, sealed] : inbox_) {
    const bool surv = survivors.count(from) > 0, drop = dropped.count(from) > 0;
    if (!surv && !drop) continue;
    auto opened =
        open_sealed(share_keys_.at(from), sealed.sealed, secagg_internal::share_context(s_, round_, from, client_));
    if (!opened.ok()) {
      return opened.status().with_context(fmt::format("client_{}: the share from client_{}", client_, from));
    }
    std::vector<uint8_t> plain = std::move(opened).value();
    uint32_t subject = 0, x = 0;
    std::memcpy(&subject, plain.data(), 4);
    std::memcpy(&x, plain.data() + 4, 4);
    if (static_cast<int>(subject) != from || x != x_) {
      return invalid_argument("client_{}: the share from client_{} names client_{} at x {} (expected x {})", client_,
                              from, subject, x, x_);
    }
    RevealedShare r{round_, client_, from, surv ? SecretKind::kSelfMaskSeed : SecretKind::kMaskingKey, {}};
    r.share.x = x;
    const uint8_t* ys = plain.data() + 8 + (surv ? 0 : kShamirPieces * 8);
    for (size_t k = 0; k < kShamirPieces; ++k) std::memcpy(&r.share.y[k], ys + 8 * k, 8);
    out.push_back(r);
    sodium_memzero(plain.data(), plain.size());
  }
  revealed_ = true;
  return out;
}

// ---------------------------------------------------------------- server

SecAggServer::SecAggServer(int round, std::vector<int> selected, SecAggSettings settings, std::span<uint32_t> sum)
    : SecAggServer(round, std::move(selected), settings, sum.first(sum.size() - 1), &sum.back()) {}

SecAggServer::SecAggServer(int round, std::vector<int> selected, SecAggSettings settings, std::span<uint32_t> body,
                           uint32_t* tail)
    : round_(round),
      selected_(std::move(selected)),
      s_(settings),
      keys_(X25519KeyPair::generate()),
      body_(body),
      tail_(tail) {
  s_.server_public = keys_.public_key;
  std::sort(selected_.begin(), selected_.end());
  for (size_t i = 0; i < selected_.size(); ++i) peers_[selected_[i]].x = static_cast<uint32_t>(i + 1);
  std::fill(body_.begin(), body_.end(), 0u);
  *tail_ = 0;
}

SecAggServer::~SecAggServer() { sodium_memzero(keys_.secret_key.data(), keys_.secret_key.size()); }

StatusOr<SecAggServer::Peer*> SecAggServer::peer(int client, const char* stage) {
  auto it = peers_.find(client);
  if (it == peers_.end()) {
    return invalid_argument("client_{}: {} from a client not selected for round {}", client, stage, round_);
  }
  return &it->second;
}

const SecAggServer::Peer* SecAggServer::find(int client) const {
  auto it = peers_.find(client);
  return it == peers_.end() ? nullptr : &it->second;
}

Status SecAggServer::add_advert(const KeyAdvert& a) {
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(a.client, "keys"));
  if (a.round != round_) {
    return invalid_argument("client_{}: keys of round {} sent in round {} (replayed?)", a.client, a.round, round_);
  }
  if (p->advert) return invalid_argument("client_{}: sent its keys twice in round {}", a.client, round_);
  for (const auto& [c, q] : peers_) {
    if (q.advert && (q.advert->c_public == a.c_public || q.advert->s_public == a.s_public)) {
      return invalid_argument("client_{}: advertised client_{}'s public key", a.client, c);
    }
  }
  auto key = agree(keys_.secret_key, keys_.public_key, a.c_public, tag_purpose(s_, round_, a.client));
  if (!key.ok()) return key.status().with_context(fmt::format("client_{}: its keys", a.client));
  p->tag_keys.emplace(*key, kTagKeyStream);
  sodium_memzero(key->data(), key->size());
  p->advert = a;
  return Status::Ok();
}

std::vector<KeyAdvert> SecAggServer::roster_for(int client) const {
  std::vector<KeyAdvert> out;
  const Peer* me = find(client);
  if (me == nullptr) return out;
  for (size_t j : neighbourhood(me->x - 1, s_)) {
    const Peer& q = peers_.at(selected_[j]);
    if (q.advert) out.push_back(*q.advert);
  }
  return out;
}

Status SecAggServer::add_shares(int client, const std::vector<SealedShare>& shares) {
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(client, "shares"));
  if (!p->advert) return failed_precondition("client_{}: sent shares before its keys", client);
  if (p->shared) return invalid_argument("client_{}: sent its shares twice in round {}", client, round_);
  std::set<int> hood, seen;
  for (const KeyAdvert& a : roster_for(client)) hood.insert(a.client);
  for (const SealedShare& s : shares) {
    if (s.round != round_) {
      return invalid_argument("client_{}: a share of round {} sent in round {} (replayed?)", client, s.round, round_);
    }
    if (s.from != client) return invalid_argument("client_{}: a share claiming to come from client_{}", client, s.from);
    if (!hood.count(s.to)) return invalid_argument("client_{}: a share for client_{}, not a neighbour", client, s.to);
    if (!seen.insert(s.to).second) return invalid_argument("client_{}: two shares for client_{}", client, s.to);
    if (s.sealed.size() != kSharePlain + kSealOverhead) {
      return invalid_argument("client_{}: a share of {} bytes, not {}", client, s.sealed.size(),
                              kSharePlain + kSealOverhead);
    }
  }
  if (seen.size() != hood.size()) {
    return invalid_argument("client_{}: {} shares for {} neighbours", client, seen.size(), hood.size());
  }
  for (const SealedShare& s : shares) inboxes_[s.to].push_back(s);
  p->shared = true;
  return Status::Ok();
}

std::vector<SealedShare> SecAggServer::inbox_for(int client) const {
  auto it = inboxes_.find(client);
  return it == inboxes_.end() ? std::vector<SealedShare>{} : it->second;
}

StatusOr<std::vector<int>> SecAggServer::shares_refused(int recipient, const std::vector<int>& senders) {
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(recipient, "a report of shares that do not open"));
  (void)p;
  const auto& inbox = inboxes_[recipient];
  std::vector<int> out;
  for (int from : senders) {
    const bool routed = std::any_of(inbox.begin(), inbox.end(), [&](const SealedShare& s) { return s.from == from; });
    if (!routed || from == recipient) {
      return invalid_argument("client_{}: reports client_{}'s share as not opening, but was sent none", recipient,
                              from);
    }
    if (unpaired_.insert({recipient, from}).second) out.push_back(from);
  }
  return out;
}

StatusOr<SecAggServer::CheckedFrame> SecAggServer::check_tag(int client, uint64_t element_offset,
                                                             std::span<const uint32_t> chunk,
                                                             const UploadTag& tag) const {
  const Peer* p = find(client);
  if (p == nullptr) {
    return invalid_argument("client_{}: a masked chunk from a client not selected for round {}", client, round_);
  }
  if (!p->tag_keys) return failed_precondition("client_{}: a masked chunk before it advertised its keys", client);
  // Before a word is summed: once in, no word can be taken out again
  // without revealing the rest of the upload.
  if (const UploadTag want = upload_tag(*p->tag_keys, element_offset, chunk);
      sodium_memcmp(want.data(), tag.data(), want.size()) != 0) {
    return rejected(
        "client_{}: the masked words at element {} do not carry their tag for round {} of this run: made for another "
        "round, another run or another client (a replay), or not made by client_{}",
        client, element_offset, round_, client);
  }
  return CheckedFrame(client, element_offset, chunk);
}

Status SecAggServer::add_masked_chunk(int client, uint64_t element_offset, std::span<const uint32_t> chunk,
                                      const UploadTag& tag) {
  MEMFL_ASSIGN_OR_RETURN(CheckedFrame frame, check_tag(client, element_offset, chunk, tag));
  return add_masked_chunk(frame);
}

Status SecAggServer::add_masked_chunk(const CheckedFrame& frame) {
  const int client = frame.client_;
  const uint64_t element_offset = frame.element_offset_;
  const std::span<const uint32_t> chunk = frame.words_;
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(client, "a masked chunk"));
  if (!p->shared) return failed_precondition("client_{}: a masked chunk before it shared its keys", client);
  if (request_made_) return failed_precondition("client_{}: a masked chunk after unmasking began", client);
  if (p->complete) return invalid_argument("client_{}: a masked chunk after its upload was complete", client);
  if (element_offset != p->uploaded) {
    return invalid_argument("client_{}: masked chunk at element {}, expected {} (repeated or out of order)", client,
                            element_offset, p->uploaded);
  }
  const uint64_t total = total_elements();
  if (chunk.size() > total - element_offset) {
    return invalid_argument("client_{}: masked vector longer than {} elements (chunk at {} of {})", client, total,
                            element_offset, chunk.size());
  }
  // Unsigned addition wraps mod 2^32, and 2^32 is a multiple of every
  // allowed modulus: the sum is reduced once, when it is unmasked.
  const size_t in_body = std::min<uint64_t>(chunk.size(), body_.size() - element_offset);
  uint32_t* dst = body_.data() + element_offset;
  for (size_t i = 0; i < in_body; ++i) dst[i] += chunk[i];
  if (in_body < chunk.size()) *tail_ += chunk[in_body];  // the weight's word
  p->uploaded += chunk.size();
  return Status::Ok();
}

Status SecAggServer::finish_upload(int client) {
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(client, "the end of an upload"));
  if (p->uploaded != total_elements()) {
    return invalid_argument("client_{}: masked vector of {} elements, expected {}", client, p->uploaded,
                            total_elements());
  }
  p->complete = true;
  return Status::Ok();
}

StatusOr<UnmaskRequest> SecAggServer::unmask_request() {
  survivors_.clear();
  dropped_.clear();
  for (const auto& [c, p] : peers_) {
    if (p.uploaded > 0 && !p.complete) {
      return aborted("client_{}: its upload broke after {} of {} masked elements were summed; the round is redone", c,
                     p.uploaded, total_elements());
    }
    if (p.complete) {
      survivors_.push_back(c);
    } else if (p.shared) {
      dropped_.push_back(c);  // its pairwise masks are in survivors' uploads
    }
  }
  if (survivors_.empty()) return aborted("round {}: no client completed its masked upload", round_);
  for (int u : survivors_) {
    size_t alive = 0;
    for (size_t j : neighbourhood(peers_.at(u).x - 1, s_)) alive += peers_.at(selected_[j]).complete;
    if (alive < s_.threshold) {
      return aborted("client_{}: {} of its neighbours survived, fewer than the threshold {}; the round is redone", u,
                     alive, s_.threshold);
    }
  }
  request_made_ = true;
  return UnmaskRequest{round_, survivors_, dropped_};
}

Status SecAggServer::add_revealed(int client, const std::vector<RevealedShare>& shares) {
  MEMFL_ASSIGN_OR_RETURN(Peer * p, peer(client, "revealed shares"));
  if (!request_made_) return failed_precondition("client_{}: revealed shares before the unmask request", client);
  if (!p->complete) return invalid_argument("client_{}: revealed shares but is not a survivor", client);
  if (p->revealed) return invalid_argument("client_{}: revealed its shares twice in round {}", client, round_);
  std::set<std::pair<int, SecretKind>> seen;
  for (const RevealedShare& r : shares) {
    if (r.round != round_) {
      return invalid_argument("client_{}: a revealed share of round {} in round {} (replayed?)", client, r.round,
                              round_);
    }
    if (r.from != client) return invalid_argument("client_{}: a share revealed in client_{}'s name", client, r.from);
    if (r.share.x != p->x) {
      return invalid_argument("client_{}: a revealed share at x {}, its x is {}", client, r.share.x, p->x);
    }
    const bool want =
        r.kind == SecretKind::kSelfMaskSeed ? contains(survivors_, r.subject) : contains(dropped_, r.subject);
    if (!want) {
      return invalid_argument("client_{}: revealed a share of client_{} that was not asked for", client, r.subject);
    }
    if (!seen.insert({r.subject, r.kind}).second) {
      return invalid_argument("client_{}: revealed two shares of client_{}", client, r.subject);
    }
    for (uint64_t y : r.share.y) {
      if (y >= kShamirPrime) return invalid_argument("client_{}: a revealed share outside the field", client);
    }
    // The share must be the one its subject sealed for this client (whose
    // check this client confirmed when it opened it): a wrong one is this
    // client's doing, whatever t is.
    const auto& inbox = inboxes_[client];
    auto sealed = std::find_if(inbox.begin(), inbox.end(), [&](const SealedShare& s) { return s.from == r.subject; });
    if (sealed == inbox.end() || unpaired_.count({client, r.subject})) {
      return rejected("client_{}: revealed a share of client_{} that it was never sent", client, r.subject);
    }
    const Secret32& check = r.kind == SecretKind::kSelfMaskSeed ? sealed->b_check : sealed->sk_check;
    if (share_check(s_, round_, r.subject, client, r.kind, r.share) != check) {
      return rejected("client_{}: its share of client_{}'s {} is not the one client_{} sealed for it", client,
                      r.subject, r.kind == SecretKind::kSelfMaskSeed ? "self-mask seed" : "masking key", r.subject);
    }
  }
  for (const RevealedShare& r : shares) revealed_[{r.subject, r.kind}].emplace_back(client, r.share);
  p->revealed = true;
  return Status::Ok();
}

Status SecAggServer::reconstruct() {
  if (!request_made_) return failed_precondition("round {}: reconstruct before the unmask request", round_);
  // One secret from its shares: the first t, checked; when that fails and
  // more than t came, the share whose replacement fixes it is the bad one.
  const auto recover = [&](int subject, SecretKind kind, const auto& valid, Secret32* out) -> Status {
    auto& got = revealed_[{subject, kind}];
    const char* what = kind == SecretKind::kSelfMaskSeed ? "self-mask seed" : "masking key";
    if (got.size() < s_.threshold) {
      return aborted("client_{}: {} shares of its {} came back, fewer than the threshold {}; the round is redone",
                     subject, got.size(), what, s_.threshold);
    }
    std::vector<ShamirShare> sh;
    for (const auto& [from, share] : got) sh.push_back(share);
    if (shamir_reconstruct(sh, s_.threshold, out).ok() && valid(*out)) return Status::Ok();
    for (size_t bad = 0; bad < s_.threshold; ++bad) {
      for (size_t spare = s_.threshold; spare < sh.size(); ++spare) {
        std::vector<ShamirShare> trial(sh.begin(), sh.begin() + static_cast<long>(s_.threshold));
        trial[bad] = sh[spare];
        if (shamir_reconstruct(trial, s_.threshold, out).ok() && valid(*out)) {
          wrong_revealers_.push_back(got[bad].first);
          return rejected("client_{}: its share of client_{}'s {} is wrong", got[bad].first, subject, what);
        }
      }
    }
    std::string who;
    for (const auto& [from, share] : got) who += (who.empty() ? "client_" : ", client_") + std::to_string(from);
    return rejected("client_{}'s {} does not reconstruct from the shares of {}: one of them is wrong", subject, what,
                    who);
  };
  self_masks_.clear();
  dropped_pairwise_.clear();
  for (int u : survivors_) {
    const Secret32 commitment = peers_.at(u).advert->b_commitment;
    Secret32 b{};
    MEMFL_RETURN_IF_ERROR(recover(
        u, SecretKind::kSelfMaskSeed, [&](const Secret32& s) { return commit(s, s_, round_, u) == commitment; }, &b));
    self_masks_.emplace_back(secagg_internal::self_mask(b, s_, round_, u));
    sodium_memzero(b.data(), b.size());
  }
  for (int d : dropped_) {
    // Only the survivors that paired a mask with d need d's key: none (all
    // refused its share) and it stays secret.
    bool paired = false;
    for (size_t j : neighbourhood(peers_.at(d).x - 1, s_)) {
      const int u = selected_[j];
      paired = paired || (contains(survivors_, u) && !unpaired_.count({u, d}));
    }
    if (!paired) continue;
    const PublicKey32 pub = peers_.at(d).advert->s_public;
    Secret32 sk{};
    MEMFL_RETURN_IF_ERROR(recover(
        d, SecretKind::kMaskingKey, [&](const Secret32& s) { return X25519KeyPair::from_secret(s).public_key == pub; },
        &sk));
    for (size_t j : neighbourhood(peers_.at(d).x - 1, s_)) {
      const int u = selected_[j];
      // A survivor that could not open d's share paired no mask with d.
      if (!contains(survivors_, u) || unpaired_.count({u, d})) continue;
      MEMFL_ASSIGN_OR_RETURN(Secret32 seed,
                             agree(sk, pub, peers_.at(u).advert->s_public, "memfl-secagg-pairwise-mask"));
      // Survivor u added sign(u, d)·PRG(s_ud); that is what comes off.
      dropped_pairwise_.emplace_back(u < d ? +1 : -1, secagg_internal::pairwise_mask(seed, s_, round_, u, d));
      sodium_memzero(seed.data(), seed.size());
    }
    sodium_memzero(sk.data(), sk.size());
  }
  reconstructed_ = true;
  return Status::Ok();
}

Status SecAggServer::unmask_chunk(uint64_t element_offset, std::span<uint32_t> chunk) const {
  if (!reconstructed_) return failed_precondition("round {}: unmasking before the secrets were reconstructed", round_);
  if (element_offset > total_elements() || chunk.size() > total_elements() - element_offset) {
    return internal_error("unmask_chunk: elements [{}, +{}) of {}", element_offset, chunk.size(), total_elements());
  }
  // Cut among the cores as the clients' masking is (same words, any cut).
  parallel_for(chunk.size(), kParallelMaskWords, [&](size_t a, size_t b) {
    auto part = chunk.subspan(a, b - a);
    for (const MaskStream& m : self_masks_) m.apply(element_offset + a, part, -1);
    for (const auto& [sign, mask] : dropped_pairwise_) mask.apply(element_offset + a, part, -sign);
    if (s_.modulus_range < (uint64_t{1} << 32)) {
      const auto m = static_cast<uint32_t>(s_.modulus_range - 1);
      for (uint32_t& w : part) w &= m;
    }
  });
  return Status::Ok();
}

double SecAggServer::total_weight(uint32_t unmasked_weight_word) const {
  const double n = static_cast<double>(survivors_.size());
  return static_cast<double>(unmasked_weight_word) / s_.scale() - n * s_.clipping_range;
}

void SecAggServer::dequantize(std::span<const uint32_t> unmasked, double total_weight, std::span<float> out) const {
  const double inv_scale = 1.0 / s_.scale(), shift = static_cast<double>(survivors_.size()) * s_.clipping_range;
  const double inv_w = 1.0 / total_weight;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<float>((static_cast<double>(unmasked[i]) * inv_scale - shift) * inv_w);
  }
}

}  // namespace memfl
