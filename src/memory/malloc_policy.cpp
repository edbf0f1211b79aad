#include "memory/malloc_policy.h"

#include <malloc.h>

#include <climits>
#include <cstdlib>
#include <cstring>

namespace memfl {

namespace {

const char* g_policy = "glibc";

bool left_to_glibc() {
  const char* v = std::getenv("MEMFL_MALLOC_POLICY");
  return v != nullptr && std::strcmp(v, "glibc") == 0;
}

}  // namespace

Status check_malloc_policy_env() {
  const char* v = std::getenv("MEMFL_MALLOC_POLICY");
  if (v == nullptr || std::strcmp(v, "glibc") == 0) return Status::Ok();
  return invalid_argument(
      "MEMFL_MALLOC_POLICY is '{}': the one value it takes is glibc (glibc's defaults); unset it for each role's "
      "policy",
      v);
}

void tune_malloc_for_streaming() {
  if (left_to_glibc()) return;
  // Chunk buffers are allocated and freed at line rate. With glibc's default
  // dynamic thresholds each multi-MiB buffer was a fresh mmap and page faults
  // (0.1–0.2 GB/s here); keeping them in the heap and not trimming it reached
  // 1.1–1.7 GB/s (../shared/DEPENDENCIES.md). Freed chunks are reused, so the
  // heap stays at a few chunks, not a model. 32 MiB is the most glibc takes.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // gRPC's threads would each get a malloc arena holding its own freed
  // chunks; a few shared arenas keep the retained heap to a few chunks.
  mallopt(M_ARENA_MAX, 2);
  g_policy = "streaming";
}

void tune_malloc_for_training() {
  if (left_to_glibc()) return;
  tune_malloc_for_streaming();
  // A training step frees its activations and gradients at the end of the
  // step and allocates the same sizes again in the next. Trimmed, the heap
  // went back to the kernel every step: ResNet18 (batch 16) took 75–81 k
  // page faults per 8 steps under glibc's defaults and none with the heap
  // kept, which trained 1.4× faster (docs/BENCHMARKS.md,
  // "Training speed").
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
  g_policy = "training";
}

const char* malloc_policy() { return g_policy; }

}  // namespace memfl
