// Each role's glibc malloc policy. The defaults suit neither of memfl's two
// kinds of work: with glibc's dynamic thresholds a multi-MiB buffer freed at
// the top of the heap is handed back to the kernel and faulted in again on
// the next allocation, one 4 KiB page at a time.
//
// - Streaming (a server, the transports): chunk buffers are allocated and
//   freed at line rate; they stay in the heap, and the heap is trimmed above
//   a few chunks, so RSS stays flat whatever the model's size.
// - Training (a client, MPI client ranks, the simulator): on top of that, the
//   heap is never trimmed, so each batch reuses the last one's activation and
//   gradient memory instead of faulting it in again. The heap then stays at
//   the training step's high-water mark, which the peak already contains.
//
// MEMFL_MALLOC_POLICY=glibc leaves glibc's defaults (for A/B measurements).
// Model-sized arenas are mappings of their own (tensor/arena.h) and are not
// affected by either policy.
#pragma once

#include "common/status.h"

namespace memfl {

// MEMFL_MALLOC_POLICY is unset or "glibc"; any other value is refused,
// naming the variable (a misspelt "glibc" would otherwise run the A/B's B
// side as its A). The CLI checks it before any role starts.
Status check_malloc_policy_env();

void tune_malloc_for_streaming();
void tune_malloc_for_training();

// What the process runs with: "streaming", "training" or "glibc" (nothing
// set yet, or MEMFL_MALLOC_POLICY=glibc), for run summaries and benchmarks.
const char* malloc_policy();

}  // namespace memfl
