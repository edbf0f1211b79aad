// Client selection: which clients a round trains. Every method is a small
// class with a name key, behind one interface; `memfl list-methods` prints
// them and `memfl compare-methods` runs several on the same experiment.
//
// A virtual client's selection state is a few numbers (sample count, last
// loss, picks, last round) — 1000 clients cost kilobytes.
//
//   auto method = make_client_selection("topk_loss", opts);
//   std::vector<int> chosen = (*method)->select(round, 10, clients, rng);
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

struct ClientStats {
  double samples = 0;
  double last_loss = -1;  // < 0: never trained
  int times_picked = 0;
  int last_round = 0;
  // DP-SGD: steps taken over every round so far and their Poisson rate (the
  // accountant's input for this client's ε).
  int64_t dp_steps = 0;
  double dp_sample_rate = 0;
};

struct SelectionOptions {
  int power_of_choice_d = 0;      // topk_loss: candidates sampled first (0 = 2k)
  double exploration = 0.2;       // oort: share of slots for exploration
  double fairness_penalty = 1.0;  // fairness: exponent on (1 + times picked)
};

class ClientSelection {
 public:
  virtual ~ClientSelection() = default;
  virtual std::string_view name() const = 0;
  // `k` distinct client ids in [0, clients.size()), sorted.
  virtual std::vector<int> select(int round, int k, const std::vector<ClientStats>& clients, std::mt19937_64& rng) = 0;
};

struct SelectionMethodInfo {
  std::string name, description;
};
const std::vector<SelectionMethodInfo>& client_selection_methods();

StatusOr<std::unique_ptr<ClientSelection>> make_client_selection(const std::string& name, const SelectionOptions& opts);

}  // namespace memfl
