#include "dp/rdp_accountant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

namespace memfl {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kMaxOrder = 100000;  // integer orders cost one term each
// The fractional series stops once both of its terms fall below e^-30 of
// A_α's scale (A_α ≥ 1), as in the paper's reference implementation.
constexpr double kSeriesTailLog = -30;
constexpr int64_t kMaxSeriesTerms = 2'000'000;

// log(e^a + e^b) without overflow; -inf is log 0.
double log_add(double a, double b) {
  if (a < b) std::swap(a, b);
  if (b == -kInf || a == kInf) return a;
  return a + std::log1p(std::exp(b - a));
}

// A real number kept as sign × e^log_abs, so alternating series can be summed
// in log space.
struct LogSigned {
  double log_abs = -kInf;
  bool negative = false;

  void add(double log_term, bool term_negative) {
    if (log_term == -kInf) return;
    if (log_abs == -kInf) {
      log_abs = log_term;
      negative = term_negative;
    } else if (negative == term_negative) {
      log_abs = log_add(log_abs, log_term);
    } else if (log_term == log_abs) {
      log_abs = -kInf;
      negative = false;
    } else {
      // |e^x − e^y| = e^max · (1 − e^(min − max)); the sign follows the larger.
      const double hi = std::max(log_abs, log_term), lo = std::min(log_abs, log_term);
      negative = (log_term > log_abs) ? term_negative : negative;
      log_abs = hi + std::log(-std::expm1(lo - hi));
    }
  }
};

// log(erfc(x)), accurate where erfc underflows (x beyond ~26).
double log_erfc(double x) {
  if (x < 25) return std::log(std::erfc(x));
  // erfc(x) = e^(−x²)/(x√π) · (1 − 1/(2x²) + 3/(4x⁴) − 15/(8x⁶) + 105/(16x⁸) − …)
  const double u = 1 / (x * x);
  const double series = u * (-0.5 + u * (0.75 + u * (-1.875 + u * 6.5625)));
  return -x * x - std::log(x) - 0.5 * std::log(std::numbers::pi) + std::log1p(series);
}

// log A_α for integer α (Mironov et al. 2019, §3.3): the binomial expansion
//   A_α = Σ_{i=0..α} C(α, i) q^i (1 − q)^(α−i) exp((i² − i)/(2σ²)),
// every term positive, summed in log space.
double log_a_integer(double q, double sigma, int64_t alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q), two_s2 = 2 * sigma * sigma;
  std::vector<double> terms(static_cast<size_t>(alpha) + 1);
  double log_binom = 0;  // log C(α, 0)
  double top = -kInf;
  for (int64_t i = 0; i <= alpha; ++i) {
    const double di = static_cast<double>(i);
    terms[static_cast<size_t>(i)] =
        log_binom + di * log_q + static_cast<double>(alpha - i) * log_1mq + (di * di - di) / two_s2;
    top = std::max(top, terms[static_cast<size_t>(i)]);
    log_binom += std::log(static_cast<double>(alpha - i)) - std::log(di + 1);
  }
  if (top == kInf) return kInf;
  double sum = 0;
  for (double t : terms) sum += std::exp(t - top);
  return top + std::log(sum);
}

// log A_α for fractional α (Mironov et al. 2019, §3.3): split the integral
// at z0 = σ² log(1/q − 1) + 1/2 and expand each half with the generalised
// binomial series (coefficients change sign once i > α):
//   A0 = Σ_i C(α,i) q^i (1−q)^(α−i) e^((i²−i)/(2σ²)) · ½ erfc((i − z0)/(√2 σ))
//   A1 = Σ_i C(α,i) q^(α−i) (1−q)^i e^((j²−j)/(2σ²)) · ½ erfc((z0 − j)/(√2 σ)),  j = α − i
StatusOr<double> log_a_fractional(double q, double sigma, double alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q), two_s2 = 2 * sigma * sigma;
  const double z0 = sigma * sigma * std::log(1 / q - 1) + 0.5;
  const double sqrt2_sigma = std::numbers::sqrt2 * sigma;
  LogSigned a0, a1;
  double log_binom = 0;  // log |C(α, i)|
  bool binom_negative = false;
  for (int64_t i = 0; i < kMaxSeriesTerms; ++i) {
    const double di = static_cast<double>(i);
    const double j = alpha - di;
    const double log_t0 = log_binom + di * log_q + j * log_1mq;
    const double log_t1 = log_binom + j * log_q + di * log_1mq;
    const double log_e0 = std::log(0.5) + log_erfc((di - z0) / sqrt2_sigma);
    const double log_e1 = std::log(0.5) + log_erfc((z0 - j) / sqrt2_sigma);
    const double log_s0 = log_t0 + (di * di - di) / two_s2 + log_e0;
    const double log_s1 = log_t1 + (j * j - j) / two_s2 + log_e1;
    // σ so small that a term overflows (∞ or ∞ − ∞): no finite bound.
    if (std::isnan(log_s0) || std::isnan(log_s1) || log_s0 == kInf || log_s1 == kInf) return kInf;
    a0.add(log_s0, binom_negative);
    a1.add(log_s1, binom_negative);
    if (std::max(log_s0, log_s1) < kSeriesTailLog) {
      if (a0.negative || a1.negative) {
        return internal_error("RDP series for order {} (sigma {}, q {}) summed to a negative value", alpha, sigma, q);
      }
      return log_add(a0.log_abs, a1.log_abs);
    }
    // C(α, i+1) = C(α, i) · (α − i)/(i + 1)
    log_binom += std::log(std::abs(j)) - std::log(di + 1);
    if (j < 0) binom_negative = !binom_negative;
  }
  return internal_error("RDP series for order {} (sigma {}, q {}) did not converge", alpha, sigma, q);
}

Status check_mechanism(double noise_multiplier, double sample_rate) {
  if (!(noise_multiplier > 0) || !std::isfinite(noise_multiplier)) {
    return invalid_argument("noise_multiplier (sigma) must be a finite number > 0, got {}", noise_multiplier);
  }
  if (!(sample_rate > 0 && sample_rate <= 1)) {
    return invalid_argument("sample_rate (q) must be in (0, 1], got {}", sample_rate);
  }
  return Status::Ok();
}

Status check_delta(double delta) {
  if (!(delta > 0 && delta < 1)) return invalid_argument("delta must be in (0, 1), got {}", delta);
  return Status::Ok();
}

Status check_order(double order) {
  if (!(order > 1 && order <= kMaxOrder)) {
    return invalid_argument("Renyi order must be in (1, {}], got {}", kMaxOrder, order);
  }
  return Status::Ok();
}

}  // namespace

const std::vector<double>& default_rdp_orders() {
  static const std::vector<double> orders = [] {
    std::vector<double> o;
    for (int x = 1; x < 100; ++x) o.push_back(1 + x / 10.0);
    for (int a = 12; a < 64; ++a) o.push_back(a);
    return o;
  }();
  return orders;
}

StatusOr<double> sampled_gaussian_rdp(double noise_multiplier, double sample_rate, double order) {
  MEMFL_RETURN_IF_ERROR(check_mechanism(noise_multiplier, sample_rate));
  MEMFL_RETURN_IF_ERROR(check_order(order));
  const double sigma = noise_multiplier, q = sample_rate;
  // No subsampling: the Gaussian mechanism itself (the series would take
  // log(1 − q) = −inf).
  if (q == 1) return order / (2 * sigma * sigma);
  double log_a = 0;
  if (order == std::floor(order)) {
    log_a = log_a_integer(q, sigma, static_cast<int64_t>(order));
  } else {
    MEMFL_ASSIGN_OR_RETURN(log_a, log_a_fractional(q, sigma, order));
  }
  // A σ so small that σ² underflows overflows the terms: no privacy. (A NaN
  // must never turn into an RDP of 0 below.)
  if (std::isnan(log_a)) return kInf;
  // RDP is ≥ 0; rounding can leave −1e-17.
  return std::max(0.0, log_a / (order - 1));
}

StatusOr<PrivacySpent> epsilon_from_rdp(std::span<const double> orders, std::span<const double> rdp, double delta,
                                        RdpConversion conversion) {
  MEMFL_RETURN_IF_ERROR(check_delta(delta));
  if (orders.size() != rdp.size()) {
    return invalid_argument("{} Renyi orders but {} RDP values", orders.size(), rdp.size());
  }
  if (orders.empty()) return invalid_argument("no Renyi orders to convert RDP at");
  const double log_delta = std::log(delta);
  PrivacySpent best{kInf, 0};
  for (size_t i = 0; i < orders.size(); ++i) {
    const double a = orders[i], r = rdp[i];
    if (!(a > 1) || !std::isfinite(a) || !std::isfinite(r)) continue;
    const double eps = conversion == RdpConversion::kBalle2020
                           ? r - (log_delta + std::log(a)) / (a - 1) + std::log((a - 1) / a)
                           : r - log_delta / (a - 1);
    if (eps < best.epsilon) best = {eps, a};
  }
  // (ε, δ)-DP is monotone in ε: a negative bound is a bound of 0.
  best.epsilon = std::max(0.0, best.epsilon);
  return best;
}

RdpAccountant::RdpAccountant() : RdpAccountant(default_rdp_orders()) {}

RdpAccountant::RdpAccountant(std::vector<double> orders) : orders_(std::move(orders)), rdp_(orders_.size(), 0.0) {}

StatusOr<RdpAccountant> RdpAccountant::with_orders(std::vector<double> orders) {
  if (orders.empty()) return invalid_argument("an RDP accountant needs at least one Renyi order");
  for (double a : orders) MEMFL_RETURN_IF_ERROR(check_order(a));
  return RdpAccountant(std::move(orders));
}

Status RdpAccountant::step(double noise_multiplier, double sample_rate, int64_t steps) {
  MEMFL_RETURN_IF_ERROR(check_mechanism(noise_multiplier, sample_rate));
  if (steps < 0) return invalid_argument("steps must be >= 0, got {}", steps);
  if (steps == 0) return Status::Ok();
  if (cached_step_rdp_.empty() || cached_sigma_ != noise_multiplier || cached_q_ != sample_rate) {
    std::vector<double> curve(orders_.size());
    for (size_t i = 0; i < orders_.size(); ++i) {
      MEMFL_ASSIGN_OR_RETURN(curve[i], sampled_gaussian_rdp(noise_multiplier, sample_rate, orders_[i]));
    }
    cached_step_rdp_ = std::move(curve);
    cached_sigma_ = noise_multiplier;
    cached_q_ = sample_rate;
  }
  for (size_t i = 0; i < orders_.size(); ++i) rdp_[i] += static_cast<double>(steps) * cached_step_rdp_[i];
  steps_ += steps;
  return Status::Ok();
}

StatusOr<PrivacySpent> RdpAccountant::privacy_spent(double delta, RdpConversion conversion) const {
  MEMFL_RETURN_IF_ERROR(check_delta(delta));
  // Nothing released yet. (The conversion alone would give a small ε > 0 for
  // an all-zero curve: it is a bound, not exact.)
  if (steps_ == 0) return PrivacySpent{0, 0};
  return epsilon_from_rdp(orders_, rdp_, delta, conversion);
}

StatusOr<double> RdpAccountant::epsilon(double delta, double* best_order) const {
  MEMFL_ASSIGN_OR_RETURN(PrivacySpent spent, privacy_spent(delta));
  if (best_order != nullptr) *best_order = spent.order;
  return spent.epsilon;
}

StatusOr<double> rdp_epsilon(double sigma, double q, int64_t steps, double delta) {
  MEMFL_RETURN_IF_ERROR(check_delta(delta));
  RdpAccountant accountant;
  MEMFL_RETURN_IF_ERROR(accountant.step(sigma, q, steps));
  return accountant.epsilon(delta);
}

}  // namespace memfl
