// The FedAvg fold of an f32 update as memfl does it (aggregate/
// fedavg_aggregator.cpp), for the programs that measure this machine's
// ceiling (transfer_ceiling, tcp_raw_bandwidth's FOLD): sum = w·x for the
// first update in fold order, with streaming stores (the sum is written,
// never read), sum += w·x for the others. `sum` is 32-byte aligned and `n`
// a multiple of 8.
#pragma once

#include <immintrin.h>

#include <cstddef>

__attribute__((target("avx2"))) inline void ceiling_fold(float* sum, const float* x, size_t n, float w, bool first) {
  const __m256 vw = _mm256_set1_ps(w);
  if (first) {
    for (size_t i = 0; i < n; i += 8) _mm256_stream_ps(sum + i, _mm256_mul_ps(vw, _mm256_loadu_ps(x + i)));
    _mm_sfence();
  } else {
    for (size_t i = 0; i < n; i += 8)
      _mm256_store_ps(sum + i, _mm256_add_ps(_mm256_load_ps(sum + i), _mm256_mul_ps(vw, _mm256_loadu_ps(x + i))));
  }
}
