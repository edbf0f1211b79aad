// Data-parallel loops over large byte ranges (model-sized arenas: filling,
// first touch, folding a big chunk). One process-wide pool, made on first
// use; the calling thread works too, so callers on several threads at once
// (one per client stream) never wait on each other's tasks.
//
// Why: on a 2-core machine these loops are bound by one core either way, but
// a 70B model (141 GB) on a many-core host spent minutes in single-threaded
// first touch, seeded fill and bf16 folding (docs/BENCHMARKS.md, "LLM
// scale"). The work is split into disjoint index ranges, so results do not
// depend on the number of threads.
#pragma once

#include <cstddef>
#include <functional>

namespace memfl {

// Threads the pool may use, the caller included: MEMFL_THREADS if set (≥ 1),
// else the cores this process may run on, at most 32.
int parallel_threads();

// Calls fn(begin, end) over [0, n) cut into pieces of at least `grain`
// (at most parallel_threads() pieces); returns when every piece is done.
// Below 2 × grain, fn(0, n) on the calling thread.
void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

// memcpy of n bytes on the pool, 8 MiB pieces at least (a model of many GB
// is copied at the memory's speed, not one core's).
void parallel_copy(void* dst, const void* src, size_t n);

}  // namespace memfl
