// Secure aggregation, SecAgg+ (Bell et al. 2020; SecAgg, Bonawitz et al.
// 2017, is the case where every client is every other's neighbour), with
// Flower's SecAggPlusWorkflow quantisation, as a pair of transport-free
// state machines: SecAggClient (one per client per round) and SecAggServer
// (one per round). A transport carries their small messages; the update
// itself streams as masked 32-bit words, chunk by chunk, and the server sums
// them modulo modulus_range as they arrive and unmasks the sum chunk by
// chunk, regenerating each mask stream at the chunk's offset. Nobody holds
// a whole mask, and the server never holds an individual update unmasked.
//
// A round, for selected clients sorted by id (x = position + 1 is each
// client's Shamir x):
//   1. setup: each client advertises two X25519 public keys (c: to seal
//      shares; s: to agree pairwise mask seeds) and a BLAKE2b commitment to
//      its self-mask seed b.
//   2. share keys: the server hands each client its neighbours' adverts (a
//      ring of num_shares clients centred on it; all of them for SecAgg);
//      each client Shamir-splits b and its s secret key (threshold t) and
//      seals one share for each neighbour; the server routes the sealed
//      shares.
//   3. collect masked vectors: the update y (model elements, then the
//      weight) is weighted, clipped, stochastically quantised to
//      [0, quantization_range), and masked:
//        y + PRG(b) + Σ_{v neighbour} sign(u, v)·PRG(s_uv)  (mod 2^32)
//      with sign +1 when u < v, −1 otherwise. Each frame carries a Poly1305
//      tag under a key only the client and the server agree (the client's
//      c key with the server's key of the round); the server checks it,
//      then adds the frame's words into its sum.
//   4. unmask: survivors (whole uploads) reveal their shares of each
//      surviving neighbour's b and each dropped neighbour's s key; the
//      server reconstructs them (checked against the adverts), subtracts
//      PRG(b) of every survivor and the dropped clients' pairwise masks, and
//      dequantises: mean = (Σ y·2c/(q−1) − n·c) / Σ weight.
// A client whose upload broke after some of its chunks were summed cannot
// be taken out without revealing that part of its update: the round fails
// (kAborted) and is redone. Bad peer input (wrong round, unknown or
// repeated sender, wrong length or offset, a share that does not open or
// does not reconstruct its committed secret, masked words whose tag does
// not check) is refused naming the client.
//
// Everything a round makes is bound to the run (SecAggSettings::experiment),
// the round and the clients it is for: the masks' keystream nonces, the
// sealed shares' associated data, the shares' checks, the commitments and
// the upload tags' keys. So a sealed share or masked upload of another run
// or round, or made for another client, does not open or does not check.
//
//   SecAggServer server(round, selected, settings, sum_words);
//   clients are made with server.settings() (it carries the server's key)
//   for each client: server.add_advert(client.advertise());
//   for each client: server.add_shares(c, client.share_keys(server.roster_for(c)));
//   for each client: client.receive_shares(server.inbox_for(c)); then its masked
//                    chunks: server.add_masked_chunk(c, offset, chunk, client.tag(offset, chunk)) …;
//                    server.finish_upload(c);
//   MEMFL_ASSIGN_OR_RETURN(UnmaskRequest req, server.unmask_request());
//   for each survivor: server.add_revealed(c, client.unmask(req));
//   MEMFL_RETURN_IF_ERROR(server.reconstruct());
//   for each chunk: server.unmask_chunk(offset, sum_chunk) then dequantize(…);
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "secagg/crypto.h"
#include "secagg/shamir.h"

namespace memfl {

// Flower's names; num_shares and reconstruction_threshold are proportions
// at most 1 and counts above 1, resolved for the round's client count.
struct SecAggParams {
  double num_shares = 1.0;
  double reconstruction_threshold = 0.67;
  double max_weight = 1000;
  double clipping_range = 8.0;
  uint64_t quantization_range = 1 << 22;
  uint64_t modulus_range = uint64_t{1} << 32;
};

// Which run a round belongs to: BLAKE2b of the experiment's identity and a
// random nonce drawn when the run starts (secagg_experiment_id). Not secret:
// the server announces it with the round's settings.
using ExperimentId = std::array<uint8_t, 32>;

// The identity's keys and values (config.h's experiment_identity) hashed
// with 32 random bytes: two runs of one config get different ids.
ExperimentId secagg_experiment_id(const std::map<std::string, std::string>& identity);

// The round's settings with the counts resolved.
struct SecAggSettings {
  size_t clients = 0;     // selected this round
  size_t neighbours = 0;  // k: clients in each neighbourhood, the client itself included (odd, or all)
  size_t threshold = 0;   // t: shares that reconstruct a secret
  double max_weight = 1000, clipping_range = 8.0;
  uint64_t quantization_range = 1 << 22, modulus_range = uint64_t{1} << 32;
  // The run (see the file's comment) and the server's X25519 key of the
  // round, with which each client agrees the key of its upload's tags: both
  // announced with the settings (SecAggServer::settings fills the key).
  ExperimentId experiment{};
  PublicKey32 server_public{};
  // Refuses settings that cannot work: t > k, t < 1, a sum that can wrap
  // the modulus, a modulus that is not a power of two ≤ 2^32.
  static StatusOr<SecAggSettings> resolve(const SecAggParams& p, size_t clients);
  // Quantisation: y = (clip(v) + c) · scale, scale = (q − 1) / 2c.
  double scale() const { return static_cast<double>(quantization_range - 1) / (2 * clipping_range); }
};

// Which clients (positions in the round's sorted list) are neighbours of
// position `i`: a ring of `neighbours` positions centred on it.
std::vector<size_t> neighbourhood(size_t i, const SecAggSettings& s);

struct KeyAdvert {
  int round = -1;
  int client = -1;
  PublicKey32 c_public{}, s_public{};
  Secret32 b_commitment{};  // BLAKE2b of the self-mask seed
};

struct SealedShare {
  int round = -1;
  int from = -1, to = -1;
  std::vector<uint8_t> sealed;
  // BLAKE2b of the two shares inside (of b, of the s secret key), bound to
  // round, sender and recipient: the recipient checks them when the share
  // opens, the server checks a revealed share against them, so a share that
  // is wrong names who made it wrong even with exactly t shares.
  Secret32 b_check{}, sk_check{};
};

struct UnmaskRequest {
  int round = -1;
  std::vector<int> survivors, dropped;  // sorted
};

enum class SecretKind : uint8_t { kSelfMaskSeed = 1, kMaskingKey = 2 };

struct RevealedShare {
  int round = -1;
  int from = -1;     // who reveals it
  int subject = -1;  // whose secret it is a share of
  SecretKind kind = SecretKind::kSelfMaskSeed;
  ShamirShare share;
};

class SecAggClient {
 public:
  // `selected`: the round's clients, sorted; `client` among them.
  SecAggClient(int client, int round, std::vector<int> selected, SecAggSettings settings);
  ~SecAggClient();
  SecAggClient(const SecAggClient&) = delete;
  SecAggClient& operator=(const SecAggClient&) = delete;

  KeyAdvert advertise() const;
  // Stage 2: the neighbours' adverts (its own among them, unchanged) →
  // one sealed share for each neighbour.
  StatusOr<std::vector<SealedShare>> share_keys(const std::vector<KeyAdvert>& roster);
  // The sealed shares neighbours sent it, each opened and checked now and
  // kept sealed until unmasking. Returns the senders whose share does not
  // open or does not match its checks: those shares are left out (and no
  // mask is paired with their senders); the server drops the senders.
  StatusOr<std::vector<int>> receive_shares(std::vector<SealedShare> inbox);
  // Stage 3: starts a masked update of `model_elements` values (the weight
  // is element `model_elements`); `sample_count` gives the weight.
  Status begin_update(uint64_t model_elements, double sample_count);
  // Weights, clips, quantises and masks values[i] (element offset + i) into out.
  Status mask_chunk(uint64_t element_offset, std::span<const float> values, std::span<uint32_t> out);
  // The masked weight: the update's last element.
  uint32_t masked_weight();
  // The tag of one frame: masked words [element_offset, + words.size()),
  // under the key this client agreed with the server for this upload.
  StatusOr<UploadTag> tag(uint64_t element_offset, std::span<const uint32_t> words) const;
  // Stage 4: the shares the server asked for, checked against the round.
  StatusOr<std::vector<RevealedShare>> unmask(const UnmaskRequest& request);

  int client() const { return client_; }
  uint32_t x() const { return x_; }

 private:
  // Every mask this client adds (its self mask, ± each pairwise one) onto
  // words [element_offset, + out.size()): one thread's part of a chunk.
  void apply_masks(uint64_t element_offset, std::span<uint32_t> out) const;
  // The same, a big chunk cut among the cores.
  void add_masks(uint64_t element_offset, std::span<uint32_t> out) const;
  uint32_t quantise(double v);

  int client_, round_;
  std::vector<int> selected_;
  SecAggSettings s_;
  uint32_t x_ = 0;
  X25519KeyPair c_keys_, s_keys_;
  Secret32 b_{};
  std::map<int, KeyAdvert> neighbours_;               // by client, itself excluded
  std::map<int, Secret32> share_keys_;                // c-agreement key with each neighbour
  std::vector<std::pair<int, MaskStream>> pairwise_;  // (neighbour, its pairwise mask)
  std::optional<MaskStream> self_mask_;
  std::optional<MaskStream> tag_keys_;  // the upload tags' one-time keys
  std::map<int, SealedShare> inbox_;
  uint64_t model_elements_ = 0;
  double ratio_ = 0;
  uint64_t rng_state_ = 0;  // stochastic rounding only; the masks hide the result
  bool revealed_ = false;
};

class SecAggServer {
 public:
  // `sum`: model elements + 1 words the masked sum lives in (zeroed here).
  SecAggServer(int round, std::vector<int> selected, SecAggSettings settings, std::span<uint32_t> sum);
  // The same with the sum in two places: the model's words in `body` (the
  // global model's own memory, say) and the weight's word in `*tail`.
  SecAggServer(int round, std::vector<int> selected, SecAggSettings settings, std::span<uint32_t> body, uint32_t* tail);
  ~SecAggServer();
  SecAggServer(const SecAggServer&) = delete;
  SecAggServer& operator=(const SecAggServer&) = delete;

  // The settings clients are asked to advertise with: the given ones and
  // the server's public key of this round.
  const SecAggSettings& settings() const { return s_; }

  Status add_advert(const KeyAdvert& advert);
  // Stage 2: adverts of `client`'s neighbours that advertised (itself included).
  std::vector<KeyAdvert> roster_for(int client) const;
  Status add_shares(int client, const std::vector<SealedShare>& shares);
  std::vector<SealedShare> inbox_for(int client) const;
  // `recipient` could not open (or check) the shares `senders` sent it: it
  // pairs no mask with them. Returns the senders, checked to be neighbours
  // that shared; the caller drops them from the round.
  StatusOr<std::vector<int>> shares_refused(int recipient, const std::vector<int>& senders);
  // A frame whose tag check_tag found good: what add_masked_chunk sums.
  class CheckedFrame {
   private:
    friend class SecAggServer;
    CheckedFrame(int client, uint64_t element_offset, std::span<const uint32_t> words)
        : client_(client), element_offset_(element_offset), words_(words) {}
    int client_;
    uint64_t element_offset_;
    std::span<const uint32_t> words_;
  };
  // Stage 3, a frame's tag: whether words [element_offset, + chunk.size())
  // of `client`'s masked vector carry `tag` under its key. kRejected naming
  // the client if not: words not made for this run, round and client
  // (replayed, or not its). Safe on several threads at once and beside
  // add_masked_chunk (it reads only the key add_advert set), so the
  // frames' tags are checked outside the lock that guards the sum.
  StatusOr<CheckedFrame> check_tag(int client, uint64_t element_offset, std::span<const uint32_t> chunk,
                                   const UploadTag& tag) const;
  // Stage 3: a checked frame's words, in order; checked (order, length)
  // before a word is summed.
  Status add_masked_chunk(const CheckedFrame& frame);
  // Both, on one thread.
  Status add_masked_chunk(int client, uint64_t element_offset, std::span<const uint32_t> chunk, const UploadTag& tag);
  Status finish_upload(int client);
  // Stage 4. Fails (kAborted) when an upload broke part-way, or when fewer
  // than t neighbours of someone survived.
  StatusOr<UnmaskRequest> unmask_request();
  Status add_revealed(int client, const std::vector<RevealedShare>& shares);
  // Reconstructs every needed secret from the revealed shares, each checked
  // against its advert or commitment; a share that spoils one is named.
  Status reconstruct();
  // Removes the masks from sum words [element_offset, + chunk.size()) in
  // place and reduces them mod modulus_range: the quantised sum.
  Status unmask_chunk(uint64_t element_offset, std::span<uint32_t> chunk) const;
  // The weighted mean's elements from unmasked quantised sums, and the sum of
  // weights from the unmasked last word.
  void dequantize(std::span<const uint32_t> unmasked, double total_weight, std::span<float> out) const;
  double total_weight(uint32_t unmasked_weight_word) const;

  const std::vector<int>& survivors() const { return survivors_; }
  const std::vector<int>& dropped() const { return dropped_; }
  // Survivors whose revealed share reconstruct found wrong (with spares).
  const std::vector<int>& wrong_revealers() const { return wrong_revealers_; }
  uint64_t total_elements() const { return body_.size() + 1; }

 private:
  struct Peer {
    uint32_t x = 0;
    std::optional<KeyAdvert> advert;
    std::optional<MaskStream> tag_keys;  // its upload tags' one-time keys
    bool shared = false;
    uint64_t uploaded = 0;  // words summed so far
    bool complete = false;
    bool revealed = false;
  };
  StatusOr<Peer*> peer(int client, const char* stage);
  const Peer* find(int client) const;

  int round_;
  std::vector<int> selected_;
  SecAggSettings s_;
  X25519KeyPair keys_;        // the round's: agrees each client's tag key
  std::span<uint32_t> body_;  // the sum's words but the last
  uint32_t* tail_;            // the last: the weights'
  std::map<int, Peer> peers_;
  std::map<int, std::vector<SealedShare>> inboxes_;  // by recipient
  std::set<std::pair<int, int>> unpaired_;           // (recipient, sender): a share that did not open
  std::vector<int> survivors_, dropped_;
  bool request_made_ = false;
  // (subject, kind) → revealed shares, each with its revealer.
  std::map<std::pair<int, SecretKind>, std::vector<std::pair<int, ShamirShare>>> revealed_;
  std::vector<MaskStream> self_masks_;                        // survivors' PRG(b)
  std::vector<std::pair<int, MaskStream>> dropped_pairwise_;  // (sign as survivor added it, mask)
  bool reconstructed_ = false;
  std::vector<int> wrong_revealers_;
};

// The masks and checks of a round, as the client and the server both make
// them; here for tests.
namespace secagg_internal {

// Client u's self mask from its seed b.
MaskStream self_mask(const Secret32& b, const SecAggSettings& s, int round, int u);
// The pairwise mask of u and v (either order gives the same stream).
MaskStream pairwise_mask(const Secret32& seed, const SecAggSettings& s, int round, int u, int v);
// The associated data sealed shares from `from` to `to` carry.
std::string share_context(const SecAggSettings& s, int round, int from, int to);

}  // namespace secagg_internal

}  // namespace memfl
