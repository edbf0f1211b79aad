// The RDP accountant against published values (sources named at each test)
// and against its own definition (numerical integration, closed forms,
// monotonicity, composition).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "dp/rdp_accountant.h"

namespace memfl {
namespace {

// "To 2 decimals": both round to the same hundredth.
::testing::AssertionResult same_to_2_decimals(double got, double published) {
  if (std::round(got * 100) == std::round(published * 100)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << ", published " << published;
}

PrivacySpent spent_after(double sigma, double q, int64_t steps, double delta,
                         RdpConversion conversion = RdpConversion::kBalle2020,
                         std::vector<double> orders = default_rdp_orders()) {
  auto accountant = RdpAccountant::with_orders(std::move(orders));
  EXPECT_TRUE(accountant.ok()) << accountant.status().to_string();
  Status st = accountant->step(sigma, q, steps);
  EXPECT_TRUE(st.ok()) << st.to_string();
  auto spent = accountant->privacy_spent(delta, conversion);
  EXPECT_TRUE(spent.ok()) << spent.status().to_string();
  return *spent;
}

TEST(RdpAccountant, DefaultOrdersAreOpacus) {
  // Opacus RDPAccountant.DEFAULT_ALPHAS: [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)).
  const auto& o = default_rdp_orders();
  ASSERT_EQ(o.size(), 99u + 52u);
  EXPECT_DOUBLE_EQ(o.front(), 1.1);
  EXPECT_DOUBLE_EQ(o[98], 10.9);
  EXPECT_DOUBLE_EQ(o[99], 12);
  EXPECT_DOUBLE_EQ(o.back(), 63);
}

// Opacus, opacus/tests/accountants_test.py, test_rdp_accountant: σ = 1.5,
// q = 0.04, steps = int(90 / 0.04) = 2250, δ = 1e-5 → ε = 7.32911117143
// (assertAlmostEqual, 7 places), default orders, Balle et al. conversion.
TEST(RdpAccountant, MatchesOpacusAccountantTest) {
  RdpAccountant accountant;
  for (int i = 0; i < 2250; ++i) ASSERT_TRUE(accountant.step(1.5, 0.04).ok());
  double order = 0;
  auto eps = accountant.epsilon(1e-5, &order);
  ASSERT_TRUE(eps.ok()) << eps.status().to_string();
  EXPECT_TRUE(same_to_2_decimals(*eps, 7.33));
  EXPECT_NEAR(*eps, 7.32911117143, 1e-7);
  EXPECT_GT(order, 1);
  auto one_shot = rdp_epsilon(1.5, 0.04, 2250, 1e-5);
  ASSERT_TRUE(one_shot.ok());
  EXPECT_NEAR(*one_shot, 7.32911117143, 1e-7);
}

// TF-Privacy, tensorflow_privacy/privacy/analysis/rdp_accountant_test.py:
// compute_rdp(q, noise_multiplier, steps, orders) is steps × the one-step RDP.
TEST(RdpAccountant, MatchesTfPrivacyComputeRdp) {
  // test_compute_rdp_no_sampling: q = 1, σ = 10, 1 step, order 20 → 0.1 (= α/(2σ²)).
  EXPECT_DOUBLE_EQ(*sampled_gaussian_rdp(10, 1, 20), 0.1);
  // test_compute_rdp_scalar: q = 0.1, σ = 2, 10 steps, order 5 → 0.07737 (5 places).
  EXPECT_NEAR(10 * *sampled_gaussian_rdp(2, 0.1, 5), 0.07737, 0.5e-5);
  // test_compute_rdp_sequence: q = 0.01, σ = 2.5, 50 steps (delta=1e-5 in assertSequenceAlmostEqual).
  const double orders[] = {1.5, 2.5, 5, 50, 100};
  const double published[] = {0.00065, 0.001085, 0.00218075, 0.023846, 167.416307};
  for (size_t i = 0; i < std::size(orders); ++i) {
    EXPECT_NEAR(50 * *sampled_gaussian_rdp(2.5, 0.01, orders[i]), published[i], 1e-5) << "order " << orders[i];
  }
}

// TF-Privacy rdp_accountant_test.py, test_get_privacy_spent_check_target_delta
// (the conversion TF-Privacy and Opacus share).
TEST(RdpAccountant, ConversionMatchesTfPrivacyTest) {
  // A constant RDP curve (pure DP) over orders 2..32 picks the largest
  // order; δ = 1e-5 → ε = 1.32783806176.
  std::vector<double> orders, rdp;
  for (int a = 2; a <= 32; ++a) {
    orders.push_back(a);
    rdp.push_back(1.1);
  }
  auto spent = epsilon_from_rdp(orders, rdp, 1e-5);
  ASSERT_TRUE(spent.ok());
  EXPECT_EQ(spent->order, 32);
  EXPECT_NEAR(spent->epsilon, 1.32783806176, 1e-9);

  // The Gaussian mechanism (q = 1) with σ = 4.530877117, one step, on the
  // orders 1.000, 1.001, …, 99.999, is exactly (1, 1e-6)-DP.
  orders.clear();
  rdp.clear();
  for (int i = 1001; i < 100000; ++i) {
    orders.push_back(0.001 * i);
    rdp.push_back(*sampled_gaussian_rdp(4.530877117, 1, orders.back()));
  }
  spent = epsilon_from_rdp(orders, rdp, 1e-6);
  ASSERT_TRUE(spent.ok());
  EXPECT_NEAR(spent->epsilon, 1, 1e-7);
}

// TF-Privacy's MNIST DP-SGD figures, published before TF-Privacy moved to the
// Balle et al. conversion, so they are checked with kMironov2017 (the old
// ε = r + log(1/δ)/(α − 1)); the current conversion must be at most these.
TEST(RdpAccountant, MatchesTfPrivacyMnistTutorialFigures) {
  const double q = 256.0 / 60000;  // batch 256 of MNIST's 60000
  const auto mironov = RdpConversion::kMironov2017;
  // tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy.py docstring:
  // "--N=60000 --batch_size=256 --noise_multiplier=1.12 --epochs=60
  // --delta=1e-5 ... satisfies (2.92, 1e-5)-DP"; the script takes
  // ceil(60 × 60000 / 256) = 14063 steps on its own order list.
  std::vector<double> script_orders = {1.25, 1.5, 1.75, 2., 2.25, 2.5, 3., 3.5, 4., 4.5};
  for (int a = 5; a < 64; ++a) script_orders.push_back(a);
  script_orders.insert(script_orders.end(), {128, 256, 512});
  EXPECT_TRUE(same_to_2_decimals(spent_after(1.12, q, 14063, 1e-5, mironov, script_orders).epsilon, 2.92));

  // tutorials/README.md (mnist_dpsgd_tutorial.py: steps = epoch × (60000 // 256),
  // orders = [1 + x / 10. for x in range(1, 100)] + range(12, 64), δ = 1e-5),
  // "Expected Output": σ = 1.12 → ε 1.00 after 1 epoch, 1.04 after 2, 2.92 after 60.
  EXPECT_TRUE(same_to_2_decimals(spent_after(1.12, q, 1 * 234, 1e-5, mironov).epsilon, 1.00));
  EXPECT_TRUE(same_to_2_decimals(spent_after(1.12, q, 2 * 234, 1e-5, mironov).epsilon, 1.04));
  EXPECT_TRUE(same_to_2_decimals(spent_after(1.12, q, 60 * 234, 1e-5, mironov).epsilon, 2.92));
  // Same README, "Select Parameters" table: σ = 1.2, 10 epochs → 1.20.
  EXPECT_TRUE(same_to_2_decimals(spent_after(1.2, q, 10 * 234, 1e-5, mironov).epsilon, 1.20));
  // Same table: σ = 0.6, 30 epochs → 9.74. On the tutorial's order list we get
  // 9.747 (order 2.9, between two orders of the grid); on a grid of step 0.001
  // the minimum is 9.745, which is the published 9.74.
  EXPECT_NEAR(spent_after(0.6, q, 30 * 234, 1e-5, mironov).epsilon, 9.74, 0.01);
  std::vector<double> fine;
  for (int i = 1001; i < 10000; ++i) fine.push_back(0.001 * i);
  EXPECT_TRUE(same_to_2_decimals(spent_after(0.6, q, 30 * 234, 1e-5, mironov, fine).epsilon, 9.74));

  // The Balle et al. conversion is never looser.
  EXPECT_LT(spent_after(1.12, q, 60 * 234, 1e-5).epsilon, 2.92);
}

// log A_α by brute-force quadrature of its definition,
//   A_α = ∫ μ0(z) ((1 − q) + q μ1(z)/μ0(z))^α dz,  μ1/μ0 = exp((2z − 1)/(2σ²)),
// as TF-Privacy's test_compute_log_a_equals_mp does with mpmath (rtol 1e-4).
double log_a_by_quadrature(double q, double sigma, double alpha) {
  using ld = long double;
  const ld s = sigma, a = alpha;
  const ld lo = -40 * s - 2, hi = a + 40 * s + 2, h = s / 100;
  const int64_t n = static_cast<int64_t>((hi - lo) / h) + 1;
  const ld log_1mq = std::log1p(-static_cast<ld>(q)), log_q = std::log(static_cast<ld>(q));
  std::vector<ld> log_terms(static_cast<size_t>(n));
  ld top = -INFINITY, a_minus_1 = 0;  // A − 1 = ∫ μ0 (mix^α − 1), precise when A is near 1
  for (int64_t k = 0; k < n; ++k) {
    const ld z = lo + static_cast<ld>(k) * h;
    const ld log_mu0 = -z * z / (2 * s * s) - std::log(s * std::sqrt(2 * std::numbers::pi_v<ld>));
    const ld x = log_q + (2 * z - 1) / (2 * s * s);
    const ld log_mix = std::max(log_1mq, x) + std::log1p(std::exp(-std::abs(log_1mq - x)));
    log_terms[static_cast<size_t>(k)] = log_mu0 + a * log_mix;
    top = std::max(top, log_terms[static_cast<size_t>(k)]);
    a_minus_1 += std::exp(log_mu0) * std::expm1(a * log_mix) * h;
  }
  ld sum = 0;
  for (ld t : log_terms) sum += std::exp(t - top);
  const ld log_a = top + std::log(sum * h);
  return static_cast<double>(log_a < 1e-3L ? std::log1p(a_minus_1) : log_a);
}

TEST(RdpAccountant, SeriesAgreeWithQuadratureOfTheDefinition) {
  // A subset of TF-Privacy's parameters for test_compute_log_a_equals_mp,
  // fractional and integer orders.
  struct P {
    double q, sigma, order;
  };
  for (P p : {P{1e-4, 1, 1.5}, P{1e-3, 1, 2}, P{0.01, 10, 20}, P{0.1, 100, 20.5}, P{1e-6, 1, 27}, P{0.99, 0.1, 256},
              P{0.999, 100, 256.1}, P{0.2, 0.8, 3.7}, P{0.5, 2, 7.25}}) {
    const double log_a = *sampled_gaussian_rdp(p.sigma, p.q, p.order) * (p.order - 1);
    const double expected = log_a_by_quadrature(p.q, p.sigma, p.order);
    EXPECT_NEAR(log_a, expected, 1e-4 * std::abs(expected) + 1e-12)
        << "q " << p.q << " sigma " << p.sigma << " order " << p.order;
  }
}

TEST(RdpAccountant, FractionalAndIntegerOrdersJoinUp) {
  for (double sigma : {0.7, 1.1, 4.0}) {
    for (double a : {2.0, 5.0, 20.0}) {
      const double at = *sampled_gaussian_rdp(sigma, 0.01, a);
      EXPECT_NEAR(*sampled_gaussian_rdp(sigma, 0.01, a + 1e-7), at, 1e-5 * at + 1e-12) << sigma << " " << a;
      EXPECT_NEAR(*sampled_gaussian_rdp(sigma, 0.01, a - 1e-7), at, 1e-5 * at + 1e-12) << sigma << " " << a;
    }
  }
}

TEST(RdpAccountant, FullBatchIsTheGaussianMechanism) {
  for (double sigma : {0.5, 1.0, 3.0}) {
    for (double a : default_rdp_orders()) {
      EXPECT_DOUBLE_EQ(*sampled_gaussian_rdp(sigma, 1, a), a / (2 * sigma * sigma));
    }
    // ε is the conversion of k·α/(2σ²), minimised over the orders.
    const int64_t k = 10;
    double expected = INFINITY;
    for (double a : default_rdp_orders()) {
      expected = std::min(
          expected, k * a / (2 * sigma * sigma) - (std::log(1e-5) + std::log(a)) / (a - 1) + std::log((a - 1) / a));
    }
    EXPECT_NEAR(*rdp_epsilon(sigma, 1, k, 1e-5), expected, 1e-12);
  }
  // Subsampling only helps: q → 1 approaches the full-batch value from below.
  EXPECT_LT(*sampled_gaussian_rdp(1, 0.999, 8), *sampled_gaussian_rdp(1, 1, 8));
  EXPECT_NEAR(*sampled_gaussian_rdp(1, 1 - 1e-9, 8), 4, 1e-6);
}

TEST(RdpAccountant, EpsilonFallsWithNoiseAndGrowsWithStepsAndRate) {
  double last = INFINITY;
  for (double sigma : {0.6, 0.8, 1.0, 1.5, 2.0, 4.0, 8.0}) {
    const double eps = *rdp_epsilon(sigma, 0.01, 1000, 1e-5);
    EXPECT_LT(eps, last) << "sigma " << sigma;
    last = eps;
  }
  last = 0;
  for (int64_t steps : {1, 10, 100, 1000, 10000}) {
    const double eps = *rdp_epsilon(1.0, 0.01, steps, 1e-5);
    EXPECT_GT(eps, last) << "steps " << steps;
    last = eps;
  }
  last = 0;
  for (double q : {1e-4, 1e-3, 0.01, 0.1, 0.5, 1.0}) {
    const double eps = *rdp_epsilon(1.0, q, 100, 1e-5);
    EXPECT_GT(eps, last) << "q " << q;
    last = eps;
  }
  EXPECT_GT(*rdp_epsilon(1.0, 0.01, 1000, 1e-7), *rdp_epsilon(1.0, 0.01, 1000, 1e-5)) << "smaller delta, larger eps";
}

TEST(RdpAccountant, StepsComposeByAddingCurves) {
  RdpAccountant one_by_one, at_once, mixed;
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(one_by_one.step(1.1, 0.02).ok());
  ASSERT_TRUE(at_once.step(1.1, 0.02, 50).ok());
  EXPECT_EQ(one_by_one.steps(), 50);
  for (size_t i = 0; i < at_once.rdp().size(); ++i)
    EXPECT_NEAR(one_by_one.rdp()[i], at_once.rdp()[i], 1e-12 * at_once.rdp()[i]);

  ASSERT_TRUE(mixed.step(1.1, 0.02, 50).ok());
  ASSERT_TRUE(mixed.step(2.0, 0.05, 20).ok());
  ASSERT_TRUE(mixed.step(1.1, 0.02, 0).ok());  // zero steps: nothing happens
  for (size_t i = 0; i < mixed.orders().size(); ++i) {
    const double a = mixed.orders()[i];
    EXPECT_NEAR(mixed.rdp()[i], 50 * *sampled_gaussian_rdp(1.1, 0.02, a) + 20 * *sampled_gaussian_rdp(2.0, 0.05, a),
                1e-9 * mixed.rdp()[i]);
  }
  EXPECT_EQ(mixed.steps(), 70);
  EXPECT_GT(*mixed.epsilon(1e-5), *at_once.epsilon(1e-5));
}

TEST(RdpAccountant, VanishingNoiseIsNoPrivacy) {
  // σ² underflows: the terms overflow, and must give RDP +inf, never 0.
  EXPECT_EQ(*sampled_gaussian_rdp(1e-200, 0.01, 5), INFINITY);
  EXPECT_EQ(*sampled_gaussian_rdp(1e-200, 0.01, 5.5), INFINITY);
  EXPECT_EQ(*rdp_epsilon(1e-200, 0.01, 10, 1e-5), INFINITY);
  EXPECT_GT(*rdp_epsilon(0.05, 0.01, 10, 1e-5), 100);
}

TEST(RdpAccountant, NoStepsSpendNothing) {
  RdpAccountant accountant;
  double order = -1;
  auto eps = accountant.epsilon(1e-5, &order);
  ASSERT_TRUE(eps.ok());
  EXPECT_EQ(*eps, 0);
  EXPECT_EQ(order, 0);
  EXPECT_EQ(*rdp_epsilon(1.0, 0.01, 0, 1e-5), 0);
}

TEST(RdpAccountant, BadArgumentsAreNamed) {
  auto message_of = [](const Status& s) { return s.message(); };
  struct Case {
    double sigma, q;
    int64_t steps;
    double delta;
    const char* name;
  };
  for (Case c : {Case{0, 0.01, 10, 1e-5, "noise_multiplier"}, Case{-1, 0.01, 10, 1e-5, "noise_multiplier"},
                 Case{NAN, 0.01, 10, 1e-5, "noise_multiplier"}, Case{INFINITY, 0.01, 10, 1e-5, "noise_multiplier"},
                 Case{1, 0, 10, 1e-5, "sample_rate"}, Case{1, 1.5, 10, 1e-5, "sample_rate"},
                 Case{1, NAN, 10, 1e-5, "sample_rate"}, Case{1, 0.01, -1, 1e-5, "steps"}, Case{1, 0.01, 10, 0, "delta"},
                 Case{1, 0.01, 10, 1, "delta"}, Case{1, 0.01, 10, -1e-5, "delta"}}) {
    auto eps = rdp_epsilon(c.sigma, c.q, c.steps, c.delta);
    ASSERT_FALSE(eps.ok()) << c.name;
    EXPECT_EQ(eps.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(message_of(eps.status()).find(c.name), std::string::npos) << message_of(eps.status());
  }
  RdpAccountant accountant;
  ASSERT_TRUE(accountant.step(1.0, 0.01, 10).ok());
  const std::vector<double> before = accountant.rdp();
  EXPECT_FALSE(accountant.step(1.0, 2.0, 10).ok());
  EXPECT_EQ(accountant.rdp(), before) << "a refused step records nothing";
  EXPECT_EQ(accountant.steps(), 10);
  EXPECT_FALSE(RdpAccountant::with_orders({}).ok());
  EXPECT_FALSE(RdpAccountant::with_orders({2, 1.0}).ok());
  EXPECT_FALSE(sampled_gaussian_rdp(1, 0.1, 0.5).ok());
  EXPECT_FALSE(epsilon_from_rdp(std::vector<double>{2, 3}, std::vector<double>{0.1}, 1e-5).ok());
}

}  // namespace
}  // namespace memfl
