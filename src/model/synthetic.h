// Synthetic models: a layout of any size and dtype computed from a spec, no
// network behind it. With DummyTrainer they let transfer and aggregation
// memory be measured without training in the way (APPFL's LLMDummyTrainer
// plays the same role).
#pragma once

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// Tensors named layers.<i>.weight of at most 16 Mi elements each, `num_params`
// in all.
StatusOr<Layout> synthetic_layout(int64_t num_params, DType dtype);

// SplitMix64's finaliser: a well-mixed 64-bit value of `x`, for counter-based
// draws that give the same values in every process.
uint64_t splitmix64(uint64_t x);

// Seeded values in (-1, 1), cheap enough for multi-GB arenas.
void fill_synthetic(const Layout& layout, Arena& arena, uint64_t seed);

}  // namespace memfl
