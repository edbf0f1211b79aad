// Client-level DP-FedAvg (McMahan et al. 2018, "Learning Differentially
// Private Recurrent Language Models"): each client's update Δ = x_local −
// x_global is clipped to norm C before it leaves the client, and the server
// adds N(0, (σ·C / n)²) to every weight of the mean of n equally weighted
// updates. The server's state stays the streaming aggregator's (noise is
// added in place after finalize); a client keeps one copy of the global model
// to form Δ. The accountant composes one subsampled Gaussian per round with
// q = clients_per_round / num_clients.
#pragma once

#include <cstdint>

#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// Clips `local` − `global` to L2 norm `clip_norm` in place (local ← global +
// min(1, C/‖Δ‖)·Δ), over the float entries (integer buffers are left as
// trained). Returns ‖Δ‖ before clipping.
double clip_update(const Layout& layout, const Arena& global, Arena& local, double clip_norm);

// Adds N(0, stddev²) to every float element of `model`, from a seeded
// generator (so runs repeat).
void add_gaussian_noise(const Layout& layout, Arena& model, double stddev, uint64_t seed);

}  // namespace memfl
