#include "secagg/crypto.h"

#include <sodium.h>

#include <algorithm>
#include <cstring>

namespace memfl {

namespace {

struct SodiumInit {
  SodiumInit() {
    // sodium_init picks the fastest implementations and seeds the CSPRNG; it
    // is safe to call more than once and only fails without entropy.
    if (sodium_init() < 0) std::abort();
  }
};

void ensure_sodium() { static SodiumInit once; }

}  // namespace

X25519KeyPair X25519KeyPair::generate() {
  ensure_sodium();
  X25519KeyPair kp;
  randombytes_buf(kp.secret_key.data(), kp.secret_key.size());
  crypto_scalarmult_base(kp.public_key.data(), kp.secret_key.data());
  return kp;
}

X25519KeyPair X25519KeyPair::from_secret(const Secret32& secret_key) {
  ensure_sodium();
  X25519KeyPair kp;
  kp.secret_key = secret_key;
  crypto_scalarmult_base(kp.public_key.data(), kp.secret_key.data());
  return kp;
}

StatusOr<Secret32> agree(const Secret32& my_secret, const PublicKey32& my_public, const PublicKey32& their_public,
                         std::string_view purpose) {
  ensure_sodium();
  std::array<uint8_t, crypto_scalarmult_BYTES> shared{};
  // Fails for a low-order public key (all-zero shared point): a peer's bad key.
  if (crypto_scalarmult(shared.data(), my_secret.data(), their_public.data()) != 0) {
    return invalid_argument("X25519 agreement failed: the peer's public key is of low order");
  }
  const bool mine_first = std::memcmp(my_public.data(), their_public.data(), 32) < 0;
  const PublicKey32& a = mine_first ? my_public : their_public;
  const PublicKey32& b = mine_first ? their_public : my_public;
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  crypto_generichash_update(&st, shared.data(), shared.size());
  crypto_generichash_update(&st, a.data(), a.size());
  crypto_generichash_update(&st, b.data(), b.size());
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(purpose.data()), purpose.size());
  Secret32 out{};
  crypto_generichash_final(&st, out.data(), out.size());
  sodium_memzero(shared.data(), shared.size());
  return out;
}

Secret32 random_secret() {
  ensure_sodium();
  Secret32 s{};
  randombytes_buf(s.data(), s.size());
  return s;
}

std::vector<uint8_t> seal(const Secret32& key, std::span<const uint8_t> plaintext, std::string_view context) {
  ensure_sodium();
  std::vector<uint8_t> out(crypto_aead_xchacha20poly1305_ietf_NPUBBYTES + plaintext.size() +
                           crypto_aead_xchacha20poly1305_ietf_ABYTES);
  randombytes_buf(out.data(), crypto_aead_xchacha20poly1305_ietf_NPUBBYTES);
  unsigned long long clen = 0;
  crypto_aead_xchacha20poly1305_ietf_encrypt(
      out.data() + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES, &clen, plaintext.data(), plaintext.size(),
      reinterpret_cast<const unsigned char*>(context.data()), context.size(), nullptr, out.data(), key.data());
  return out;
}

StatusOr<std::vector<uint8_t>> open_sealed(const Secret32& key, std::span<const uint8_t> sealed,
                                           std::string_view context) {
  ensure_sodium();
  if (sealed.size() < kSealOverhead)
    return data_loss("sealed share of {} bytes is shorter than its overhead", sealed.size());
  std::vector<uint8_t> out(sealed.size() - kSealOverhead);
  unsigned long long mlen = 0;
  if (crypto_aead_xchacha20poly1305_ietf_decrypt(
          out.data(), &mlen, nullptr, sealed.data() + crypto_aead_xchacha20poly1305_ietf_NPUBBYTES,
          sealed.size() - crypto_aead_xchacha20poly1305_ietf_NPUBBYTES,
          reinterpret_cast<const unsigned char*>(context.data()), context.size(), sealed.data(), key.data()) != 0) {
    return data_loss("sealed share does not open: forged, altered, or sealed for another round or client");
  }
  out.resize(mlen);
  return out;
}

MaskStream::MaskStream(const Secret32& seed, int round) : seed_(seed) {
  ensure_sodium();
  // The seed is fresh each round; the round in the nonce is a second guard
  // against a mask stream ever being reused across rounds.
  const char tag[] = "memfl-secagg-mask";
  std::memcpy(nonce_.data(), tag, sizeof tag - 1);
  const uint32_t r = static_cast<uint32_t>(round);
  std::memcpy(nonce_.data() + 20, &r, 4);
}

void MaskStream::generate(uint64_t element_offset, std::span<uint32_t> out) const {
  std::fill(out.begin(), out.end(), 0u);
  apply(element_offset, out, +1);
}

void MaskStream::apply(uint64_t element_offset, std::span<uint32_t> out, int sign) const {
  // 16 words per 64-byte block: start at the block holding element_offset,
  // in pieces of a bounded scratch buffer.
  constexpr size_t kWordsPerBlock = 16, kScratchWords = 4096;
  // The keystream is XChaCha20 of zeros: read from a block of zeros kept
  // for it rather than zeroing the scratch before every piece.
  alignas(64) static const unsigned char kZeros[kScratchWords * 4] = {};
  alignas(64) uint32_t scratch[kScratchWords];
  size_t done = 0;
  while (done < out.size()) {
    const uint64_t e = element_offset + done;
    const uint64_t block = e / kWordsPerBlock;
    const size_t skip = static_cast<size_t>(e % kWordsPerBlock);
    const size_t take = std::min(out.size() - done, kScratchWords - skip);
    const size_t words = (skip + take + kWordsPerBlock - 1) / kWordsPerBlock * kWordsPerBlock;
    crypto_stream_xchacha20_xor_ic(reinterpret_cast<unsigned char*>(scratch), kZeros, words * 4, nonce_.data(), block,
                                   seed_.data());
    uint32_t* dst = out.data() + done;
    const uint32_t* src = scratch + skip;
    if (sign > 0) {
      for (size_t i = 0; i < take; ++i) dst[i] += src[i];
    } else {
      for (size_t i = 0; i < take; ++i) dst[i] -= src[i];
    }
    done += take;
  }
}

}  // namespace memfl
