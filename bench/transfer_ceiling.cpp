// The machine's ceiling for a checked, folded transfer through shared memory
//: the work every chunk of a memfl transfer must get —
// the sender's xxh3, a copy into a slot of a ring, the receiver's xxh3 check,
// and on upload the FedAvg fold into the sum (the first update in fold order
// writes it with streaming stores, the others read-modify-write it) — done by
// threads of one process, with no MPI, no messages and no memfl in between.
// No transport that does the same work on the same cores can be faster, so
// memfl's figures divided by these are its distance from the machine's limit.
//
//   upload:   a producer copies chunk i of client k's model into a slot with
//             its xxh3 (as a client rank fills a slot); a consumer checks the
//             slot's xxh3 and folds it (as the server). Clients in turn, each
//             whole model, as memfl's MPI server takes them ("sequential"), or
//             chunk by chunk across clients ("interleaved"): the sum's chunk
//             is still in cache for the next client's fold.
//   upload "split_copy": one client's copy split over two producer threads
//             (alternate slots), one consumer checking and folding in order.
//   upload "direct": no slot: the consumer checks and folds from the
//             client's model itself (a zero-copy shared window).
//   download: a producer copies chunk i of the global model into a slot with
//             its xxh3 (as the server); each of CLIENTS consumer threads
//             copies it into its own model with the xxh3 check (as a client).
//
// Waits are futexes (C++20 atomic wait), so threads beyond the cores cost a
// wake-up, not a spinning core. GB/s counts every client's bytes.
//
// Usage: transfer_ceiling MODEL_MB CLIENTS CHUNK_KB SLOTS REPS
// Prints one JSON object: best and median of REPS for each way.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ceiling_copy.h"
#include "ceiling_fold.h"
#include "huge_buffer.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Buffer {
  // Resident and huge-page advised, as a model arena is after its first
  // round (bench/huge_buffer.h); 0x3f bytes are the float 0.747 (bytes of 1
  // would be denormals, which fold at a fraction of the speed and would
  // measure the FPU, not the memory).
  explicit Buffer(size_t n) : bytes(n), mem(n, 0x3f), p(mem.data()) {}
  size_t bytes;
  HugeBuffer mem;
  char* p;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "transfer_ceiling: %s\n", what);
  std::exit(1);
}

// One upload: items in `order` (client, chunk); `slots` slots between
// `producers` producer threads (item n is producer n mod producers's, so
// with 2 one client's copy is split over two threads) and one consumer,
// which checks and folds the items in order; with `direct` the consumer
// reads the client's model itself. Returns seconds.
double upload(const std::vector<std::unique_ptr<Buffer>>& models, Buffer& sum, size_t chunk, size_t slots,
              const std::vector<std::pair<int, size_t>>& order, bool direct, size_t producers = 1) {
  const size_t model = sum.bytes;
  std::vector<std::unique_ptr<Buffer>> ring;
  for (size_t s = 0; s < slots; ++s) ring.push_back(std::make_unique<Buffer>(chunk));
  std::vector<uint64_t> sums(order.size());
  std::vector<std::atomic<uint32_t>> ready(order.size());
  std::atomic<uint64_t> taken{0};
  const float w = 1.0f / static_cast<float>(models.size());
  const auto t0 = Clock::now();
  auto produce = [&](size_t first) {
    for (size_t n = first; n < order.size(); n += producers) {
      for (uint64_t t = taken.load(); n >= t + slots; t = taken.load()) taken.wait(t);
      const auto [k, i] = order[n];
      const size_t len = std::min(chunk, model - i * chunk);
      const char* src = models[static_cast<size_t>(k)]->p + i * chunk;
      sums[n] = direct ? XXH3_64bits(src, len) : copy_with_xxh3(ring[n % slots]->p, src, len);
      ready[n].store(1);
      ready[n].notify_one();
    }
  };
  std::vector<std::thread> threads;
  for (size_t p = 0; p < producers; ++p) threads.emplace_back(produce, p);
  for (size_t n = 0; n < order.size(); ++n) {
    while (ready[n].load() == 0) ready[n].wait(0);
    const auto [k, i] = order[n];
    const size_t len = std::min(chunk, model - i * chunk);
    const char* got = direct ? models[static_cast<size_t>(k)]->p + i * chunk : ring[n % slots]->p;
    if (XXH3_64bits(got, len) != sums[n]) fail("checksum mismatch");
    ceiling_fold(reinterpret_cast<float*>(sum.p + i * chunk), reinterpret_cast<const float*>(got), len / 4, w, k == 0);
    taken.store(n + 1);
    taken.notify_all();
  }
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One download: a producer fills slots from the global model; every client
// thread copies each slot into its model with the check, then frees it.
double download(const Buffer& global, const std::vector<std::unique_ptr<Buffer>>& models, size_t chunk, size_t slots) {
  const size_t model = global.bytes, nchunks = (model + chunk - 1) / chunk, clients = models.size();
  std::vector<std::unique_ptr<Buffer>> ring;
  for (size_t s = 0; s < slots; ++s) ring.push_back(std::make_unique<Buffer>(chunk));
  std::vector<uint64_t> sums(nchunks);
  std::atomic<uint64_t> filled{0};
  std::vector<std::atomic<uint64_t>> done(clients);  // chunks each client has taken
  const auto t0 = Clock::now();
  std::vector<std::thread> readers;
  for (size_t c = 0; c < clients; ++c) {
    readers.emplace_back([&, c] {
      for (size_t i = 0; i < nchunks; ++i) {
        for (uint64_t f = filled.load(); f <= i; f = filled.load()) filled.wait(f);
        const size_t len = std::min(chunk, model - i * chunk);
        if (copy_with_xxh3(models[c]->p + i * chunk, ring[i % slots]->p, len) != sums[i]) fail("checksum mismatch");
        done[c].store(i + 1);
        done[c].notify_one();
      }
    });
  }
  for (size_t i = 0; i < nchunks; ++i) {
    for (size_t c = 0; c < clients; ++c) {
      for (uint64_t d = done[c].load(); i >= d + slots; d = done[c].load()) done[c].wait(d);
    }
    const size_t len = std::min(chunk, model - i * chunk);
    sums[i] = copy_with_xxh3(ring[i % slots]->p, global.p + i * chunk, len);
    filled.store(i + 1);
    filled.notify_all();
  }
  for (auto& t : readers) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s MODEL_MB CLIENTS CHUNK_KB SLOTS REPS\n", argv[0]);
    return 2;
  }
  const size_t model = static_cast<size_t>(std::atof(argv[1]) * (1 << 20));
  const int clients = std::atoi(argv[2]);
  const size_t chunk = static_cast<size_t>(std::atol(argv[3])) << 10;
  const size_t slots = static_cast<size_t>(std::atol(argv[4]));
  const int reps = std::atoi(argv[5]);
  if (model == 0 || clients < 1 || chunk == 0 || chunk % 32 != 0 || model % chunk != 0 || slots < 1 || reps < 1) {
    std::fprintf(stderr, "MODEL_MB, CLIENTS, CHUNK_KB, SLOTS, REPS: positive; the model a whole number of chunks\n");
    return 2;
  }
  const size_t nchunks = model / chunk;
  Buffer global(model), sum(model);
  std::vector<std::unique_ptr<Buffer>> models;
  for (int c = 0; c < clients; ++c) models.push_back(std::make_unique<Buffer>(model));
  std::vector<std::pair<int, size_t>> sequential, interleaved;
  for (int k = 0; k < clients; ++k)
    for (size_t i = 0; i < nchunks; ++i) sequential.emplace_back(k, i);
  for (size_t i = 0; i < nchunks; ++i)
    for (int k = 0; k < clients; ++k) interleaved.emplace_back(k, i);
  const double total = static_cast<double>(model) * clients / 1e9;
  std::vector<double> down, up_seq, up_inter, up_direct, up_split;
  for (int r = 0; r < reps; ++r) {
    down.push_back(total / download(global, models, chunk, slots));
    up_seq.push_back(total / upload(models, sum, chunk, slots, sequential, false));
    up_inter.push_back(total / upload(models, sum, chunk, slots, interleaved, false));
    up_direct.push_back(total / upload(models, sum, chunk, slots, interleaved, true));
    up_split.push_back(total / upload(models, sum, chunk, slots, sequential, false, 2));
  }
  auto both = [](const char* name, const std::vector<double>& v) {
    return std::string("\"") + name + "_gbps_best\": " + std::to_string(*std::max_element(v.begin(), v.end())) +
           ", \"" + name + "_gbps_median\": " + std::to_string(median(v));
  };
  std::printf(
      "{\"model_bytes\": %zu, \"clients\": %d, \"chunk_bytes\": %zu, \"slots\": %zu, \"reps\": %d, %s, %s, %s, %s, "
      "%s}\n",
      model, clients, chunk, slots, reps, both("download", down).c_str(), both("upload_sequential", up_seq).c_str(),
      both("upload_interleaved", up_inter).c_str(), both("upload_direct", up_direct).c_str(),
      both("upload_split_copy", up_split).c_str());
  return 0;
}
