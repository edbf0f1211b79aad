// What each stage of a checked, folded transfer costs one core here, alone
//: the work per GiB of model that any transport doing
// these stages must spend, whatever it overlaps. With C cores, a direction
// that needs W core-seconds per GB delivered cannot move more than C / W GB/s.
//
// Every stage is timed on one thread with nothing else running, over a model of
// MODEL_MB (1 GiB: beyond the L2, mostly beyond the L3) in chunks of CHUNK_KB,
// best of REPS: the most favourable conditions it gets (a slot the same
// thread has just written is in its own cache; in a real transfer it comes
// from the other core). So the bound is an upper one: contention only adds.
//
// Stages of the shared-memory ring (memfl's MPI path):
//   up_client      copy a chunk of the update into a slot with its xxh3
//   up_server      check the slot's xxh3, fold it into the sum (read-modify-
//                  write; the first update in fold order writes it with
//                  streaming stores: up_server_first)
//   down_server    copy a chunk of the global model into a slot with its xxh3
//   down_client    copy the slot into the client's model, checking its xxh3
// Zero copy (the server reads the client's memory, the client the server's,
// through a shared mapping that is dropped chunk by chunk so that neither
// side's RSS holds the other's model; without the drop the server's RSS
// would grow by a model per client):
//   zc_up_client   xxh3 of the chunk where it lies
//   zc_up_server   map the chunk in (MADV_POPULATE_READ), check, fold, drop it
//                  (MADV_DONTNEED)
//   zc_down_server xxh3 of the chunk of the global model
//   zc_down_client map in, copy into its model checking the xxh3, drop
//   map_only       the map-in and drop alone
//
// One client and the server, one thread each, form a pipeline that moves no
// faster than its slower stage (pipeline_bound_gbps).
//
// Usage: transfer_work [MODEL_MB [REPS [CHUNK_KB]]] (default 1024 3 1024: the
// chunk of `memfl bench transfer`, and as many slots as memfl's ring gives
// it, 8 MiB worth, 2 to 8). Prints one JSON object: seconds per GiB of
// each stage, and the bound each design gives for 1, 2 and 4 clients on
// this machine's cores.
#define XXH_INLINE_ALL
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ceiling_copy.h"
#include "ceiling_fold.h"
#include "huge_buffer.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "transfer_work: %s\n", what);
  std::exit(1);
}

// A resident buffer of 0.747f (bytes of 1 would be denormals), advised to
// use huge pages as memfl's arenas are; it lives until the process ends.
char* private_buffer(size_t n) { return (new HugeBuffer(n, 0x3f))->data(); }

// A resident shared-memory file of n bytes and a mapping of it.
char* shared_buffer(size_t n) {
  const int fd = memfd_create("transfer_work", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) fail("memfd");
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("mmap");
  std::memset(p, 0x3f, n);
  return static_cast<char*>(p);
}

void map_in(char* p, size_t n) {
  if (madvise(p, n, MADV_POPULATE_READ) != 0) fail("MADV_POPULATE_READ");
}
void drop(char* p, size_t n) {
  if (madvise(p, n, MADV_DONTNEED) != 0) fail("MADV_DONTNEED");
}

struct Stage {
  std::string name;
  double best_s = 1e30;
};

}  // namespace

int main(int argc, char** argv) {
  const size_t kModel = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  const size_t kChunk = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1024) << 10;
  // As memfl's ring: 8 MiB of slots, 2 to 8 of them.
  const size_t kSlots = std::clamp<size_t>((size_t{8} << 20) / std::max<size_t>(kChunk, 1), 2, 8);
  if (kModel == 0 || kChunk == 0 || kChunk % 32 != 0 || kModel % kChunk != 0 || reps < 1)
    fail("MODEL_MB: positive, a whole number of chunks; REPS: positive; CHUNK_KB: positive");
  const size_t kChunks = kModel / kChunk;
  char* model = private_buffer(kModel);   // a client's update / its model
  char* sum = private_buffer(kModel);     // the server's running sum
  char* global = private_buffer(kModel);  // the server's global model
  char* shared = shared_buffer(kModel);   // zero copy: the other side's memory
  std::vector<char*> slots;
  for (size_t k = 0; k < kSlots; ++k) slots.push_back(private_buffer(kChunk));
  std::vector<uint64_t> sums(kChunks);
  const float w = 0.25f;

  // Each stage's body runs over every chunk; only the body is timed, so a
  // stage that needs a slot filled first (the server's check) gets it filled
  // untimed, and hot in its own cache.
  std::vector<Stage> stages;
  auto time_stage = [&](const char* name, const std::function<void(size_t)>& prepare,
                        const std::function<void(size_t)>& body) {
    Stage s{name};
    for (int r = -1; r < reps; ++r) {  // an untimed first pass: a cold start once cost 2.5 ×
      double t = 0;
      for (size_t i = 0; i < kChunks; ++i) {
        prepare(i);
        const auto t0 = Clock::now();
        body(i);
        t += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      if (r >= 0) s.best_s = std::min(s.best_s, t);
    }
    stages.push_back(s);
  };
  auto none = [](size_t) {};
  auto fill_slot = [&](size_t i) { sums[i] = copy_with_xxh3(slots[i % kSlots], model + i * kChunk, kChunk); };
  auto check = [&](const char* p, size_t i) {
    if (XXH3_64bits(p, kChunk) != sums[i]) fail("checksum mismatch");
  };

  time_stage("up_client", none,
             [&](size_t i) { sums[i] = copy_with_xxh3(slots[i % kSlots], model + i * kChunk, kChunk); });
  time_stage("up_server_first", fill_slot, [&](size_t i) {
    check(slots[i % kSlots], i);
    ceiling_fold(reinterpret_cast<float*>(sum + i * kChunk), reinterpret_cast<const float*>(slots[i % kSlots]),
                 kChunk / 4, w, true);
  });
  time_stage("up_server", fill_slot, [&](size_t i) {
    check(slots[i % kSlots], i);
    ceiling_fold(reinterpret_cast<float*>(sum + i * kChunk), reinterpret_cast<const float*>(slots[i % kSlots]),
                 kChunk / 4, w, false);
  });
  time_stage("down_server", none,
             [&](size_t i) { sums[i] = copy_with_xxh3(slots[i % kSlots], global + i * kChunk, kChunk); });
  time_stage(
      "down_client", [&](size_t i) { sums[i] = copy_with_xxh3(slots[i % kSlots], global + i * kChunk, kChunk); },
      [&](size_t i) {
        if (copy_with_xxh3(model + i * kChunk, slots[i % kSlots], kChunk) != sums[i]) fail("checksum mismatch");
      });
  // Zero copy. The shared buffer stands for the other side's memory; the
  // page cache holds it, and each chunk is mapped in and dropped around use.
  drop(shared, kModel);
  time_stage("zc_up_client", none, [&](size_t i) { sums[i] = XXH3_64bits(model + i * kChunk, kChunk); });
  auto hash_shared = [&](size_t i) {
    sums[i] = XXH3_64bits(shared + i * kChunk, kChunk);
    drop(shared + i * kChunk, kChunk);
  };
  for (const bool first : {true, false}) {
    time_stage(first ? "zc_up_server_first" : "zc_up_server", hash_shared, [&](size_t i) {
      char* p = shared + i * kChunk;
      map_in(p, kChunk);
      check(p, i);
      ceiling_fold(reinterpret_cast<float*>(sum + i * kChunk), reinterpret_cast<const float*>(p), kChunk / 4, w, first);
      drop(p, kChunk);
    });
  }
  time_stage("zc_down_server", none, [&](size_t i) { sums[i] = XXH3_64bits(global + i * kChunk, kChunk); });
  time_stage("zc_down_client", hash_shared, [&](size_t i) {
    char* p = shared + i * kChunk;
    map_in(p, kChunk);
    if (copy_with_xxh3(model + i * kChunk, p, kChunk) != sums[i]) fail("checksum mismatch");
    drop(p, kChunk);
  });
  time_stage("map_only", none, [&](size_t i) {
    map_in(shared + i * kChunk, kChunk);
    drop(shared + i * kChunk, kChunk);
  });

  auto cost = [&](const char* name) {  // seconds per GB (1e9 bytes)
    for (const auto& s : stages)
      if (s.name == name) return s.best_s * 1e9 / static_cast<double>(kModel);
    fail("no such stage");
  };
  const double cores = static_cast<double>(std::thread::hardware_concurrency());
  // Core-seconds per GB delivered with n clients. Upload: every client's
  // bytes pay the client's stage and a fold (the first update in fold order
  // the cheaper one). Download: the server's stage once per model, each
  // client's once per copy.
  auto up = [&](const char* client, const char* first, const char* rest, int n) {
    return (n * cost(client) + cost(first) + (n - 1) * cost(rest)) / n;
  };
  auto down = [&](const char* server, const char* client, int n) { return (cost(server) + n * cost(client)) / n; };
  std::string out = "{\"model_bytes\": " + std::to_string(kModel) + ", \"chunk_bytes\": " + std::to_string(kChunk) +
                    ", \"slots\": " + std::to_string(kSlots) + ", \"reps\": " + std::to_string(reps) +
                    ", \"cores\": " + std::to_string(static_cast<int>(cores)) + ", \"seconds_per_gb\": {";
  for (size_t k = 0; k < stages.size(); ++k)
    out += (k ? ", \"" : "\"") + stages[k].name + "\": " + std::to_string(cost(stages[k].name.c_str()));
  out += "}, \"bound_gbps\": {";
  bool firstcell = true;
  for (int n : {1, 2, 4}) {
    const std::pair<std::string, double> cells[] = {
        {"ring_up", up("up_client", "up_server_first", "up_server", n)},
        {"ring_down", down("down_server", "down_client", n)},
        {"zero_copy_up", up("zc_up_client", "zc_up_server_first", "zc_up_server", n)},
        {"zero_copy_down", down("zc_down_server", "zc_down_client", n)},
    };
    for (const auto& [name, w_per_gb] : cells) {
      out += (firstcell ? "\"" : ", \"") + name + "_" + std::to_string(n) + "\": " + std::to_string(cores / w_per_gb);
      firstcell = false;
    }
  }
  // One client against the server is a two-stage pipeline of one thread
  // each (memfl's ranks): it moves no faster than its slower stage.
  out += "}, \"pipeline_bound_gbps\": {";
  const std::pair<const char*, double> one[] = {
      {"ring_up_1", std::max(cost("up_client"), cost("up_server_first"))},
      {"ring_down_1", std::max(cost("down_server"), cost("down_client"))},
      {"zero_copy_up_1", std::max(cost("zc_up_client"), cost("zc_up_server_first"))},
      {"zero_copy_down_1", std::max(cost("zc_down_server"), cost("zc_down_client"))},
  };
  for (size_t k = 0; k < std::size(one); ++k)
    out += (k ? ", \"" : "\"") + std::string(one[k].first) + "\": " + std::to_string(1 / one[k].second);
  out += "}}";
  std::puts(out.c_str());
  return 0;
}
