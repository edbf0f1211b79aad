#include "secagg/crypto.h"

#include <sodium.h>
#ifdef MEMFL_HAVE_OPENSSL_CHACHA
#include <openssl/evp.h>
#include <openssl/opensslv.h>
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
#define MEMFL_OPENSSL_POLY1305 1  // EVP_MAC, OpenSSL 3's
#endif
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "common/parallel.h"

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

std::array<uint8_t, 24> mask_nonce(std::string_view context) {
  ensure_sodium();
  std::array<uint8_t, 24> nonce{};
  const char tag[] = "memfl-secagg-mask-nonce";
  crypto_generichash(nonce.data(), nonce.size(), reinterpret_cast<const unsigned char*>(context.data()), context.size(),
                     reinterpret_cast<const unsigned char*>(tag), sizeof tag - 1);
  return nonce;
}

MaskStream::MaskStream(const Secret32& seed, std::string_view context) : seed_(seed), nonce_(mask_nonce(context)) {
  // XChaCha20 is ChaCha20 (64-bit counter, 64-bit nonce) under the
  // HChaCha20 subkey of the key and the nonce's first 16 bytes: worked once
  // here, so each piece of the stream costs only ChaCha20's blocks.
  crypto_core_hchacha20(subkey_.data(), nonce_.data(), seed_.data(), nullptr);
}

MaskStream::~MaskStream() { sodium_memzero(subkey_.data(), subkey_.size()); }

void MaskStream::generate(uint64_t element_offset, std::span<uint32_t> out) const {
  std::fill(out.begin(), out.end(), 0u);
  apply(element_offset, out, +1);
}

namespace {

constexpr size_t kWordsPerBlock = 16, kScratchWords = 4096;

// The keystream is the cipher over zeros: read from a block of zeros kept
// for it rather than zeroing the scratch before every piece.
alignas(64) const unsigned char kZeros[kScratchWords * 4] = {};

void add_words(uint32_t* dst, const uint32_t* src, size_t n, int sign) {
  if (sign > 0) {
    for (size_t i = 0; i < n; ++i) dst[i] += src[i];
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] -= src[i];
  }
}

#ifdef MEMFL_HAVE_OPENSSL_CHACHA
// One cipher context per thread, its cipher set once: the server unmasks on
// several threads at once, and a mask is re-keyed for every cache-sized
// block, where setting the cipher again (a provider lookup under a lock
// in OpenSSL 3) cost more than the block.
EVP_CIPHER_CTX* thread_chacha() {
  struct Free {
    void operator()(EVP_CIPHER_CTX* c) const { EVP_CIPHER_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_CIPHER_CTX, Free> ctx = [] {
    std::unique_ptr<EVP_CIPHER_CTX, Free> c(EVP_CIPHER_CTX_new());
    if (!c || EVP_EncryptInit_ex(c.get(), EVP_chacha20(), nullptr, nullptr, nullptr) != 1) std::abort();
    return c;
  }();
  return ctx.get();
}
#endif

}  // namespace

void MaskStream::apply(uint64_t element_offset, std::span<uint32_t> out, int sign) const {
  if (out.empty()) return;
  // 16 words per 64-byte block: start at the block holding element_offset,
  // in pieces of a bounded scratch buffer.
  alignas(64) uint32_t scratch[kScratchWords];
  const uint64_t first_block = element_offset / kWordsPerBlock;
  size_t skip = static_cast<size_t>(element_offset % kWordsPerBlock);
#ifdef MEMFL_HAVE_OPENSSL_CHACHA
  // OpenSSL's ChaCha20 (its 16-byte IV: the 64-bit block counter, then the
  // 64-bit nonce, carrying from the counter's low word into its high word as
  // libsodium's does) under the HChaCha20 subkey is libsodium's XChaCha20
  // stream word for word (test SecAggCrypto.MaskStreamIsLibsodiumsXChaCha20Keystream),
  // 3 × faster where OpenSSL has AVX-512 code for it. One keying per call;
  // the pieces then continue the stream.
  EVP_CIPHER_CTX* ctx = thread_chacha();
  unsigned char iv[16];
  for (int i = 0; i < 8; ++i) iv[i] = static_cast<unsigned char>(first_block >> (8 * i));
  std::memcpy(iv + 8, nonce_.data() + 16, 8);
  if (EVP_EncryptInit_ex(ctx, nullptr, nullptr, subkey_.data(), iv) != 1) std::abort();
#endif
  size_t done = 0;
#ifndef MEMFL_HAVE_OPENSSL_CHACHA
  uint64_t block = first_block;
#endif
  while (done < out.size()) {
    const size_t take = std::min(out.size() - done, kScratchWords - skip);
    const size_t words = (skip + take + kWordsPerBlock - 1) / kWordsPerBlock * kWordsPerBlock;
#ifdef MEMFL_HAVE_OPENSSL_CHACHA
    int len = 0;
    if (EVP_EncryptUpdate(ctx, reinterpret_cast<unsigned char*>(scratch), &len, kZeros, static_cast<int>(words * 4)) !=
        1)
      std::abort();
#else
    crypto_stream_xchacha20_xor_ic(reinterpret_cast<unsigned char*>(scratch), kZeros, words * 4, nonce_.data(), block,
                                   seed_.data());
    block += words / kWordsPerBlock;
#endif
    add_words(out.data() + done, scratch + skip, take, sign);
    done += take;
    skip = 0;
  }
}

namespace {

#ifdef MEMFL_OPENSSL_POLY1305
// One MAC context per thread, re-keyed for every piece (the pieces of one
// frame are tagged on several threads at once). Null where the provider has
// no Poly1305 (then libsodium's).
EVP_MAC_CTX* thread_poly1305() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "POLY1305", nullptr);
  struct Free {
    void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MAC_CTX, Free> ctx(mac != nullptr ? EVP_MAC_CTX_new(mac) : nullptr);
  return ctx.get();
}
#endif

void poly1305(const uint8_t* key, const uint8_t* message, size_t length, uint8_t* tag) {
#ifdef MEMFL_OPENSSL_POLY1305
  if (EVP_MAC_CTX* ctx = thread_poly1305()) {
    size_t n = 0;
    if (EVP_MAC_init(ctx, key, 32, nullptr) != 1 || EVP_MAC_update(ctx, message, length) != 1 ||
        EVP_MAC_final(ctx, tag, &n, 16) != 1 || n != 16) {
      std::abort();
    }
    return;
  }
#endif
  crypto_onetimeauth(tag, message, length, key);
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A tag as the little-endian 128-bit number Poly1305 makes it.
struct Tag128 {
  uint64_t lo = 0, hi = 0;
  void add(const Tag128& o) {
    lo += o.lo;
    hi += o.hi + (lo < o.lo ? 1 : 0);
  }
};

}  // namespace

UploadTag upload_tag(const MaskStream& keys, uint64_t element_offset, std::span<const uint32_t> words) {
  ensure_sodium();
  const size_t pieces = (words.size() + kTagPieceWords - 1) / kTagPieceWords;
  std::mutex mu;
  Tag128 sum;
  parallel_for(pieces, 1, [&](size_t a, size_t b) {
    Tag128 part;
    for (size_t p = a; p < b; ++p) {
      const size_t lo = p * kTagPieceWords, n = std::min(kTagPieceWords, words.size() - lo);
      // Block number = the piece's first element (16 words a block).
      std::array<uint32_t, 8> key{};
      keys.generate((element_offset + lo) * 16, key);
      uint8_t t[16];
      poly1305(reinterpret_cast<const uint8_t*>(key.data()), reinterpret_cast<const uint8_t*>(words.data() + lo), n * 4,
               t);
      sodium_memzero(key.data(), sizeof key);
      part.add(Tag128{load_le64(t), load_le64(t + 8)});
    }
    std::lock_guard lock(mu);
    sum.add(part);
  });
  UploadTag out{};
  for (int i = 0; i < 8; ++i) {
    out[static_cast<size_t>(i)] = static_cast<uint8_t>(sum.lo >> (8 * i));
    out[static_cast<size_t>(i) + 8] = static_cast<uint8_t>(sum.hi >> (8 * i));
  }
  return out;
}

}  // namespace memfl
