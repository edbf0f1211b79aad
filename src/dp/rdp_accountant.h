// Privacy accounting for DP-SGD / DP-FedAvg: the Rényi-DP (RDP) accountant of
// the Poisson-subsampled Gaussian mechanism (Mironov, Talwar, Zhang 2019,
// "Rényi Differential Privacy of the Sampled Gaussian Mechanism"). Each step
// samples every record with probability q and adds Gaussian noise of standard
// deviation σ × sensitivity; RDP adds up over steps, and the total converts to
// an (ε, δ) guarantee, minimised over a list of Rényi orders.
//
//   RdpAccountant accountant;  // Opacus's default orders
//   MEMFL_RETURN_IF_ERROR(accountant.step(/*noise_multiplier=*/1.1, /*sample_rate=*/256.0 / 60000, 14062));
//   MEMFL_ASSIGN_OR_RETURN(PrivacySpent spent, accountant.privacy_spent(/*delta=*/1e-5));
//   // spent.epsilon, spent.order (the order that gave the smallest ε)
//
// Numbers match Opacus's RDPAccountant (same default orders, same
// RDP → (ε, δ) conversion); tests/test_rdp_accountant.cpp checks published
// values.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace memfl {

// Opacus's default Rényi orders: 1.1, 1.2, …, 10.9, then 12, 13, …, 63.
const std::vector<double>& default_rdp_orders();

// RDP, at Rényi order `order` (> 1), of one step of the Gaussian mechanism
// with noise multiplier σ on a Poisson sample of rate q ∈ (0, 1]. q = 1 is the
// plain Gaussian mechanism, α / (2σ²).
StatusOr<double> sampled_gaussian_rdp(double noise_multiplier, double sample_rate, double order);

// How an RDP curve becomes (ε, δ).
enum class RdpConversion {
  // ε = r − (log δ + log α)/(α − 1) + log((α − 1)/α): Balle et al. 2020
  // (Thm. 21) / Canonne, Kamath, Steinke 2020; what Opacus and TF-Privacy use
  // today. The default.
  kBalle2020,
  // ε = r + log(1/δ)/(α − 1): Mironov 2017, Prop. 3. Looser; figures
  // published before 2020 (e.g. TF-Privacy's MNIST tutorial) used it.
  kMironov2017,
};

// An (ε, δ) guarantee and the Rényi order it came from.
struct PrivacySpent {
  double epsilon = 0;
  double order = 0;  // 0 when no order applied (nothing was released)
};

// The smallest ε over the orders for a composed RDP curve (rdp[i] at
// orders[i]); orders ≤ 1 and non-finite RDP values are skipped.
StatusOr<PrivacySpent> epsilon_from_rdp(std::span<const double> orders, std::span<const double> rdp, double delta,
                                        RdpConversion conversion = RdpConversion::kBalle2020);

// Keeps the composed RDP curve of every step taken so far, one value per
// order; steps with different σ or q compose by adding their curves.
class RdpAccountant {
 public:
  RdpAccountant();  // default_rdp_orders()
  // Orders must be finite, in (1, 100000].
  static StatusOr<RdpAccountant> with_orders(std::vector<double> orders);

  // Records `steps` steps of the subsampled Gaussian with these parameters.
  // On error nothing is recorded.
  Status step(double noise_multiplier, double sample_rate, int64_t steps = 1);

  // ε for this δ ∈ (0, 1) after all recorded steps, and its order. No steps
  // taken: ε = 0.
  StatusOr<PrivacySpent> privacy_spent(double delta, RdpConversion conversion = RdpConversion::kBalle2020) const;
  // The same, as ε alone; *best_order receives the order when given.
  StatusOr<double> epsilon(double delta, double* best_order = nullptr) const;

  const std::vector<double>& orders() const { return orders_; }
  const std::vector<double>& rdp() const { return rdp_; }  // composed, per order
  int64_t steps() const { return steps_; }

 private:
  explicit RdpAccountant(std::vector<double> orders);

  std::vector<double> orders_;
  std::vector<double> rdp_;
  int64_t steps_ = 0;
  // One step's curve for the last (σ, q): FL calls step() once per round with
  // the same parameters, and a curve costs ~150 series evaluations.
  double cached_sigma_ = 0, cached_q_ = 0;
  std::vector<double> cached_step_rdp_;
};

// ε after `steps` steps of the subsampled Gaussian (σ, q) at δ, with the
// default orders and conversion: the `memfl privacy` computation.
StatusOr<double> rdp_epsilon(double sigma, double q, int64_t steps, double delta);

}  // namespace memfl
