// Secure aggregation's costs, as one JSON object on stdout:
//   mask_gbps_per_core      XChaCha20 mask regeneration, one thread, 1 MiB chunks
//   keystream_gbps_per_core the ceiling beside it: the ChaCha20 keystream
//                           alone (OpenSSL's where memfl uses it), 64 KiB at
//                           a time, one thread
//   libsodium_keystream_gbps_per_core  libsodium's XChaCha20 keystream alone
//   tag_gbps                upload frames' tags (Poly1305 pieces), 1 MiB frames,
//                           on the pool's threads (MEMFL_THREADS=1: one core)
//   mask_client_seconds     one client quantising, masking and tagging its
//                           update (k streams)
//   unmask_seconds_dropped  the server's unmasking with 0, 1, 2 dropped clients;
//                           the slope is the cost per dropped client
// Usage: memfl_bench_secagg [ELEMENTS=10000000] [CLIENTS=10]
//        memfl_bench_secagg ceiling   the mask streams' ceiling alone:
//   mask_gbps_all_cores     one MaskStream per core at once, each over its own
//                           512 MiB in 1 MiB calls: what the cores can put
//                           into masks together (bench/secagg.sh's floor)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <sodium.h>
#ifdef MEMFL_HAVE_OPENSSL_CHACHA
#include <openssl/evp.h>
#endif

#include "secagg/crypto.h"
#include "secagg/secagg.h"

using namespace memfl;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One round with `dropped` of `n` clients dropping after key sharing;
// returns the unmasking's seconds, and the masking's of one client.
double round_seconds(size_t elements, int n, int dropped, double* mask_seconds) {
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) ids.push_back(i);
  SecAggParams p;
  p.reconstruction_threshold = 0.5;
  const SecAggSettings s = SecAggSettings::resolve(p, ids.size()).value();
  std::vector<uint32_t> sum(elements + 1);
  SecAggServer server(1, ids, s, sum);
  std::vector<std::unique_ptr<SecAggClient>> clients;
  for (int id : ids) clients.push_back(std::make_unique<SecAggClient>(id, 1, ids, server.settings()));
  for (auto& c : clients) (void)server.add_advert(c->advertise());
  for (auto& c : clients) (void)server.add_shares(c->client(), *c->share_keys(server.roster_for(c->client())));
  for (auto& c : clients) (void)c->receive_shares(server.inbox_for(c->client()));
  constexpr size_t kChunk = 1 << 18;  // elements: 1 MiB of words
  std::vector<float> x(kChunk, 0.01f);
  std::vector<uint32_t> words(kChunk);
  for (int i = dropped; i < n; ++i) {
    auto& c = *clients[static_cast<size_t>(i)];
    const auto t = Clock::now();
    (void)c.begin_update(elements, 100);
    for (size_t off = 0; off < elements; off += kChunk) {
      const size_t len = std::min(kChunk, elements - off);
      (void)c.mask_chunk(off, std::span(x).first(len), std::span(words).first(len));
      const auto tag = c.tag(off, std::span(words).first(len));
      (void)server.add_masked_chunk(c.client(), off, std::span(words).first(len), *tag);
    }
    const uint32_t w = c.masked_weight();
    (void)server.add_masked_chunk(c.client(), elements, std::span(&w, 1), *c.tag(elements, std::span(&w, 1)));
    (void)server.finish_upload(c.client());
    if (i == dropped) *mask_seconds = seconds_since(t);
  }
  const auto t = Clock::now();
  auto req = server.unmask_request().value();
  for (int id : req.survivors) (void)server.add_revealed(id, *clients[static_cast<size_t>(id)]->unmask(req));
  if (!server.reconstruct().ok()) std::abort();
  for (size_t off = 0; off <= elements; off += kChunk) {
    const size_t len = std::min(kChunk, elements + 1 - off);
    (void)server.unmask_chunk(off, std::span(sum).subspan(off, len));
  }
  return seconds_since(t);
}

}  // namespace

// Masks added by one thread per core at once, GB/s in all.
double mask_gbps_all_cores(int cores) {
  // 512 MiB a core a repetition (about 0.1 s), the best of 5: shorter runs
  // read this VM's scheduling noise, 2–3 × low at times.
  constexpr size_t kWords = size_t{128} << 20, kCall = 1 << 18;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<std::thread> threads;
    const auto t = Clock::now();
    for (int c = 0; c < cores; ++c) {
      threads.emplace_back([] {
        MaskStream m(random_secret(), "bench");
        std::vector<uint32_t> buf(kCall);
        for (size_t off = 0; off < kWords; off += kCall) m.apply(off, buf, +1);
      });
    }
    for (auto& th : threads) th.join();
    best = std::max(best, static_cast<double>(cores) * kWords * 4 / seconds_since(t) / 1e9);
  }
  return best;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "ceiling") {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    nlohmann::ordered_json c;
    c["cores"] = cores;
    c["mask_gbps_all_cores"] = mask_gbps_all_cores(cores);
    std::printf("%s\n", c.dump().c_str());
    return 0;
  }
  const size_t elements = argc > 1 ? std::stoull(argv[1]) : 10'000'000;
  const int clients = argc > 2 ? std::stoi(argv[2]) : 10;
  nlohmann::ordered_json out;
  out["elements"] = elements;
  out["clients"] = clients;
  // Mask regeneration alone: one stream over the update, 1 MiB at a time.
  {
    MaskStream m(random_secret(), "bench");
    std::vector<uint32_t> buf(1 << 18);
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t = Clock::now();
      for (size_t off = 0; off < elements; off += buf.size()) {
        m.apply(off, std::span(buf).first(std::min(buf.size(), elements - off)), +1);
      }
      best = std::max(best, static_cast<double>(elements) * 4 / seconds_since(t) / 1e9);
    }
    out["mask_gbps_per_core"] = best;
  }
  {
    const MaskStream keys(random_secret(), "bench");
    std::vector<uint32_t> buf(1 << 18, 7u);
    double best = 0;
    uint8_t fold = 0;  // keeps the tags from being optimised away
    for (int rep = 0; rep < 3; ++rep) {
      const auto t = Clock::now();
      for (size_t off = 0; off < elements; off += buf.size()) {
        fold ^= upload_tag(keys, off, std::span(buf).first(std::min(buf.size(), elements - off)))[0];
      }
      best = std::max(best, static_cast<double>(elements) * 4 / seconds_since(t) / 1e9);
    }
    out["tag_gbps"] = best;
    out["tag_fold"] = fold;
  }
  {
    std::vector<unsigned char> zeros(1 << 16), stream(1 << 16);
    const Secret32 key = random_secret();
    const unsigned char nonce[24] = {1};
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t = Clock::now();
      for (size_t off = 0; off < elements * 4; off += stream.size()) {
        crypto_stream_xchacha20_xor_ic(stream.data(), zeros.data(), stream.size(), nonce, off / 64, key.data());
      }
      best = std::max(best, static_cast<double>(elements) * 4 / seconds_since(t) / 1e9);
    }
    out["libsodium_keystream_gbps_per_core"] = best;
    out["keystream_gbps_per_core"] = best;
#ifdef MEMFL_HAVE_OPENSSL_CHACHA
    // OpenSSL's ChaCha20 keyed once, then streamed: no re-keying per piece.
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    const unsigned char iv[16] = {};
    best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t = Clock::now();
      EVP_EncryptInit_ex(ctx, EVP_chacha20(), nullptr, key.data(), iv);
      for (size_t off = 0; off < elements * 4; off += stream.size()) {
        int len = 0;
        EVP_EncryptUpdate(ctx, stream.data(), &len, zeros.data(), static_cast<int>(stream.size()));
      }
      best = std::max(best, static_cast<double>(elements) * 4 / seconds_since(t) / 1e9);
    }
    EVP_CIPHER_CTX_free(ctx);
    out["keystream_gbps_per_core"] = best;
#endif
  }
  std::vector<double> unmask;
  double mask_seconds = 0;
  for (int d = 0; d <= 2; ++d) unmask.push_back(round_seconds(elements, clients, d, &mask_seconds));
  out["mask_client_seconds"] = mask_seconds;
  out["unmask_seconds_dropped"] = unmask;
  const double per_dropped = (unmask[2] - unmask[0]) / 2;
  out["unmask_seconds_per_dropped_client"] = per_dropped;
  // A dropped client costs one pairwise stream per surviving neighbour.
  out["unmask_gbps_per_dropped_client_stream"] =
      per_dropped > 0 ? static_cast<double>(elements) * 4 * (clients - 2) / per_dropped / 1e9 : 0.0;
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
