// One core's memory speed here, the ceiling under every transport's copy:
// memcpy, xxh3-64 and the two fused (copy a 32 KiB block, hash it while it is
// in L1, as comm/chunk's copy_with_checksum does), over a 1 GiB buffer in
// 1 MiB steps, best of 3; and memcpy on two threads at once, each its own
// 1 GiB (whether one core's copy is the limit, or the memory). Prints one
// JSON object.
// Build and run: c++ -O2 -march=x86-64-v3 bench/membw.cpp -o build/membw -pthread && build/membw
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

int main() {
  using Clock = std::chrono::steady_clock;
  const size_t n = size_t{1} << 30, step = size_t{1} << 20, block = 32 << 10;
  std::vector<char> a(n, 1), b(n, 2);
  double copy = 0, hash = 0, fused = 0;
  uint64_t sink = 0;
  auto gbps = [&](auto&& body) {
    const auto t = Clock::now();
    body();
    return static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - t).count() / 1e9;
  };
  for (int rep = 0; rep < 3; ++rep) {
    copy = std::max(copy, gbps([&] {
                      for (size_t o = 0; o < n; o += step) std::memcpy(b.data() + o, a.data() + o, step);
                    }));
    hash = std::max(hash, gbps([&] {
                      for (size_t o = 0; o < n; o += step) sink ^= XXH3_64bits(a.data() + o, step);
                    }));
    fused = std::max(fused, gbps([&] {
                       XXH3_state_t st;
                       XXH3_64bits_reset(&st);
                       for (size_t o = 0; o < n; o += block) {
                         std::memcpy(b.data() + o, a.data() + o, block);
                         XXH3_64bits_update(&st, b.data() + o, block);
                       }
                       sink ^= XXH3_64bits_digest(&st);
                     }));
  }
  std::vector<char> c(n, 1), d(n, 2);
  double copy2 = 0;
  for (int rep = 0; rep < 3; ++rep) {
    copy2 = std::max(copy2, 2 * gbps([&] {
                              std::thread other([&] {
                                for (size_t o = 0; o < n; o += step) std::memcpy(d.data() + o, c.data() + o, step);
                              });
                              for (size_t o = 0; o < n; o += step) std::memcpy(b.data() + o, a.data() + o, step);
                              other.join();
                            }));
  }
  std::printf(
      "{\"memcpy_gbps\": %.2f, \"xxh3_gbps\": %.2f, \"memcpy_then_xxh3_fused_gbps\": %.2f, \"memcpy_2_threads_gbps\": "
      "%.2f, \"sink\": %llu}\n",
      copy, hash, fused, copy2, static_cast<unsigned long long>(sink & 1));
  return 0;
}
