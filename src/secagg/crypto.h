// Secure aggregation's cryptography, libsodium's: X25519 key pairs and
// agreement (crypto_scalarmult, the shared point hashed with both public keys
// by BLAKE2b), XChaCha20-Poly1305 for the shares a client sends its
// neighbours through the server, the XChaCha20 keystream that expands a
// 32-byte seed into a mask (its ChaCha20 blocks from OpenSSL where found) — at any element offset, because the
// stream cipher's 64-bit block counter lets a mask be regenerated from the
// middle, chunk by chunk, without the elements before it — and Poly1305
// tags over the masked words (OpenSSL's where found).
//
//   X25519KeyPair mine = X25519KeyPair::generate();
//   Secret32 seed = agree(mine, their_public, "pairwise");     // both ends get the same
//   MaskStream mask(seed, "what the mask is for: run, round, clients");
//   mask.generate(element_offset, std::span<uint32_t>(chunk));  // uniform 32-bit words
//   UploadTag tag = upload_tag(tag_keys, element_offset, chunk);
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "secagg/shamir.h"

namespace memfl {

using PublicKey32 = std::array<uint8_t, 32>;

struct X25519KeyPair {
  PublicKey32 public_key{};
  Secret32 secret_key{};
  static X25519KeyPair generate();
  // The key pair of a secret key (a reconstructed one, checked against the
  // public key its owner advertised).
  static X25519KeyPair from_secret(const Secret32& secret_key);
};

// A 32-byte key both ends of an X25519 exchange derive alike: BLAKE2b of the
// shared point, the two public keys in byte order and `purpose` (so the key
// that encrypts shares and the seed of a pairwise mask differ).
StatusOr<Secret32> agree(const Secret32& my_secret, const PublicKey32& my_public, const PublicKey32& their_public,
                         std::string_view purpose);

Secret32 random_secret();

// Authenticated encryption of a share's bytes for one neighbour; `context`
// (run, round, sender, recipient) is bound as associated data, so a
// ciphertext replayed in another run or round or between other clients
// fails to open.
std::vector<uint8_t> seal(const Secret32& key, std::span<const uint8_t> plaintext, std::string_view context);
StatusOr<std::vector<uint8_t>> open_sealed(const Secret32& key, std::span<const uint8_t> sealed,
                                           std::string_view context);
inline constexpr size_t kSealOverhead = 24 + 16;  // nonce + tag

// The 24-byte XChaCha20 nonce of a mask made for `context`: BLAKE2b of it.
std::array<uint8_t, 24> mask_nonce(std::string_view context);

// A mask: the XChaCha20 keystream of `seed` under mask_nonce(context), read
// as little-endian 32-bit words; word i is the mask of the update's element
// i. `context` names what the mask is for (the run, the round, the client or
// the pair of clients), so the same seed never makes the same stream for
// two purposes. Where OpenSSL is found the blocks come from its ChaCha20
// (the same stream, faster); libsodium's otherwise.
class MaskStream {
 public:
  MaskStream(const Secret32& seed, std::string_view context);
  ~MaskStream();
  MaskStream(const MaskStream&) = default;
  MaskStream& operator=(const MaskStream&) = default;
  // Words [element_offset, element_offset + out.size()) of the mask.
  void generate(uint64_t element_offset, std::span<uint32_t> out) const;
  // out[i] += sign · mask[element_offset + i] (mod 2^32), sign = ±1.
  void apply(uint64_t element_offset, std::span<uint32_t> out, int sign) const;

 private:
  Secret32 seed_;
  std::array<uint8_t, 24> nonce_{};
  Secret32 subkey_{};  // HChaCha20(seed, nonce[0..16))
};

// The tag of one frame of a masked upload: its words [element_offset,
// + words.size()) of the upload, cut into pieces of kTagPieceWords from the
// frame's start, each piece MACed by Poly1305 under a one-time key of its
// own (the first 32 bytes of `keys`'s block numbered by the piece's first
// element, unique within an upload), the pieces' tags added mod 2^128. The
// pieces are tagged on every core at once, and a piece that changes changes
// the sum unpredictably to anyone without `keys` (each term is a one-time
// MAC). Where OpenSSL has Poly1305 it computes it (3 × faster than
// libsodium's, the same tags).
using UploadTag = std::array<uint8_t, 16>;
inline constexpr size_t kTagPieceWords = size_t{1} << 14;
UploadTag upload_tag(const MaskStream& keys, uint64_t element_offset, std::span<const uint32_t> words);

}  // namespace memfl
