#include "schedule/client_selection.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/ranges.h>

namespace memfl {

namespace {

std::vector<int> sorted(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// k distinct ids drawn with probability ∝ weight (without replacement):
// Efraimidis–Spirakis keys u^(1/w).
std::vector<int> weighted_sample(const std::vector<double>& weight, int k, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(1e-12, 1.0);
  std::vector<std::pair<double, int>> keys;
  keys.reserve(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) {
    const double w = std::max(weight[i], 1e-12);
    keys.emplace_back(std::log(u(rng)) / w, static_cast<int>(i));
  }
  const size_t n = std::min(keys.size(), static_cast<size_t>(k));
  std::partial_sort(keys.begin(), keys.begin() + static_cast<ptrdiff_t>(n), keys.end(), std::greater<>());
  std::vector<int> out;
  for (size_t i = 0; i < n; ++i) out.push_back(keys[i].second);
  return out;
}

// The k best by score (ties broken at random, so equal clients rotate).
std::vector<int> top_k(const std::vector<double>& score, int k, std::mt19937_64& rng) {
  std::vector<int> idx(score.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::shuffle(idx.begin(), idx.end(), rng);
  const size_t n = std::min(idx.size(), static_cast<size_t>(k));
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
  idx.resize(n);
  return idx;
}

class Random final : public ClientSelection {
 public:
  std::string_view name() const override { return "random"; }
  std::vector<int> select(int, int k, const std::vector<ClientStats>& c, std::mt19937_64& rng) override {
    std::vector<int> idx(c.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(std::min(idx.size(), static_cast<size_t>(k)));
    return sorted(idx);
  }
};

class RoundRobin final : public ClientSelection {
 public:
  std::string_view name() const override { return "round_robin"; }
  std::vector<int> select(int round, int k, const std::vector<ClientStats>& c, std::mt19937_64&) override {
    const int n = static_cast<int>(c.size());
    const int take = std::min(k, n);
    std::vector<int> out;
    const int start = static_cast<int>((static_cast<int64_t>(round - 1) * take) % n);
    for (int i = 0; i < take; ++i) out.push_back((start + i) % n);
    return sorted(out);
  }
};

class ProportionalData final : public ClientSelection {
 public:
  std::string_view name() const override { return "proportional_data"; }
  std::vector<int> select(int, int k, const std::vector<ClientStats>& c, std::mt19937_64& rng) override {
    std::vector<double> w;
    for (const auto& s : c) w.push_back(s.samples);
    return sorted(weighted_sample(w, k, rng));
  }
};

// Power-of-choice (Cho et al. 2022): d candidates ∝ data size, then the k
// with the highest last local loss; never-trained clients count as highest.
class TopKLoss final : public ClientSelection {
 public:
  explicit TopKLoss(int d) : d_(d) {}
  std::string_view name() const override { return "topk_loss"; }
  std::vector<int> select(int, int k, const std::vector<ClientStats>& c, std::mt19937_64& rng) override {
    std::vector<double> w;
    for (const auto& s : c) w.push_back(s.samples);
    const int d = std::min<int>(static_cast<int>(c.size()), d_ > 0 ? std::max(d_, k) : 2 * k);
    auto cand = weighted_sample(w, d, rng);
    std::vector<double> score;
    for (int i : cand) score.push_back(c[i].last_loss < 0 ? 1e30 : c[i].last_loss);
    auto best = top_k(score, k, rng);
    std::vector<int> out;
    for (int b : best) out.push_back(cand[b]);
    return sorted(out);
  }

 private:
  int d_;
};

// Oort-style (Lai et al. 2021): utility = samples × loss; (1 − ε) of the
// slots go to the highest utility, ε to exploration among clients not yet
// tried (or at random when all were).
class Oort final : public ClientSelection {
 public:
  explicit Oort(double eps) : eps_(eps) {}
  std::string_view name() const override { return "oort"; }
  std::vector<int> select(int, int k, const std::vector<ClientStats>& c, std::mt19937_64& rng) override {
    const int n = static_cast<int>(c.size());
    k = std::min(k, n);
    const int explore = std::clamp(static_cast<int>(std::round(eps_ * k)), 0, k);
    std::vector<double> utility(c.size(), -1);
    for (int i = 0; i < n; ++i) {
      if (c[i].last_loss >= 0) utility[i] = c[i].samples * c[i].last_loss;
    }
    auto exploit = top_k(utility, k - explore, rng);
    std::vector<char> taken(c.size(), 0);
    std::vector<int> out;
    for (int i : exploit) {
      if (utility[i] < 0) continue;  // nothing known yet: leave the slot to exploration
      taken[i] = 1;
      out.push_back(i);
    }
    std::vector<int> fresh, rest;
    for (int i = 0; i < n; ++i) {
      if (taken[i]) continue;
      (c[i].last_loss < 0 ? fresh : rest).push_back(i);
    }
    std::shuffle(fresh.begin(), fresh.end(), rng);
    std::shuffle(rest.begin(), rest.end(), rng);
    for (int i : fresh) {
      if (static_cast<int>(out.size()) == k) break;
      out.push_back(i);
    }
    for (int i : rest) {
      if (static_cast<int>(out.size()) == k) break;
      out.push_back(i);
    }
    return sorted(out);
  }

 private:
  double eps_;
};

// Fairness-adjusted: loss-driven, but each pick lowers a client's score by
// (1 + times picked)^penalty, so frequent picks make way for the rest.
class Fairness final : public ClientSelection {
 public:
  explicit Fairness(double penalty) : penalty_(penalty) {}
  std::string_view name() const override { return "fairness"; }
  std::vector<int> select(int, int k, const std::vector<ClientStats>& c, std::mt19937_64& rng) override {
    std::vector<double> score;
    for (const auto& s : c) {
      const double loss = s.last_loss < 0 ? 1e6 : s.last_loss;
      score.push_back(loss / std::pow(1.0 + s.times_picked, penalty_));
    }
    return sorted(top_k(score, k, rng));
  }

 private:
  double penalty_;
};

}  // namespace

const std::vector<SelectionMethodInfo>& client_selection_methods() {
  static const std::vector<SelectionMethodInfo> methods = {
      {"random", "uniformly at random without replacement (FedAvg's default)"},
      {"round_robin", "clients in turn, k at a time"},
      {"proportional_data", "at random, with probability proportional to the client's sample count"},
      {"topk_loss", "power-of-choice: d candidates by data size, the k with the highest last loss"},
      {"oort", "Oort-style utility (samples × loss) with an exploration share for untried clients"},
      {"fairness", "highest loss, penalised by how often a client was already picked"},
  };
  return methods;
}

StatusOr<std::unique_ptr<ClientSelection>> make_client_selection(const std::string& name, const SelectionOptions& o) {
  if (name == "random") return std::unique_ptr<ClientSelection>(std::make_unique<Random>());
  if (name == "round_robin") return std::unique_ptr<ClientSelection>(std::make_unique<RoundRobin>());
  if (name == "proportional_data") return std::unique_ptr<ClientSelection>(std::make_unique<ProportionalData>());
  if (name == "topk_loss") return std::unique_ptr<ClientSelection>(std::make_unique<TopKLoss>(o.power_of_choice_d));
  if (name == "oort") return std::unique_ptr<ClientSelection>(std::make_unique<Oort>(o.exploration));
  if (name == "fairness") return std::unique_ptr<ClientSelection>(std::make_unique<Fairness>(o.fairness_penalty));
  std::vector<std::string> names;
  for (const auto& m : client_selection_methods()) names.push_back(m.name);
  return invalid_argument("unknown client selection method '{}'; known: {}", name, fmt::join(names, ", "));
}

}  // namespace memfl
