// Secure aggregation's pieces: Shamir against hand-worked vectors, the mask
// stream at any offset, and whole SecAgg+ rounds driven in memory — the
// unmasked mean against plain FedAvg of the same updates, dropout recovery,
// uniformity of one masked upload, and refusal of bad peer input.
#include <gtest/gtest.h>
#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include "aggregate/fedavg_aggregator.h"
#include "comm/client_transport.h"
#include "secagg/channel.h"
#include "secagg/crypto.h"
#include "secagg/masking_place.h"
#include "secagg/secagg.h"
#include "secagg/secagg_round.h"
#include "secagg/shamir.h"
#include "secagg/wire.h"

namespace memfl {
namespace {

// The run's id most tests use (a server makes one per run).
const ExperimentId kRun = secagg_experiment_id({{"server_configs.seed", "1"}});

TEST(Shamir, FieldArithmeticHandWorked) {
  const uint64_t p = kShamirPrime;
  EXPECT_EQ(gf_add(p - 1, 2), 1u);
  EXPECT_EQ(gf_sub(1, 2), p - 1);
  // 2^60 · 4 = 2^62 = 2 · 2^61 ≡ 2 (mod 2^61 − 1).
  EXPECT_EQ(gf_mul(uint64_t{1} << 60, 4), 2u);
  // (p − 1)² = p² − 2p + 1 ≡ 1.
  EXPECT_EQ(gf_mul(p - 1, p - 1), 1u);
  // 2 · 2^60 = 2^61 ≡ 1, so 2⁻¹ = 2^60.
  EXPECT_EQ(gf_inv(2), uint64_t{1} << 60);
  EXPECT_EQ(gf_mul(gf_inv(123456789), 123456789), 1u);
}

TEST(Shamir, KnownVectorInterpolates) {
  // f(x) = 1234 + 166x + 94x²: f(1) = 1494, f(2) = 1942, f(3) = 2578,
  // f(4) = 3402, f(5) = 4414, f(6) = 5614 (worked by hand; no reduction).
  const uint64_t coeffs[] = {1234, 166, 94};
  const uint64_t expect[] = {1494, 1942, 2578, 3402, 4414, 5614};
  for (uint64_t x = 1; x <= 6; ++x) EXPECT_EQ(shamir_detail::evaluate(coeffs, x), expect[x - 1]) << x;
  const uint64_t xs[] = {2, 4, 5}, ys[] = {1942, 3402, 4414};
  auto s = shamir_detail::interpolate_at_zero(xs, ys);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 1234u);
  // Through the field's wrap: f(x) = (p − 1) + 2x gives f(1) = 1, f(2) = 3,
  // and 2·f(1) − f(2) = −1 ≡ p − 1 at 0.
  const uint64_t xw[] = {1, 2}, yw[] = {1, 3};
  auto w = shamir_detail::interpolate_at_zero(xw, yw);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(*w, kShamirPrime - 1);
  const uint64_t xd[] = {3, 3}, yd[] = {1, 2};
  EXPECT_FALSE(shamir_detail::interpolate_at_zero(xd, yd).ok());
}

TEST(Shamir, AnyThresholdSubsetReconstructsAndFewerDoNot) {
  const Secret32 secret = random_secret();
  const uint32_t xs[] = {1, 2, 3, 4, 5, 9};
  auto shares = shamir_split(secret, 4, xs);
  ASSERT_TRUE(shares.ok());
  for (int mask = 0; mask < 64; ++mask) {
    if (__builtin_popcount(mask) != 4) continue;
    std::vector<ShamirShare> pick;
    for (int i = 0; i < 6; ++i)
      if ((mask >> i) & 1) pick.push_back((*shares)[static_cast<size_t>(i)]);
    Secret32 back{};
    ASSERT_TRUE(shamir_reconstruct(pick, 4, &back).ok());
    EXPECT_EQ(back, secret) << mask;
  }
  // Three shares interpolate a degree-2 polynomial: not the secret (but for
  // a 2^-280 chance).
  Secret32 wrong{};
  const auto st = shamir_reconstruct(std::span(*shares).first(3), 3, &wrong);
  EXPECT_TRUE(!st.ok() || wrong != secret);
  EXPECT_FALSE(shamir_reconstruct(std::span(*shares).first(3), 4, &wrong).ok());
  const uint32_t bad_xs[] = {1, 1, 2};
  EXPECT_FALSE(shamir_split(secret, 2, bad_xs).ok());
  const uint32_t zero_x[] = {0, 1, 2};
  EXPECT_FALSE(shamir_split(secret, 2, zero_x).ok());
}

TEST(SecAggCrypto, AgreementIsSymmetricAndPurposeSeparates) {
  const auto a = X25519KeyPair::generate(), b = X25519KeyPair::generate();
  auto ab = agree(a.secret_key, a.public_key, b.public_key, "x");
  auto ba = agree(b.secret_key, b.public_key, a.public_key, "x");
  auto other = agree(a.secret_key, a.public_key, b.public_key, "y");
  ASSERT_TRUE(ab.ok() && ba.ok() && other.ok());
  EXPECT_EQ(*ab, *ba);
  EXPECT_NE(*ab, *other);
  EXPECT_EQ(X25519KeyPair::from_secret(a.secret_key).public_key, a.public_key);
  PublicKey32 low_order{};  // the all-zero point
  EXPECT_FALSE(agree(a.secret_key, a.public_key, low_order, "x").ok());
}

TEST(SecAggCrypto, SealedShareOpensOnlyInItsContext) {
  const Secret32 key = random_secret();
  const std::vector<uint8_t> msg = {1, 2, 3, 4};
  auto sealed = seal(key, msg, "round=1 from=2 to=3");
  auto ok = open_sealed(key, sealed, "round=1 from=2 to=3");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, msg);
  EXPECT_FALSE(open_sealed(key, sealed, "round=2 from=2 to=3").ok());
  sealed[30] ^= 1;
  EXPECT_FALSE(open_sealed(key, sealed, "round=1 from=2 to=3").ok());
}

TEST(SecAggCrypto, MaskStreamRegeneratesAtAnyOffset) {
  const Secret32 seed = random_secret();
  MaskStream m(seed, "round=3");
  std::vector<uint32_t> whole(10000);
  m.generate(0, whole);
  // Odd offsets and lengths, across block (16 words) and scratch (4096) edges.
  for (auto [off, len] : {std::pair<size_t, size_t>{0, 1}, {1, 15}, {15, 2}, {17, 4100}, {4095, 3}, {9000, 1000}}) {
    std::vector<uint32_t> part(len);
    m.generate(off, part);
    for (size_t i = 0; i < len; ++i) ASSERT_EQ(part[i], whole[off + i]) << off << "+" << i;
  }
  // The same seed for another purpose is another stream.
  std::vector<uint32_t> next(16);
  MaskStream(seed, "round=4").generate(0, next);
  EXPECT_FALSE(std::equal(next.begin(), next.end(), whole.begin()));
  // apply(−1) undoes apply(+1).
  std::vector<uint32_t> v(100, 7u);
  m.apply(50, v, +1);
  m.apply(50, v, -1);
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](uint32_t w) { return w == 7u; }));
}

// The mask is libsodium's XChaCha20 keystream of the seed under its
// context's nonce, whichever library makes the blocks: checked word for word against
// crypto_stream_xchacha20_xor_ic itself, at offsets that start mid-block and
// one that crosses the block counter's low 32 bits (element 2^36, a 256 GiB
// f32 model's, where a 32-bit counter would wrap).
TEST(SecAggCrypto, MaskStreamIsLibsodiumsXChaCha20Keystream) {
  const Secret32 seed = random_secret();
  const std::array<unsigned char, 24> nonce = mask_nonce("round=7");
  MaskStream m(seed, "round=7");
  const uint64_t wrap = uint64_t{1} << 36;  // block 2^32
  for (auto [off, len] : {std::pair<uint64_t, size_t>{0, 5000}, {3, 9000}, {wrap - 16 * 3 - 5, 200}, {wrap + 1, 64}}) {
    std::vector<uint32_t> got(len);
    m.generate(off, got);
    // libsodium's stream from the block holding `off`, over zeros.
    const uint64_t block = off / 16, skip = off % 16;
    std::vector<unsigned char> zeros((skip + len + 15) / 16 * 64), ks(zeros.size());
    crypto_stream_xchacha20_xor_ic(ks.data(), zeros.data(), ks.size(), nonce.data(), block, seed.data());
    for (size_t i = 0; i < len; ++i) {
      uint32_t want = 0;
      std::memcpy(&want, ks.data() + (skip + i) * 4, 4);
      ASSERT_EQ(got[i], want) << "element " << off + i;
    }
  }
}

// What a round makes is bound to the run, the round and the clients: a
// sealed share opens only in its own context, and masks made for another
// run, round or client are other streams, so they do not cancel.
TEST(SecAggCrypto, SharesAndMasksAreBoundToTheRunTheRoundAndTheClients) {
  SecAggSettings a, b;
  a.experiment = kRun;
  b.experiment = secagg_experiment_id({{"server_configs.seed", "1"}});  // the same config, another run
  using secagg_internal::share_context;
  const Secret32 key = random_secret();
  const std::vector<uint8_t> msg(56, 0x3c);
  const auto sealed = seal(key, msg, share_context(a, 3, 1, 2));
  EXPECT_TRUE(open_sealed(key, sealed, share_context(a, 3, 1, 2)).ok());
  EXPECT_FALSE(open_sealed(key, sealed, share_context(b, 3, 1, 2)).ok()) << "another run";
  EXPECT_FALSE(open_sealed(key, sealed, share_context(a, 4, 1, 2)).ok()) << "the next round";
  EXPECT_FALSE(open_sealed(key, sealed, share_context(a, 3, 2, 1)).ok()) << "sender and recipient swapped";
  EXPECT_FALSE(open_sealed(key, sealed, share_context(a, 3, 1, 3)).ok()) << "another recipient";
  // A pairwise mask: client 1 adds it, client 2 subtracts the one it makes
  // from the same seed. Made for one run they cancel word for word; made
  // for two runs (or rounds) they leave noise in (nearly) every word.
  const Secret32 seed = random_secret();
  const auto residue = [&](const SecAggSettings& s1, int r1, const SecAggSettings& s2, int r2) {
    std::vector<uint32_t> w(4096, 0u);
    secagg_internal::pairwise_mask(seed, s1, r1, 1, 2).apply(0, w, +1);
    secagg_internal::pairwise_mask(seed, s2, r2, 2, 1).apply(0, w, -1);
    return static_cast<size_t>(std::count_if(w.begin(), w.end(), [](uint32_t x) { return x != 0; }));
  };
  EXPECT_EQ(residue(a, 3, a, 3), 0u);
  EXPECT_GT(residue(a, 3, b, 3), 4090u) << "another run's mask";
  EXPECT_GT(residue(a, 3, a, 4), 4090u) << "the next round's mask";
  // A self mask of one seed differs by run, round and client.
  std::vector<uint32_t> m0(64), m1(64), m2(64), m3(64);
  secagg_internal::self_mask(seed, a, 3, 1).generate(0, m0);
  secagg_internal::self_mask(seed, b, 3, 1).generate(0, m1);
  secagg_internal::self_mask(seed, a, 4, 1).generate(0, m2);
  secagg_internal::self_mask(seed, a, 3, 2).generate(0, m3);
  EXPECT_NE(m0, m1);
  EXPECT_NE(m0, m2);
  EXPECT_NE(m0, m3);
}

// The frame tag is Poly1305 (libsodium's, checked here whichever library
// computes it) of each 2^14-word piece under 32 bytes of the key stream at
// the block numbered by the piece's first element, the pieces' tags added
// mod 2^128; and any change of word, offset or key changes it.
TEST(SecAggCrypto, UploadTagIsPoly1305OfEachPieceSummed) {
  const MaskStream keys(random_secret(), "tag keys");
  std::vector<uint32_t> words(2 * kTagPieceWords + 7232);
  std::mt19937 gen(3);
  for (uint32_t& w : words) w = gen();
  const uint64_t offset = 100;
  uint64_t lo = 0, hi = 0;
  for (size_t at = 0; at < words.size(); at += kTagPieceWords) {
    const size_t n = std::min(kTagPieceWords, words.size() - at);
    std::array<uint32_t, 8> key{};
    keys.generate((offset + at) * 16, key);
    unsigned char t[16];
    crypto_onetimeauth(t, reinterpret_cast<const unsigned char*>(words.data() + at), n * 4,
                       reinterpret_cast<const unsigned char*>(key.data()));
    uint64_t tlo = 0, thi = 0;
    std::memcpy(&tlo, t, 8);
    std::memcpy(&thi, t + 8, 8);
    lo += tlo;
    hi += thi + (lo < tlo ? 1 : 0);
  }
  UploadTag want{};
  std::memcpy(want.data(), &lo, 8);
  std::memcpy(want.data() + 8, &hi, 8);
  EXPECT_EQ(upload_tag(keys, offset, words), want);
  // One word changed, in the last piece; the same words at another offset;
  // under other keys.
  auto changed = words;
  changed.back() ^= 1;
  EXPECT_NE(upload_tag(keys, offset, changed), want);
  EXPECT_NE(upload_tag(keys, offset + 1, words), want);
  EXPECT_NE(upload_tag(MaskStream(random_secret(), "tag keys"), offset, words), want);
}

TEST(SecAggSettings, ResolvesFlowerProportionsAndRefusesWrap) {
  SecAggParams p;
  p.num_shares = 0.5;
  p.reconstruction_threshold = 0.6;
  auto s = SecAggSettings::resolve(p, 10);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->neighbours, 5u);  // ⌈0.5·10⌉ = 5, odd
  EXPECT_EQ(s->threshold, 3u);   // ⌈0.6·5⌉
  p.num_shares = 4;              // even count: made odd
  p.reconstruction_threshold = 2;
  s = SecAggSettings::resolve(p, 10);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->neighbours, 5u);
  auto hood = neighbourhood(0, *s);
  EXPECT_EQ(hood, (std::vector<size_t>{0, 1, 2, 8, 9}));
  p.quantization_range = uint64_t{1} << 30;  // 5 × (2^30 − 1) ≥ 2^32
  EXPECT_FALSE(SecAggSettings::resolve(p, 5).ok());
  EXPECT_TRUE(SecAggSettings::resolve(p, 3).ok());
  p = SecAggParams{};
  p.modulus_range = 3u << 20;
  EXPECT_FALSE(SecAggSettings::resolve(p, 3).ok());
  p = SecAggParams{};
  p.reconstruction_threshold = 7;
  EXPECT_FALSE(SecAggSettings::resolve(p, 5).ok());
}

// A round in memory: n clients with updates[i] and weights[i], the masked
// vectors streamed in chunks of `chunk` elements.
struct Round {
  int round = 1;
  std::vector<int> ids;
  SecAggSettings settings;
  std::vector<std::unique_ptr<SecAggClient>> clients;
  std::vector<uint32_t> sum;
  std::unique_ptr<SecAggServer> server;
  uint64_t elements = 0;

  Round(std::vector<int> client_ids, const SecAggParams& p, uint64_t model_elements)
      : ids(std::move(client_ids)), elements(model_elements) {
    settings = SecAggSettings::resolve(p, ids.size()).value();
    sum.resize(elements + 1);
    server = std::make_unique<SecAggServer>(round, ids, settings, sum);
    settings = server->settings();  // with the server's key of the round
    for (int id : ids) clients.push_back(std::make_unique<SecAggClient>(id, round, ids, settings));
  }
  SecAggClient& client(int id) {
    return *clients[static_cast<size_t>(std::find(ids.begin(), ids.end(), id) - ids.begin())];
  }
  // Stages 1–2 for everyone but `absent` (clients that drop before sharing).
  void share(const std::set<int>& absent = {}) {
    for (int id : ids) {
      if (!absent.count(id)) {
        ASSERT_TRUE(server->add_advert(client(id).advertise()).ok());
      }
    }
    for (int id : ids) {
      if (absent.count(id)) continue;
      auto shares = client(id).share_keys(server->roster_for(id));
      ASSERT_TRUE(shares.ok()) << shares.status().message();
      ASSERT_TRUE(server->add_shares(id, *shares).ok());
    }
    for (int id : ids) {
      if (!absent.count(id)) {
        auto refused = client(id).receive_shares(server->inbox_for(id));
        ASSERT_TRUE(refused.ok()) << refused.status().message();
        ASSERT_TRUE(refused->empty());
      }
    }
  }
  // Stage 3 for one client: its masked vector, streamed.
  std::vector<uint32_t> upload(int id, const std::vector<float>& x, double weight, size_t chunk,
                               bool to_server = true) {
    SecAggClient& c = client(id);
    EXPECT_TRUE(c.begin_update(elements, weight).ok());
    std::vector<uint32_t> all(elements + 1);
    for (uint64_t off = 0; off < elements; off += chunk) {
      const size_t len = std::min<uint64_t>(chunk, elements - off);
      std::vector<uint32_t> words(len);
      EXPECT_TRUE(c.mask_chunk(off, std::span(x).subspan(off, len), words).ok());
      std::copy(words.begin(), words.end(), all.begin() + static_cast<long>(off));
      if (to_server) {
        EXPECT_TRUE(server->add_masked_chunk(id, off, words, *c.tag(off, words)).ok());
      }
    }
    const uint32_t w = c.masked_weight();
    all[elements] = w;
    if (to_server) {
      EXPECT_TRUE(server->add_masked_chunk(id, elements, std::span(&w, 1), *c.tag(elements, std::span(&w, 1))).ok());
      EXPECT_TRUE(server->finish_upload(id).ok());
    }
    return all;
  }
  // Stage 4 and the dequantised mean, unmasked in chunks of `chunk`.
  StatusOr<std::vector<float>> unmask(size_t chunk, const std::set<int>& silent = {}) {
    MEMFL_ASSIGN_OR_RETURN(UnmaskRequest req, server->unmask_request());
    for (int id : req.survivors) {
      if (silent.count(id)) continue;
      MEMFL_ASSIGN_OR_RETURN(auto revealed, client(id).unmask(req));
      MEMFL_RETURN_IF_ERROR(server->add_revealed(id, revealed));
    }
    MEMFL_RETURN_IF_ERROR(server->reconstruct());
    // The weight word first (the mean needs Σ weight), then the model.
    MEMFL_RETURN_IF_ERROR(server->unmask_chunk(elements, std::span(sum).subspan(elements, 1)));
    const double w = server->total_weight(sum[elements]);
    std::vector<float> mean(elements);
    for (uint64_t off = 0; off < elements; off += chunk) {
      const size_t len = std::min<uint64_t>(chunk, elements - off);
      auto words = std::span(sum).subspan(off, len);
      MEMFL_RETURN_IF_ERROR(server->unmask_chunk(off, words));
      server->dequantize(words, w, std::span(mean).subspan(off, len));
    }
    return mean;
  }
};

std::vector<std::vector<float>> random_updates(size_t n, size_t elements, double range, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(static_cast<float>(-range), static_cast<float>(range));
  std::vector<std::vector<float>> x(n, std::vector<float>(elements));
  for (auto& v : x)
    for (float& e : v) e = u(gen);
  return x;
}

TEST(SecAgg, UnmaskedMeanIsExactOnIntegerUpdates) {
  // c = 8 and q = 2^20 + 1: scale = 2^16, so integers in [−8, 8] quantise
  // exactly and the mean comes back exactly (equal weights of 1: ratio 1).
  SecAggParams p;
  p.clipping_range = 8;
  p.quantization_range = (uint64_t{1} << 20) + 1;
  p.max_weight = 1;
  const size_t n = 5, elements = 1003;
  Round r({3, 7, 11, 12, 40}, p, elements);
  r.share();
  std::mt19937 gen(1);
  std::uniform_int_distribution<int> u(-8, 8);
  std::vector<std::vector<float>> x(n, std::vector<float>(elements));
  for (auto& v : x)
    for (float& e : v) e = static_cast<float>(u(gen));
  for (size_t i = 0; i < n; ++i) r.upload(r.ids[i], x[i], 1.0, 97);
  auto mean = r.unmask(61);
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  for (size_t k = 0; k < elements; ++k) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += x[i][k];
    // Plain FedAvg of equal weights, rounded to f32 once as FedAvg does.
    ASSERT_EQ((*mean)[k], static_cast<float>(s / n)) << k;
  }
}

TEST(SecAgg, UnmaskedMeanMatchesWeightedFedAvgWithinQuantisationBound) {
  SecAggParams p;  // Flower's defaults: c = 8, q = 2^22, m = 2^32, max_weight 1000
  const size_t n = 6, elements = 2000;
  Round r({1, 2, 3, 4, 5, 6}, p, elements);
  r.share();
  auto x = random_updates(n, elements, 2.0, 7);
  const std::vector<double> samples = {100, 250, 40, 999, 1500, 600};  // 1500 is capped at max_weight
  for (size_t i = 0; i < n; ++i) r.upload(r.ids[i], x[i], samples[i], 333);
  auto mean = r.unmask(128);
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  // Independent bound: every quantised element and every weight is within
  // one step (1/scale) of its value, so the sums S = Σ rᵢxᵢ and W = Σ rᵢ
  // come back within n steps each, and m̂ − m = (E·W − S·δ) / (W·(W + δ))
  // gives |m̂ − m| ≤ n·step·(W + |S|) / (W·(W − n·step)), plus f32 rounding.
  const double step = 2 * 8.0 / static_cast<double>((1 << 22) - 1);
  double W = 0;
  std::vector<double> ratio(n);
  for (size_t i = 0; i < n; ++i) W += ratio[i] = std::min(samples[i], 1000.0) / 1000.0;
  double worst = 0;
  for (size_t k = 0; k < elements; ++k) {
    double S = 0;
    for (size_t i = 0; i < n; ++i) S += ratio[i] * x[i][k];
    const double exact = S / W;
    const double bound = n * step * (W + std::abs(S)) / (W * (W - n * step)) + 1e-6 * std::abs(exact) + 1e-7;
    const double err = std::abs((*mean)[k] - exact);
    worst = std::max(worst, err / bound);
    ASSERT_LE(err, bound) << "element " << k;
  }
  // Stochastic rounding is unbiased: the errors should sit well inside the
  // worst case, not at it.
  EXPECT_LT(worst, 0.9);
}

// Stochastic rounding, unbiased: with c = 8 and q = 2^20 + 1 (scale 2^16) a
// value of f·2^-16 sits a fraction f of a step above a grid point. Over many
// elements the unmasked mean must average to the value itself: rounding to
// the nearest step would give 0 for f = 1/4 and a whole step for f = 3/4,
// rounding down 0 for both.
TEST(SecAgg, StochasticRoundingIsUnbiasedAtQuarterAndThreeQuarterSteps) {
  SecAggParams p;
  p.clipping_range = 8;
  p.quantization_range = (uint64_t{1} << 20) + 1;
  p.max_weight = 1;
  const size_t half = 100000, elements = 2 * half;
  Round r({2, 9, 13}, p, elements);
  r.share();
  const double step = 0x1.0p-16;
  std::vector<float> x(elements);
  for (size_t k = 0; k < elements; ++k) x[k] = static_cast<float>((k < half ? 0.25 : 0.75) * step);
  for (int id : r.ids) r.upload(id, x, 1.0, 4099);
  auto mean = r.unmask(5000);
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  for (int part = 0; part < 2; ++part) {
    double avg = 0;
    for (size_t k = part * half; k < (part + 1) * half; ++k) avg += (*mean)[k];
    avg /= half;
    const double f = part == 0 ? 0.25 : 0.75;
    // Each client's element is a Bernoulli(f) step; the mean of 3 clients
    // over `half` elements has σ = step·√(f(1 − f) / (3·half)). 6σ.
    const double sigma = step * std::sqrt(f * (1 - f) / (3.0 * half));
    EXPECT_NEAR(avg, f * step, 6 * sigma) << "fraction " << f;
  }
}

TEST(SecAgg, SecAggPlusRecoversClientsDroppedAfterSharingKeys) {
  SecAggParams p;
  p.clipping_range = 8;
  p.quantization_range = (uint64_t{1} << 20) + 1;
  p.max_weight = 1;
  p.num_shares = 5;                // SecAgg+: rings of 5 among 9
  p.reconstruction_threshold = 3;  // up to 2 of a neighbourhood may drop
  const std::vector<int> ids = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  const size_t elements = 300;
  Round r(ids, p, elements);
  r.share();
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> u(-8, 8);
  std::map<int, std::vector<float>> x;
  for (int id : ids) {
    x[id].resize(elements);
    for (float& e : x[id]) e = static_cast<float>(u(gen));
  }
  // Clients 2 and 6 drop after sharing: their pairwise masks are in their
  // neighbours' uploads, recovered from their reconstructed keys.
  const std::set<int> dropped = {2, 6};
  for (int id : ids)
    if (!dropped.count(id)) r.upload(id, x[id], 1.0, 50);
  auto mean = r.unmask(77);
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  EXPECT_EQ(r.server->dropped(), (std::vector<int>{2, 6}));
  for (size_t k = 0; k < elements; ++k) {
    double s = 0;
    for (int id : ids)
      if (!dropped.count(id)) s += x[id][k];
    ASSERT_EQ((*mean)[k], static_cast<float>(s / 7)) << k;
  }
}

TEST(SecAgg, ClientThatAdvertisedButNeverSharedLeavesNoMaskInTheSum) {
  SecAggParams p;
  p.clipping_range = 8;
  p.quantization_range = (uint64_t{1} << 20) + 1;
  p.max_weight = 1;
  p.reconstruction_threshold = 2;
  const size_t elements = 40;
  Round r({1, 2, 3, 4}, p, elements);
  for (int id : {1, 2, 3, 4}) ASSERT_TRUE(r.server->add_advert(r.client(id).advertise()).ok());
  // Client 3 advertised keys (the others paired masks with it) but never
  // sent its shares.
  for (int id : {1, 2, 4}) {
    auto shares = r.client(id).share_keys(r.server->roster_for(id));
    ASSERT_TRUE(shares.ok()) << shares.status().message();
    ASSERT_TRUE(r.server->add_shares(id, *shares).ok());
  }
  for (int id : {1, 2, 4}) ASSERT_TRUE(r.client(id).receive_shares(r.server->inbox_for(id)).ok());
  std::vector<float> a(elements, 3.0f), b(elements, -1.0f), c(elements, 1.0f);
  r.upload(1, a, 1, 9);
  r.upload(2, b, 1, 9);
  r.upload(4, c, 1, 9);
  auto mean = r.unmask(13);
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  EXPECT_TRUE(r.server->dropped().empty());  // it never shared: nothing of it to unmask
  for (float m : *mean) ASSERT_EQ(m, 1.0f);
}

TEST(SecAgg, SurvivorSilentDuringUnmaskingIsToleratedUpToThreshold) {
  SecAggParams p;
  p.clipping_range = 8;
  p.quantization_range = (uint64_t{1} << 20) + 1;
  p.max_weight = 1;
  p.num_shares = 1.0;  // SecAgg: everyone a neighbour
  p.reconstruction_threshold = 3;
  const size_t elements = 64;
  Round r({1, 2, 3, 4, 5}, p, elements);
  r.share();
  std::vector<float> ones(elements, 1.0f), twos(elements, 2.0f);
  r.upload(1, ones, 1.0, 10);
  r.upload(2, twos, 1.0, 10);
  r.upload(3, ones, 1.0, 10);
  r.upload(4, twos, 1.0, 10);
  // Client 5 dropped before uploading, client 4 uploads and then goes
  // silent during unmasking: 3 of 4 survivors reveal, t = 3 suffices.
  auto mean = r.unmask(16, {4});
  ASSERT_TRUE(mean.ok()) << mean.status().message();
  for (float m : *mean) ASSERT_EQ(m, 1.5f);
}

TEST(SecAgg, TooFewSharesFailsTheRoundCleanly) {
  SecAggParams p;
  p.reconstruction_threshold = 4;
  Round r({1, 2, 3, 4, 5}, p, 16);
  r.share();
  std::vector<float> v(16, 0.5f);
  for (int id : {1, 2, 3, 4}) r.upload(id, v, 10, 16);
  auto mean = r.unmask(16, {1, 2});  // 2 survivors reveal, t = 4
  ASSERT_FALSE(mean.ok());
  EXPECT_EQ(mean.status().code(), StatusCode::kAborted);
  EXPECT_NE(mean.status().message().find("fewer than the threshold 4"), std::string::npos) << mean.status().message();
}

TEST(SecAgg, UploadBrokenPartWayRedoesTheRound) {
  SecAggParams p;
  Round r({1, 2, 3}, p, 100);
  r.share();
  std::vector<float> v(100, 0.25f);
  r.upload(1, v, 10, 25);
  r.upload(2, v, 10, 25);
  ASSERT_TRUE(r.client(3).begin_update(100, 10).ok());
  std::vector<uint32_t> words(25);
  ASSERT_TRUE(r.client(3).mask_chunk(0, std::span(v).first(25), words).ok());
  ASSERT_TRUE(r.server->add_masked_chunk(3, 0, words, *r.client(3).tag(0, words)).ok());
  auto req = r.server->unmask_request();
  ASSERT_FALSE(req.ok());
  EXPECT_EQ(req.status().code(), StatusCode::kAborted);
  EXPECT_NE(req.status().message().find("client_3"), std::string::npos);
}

TEST(SecAgg, SingleMaskedUploadLooksUniform) {
  // Chi-square of one client's masked words over 256 bins of their top
  // byte: uniform words give ≈ 255 ± 23; the same update unmasked (values
  // near q/2, in a few bins) gives an enormous statistic.
  SecAggParams p;
  const size_t elements = 1 << 16;
  Round r({1, 2, 3}, p, elements);
  r.share();
  std::vector<float> x(elements, 0.5f);
  const auto masked = r.upload(1, x, 100, 4096, /*to_server=*/false);
  const auto chi2 = [](const std::vector<uint32_t>& w, int shift) {
    std::vector<double> bins(256, 0);
    for (uint32_t v : w) bins[(v >> shift) & 255] += 1;
    const double e = static_cast<double>(w.size()) / 256;
    double c = 0;
    for (double b : bins) c += (b - e) * (b - e) / e;
    return c;
  };
  // 255 degrees of freedom (Wilson–Hilferty): 330 is only the 99.9th
  // percentile, so with fresh random keys about one run in 500 went over
  // it; 400 is the 1 − 2·10⁻⁸ one, and the unmasked words below still give
  // over 25 × that.
  EXPECT_LT(chi2(masked, 24), 400) << "top byte";
  EXPECT_LT(chi2(masked, 0), 400) << "low byte";
  std::vector<uint32_t> plain(elements);
  for (size_t i = 0; i < elements; ++i) plain[i] = static_cast<uint32_t>((0.05 + 8) * SecAggSettings{}.scale());
  EXPECT_GT(chi2(plain, 24), 10000);
}

TEST(SecAgg, RefusesBadPeerInputNamingTheClient) {
  SecAggParams p;
  Round r({1, 2, 3, 4}, p, 10);
  // Keys: a replay from another round, a client not selected, twice.
  KeyAdvert stale = r.client(1).advertise();
  stale.round = 0;
  auto st = r.server->add_advert(stale);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("client_1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("round 0"), std::string::npos) << st.message();
  KeyAdvert stranger = r.client(2).advertise();
  stranger.client = 9;
  EXPECT_NE(r.server->add_advert(stranger).message().find("client_9"), std::string::npos);
  r.share();
  EXPECT_NE(r.server->add_advert(r.client(2).advertise()).message().find("client_2: sent its keys twice"),
            std::string::npos);
  // Masked vectors: wrong length, a repeated chunk, an early end.
  ASSERT_TRUE(r.client(1).begin_update(10, 1).ok());
  std::vector<uint32_t> long_chunk(12);
  st = r.server->add_masked_chunk(1, 0, long_chunk, *r.client(1).tag(0, long_chunk));
  EXPECT_NE(st.message().find("client_1: masked vector longer than 11"), std::string::npos) << st.message();
  std::vector<uint32_t> four(4);
  ASSERT_TRUE(r.client(2).begin_update(10, 1).ok());
  ASSERT_TRUE(r.server->add_masked_chunk(2, 0, four, *r.client(2).tag(0, four)).ok());
  st = r.server->add_masked_chunk(2, 0, four, *r.client(2).tag(0, four));
  EXPECT_NE(st.message().find("client_2: masked chunk at element 0, expected 4"), std::string::npos) << st.message();
  st = r.server->finish_upload(2);
  EXPECT_NE(st.message().find("client_2: masked vector of 4 elements, expected 11"), std::string::npos) << st.message();
}

TEST(SecAgg, ClientRefusesToMaskANonFiniteUpdate) {
  SecAggParams p;
  Round r({1, 2, 3}, p, 4);
  r.share();
  ASSERT_TRUE(r.client(2).begin_update(4, 1).ok());
  const std::vector<float> x = {0.f, 1.f, std::nanf(""), 2.f};
  std::vector<uint32_t> out(4);
  const Status st = r.client(2).mask_chunk(0, x, out);
  EXPECT_EQ(st.code(), StatusCode::kRejected);
  EXPECT_NE(st.message().find("client_2: element 2 of its update is not finite"), std::string::npos) << st.message();
}

TEST(SecAgg, RefusesWrongDuplicateAndReplayedShares) {
  SecAggParams p;
  p.max_weight = 1;
  p.reconstruction_threshold = 3;
  Round r({1, 2, 3, 4, 5}, p, 8);
  r.share();
  std::vector<float> v(8, 1.0f);
  for (int id : {1, 2, 3, 4, 5}) r.upload(id, v, 1, 8);
  auto req = r.server->unmask_request();
  ASSERT_TRUE(req.ok());
  // A survivor's revealed shares: replayed from another round, duplicated,
  // at another client's x, or wrong.
  auto good1 = r.client(1).unmask(*req);
  ASSERT_TRUE(good1.ok()) << good1.status().message();
  auto replay = *good1;
  replay[0].round = 0;
  auto st = r.server->add_revealed(1, replay);
  EXPECT_NE(st.message().find("client_1: a revealed share of round 0"), std::string::npos) << st.message();
  auto dup = *good1;
  dup.push_back(dup[0]);
  st = r.server->add_revealed(1, dup);
  EXPECT_NE(st.message().find("client_1: revealed two shares"), std::string::npos) << st.message();
  auto moved = *good1;
  moved[1].share.x = 2;
  st = r.server->add_revealed(1, moved);
  EXPECT_NE(st.message().find("client_1: a revealed share at x 2"), std::string::npos) << st.message();
  // Client 1 lies about its share of client 3's seed: refused against the
  // check client 3 sealed with it, naming client 1; the others are honest.
  auto wrong = *good1;
  for (auto& s : wrong)
    if (s.subject == 3) s.share.y[2] = gf_add(s.share.y[2], 1);
  st = r.server->add_revealed(1, wrong);
  EXPECT_EQ(st.code(), StatusCode::kRejected);
  EXPECT_NE(st.message().find("client_1: its share of client_3's self-mask seed is not the one"), std::string::npos)
      << st.message();
  ASSERT_TRUE(r.server->add_revealed(1, *good1).ok());
  EXPECT_NE(r.server->add_revealed(1, *good1).message().find("client_1: revealed its shares twice"), std::string::npos);
  for (int id : {2, 3, 4, 5}) {
    auto g = r.client(id).unmask(*req);
    ASSERT_TRUE(g.ok()) << g.status().message();
    ASSERT_TRUE(r.server->add_revealed(id, *g).ok());
  }
  EXPECT_TRUE(r.server->reconstruct().ok());
  // A client asked to reveal both secrets of one client refuses.
  Round r2({1, 2, 3}, p, 4);
  r2.share();
  EXPECT_NE(r2.client(1)
                .unmask(UnmaskRequest{1, {1, 2, 3}, {3}})
                .status()
                .message()
                .find("client_3 both surviving and dropped"),
            std::string::npos);
  EXPECT_NE(r2.client(2).unmask(UnmaskRequest{5, {1, 2, 3}, {}}).status().message().find("round 5 in round 1"),
            std::string::npos);
}

TEST(SecAgg, SealedSharesOfAnotherRunOrRoundAreRefused) {
  SecAggParams p;
  p.reconstruction_threshold = 2;
  // Round b's sealed shares for client 1 replayed to round c's client 1
  // (same round number, other keys): they do not open, naming the sender.
  Round b({1, 2, 3}, p, 4);
  b.share();
  const auto foreign = b.server->inbox_for(1);
  Round c({1, 2, 3}, p, 4);
  for (int id : {1, 2, 3}) ASSERT_TRUE(c.server->add_advert(c.client(id).advertise()).ok());
  for (int id : {1, 2, 3}) {
    auto shares = c.client(id).share_keys(c.server->roster_for(id));
    ASSERT_TRUE(shares.ok());
    ASSERT_TRUE(c.server->add_shares(id, *shares).ok());
  }
  // None opens, its own included: every sender is named on arrival.
  auto refused = c.client(1).receive_shares(foreign);
  ASSERT_TRUE(refused.ok()) << refused.status().message();
  EXPECT_EQ(*refused, (std::vector<int>{1, 2, 3}));
  ASSERT_TRUE(c.client(2).receive_shares(c.server->inbox_for(2)).ok());
  ASSERT_TRUE(c.client(3).receive_shares(c.server->inbox_for(3)).ok());
  Status st;
  // Shares stamped with another round, or sent twice, are refused on arrival.
  auto stale = foreign;
  stale[0].round = 7;
  SecAggClient fresh(1, 1, {1, 2, 3}, c.settings);
  EXPECT_NE(fresh.receive_shares(stale).status().message().find("round 7 in round 1"), std::string::npos);
  Round e({1, 2, 3}, p, 4);
  for (int id : {1, 2, 3}) ASSERT_TRUE(e.server->add_advert(e.client(id).advertise()).ok());
  ASSERT_TRUE(e.client(2).share_keys(e.server->roster_for(2)).ok());
  auto e_shares = e.client(1).share_keys(e.server->roster_for(1));
  ASSERT_TRUE(e_shares.ok());
  std::vector<SealedShare> to2;
  for (const auto& s : *e_shares)
    if (s.to == 2) to2 = {s, s};
  st = e.client(2).receive_shares(to2).status();
  EXPECT_NE(st.message().find("client_2: client_1 sent it two shares"), std::string::npos) << st.message();
  // The server refuses a share set with one neighbour twice.
  auto doubled = *e_shares;
  doubled.back() = doubled.front();
  st = e.server->add_shares(1, doubled);
  EXPECT_NE(st.message().find("client_1: two shares for client_"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace memfl

// ------------------------------------------------------------ the round seam

namespace memfl {
namespace {

// What the aggregator is handed: every update opened, and its bytes.
class RecordingOpener final : public UpdateOpener {
 public:
  struct Update {
    std::string client;
    double sample_count = 0;
    std::vector<std::byte> bytes;
    bool committed = false;
  };
  class Stream final : public UpdateStream {
   public:
    explicit Stream(Update& u) : u_(u) {}
    Status accept(const ChunkHeader& h, Payload payload) override {
      for (auto piece : payload) u_.bytes.insert(u_.bytes.end(), piece.begin(), piece.end());
      return h.offset + h.length <= u_.bytes.size() ? Status::Ok() : internal_error("gap");
    }
    Status commit() override {
      u_.committed = true;
      return Status::Ok();
    }

   private:
    Update& u_;
  };
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client, double sample_count) override {
    updates.push_back(std::make_unique<Update>());
    updates.back()->client = client;
    updates.back()->sample_count = sample_count;
    return std::unique_ptr<UpdateStream>(std::make_unique<Stream>(*updates.back()));
  }
  std::vector<std::unique_ptr<Update>> updates;
};

// A masked upload as a transport carries it: each frame with its header.
using Frames = std::vector<std::pair<ChunkHeader, std::vector<std::byte>>>;

// Copies what a client's transport sends on to `inner` and keeps it.
class TappedSink final : public ChunkSink {
 public:
  explicit TappedSink(ChunkSink& inner) : inner_(inner) {}
  Status accept(const ChunkHeader& h, Payload payload) override {
    frames.emplace_back(h, std::vector<std::byte>());
    for (auto piece : payload) {
      seen.insert(seen.end(), piece.begin(), piece.end());
      frames.back().second.insert(frames.back().second.end(), piece.begin(), piece.end());
    }
    return inner_.accept(h, payload);
  }
  std::vector<std::byte> seen;
  Frames frames;

 private:
  ChunkSink& inner_;
};

TEST(SecAggRoundSeam, AggregatorSeesOnlyTheUnmaskedMean) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {37}).add("b", DType::kF32, {5});
  Layout layout = std::move(lb).build().value();
  const size_t elements = layout.total_bytes() / 4;
  const std::vector<int> selected = {0, 1, 2, 3};
  SecAggParams params;
  params.max_weight = 1;
  params.clipping_range = 8;
  params.quantization_range = (uint64_t{1} << 20) + 1;  // integers quantise exactly
  auto sa = SecAggRound::start(/*round=*/4, selected, params, kRun, layout);
  ASSERT_TRUE(sa.ok()) << sa.status().message();
  SecAggClientStages clients;  // the client core's stages, as the simulator's
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(clients, &failed).ok());
  ASSERT_TRUE(failed.empty());
  std::vector<Arena> models;
  std::vector<std::vector<std::byte>> wire;
  for (int c : selected) {
    models.emplace_back(layout.total_bytes(), MemoryCategory::kModel);
    auto* f = reinterpret_cast<float*>(models.back().data());
    for (size_t i = 0; i < elements; ++i) f[i] = static_cast<float>((static_cast<int>(i) * (c + 3)) % 11 - 5);
    MaskingPlace masked(std::make_unique<ArenaPlace>(models.back()), layout, *clients.client(c));
    ASSERT_TRUE(masked.begin(1.0).ok());
    auto stream = (*sa)->open_update(client_id(c), 1.0);
    ASSERT_TRUE(stream.ok());
    TappedSink tap(**stream);
    auto sent = stream_place(layout, masked, /*chunk=*/12, tap);  // 3 elements a chunk
    ASSERT_TRUE(sent.ok()) << sent.status().message();
    ASSERT_TRUE((*stream)->commit().ok());
    // + the masked weight, + a 16-byte tag after each 12-byte frame.
    EXPECT_EQ(tap.seen.size(), layout.total_bytes() + 4 + (layout.total_bytes() + 11) / 12 * 16);
    wire.push_back(tap.seen);
  }
  RecordingOpener aggregator;
  auto n = (*sa)->unmask_into(clients, aggregator, "secure_aggregate", /*chunk=*/20);
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(*n, 4u);
  // One update reached the aggregator: the mean, exactly (integer updates).
  ASSERT_EQ(aggregator.updates.size(), 1u);
  const auto& u = *aggregator.updates[0];
  EXPECT_EQ(u.client, "secure_aggregate");
  EXPECT_TRUE(u.committed);
  ASSERT_EQ(u.bytes.size(), layout.total_bytes());
  std::vector<float> mean(elements);
  std::memcpy(mean.data(), u.bytes.data(), u.bytes.size());
  for (size_t i = 0; i < elements; ++i) {
    double s = 0;
    for (const Arena& m : models) s += reinterpret_cast<const float*>(m.data())[i];
    ASSERT_EQ(mean[i], static_cast<float>(s / 4)) << i;
  }
  // Neither the aggregator nor the wire ever carried an individual update:
  // no client's model bytes appear, as a whole or as any 12-byte chunk.
  for (size_t c = 0; c < models.size(); ++c) {
    const auto* raw = models[c].data();
    for (size_t off = 0; off + 12 <= layout.total_bytes(); off += 12) {
      EXPECT_NE(std::memcmp(u.bytes.data() + off, raw + off, 12), 0) << "client " << c << " chunk " << off;
      for (const auto& w : wire) EXPECT_NE(std::memcmp(w.data() + off, raw + off, 12), 0);
    }
  }
}

TEST(SecAggRoundSeam, ChunkCuttingAnElementIsRefusedNamingTheKey) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {10});
  Layout layout = std::move(lb).build().value();
  SecAggParams params;
  auto sa = SecAggRound::start(1, {0, 1, 2}, params, kRun, layout);
  ASSERT_TRUE(sa.ok());
  SecAggClientStages clients;
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(clients, &failed).ok());
  Arena model(layout.total_bytes(), MemoryCategory::kModel);
  std::memset(model.data(), 0, layout.total_bytes());
  MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *clients.client(0));
  ASSERT_TRUE(masked.begin(1.0).ok());
  auto stream = (*sa)->open_update(client_id(0), 1.0);
  ASSERT_TRUE(stream.ok());
  auto sent = stream_place(layout, masked, 7, **stream);
  ASSERT_FALSE(sent.ok());
  EXPECT_NE(sent.status().message().find("model_chunk_size"), std::string::npos) << sent.status().message();
  // A bf16 model is refused before any work.
  LayoutBuilder hb;
  hb.add("h", DType::kBF16, {4});
  Layout half = std::move(hb).build().value();
  auto refused = SecAggRound::start(1, {0, 1, 2}, params, kRun, half);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("entry 'h' is bf16"), std::string::npos) << refused.status().message();
}

// The server's stages as bytes over a "transport" that hands each request
// to the clients' side and its reply back, as gRPC does (secagg/wire.h).
class LoopbackWire {
 public:
  LoopbackWire(SecAggClientStages& clients, std::vector<int> plays) : clients_(clients), plays_(std::move(plays)) {}
  StatusOr<std::string> exchange(int /*client*/, std::string request) {
    requests.push_back(request);
    SecAggStage stage;
    MEMFL_ASSIGN_OR_RETURN(std::string reply, serve_secagg_request(clients_, request, "test server", plays_, &stage));
    ++per_stage[stage];
    if (tamper) tamper(stage, &reply);
    return reply;
  }
  std::vector<std::string> requests;
  std::map<SecAggStage, int> per_stage;
  std::function<void(SecAggStage, std::string*)> tamper;

 private:
  SecAggClientStages& clients_;
  std::vector<int> plays_;
};

TEST(SecAggWire, EveryStageCrossesAsBytesAndTheMeanIsExact) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {29}).add("b", DType::kF32, {3});
  Layout layout = std::move(lb).build().value();
  const size_t elements = layout.total_bytes() / 4;
  const std::vector<int> selected = {0, 2, 5};
  SecAggParams params;
  params.max_weight = 1;
  params.quantization_range = (uint64_t{1} << 20) + 1;  // integers quantise exactly
  auto sa = SecAggRound::start(/*round=*/7, selected, params, kRun, layout);
  ASSERT_TRUE(sa.ok()) << sa.status().message();
  SecAggClientStages clients;
  LoopbackWire wire(clients, selected);
  int ended = -1;
  std::vector<int> dropped;
  RemoteSecAggChannel channel([&](int c, std::string r) { return wire.exchange(c, std::move(r)); },
                              [&](int round) { ended = round; }, [&](int c, const Status&) { dropped.push_back(c); });
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(channel, &failed).ok());
  EXPECT_TRUE(failed.empty());
  EXPECT_EQ(wire.per_stage[SecAggStage::kAdvertise], 3);
  EXPECT_EQ(wire.per_stage[SecAggStage::kShareKeys], 3);
  EXPECT_EQ(wire.per_stage[SecAggStage::kDeliverShares], 3);
  std::vector<std::vector<float>> updates;
  for (int c : selected) {
    Arena model(layout.total_bytes(), MemoryCategory::kModel);
    auto* f = reinterpret_cast<float*>(model.data());
    for (size_t i = 0; i < elements; ++i) f[i] = static_cast<float>((static_cast<int>(i) * (c + 2)) % 9 - 4);
    updates.emplace_back(f, f + elements);
    MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *clients.client(c));
    ASSERT_TRUE(masked.begin(1.0).ok());
    auto stream = (*sa)->open_update(client_id(c), 1.0);
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(stream_place(layout, masked, 16, **stream).ok());
    ASSERT_TRUE((*stream)->commit().ok());
  }
  RecordingOpener aggregator;
  auto n = (*sa)->unmask_into(channel, aggregator, "secure_aggregate", 64);
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(*n, 3u);
  EXPECT_EQ(wire.per_stage[SecAggStage::kUnmask], 3);
  ASSERT_EQ(aggregator.updates.size(), 1u);
  std::vector<float> mean(elements);
  std::memcpy(mean.data(), aggregator.updates[0]->bytes.data(), layout.total_bytes());
  for (size_t i = 0; i < elements; ++i) {
    const double want = (updates[0][i] + updates[1][i] + updates[2][i]) / 3.0;
    ASSERT_EQ(mean[i], static_cast<float>(want)) << i;
  }
  EXPECT_TRUE(dropped.empty());
}

// A server whose aggregator writes over the global model sums the masked
// words in the model's own memory (RoundDriver, once the broadcast is done):
// the same exact mean, the weight's word kept apart, and nothing of the
// model's old bytes read.
TEST(SecAggRoundSeam, SumInTheModelsMemoryGivesTheSameMean) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {21}).add("b", DType::kF32, {4});
  Layout layout = std::move(lb).build().value();
  const size_t elements = layout.total_bytes() / 4;
  const std::vector<int> selected = {1, 3, 4};
  SecAggParams params;
  params.max_weight = 4;
  params.quantization_range = (uint64_t{1} << 20) + 1;
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  auto* g = reinterpret_cast<float*>(global.data());
  for (size_t i = 0; i < elements; ++i) g[i] = 1e30f;  // the old model: must not leak into the sum
  auto sa = SecAggRound::start(2, selected, params, kRun, layout,
                               std::span(reinterpret_cast<uint32_t*>(global.data()), elements));
  ASSERT_TRUE(sa.ok()) << sa.status().message();
  EXPECT_EQ((*sa)->sum_bytes(), 4u);  // only the weight's word beside the model
  SecAggClientStages clients;
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(clients, &failed).ok());
  std::vector<std::vector<float>> updates;
  const std::vector<double> weights = {1, 2, 4};  // sample counts: ratios 1/4, 2/4, 4/4
  for (size_t j = 0; j < selected.size(); ++j) {
    const int c = selected[j];
    Arena model(layout.total_bytes(), MemoryCategory::kModel);
    auto* f = reinterpret_cast<float*>(model.data());
    for (size_t i = 0; i < elements; ++i) f[i] = static_cast<float>((static_cast<int>(i) + 3 * c) % 7 - 3);
    updates.emplace_back(f, f + elements);
    MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *clients.client(c));
    ASSERT_TRUE(masked.begin(weights[j]).ok());
    auto stream = (*sa)->open_update(client_id(c), weights[j]);
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(stream_place(layout, masked, 28, **stream).ok());  // 7 words a chunk: the last one straddles
    ASSERT_TRUE((*stream)->commit().ok());
  }
  RecordingOpener aggregator;
  auto n = (*sa)->unmask_into(clients, aggregator, "secure_aggregate", 36);
  ASSERT_TRUE(n.ok()) << n.status().message();
  ASSERT_EQ(aggregator.updates.size(), 1u);
  std::vector<float> mean(elements);
  std::memcpy(mean.data(), aggregator.updates[0]->bytes.data(), layout.total_bytes());
  // Weighted by sample count: (1·u₁ + 2·u₃ + 4·u₄) / 7, each product an
  // integer over 4 that the quantisation keeps exactly.
  for (size_t i = 0; i < elements; ++i) {
    const double want = (1 * updates[0][i] + 2 * updates[1][i] + 4 * updates[2][i]) / 7.0;
    ASSERT_NEAR(mean[i], want, 1e-6) << i;
  }
}

// In process the clients read the global model while others upload, so the
// masked sum cannot live there; it lives in FedAvg's own sum instead, which
// the round's one update (the mean) writes without reading. The real
// aggregator folds it and finalizes: the model is the hand-worked mean, and
// the round holds nothing model-sized of its own.
TEST(SecAggRoundSeam, SumInFedAvgsOwnSumGivesTheSameModel) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {37}).add("b", DType::kF32, {5});
  Layout layout = std::move(lb).build().value();
  const size_t elements = layout.total_bytes() / 4;
  FedAvgAggregator fedavg(layout, ClientWeightsMode::kSampleSize);
  std::span<std::byte> idle = fedavg.idle_state_bytes();
  ASSERT_EQ(idle.size(), layout.total_bytes());
  // What an earlier round left there must not leak into this one.
  for (size_t i = 0; i < elements; ++i) reinterpret_cast<float*>(idle.data())[i] = 1e30f;
  const std::vector<int> selected = {2, 5, 6};
  SecAggParams params;
  params.max_weight = 4;
  params.quantization_range = (uint64_t{1} << 20) + 1;
  auto sa = SecAggRound::start(3, selected, params, kRun, layout,
                               std::span(reinterpret_cast<uint32_t*>(idle.data()), elements));
  ASSERT_TRUE(sa.ok()) << sa.status().message();
  EXPECT_EQ((*sa)->sum_bytes(), 4u);
  SecAggClientStages clients;
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(clients, &failed).ok());
  ASSERT_TRUE(fedavg.begin_round(3, {"secure_aggregate"}).ok());
  std::vector<std::vector<float>> updates;
  const std::vector<double> weights = {4, 1, 2};  // ratios 4/4, 1/4, 2/4
  for (size_t j = 0; j < selected.size(); ++j) {
    const int c = selected[j];
    Arena model(layout.total_bytes(), MemoryCategory::kModel);
    auto* f = reinterpret_cast<float*>(model.data());
    for (size_t i = 0; i < elements; ++i) f[i] = static_cast<float>((static_cast<int>(i) * (c + 1)) % 9 - 4);
    updates.emplace_back(f, f + elements);
    MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *clients.client(c));
    ASSERT_TRUE(masked.begin(weights[j]).ok());
    auto stream = (*sa)->open_update(client_id(c), weights[j]);
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(stream_place(layout, masked, 44, **stream).ok());
    ASSERT_TRUE((*stream)->commit().ok());
  }
  auto n = (*sa)->unmask_into(clients, fedavg, "secure_aggregate", 52);
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(*n, 3u);
  Arena global(layout.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(fedavg.finalize(global).ok());
  const auto* g = reinterpret_cast<const float*>(global.data());
  for (const LayoutEntry& e : layout.entries()) {
    for (size_t k = 0; k < e.numel(); ++k) {
      const size_t i = e.offset / 4 + k;
      // (4·u₂ + 1·u₅ + 2·u₆) / 7: each weighted element an integer over 4,
      // which the quantisation keeps exactly.
      const double want = (4 * updates[0][i] + 1 * updates[1][i] + 2 * updates[2][i]) / 7.0;
      ASSERT_NEAR(g[i], want, 1e-6) << e.name << "[" << k << "]";
    }
  }
}

TEST(SecAggWire, TruncatedForeignOrLyingMessagesAreRefusedNamingThePeer) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {8});
  Layout layout = std::move(lb).build().value();
  const std::vector<int> selected = {0, 1, 2};
  auto sa = SecAggRound::start(3, selected, SecAggParams{}, kRun, layout);
  ASSERT_TRUE(sa.ok());
  SecAggClientStages clients;
  LoopbackWire wire(clients, selected);
  RemoteSecAggChannel channel([&](int c, std::string r) { return wire.exchange(c, std::move(r)); }, [](int) {},
                              [](int, const Status&) {});
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(channel, &failed).ok());
  ASSERT_FALSE(wire.requests.empty());
  // Every strict prefix of every request the server sent is refused, never
  // read past (ASan would see it).
  SecAggClientStages fresh;
  for (const std::string& req : wire.requests) {
    for (size_t cut = 0; cut < req.size(); ++cut) {
      SecAggStage stage;
      auto r =
          serve_secagg_request(fresh, std::string_view(req).substr(0, cut), "server 127.0.0.1:1", selected, &stage);
      if (cut == 0) {
        // Empty: the server's "the round's stages are over".
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(stage, SecAggStage::kRoundOver);
        continue;
      }
      if (cut < 10) {
        ASSERT_FALSE(r.ok()) << cut;
      } else if (r.ok()) {
        // A prefix that parses must be a complete message: none is.
        ADD_FAILURE() << "a request cut at " << cut << " of " << req.size() << " bytes parsed";
      }
      if (!r.ok()) {
        EXPECT_NE(r.status().message().find("server 127.0.0.1:1"), std::string::npos);
      }
    }
  }
  // A request for a client this process does not play.
  SecAggStage stage;
  auto foreign = serve_secagg_request(fresh, wire.requests[0], "server s", {1, 2}, &stage);
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("client_0, which this process does not play"), std::string::npos)
      << foreign.status().message();
  // Replies that lie: another stage, or a count of shares far beyond the
  // bytes that follow (refused before anything is allocated for them).
  auto sb = SecAggRound::start(4, selected, SecAggParams{}, kRun, layout);
  ASSERT_TRUE(sb.ok());
  SecAggClientStages others;
  LoopbackWire lying(others, selected);
  lying.tamper = [](SecAggStage st, std::string* reply) {
    if (st == SecAggStage::kAdvertise) (*reply)[1] = static_cast<char>(SecAggStage::kUnmask);
  };
  std::vector<Status> why;
  RemoteSecAggChannel lying_channel([&](int c, std::string r) { return lying.exchange(c, std::move(r)); }, [](int) {},
                                    [&](int, const Status& s) { why.push_back(s); });
  std::vector<int> out;
  ASSERT_TRUE((*sb)->exchange_keys(lying_channel, &out).ok());
  EXPECT_EQ(out, selected);  // every advert was refused: nobody is in the round
  ASSERT_EQ(why.size(), 3u);
  EXPECT_NE(why[0].message().find("client_0's reply to 'advertise keys': it answers stage 4"), std::string::npos)
      << why[0].message();
  auto sc = SecAggRound::start(5, selected, SecAggParams{}, kRun, layout);
  ASSERT_TRUE(sc.ok());
  SecAggClientStages third;
  LoopbackWire huge(third, selected);
  huge.tamper = [](SecAggStage st, std::string* reply) {
    if (st != SecAggStage::kShareKeys) return;
    const uint32_t n = 0x7fffffff;  // shares claimed; a few hundred bytes follow
    std::memcpy(reply->data() + 3, &n, 4);
  };
  why.clear();
  RemoteSecAggChannel huge_channel([&](int c, std::string r) { return huge.exchange(c, std::move(r)); }, [](int) {},
                                   [&](int, const Status& s) { why.push_back(s); });
  out.clear();
  ASSERT_TRUE((*sc)->exchange_keys(huge_channel, &out).ok());
  EXPECT_EQ(out, selected);
  ASSERT_FALSE(why.empty());
  EXPECT_NE(why[0].message().find("client_0's sealed shares: 2147483647 items do not fit"), std::string::npos)
      << why[0].message();
}

// A request or reply of another version (another memfl) is refused on
// both sides, naming the peer and both versions.
TEST(SecAggWire, AMessageOfAnotherVersionIsRefusedNamingThePeer) {
  LayoutBuilder lb;
  lb.add("w", DType::kF32, {8});
  Layout layout = std::move(lb).build().value();
  const std::vector<int> selected = {0, 1, 2};
  auto sa = SecAggRound::start(3, selected, SecAggParams{}, kRun, layout);
  ASSERT_TRUE(sa.ok());
  SecAggClientStages clients;
  LoopbackWire wire(clients, selected);
  RemoteSecAggChannel channel([&](int c, std::string r) { return wire.exchange(c, std::move(r)); }, [](int) {},
                              [](int, const Status&) {});
  std::vector<int> failed;
  ASSERT_TRUE((*sa)->exchange_keys(channel, &failed).ok());
  std::string old = wire.requests[0];
  old[0] = 1;
  SecAggStage stage;
  SecAggClientStages fresh;
  auto r = serve_secagg_request(fresh, old, "server s", selected, &stage);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("request from server s: secure aggregation messages of version 1; this client "
                                      "speaks version 2"),
            std::string::npos)
      << r.status().message();
  auto sb = SecAggRound::start(4, selected, SecAggParams{}, kRun, layout);
  ASSERT_TRUE(sb.ok());
  SecAggClientStages others;
  LoopbackWire older(others, selected);
  older.tamper = [](SecAggStage, std::string* reply) { (*reply)[0] = 1; };
  std::vector<Status> why;
  RemoteSecAggChannel older_channel([&](int c, std::string q) { return older.exchange(c, std::move(q)); }, [](int) {},
                                    [&](int, const Status& s) { why.push_back(s); });
  std::vector<int> out;
  ASSERT_TRUE((*sb)->exchange_keys(older_channel, &out).ok());
  EXPECT_EQ(out, selected);
  ASSERT_FALSE(why.empty());
  EXPECT_NE(why[0].message().find("client_0's reply to 'advertise keys': secure aggregation messages of version 1"),
            std::string::npos)
      << why[0].message();
}

// The clients' stages, honest but for what a test makes one of them do.
class HostileStages final : public SecAggChannel {
 public:
  StatusOr<KeyAdvert> advertise(int client, int round, const std::vector<int>& selected,
                                const SecAggSettings& settings) override {
    SecAggSettings s = settings;
    if (on_advertise) on_advertise(client, &s);
    return honest.advertise(client, round, selected, s);
  }
  StatusOr<std::vector<SealedShare>> share_keys(int client, const std::vector<KeyAdvert>& roster) override {
    auto r = honest.share_keys(client, roster);
    if (r.ok() && on_share_keys) on_share_keys(client, &*r);
    return r;
  }
  StatusOr<std::vector<int>> deliver_shares(int client, std::vector<SealedShare> inbox) override {
    return honest.deliver_shares(client, std::move(inbox));
  }
  StatusOr<std::vector<RevealedShare>> unmask(int client, const UnmaskRequest& request) override {
    auto r = honest.unmask(client, request);
    if (r.ok() && on_unmask) on_unmask(client, &*r);
    return r;
  }
  void end_round(int round) override { honest.end_round(round); }
  SecAggClientStages honest;
  std::function<void(int, SecAggSettings*)> on_advertise;
  std::function<void(int, std::vector<SealedShare>*)> on_share_keys;
  std::function<void(int, std::vector<RevealedShare>*)> on_unmask;
};

// One round through the seam: keys over `stages`, client c's model
// element i = (i·(c + 3)) mod 11 − 5 (integers: the mean comes back
// exactly), uploaded by every client still in after the key exchange.
struct SeamRound {
  Layout layout;
  std::unique_ptr<SecAggRound> sa;
  std::vector<int> failed;
  std::map<int, Status> uploads;  // how each client's upload ended
  RecordingOpener aggregator;

  static Layout small_layout() {
    LayoutBuilder lb;
    lb.add("w", DType::kF32, {21});
    return std::move(lb).build().value();
  }
  static float element(int c, size_t i) { return static_cast<float>((static_cast<int>(i) * (c + 3)) % 11 - 5); }

  // `recorded`: each client's masked frames, as sent; `replayed`: frames
  // a client sends instead of its own masked upload; `run`: the run's id;
  // `before_upload(c)`: called once c's upload has begun.
  SeamRound(const std::vector<int>& selected, SecAggParams params, HostileStages& stages, int round = 2,
            std::map<int, Frames>* recorded = nullptr, const std::map<int, Frames>* replayed = nullptr,
            const ExperimentId& run = kRun, const std::function<void(int)>& before_upload = {})
      : layout(small_layout()) {
    params.max_weight = 1;
    params.clipping_range = 8;
    params.quantization_range = (uint64_t{1} << 20) + 1;
    sa = SecAggRound::start(round, selected, params, run, layout).value();
    EXPECT_TRUE(sa->exchange_keys(stages, &failed).ok());
    for (int c : selected) {
      if (std::find(failed.begin(), failed.end(), c) != failed.end()) {
        // Out of the round: its masked upload is refused.
        EXPECT_FALSE(sa->open_update(client_id(c), 1.0).ok());
        continue;
      }
      Arena model(layout.total_bytes(), MemoryCategory::kModel);
      auto* f = reinterpret_cast<float*>(model.data());
      for (size_t i = 0; i < layout.total_bytes() / 4; ++i) f[i] = element(c, i);
      MaskingPlace masked(std::make_unique<ArenaPlace>(model), layout, *stages.honest.client(c));
      EXPECT_TRUE(masked.begin(1.0).ok());
      if (before_upload) before_upload(c);
      auto stream = sa->open_update(client_id(c), 1.0);
      EXPECT_TRUE(stream.ok()) << stream.status().message();
      Status st;
      if (replayed != nullptr && replayed->count(c)) {
        for (const auto& [h, bytes] : replayed->at(c)) {
          st = (*stream)->accept(h, std::span<const std::byte>(bytes));
          if (!st.ok()) break;
        }
      } else {
        TappedSink tap(**stream);
        st = stream_place(layout, masked, /*chunk=*/16, tap).status();
        if (recorded != nullptr) (*recorded)[c] = tap.frames;
      }
      if (st.ok()) st = (*stream)->commit();
      if (replayed == nullptr || !replayed->count(c)) {
        EXPECT_TRUE(st.ok()) << st.message();
      }
      uploads[c] = st;
    }
  }
  // Unmasks the round over `channel` and expects it to finish with exactly
  // the clients `of`, their plain mean handed to the aggregator.
  void expect_unmasked_mean_of(SecAggChannel& channel, const std::vector<int>& of) {
    auto n = sa->unmask_into(channel, aggregator, "secure_aggregate", 24);
    ASSERT_TRUE(n.ok()) << n.status().message();
    EXPECT_EQ(*n, of.size());
    expect_mean_of(of);
  }
  // The mean the aggregator was handed against the plain mean of `of`.
  void expect_mean_of(const std::vector<int>& of) const {
    ASSERT_EQ(aggregator.updates.size(), 1u);
    const auto& u = *aggregator.updates[0];
    ASSERT_EQ(u.bytes.size(), layout.total_bytes());
    for (size_t i = 0; i < layout.total_bytes() / 4; ++i) {
      float got;
      std::memcpy(&got, u.bytes.data() + 4 * i, 4);
      double want = 0;
      for (int c : of) want += element(c, i);
      ASSERT_EQ(got, static_cast<float>(want / static_cast<double>(of.size()))) << i;
    }
  }
};

// Flips a byte of every share `bad` seals for one of `victims`: they do
// not open there.
std::function<void(int, std::vector<SealedShare>*)> spoil_shares(int bad, std::set<int> victims) {
  return [bad, victims](int client, std::vector<SealedShare>* shares) {
    if (client != bad) return;
    for (auto& s : *shares)
      if (victims.count(s.to)) s.sealed[30] ^= 0x5a;
  };
}

TEST(SecAggRoundSeam, SharesThatDoNotOpenDropTheirSenderAndTheRoundFinishesWithTheRest) {
  // Client 2 seals every neighbour a share that does not open: every
  // honest client would refuse to unmask, so the round could never finish.
  // It is named, out, and the others' mean comes back, no round redone.
  HostileStages stages;
  stages.on_share_keys = spoil_shares(2, {0, 1, 3});
  SeamRound r({0, 1, 2, 3}, SecAggParams{}, stages);
  EXPECT_EQ(r.failed, (std::vector<int>{2}));
  EXPECT_EQ(r.sa->culprits(), (std::vector<int>{2}));
  r.expect_unmasked_mean_of(stages, {0, 1, 3});
}

TEST(SecAggRoundSeam, AShareSpoiledForOneNeighbourIsTakenOutAsADroppedClients) {
  // Client 2 spoils only its share for client 0; 1, 3 and 4 opened theirs
  // and paired masks with 2, client 0 did not. With 2 out, its masking key
  // comes back from 1, 3 and 4 (t = 3) and only their pairwise masks with
  // it are taken off the sum.
  HostileStages stages;
  stages.on_share_keys = spoil_shares(2, {0});
  SecAggParams p;
  p.reconstruction_threshold = 3;
  SeamRound r({0, 1, 2, 3, 4}, p, stages);
  EXPECT_EQ(r.failed, (std::vector<int>{2}));
  r.expect_unmasked_mean_of(stages, {0, 1, 3, 4});
}

TEST(SecAggRoundSeam, AWrongRevealedShareWithExactlyTSharesNamesItsRevealer) {
  // t = k = 3: no spare share to find the wrong one by; the share's public
  // check names client 1 as the one whose share of client 3's seed is wrong.
  HostileStages stages;
  stages.on_unmask = [](int client, std::vector<RevealedShare>* shares) {
    if (client != 1) return;
    for (auto& s : *shares)
      if (s.subject == 3) s.share.y[1] = gf_add(s.share.y[1], 1);
  };
  SecAggParams p;
  p.reconstruction_threshold = 3;
  SeamRound r({1, 2, 3}, p, stages);
  ASSERT_TRUE(r.failed.empty());
  auto n = r.sa->unmask_into(stages, r.aggregator, "secure_aggregate", 24);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kAborted);  // redone, without client 1
  EXPECT_EQ(r.sa->culprits(), (std::vector<int>{1}));
}

TEST(SecAgg, ARevealedShareIsCheckedAgainstTheOneItsSubjectSealed) {
  SecAggParams p;
  p.reconstruction_threshold = 3;
  Round r({1, 2, 3}, p, 8);
  r.share();
  std::vector<float> v(8, 1.0f);
  for (int id : {1, 2, 3}) r.upload(id, v, 1, 8);
  auto req = r.server->unmask_request();
  ASSERT_TRUE(req.ok());
  auto wrong = r.client(1).unmask(*req);
  ASSERT_TRUE(wrong.ok());
  for (auto& s : *wrong)
    if (s.subject == 3) s.share.y[0] = gf_add(s.share.y[0], 7);
  const Status st = r.server->add_revealed(1, *wrong);
  EXPECT_EQ(st.code(), StatusCode::kRejected);
  EXPECT_NE(st.message().find("client_1: its share of client_3's self-mask seed is not the one client_3 sealed"),
            std::string::npos)
      << st.message();
}

TEST(SecAggSettings, RefusesKBelowThreeAndTBelowTwoNamingTheKeyAndTheNumbers) {
  SecAggParams p;
  p.num_shares = 0.1;  // ⌈0.1·10⌉ = 1: each client would share only with itself
  auto s = SecAggSettings::resolve(p, 10);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("server_configs.secure_aggregation.num_shares: 0.1 resolves to k = 1 with 10"),
            std::string::npos)
      << s.status().message();
  p.num_shares = 2;  // a count, even: made 3, which is allowed
  p.reconstruction_threshold = 2;
  EXPECT_TRUE(SecAggSettings::resolve(p, 10).ok());
  p.num_shares = 1;
  p.reconstruction_threshold = 0.2;  // ⌈0.2·5⌉ = 1: one share would be the secret
  s = SecAggSettings::resolve(p, 5);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("reconstruction_threshold: 0.2 resolves to t = 1 with k = 5"), std::string::npos)
      << s.status().message();
  p.reconstruction_threshold = 0.67;
  s = SecAggSettings::resolve(p, 2);  // two clients: the sum tells each the other's update
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("at least 3 clients a round (2 selected)"), std::string::npos)
      << s.status().message();
}

// Client 1's round-1 masked frames, recorded as a transport carried them.
std::map<int, Frames> round_one_frames() {
  HostileStages first;
  std::map<int, Frames> round1;
  SeamRound r1({0, 1, 2, 3}, SecAggParams{}, first, /*round=*/1, &round1);
  EXPECT_TRUE(r1.sa->unmask_into(first, r1.aggregator, "secure_aggregate", 24).ok());
  first.end_round(1);
  return round1;
}

TEST(SecAggRoundSeam, AnUploadReplayedFromAnotherRoundIsRefusedNamingItsClient) {
  // Client 1's round-1 upload, replayed word for word in round 2: every
  // chunk check passes (layout, offsets, lengths, checksums), but the tags
  // are of round 1's key. The first frame is refused before a word of it is
  // summed, naming client 1, which is out of the round and the run; the
  // round finishes with the others, its mean theirs exactly.
  std::map<int, Frames> replay = {{1, round_one_frames().at(1)}};
  HostileStages second;
  SeamRound r2({0, 1, 2, 3}, SecAggParams{}, second, /*round=*/2, nullptr, &replay);
  const Status& st = r2.uploads.at(1);
  EXPECT_EQ(st.code(), StatusCode::kRejected) << st.message();
  EXPECT_NE(st.message().find("client_1: the masked words at element 0 do not carry their tag for round 2"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(r2.sa->culprits(), (std::vector<int>{1}));
  r2.expect_unmasked_mean_of(second, {0, 2, 3});
}

TEST(SecAggRoundSeam, RandomWordsInPlaceOfAMaskedUploadAreRefusedNamingTheClient) {
  // Frames of the right shape and checksums, random words and tags: the
  // first is refused naming client 2, and nothing of it reaches the sum.
  std::map<int, Frames> random = {{2, round_one_frames().at(2)}};
  std::mt19937 gen(7);
  for (auto& [h, bytes] : random.at(2)) {
    for (std::byte& b : bytes) b = static_cast<std::byte>(gen());
    h.checksum = chunk_checksum(bytes);
  }
  HostileStages stages;
  SeamRound r({0, 1, 2, 3}, SecAggParams{}, stages, /*round=*/2, nullptr, &random);
  EXPECT_EQ(r.uploads.at(2).code(), StatusCode::kRejected) << r.uploads.at(2).message();
  EXPECT_NE(r.uploads.at(2).message().find("client_2: the masked words at element 0 do not carry their tag"),
            std::string::npos)
      << r.uploads.at(2).message();
  EXPECT_EQ(r.sa->culprits(), (std::vector<int>{2}));
  r.expect_unmasked_mean_of(stages, {0, 1, 3});
}

TEST(SecAggRoundSeam, AClientKeyedForAnotherRunIsOutAtTheKeyExchange) {
  // Client 2 makes its round for another run's id (a stale or foreign
  // client): its shares do not open for anyone and it opens nobody's. It
  // alone is out — not the honest neighbours whose shares it could not
  // open — and the round finishes with the others.
  const ExperimentId other = secagg_experiment_id({{"server_configs.seed", "1"}});
  ASSERT_NE(other, kRun);
  HostileStages stages;
  stages.on_advertise = [&](int client, SecAggSettings* s) {
    if (client == 2) s->experiment = other;
  };
  SeamRound r({0, 1, 2, 3}, SecAggParams{}, stages);
  EXPECT_EQ(r.failed, (std::vector<int>{2}));
  EXPECT_EQ(r.sa->culprits(), (std::vector<int>{2}));
  r.expect_unmasked_mean_of(stages, {0, 1, 3});
}

TEST(SecAggRoundSeam, WordsAClientTagsButDidNotMaskMakeTheRoundRefusedNotFolded) {
  // What tags cannot catch: client 1 itself sends its round-1 words again,
  // tagged with its key of round 2 (a client can tag any words it likes).
  // Its masks do not cancel; the unmasked sum is out of range and the round
  // is refused and redone, not folded — without a name, since only the sum
  // shows it.
  std::map<int, Frames> retagged = {{1, round_one_frames().at(1)}};
  HostileStages stages;
  // Re-tagged once its upload of round 2 has begun (its tag key agreed).
  SeamRound r({0, 1, 2, 3}, SecAggParams{}, stages, /*round=*/2, nullptr, &retagged, kRun, [&](int client) {
    if (client != 1) return;
    const SecAggClient& c = *stages.honest.client(1);
    for (auto& [h, bytes] : retagged.at(1)) {
      auto* w = reinterpret_cast<uint32_t*>(bytes.data());
      const size_t words = bytes.size() / 4 - 4;
      const UploadTag tag = c.tag(h.offset / 4, std::span<const uint32_t>(w, words)).value();
      std::memcpy(w + words, tag.data(), tag.size());
      h.checksum = chunk_checksum(bytes);
    }
  });
  EXPECT_TRUE(r.uploads.at(1).ok()) << r.uploads.at(1).message();
  auto n = r.sa->unmask_into(stages, r.aggregator, "secure_aggregate", 24);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kAborted);
  EXPECT_NE(n.status().message().find("a client's masked words were not made with its masks of this round"),
            std::string::npos)
      << n.status().message();
  EXPECT_TRUE(r.sa->culprits().empty());
  for (const auto& u : r.aggregator.updates) EXPECT_FALSE(u->committed);
}

}  // namespace
}  // namespace memfl
