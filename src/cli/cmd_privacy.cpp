// memfl privacy: the (ε, δ) of DP-SGD / DP-FedAvg run for `steps` steps of the
// Poisson-subsampled Gaussian (σ, q), by the RDP accountant (Opacus's orders
// and conversion).
#include <CLI/CLI.hpp>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "dp/rdp_accountant.h"

namespace memfl::cli {

namespace {

struct PrivacyArgs {
  double noise_multiplier = 0, sample_rate = 0, delta = 0;
  int64_t steps = 0;
  bool json = false;
};

int privacy_command(const PrivacyArgs& a) {
  memfl::RdpAccountant accountant;
  memfl::Status st = accountant.step(a.noise_multiplier, a.sample_rate, a.steps);
  if (!st.ok()) return fail(st.with_context("privacy"));
  auto spent = accountant.privacy_spent(a.delta);
  if (!spent.ok()) return fail(spent.status().with_context("privacy"));
  const std::vector<double>& orders = accountant.orders();
  const bool at_edge = a.steps > 0 && (spent->order == orders.front() || spent->order == orders.back());
  if (a.json) {
    nlohmann::json j;
    j["accountant"] = "rdp";
    j["conversion"] = "balle2020";
    j["noise_multiplier"] = a.noise_multiplier;
    j["sample_rate"] = a.sample_rate;
    j["steps"] = a.steps;
    j["delta"] = a.delta;
    j["order_at_edge"] = at_edge;
    // JSON has no infinity: an unbounded ε is null.
    j["epsilon"] = std::isfinite(spent->epsilon) ? nlohmann::json(spent->epsilon) : nlohmann::json(nullptr);
    j["order"] = spent->order > 0 ? nlohmann::json(spent->order) : nlohmann::json(nullptr);
    fmt::print("{}\n", j.dump());
    return kExitOk;
  }
  std::string eps = fmt::format("{:.2f}", spent->epsilon);
  if (spent->epsilon == 0) {
    eps = "0";
  } else if (spent->epsilon < 0.01) {
    eps = fmt::format("{:.3g}", spent->epsilon);
  }
  std::string order = fmt::format("order {:.1f}", spent->order);
  if (a.steps == 0) {
    order = "no steps";
  } else if (spent->order == 0) {
    order = "no order gives a finite bound";
  }
  fmt::print("epsilon = {} ({}, delta {}, sigma {}, q {:.3g}, steps {})\n", eps, order, a.delta, a.noise_multiplier,
             a.sample_rate, a.steps);
  if (at_edge) {
    fmt::print(stderr, "memfl: note: the best order is the {} one tried ({}); epsilon may be looser than it could be\n",
               spent->order == orders.front() ? "smallest" : "largest", spent->order);
  }
  return kExitOk;
}

}  // namespace

CommandFn add_privacy(CLI::App& cmd, SharedOptions&) {
  auto a = std::make_shared<PrivacyArgs>();
  cmd.add_option("--noise-multiplier", a->noise_multiplier, "sigma: noise std / clipping norm, > 0")->required();
  cmd.add_option("--sample-rate", a->sample_rate, "q: chance a record is in a step, (0, 1]")->required();
  cmd.add_option("--steps", a->steps, "number of steps (rounds), >= 0")->required();
  cmd.add_option("--delta", a->delta, "target delta, (0, 1), e.g. 1e-5")->required();
  cmd.add_flag("--json", a->json, "print one JSON object instead of a sentence");
  return [a](int&, char**&) { return privacy_command(*a); };
}

}  // namespace memfl::cli
