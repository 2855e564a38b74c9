"""Seed 000 §3.1 BN analysis: measured statistics on Gaussian data against the correct and printed formulas.

Tolerances. For i.i.d. Gaussian samples of variance s^2, S_t/s^2 ~ chi^2_{M-1} (variance
2(M-1)), S_e/s^2 ~ chi^2_{M-P}, S_a/s^2 ~ chi^2_{P-1}, and (mu_j - mu)^2 K/s^2 ~ chi^2_1
(variance 2). The mean over n independent draws therefore has standard deviation
sqrt(2 dof / n); every check allows 5 such standard deviations (a false failure has
probability ~6e-7 per check; the seeds are fixed anyway), derived from the chi-square
variance, not from the data.
"""

import math

import numpy as np
import pytest

from mfopt import bn_analysis as bn

M = 64
WORKERS = (1, 2, 4, 8, 16, 32)
TRIALS, FEATURES = 4000, 8
SIGMA2, MU = 2.5, 3.0


@pytest.fixture(scope="module")
def gaussian():
  rng = np.random.default_rng(0)
  return MU + math.sqrt(SIGMA2) * rng.normal(size=(TRIALS, M, FEATURES))


@pytest.fixture(scope="module")
def measured(gaussian):
  return {P: bn.measure_split_statistics(gaussian, P, np.full(FEATURES, SIGMA2),
                                         mu=np.full(FEATURES, MU)) for P in WORKERS}


def _sd_of_mean(dof, n=TRIALS * FEATURES):
  return math.sqrt(2 * dof / n)


def test_total_sum_of_squares_matches_correct_expectation_for_every_P(measured):
  for P, m in measured.items():
    tol = 5 * _sd_of_mean(M - 1)  # ~0.63 on an expectation of 63
    assert abs(m["S_t"] - (M - 1)) < tol, (P, m["S_t"], tol)
    assert m["correct_S_t"] == M - 1


def test_printed_eq8_departs_from_measurement_for_P_above_1(measured):
  for P, m in measured.items():
    gap = bn.printed_e2(M, P) - bn.correct_total_ss(M, P=P)
    assert gap == pytest.approx(M * (P - 1) / P)  # what eq. 8 adds
    if P == 1:
      assert m["printed_e2"] == m["correct_S_t"]  # eq. 8 degenerates to the truth at P = 1
      assert abs(m["S_t"] - m["printed_e2"]) < 5 * _sd_of_mean(M - 1)
    else:
      # measured is gap (>= 32 sigma^2 units) away from eq. 8: > 50 standard deviations
      assert abs(m["S_t"] - m["printed_e2"]) > 50 * _sd_of_mean(M - 1), (P, m)
      assert abs(m["z_printed"]) > 50 and abs(m["z_correct"]) < 5


def test_within_and_between_parts(measured):
  for P, m in measured.items():
    assert abs(m["S_e"] - (M - P)) < 5 * _sd_of_mean(M - P), (P, m["S_e"])
    if P == 1:
      assert m["S_a"] == 0.0
    else:
      assert abs(m["S_a"] - (P - 1)) < 5 * _sd_of_mean(P - 1), (P, m["S_a"])


def test_eq6_is_the_sum_of_squares_not_eq4_variance(measured):
  m = measured[1]
  # eq. 4 (1/M) has expectation (M-1)/M, printed eq. 6 says (M-1): off by a factor M.
  assert abs(m["delta2_B"] - (M - 1) / M) < 5 * _sd_of_mean(M - 1) / M
  assert bn.printed_e1(M) == M * bn.correct_batch_variance(M)


def test_anova_identity_holds_exactly(gaussian):
  x = gaussian[:5]
  total = ((x - x.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
  for P in WORKERS:
    st = bn.split_statistics(x, P)
    np.testing.assert_allclose(st["S_t"], total, rtol=1e-12)
    np.testing.assert_allclose(st["delta2_B"] * M, total, rtol=1e-12)


def test_per_worker_statistics_noise_grows_as_1_over_K(measured):
  for P, m in measured.items():
    K = M // P
    # mean noise: (mu_j - mu)^2 K / s^2 ~ chi^2_1, averaged over TRIALS*FEATURES*P values
    tol = 5 * math.sqrt(2 / (TRIALS * FEATURES * P)) / K
    assert abs(m["mean_noise"] - 1 / K) < tol, (P, m["mean_noise"], 1 / K)
    assert m["predicted_mean_noise"] == 1 / K
    # variance noise against the Gaussian formula (2K-1)/K^2, 5 empirical standard errors
    assert bn.predicted_variance_noise(K) == pytest.approx((2 * K - 1) / K**2)
    assert abs(m["var_noise"] - m["predicted_var_noise"]) < 5 * m["var_noise_se"], (P, m)
  # at fixed M the noise grows with P: 32 workers of 2 samples vs 1 worker of 64
  assert measured[32]["mean_noise"] > 25 * measured[1]["mean_noise"]


def test_variance_noise_formula_with_non_gaussian_kurtosis():
  rng = np.random.default_rng(1)
  x = rng.uniform(-1, 1, size=(4000, 32, 4))  # variance 1/3, kurtosis 9/5
  m = bn.measure_split_statistics(x, 8, np.full(4, 1 / 3), mu=np.zeros(4), kurt=np.full(4, 1.8))
  assert abs(m["var_noise"] - bn.predicted_variance_noise(4, 1.0, 1.8)) < 5 * m["var_noise_se"]
  # the Gaussian formula would be wrong here by far more than the sampling error
  assert abs(m["var_noise"] - bn.predicted_variance_noise(4)) > 10 * m["var_noise_se"]
  np.testing.assert_allclose(bn.kurtosis(rng.uniform(-1, 1, size=200_000)), 1.8, atol=0.02)


def test_formulas_and_validation():
  assert bn.printed_e1(64, 2.0) == 126.0
  assert bn.printed_e2(64, 4, 2.0) == 126.0 + 96.0
  assert bn.correct_within_ss(64, 4) + bn.correct_between_ss(64, 4) == bn.correct_total_ss(64)
  assert bn.total_ss_std(33, 2.0) == pytest.approx(16.0)
  assert bn.predicted_variance_noise(1) == 1.0
  rows = bn.expectation_table(64, (1, 3, 8))
  assert [r["P"] for r in rows] == [1, 8]  # 3 does not divide 64
  with pytest.raises(ValueError, match="M must be divisible by P=3 .*got 64"):
    bn.printed_e2(64, 3)
  with pytest.raises(ValueError, match="P must be a positive integer, got 0"):
    bn.printed_e2(64, 0)
  with pytest.raises(ValueError, match=r"batches must have shape \(trials, M, F\)"):
    bn.measure_split_statistics(np.zeros((3, 4)), 2, np.ones(1))
  # errors name the caller's argument (they said "M"), and nonsense is refused, not computed
  # (ZeroDivisionError for a worker count of 0, a negative mean square for kurt = -5)
  with pytest.raises(ValueError, match=r"K must be a positive integer, got 0"):
    bn.predicted_mean_noise(0)
  with pytest.raises(ValueError, match=r"K must be a positive integer, got 0"):
    bn.predicted_variance_noise(0)
  with pytest.raises(ValueError, match=r"kurt must be a kurtosis, >= 1, got -5"):
    bn.predicted_variance_noise(4, kurt=-5)
  assert bn.predicted_variance_noise(4, kurt=1.0) > 0
  with pytest.raises(ValueError, match=r"workers item must be a positive integer, got 0"):
    bn.expectation_table(64, (0,))
  acts, rng = np.random.default_rng(0).normal(size=(16, 3)), np.random.default_rng(1)
  with pytest.raises(ValueError, match=r"global_batch must be divisible by num_workers=3"):
    bn.measure_bn_channel_noise(acts, 8, 3, trials=2, rng=rng)
  with pytest.raises(ValueError, match=r"trials must be a positive integer, got 0"):
    bn.measure_bn_channel_noise(acts, 8, 2, trials=0, rng=rng)
  with pytest.raises(ValueError, match=r"M \(batches.shape\[1\]\) must be divisible by "
                                       r"num_workers=3"):
    bn.measure_split_statistics(np.zeros((2, 4, 1)), 3, np.ones(1))


def test_bn_channel_noise_with_spatially_correlated_activations():
  # x[n, l, c] = a[n, c] + e[n, l, c]: per-example offset (var 0.5) + i.i.d. noise (var 0.5).
  # Population variance 1; the per-example channel mean has variance 0.5 + 0.5/L, so a
  # worker's mean over K examples has E(mu_j - mu)^2 = (0.5 + 0.5/L) / K: not 1/(K L).
  rng = np.random.default_rng(2)
  n, L, C = 20000, 10, 3
  x = (np.sqrt(0.5) * rng.normal(size=(n, 1, C)) + np.sqrt(0.5) * rng.normal(size=(n, L, C)))
  for P in (1, 4):
    m = bn.measure_bn_channel_noise(x, 32, P, 2000, rng)
    K = 32 // P
    assert m["predicted_mean_noise"] == pytest.approx((0.5 + 0.5 / L) / K, rel=0.05)
    assert abs(m["mean_noise"] - m["predicted_mean_noise"]) < 5 * m["mean_noise_se"], m
    assert m["mean_noise"] > 3 / (K * L)  # the naive K*L-sample law is far too small


def test_standard_error_is_the_trial_spread_over_sqrt_trials():
  """Three hand-made trials (M = 2, P = 1, one feature, sigma^2 = 1) with S_t = 0, 2, 8: the
  standard error of the mean is sd(ddof=1) / sqrt(3), not sd / sqrt(trials - 1), which would
  overstate the uncertainty (and understate every z-score) of small runs."""
  batches = np.array([[[0.0], [0.0]], [[0.0], [2.0]], [[0.0], [4.0]]])  # (trials, M, F)
  m = bn.measure_split_statistics(batches, 1, np.ones(1), mu=np.zeros(1))
  s_t = np.array([0.0, 2.0, 8.0])  # sum of squares about each pair's mean: d^2 / 2
  assert m["S_t"] == pytest.approx(10 / 3)
  assert m["S_t_se"] == pytest.approx(s_t.std(ddof=1) / math.sqrt(3), rel=1e-12)
  assert m["delta2_B_se"] == pytest.approx((s_t / 2).std(ddof=1) / math.sqrt(3), rel=1e-12)
  assert m["z_correct"] == pytest.approx((10 / 3 - 1) / m["S_t_se"], rel=1e-12)


def test_bn_channel_noise_uses_the_biased_variance_batchnorm_normalises_with():
  """BatchNorm divides by the biased (ddof=0) variance over a worker's examples and positions.
  When every example is the same +-1 pattern, each worker's biased variance equals the
  population's, so both noises are 0; an unbiased variance would be K L / (K L - 1) times
  larger (var_noise (1 / (K L - 1))^2 = 1/9 at K = L = 2)."""
  pattern = np.array([[1.0, -1.0], [-1.0, 1.0]])  # (positions L=2, channels C=2)
  acts = np.broadcast_to(pattern, (5, 2, 2))
  m = bn.measure_bn_channel_noise(acts, 4, 2, 3, np.random.default_rng(0))
  assert (m["P"], m["K"], m["channels"]) == (2, 2, 2)
  assert m["mean_noise"] == pytest.approx(0.0, abs=1e-24)
  assert m["var_noise"] == pytest.approx(0.0, abs=1e-24)


def test_worker_count_and_table_size_errors_name_the_callers_argument():
  """measure_bn_channel_noise's worker count is its num_workers argument (an error saying "P"
  names no argument it has), and expectation_table checks M itself: with no listed worker
  count dividing M no row is built, so a negative M came back as an empty table."""
  acts, rng = np.random.default_rng(0).normal(size=(16, 3)), np.random.default_rng(1)
  with pytest.raises(ValueError, match=r"num_workers must be a positive integer, got 0"):
    bn.measure_bn_channel_noise(acts, 8, 0, trials=2, rng=rng)
  with pytest.raises(ValueError, match=r"num_workers must be a positive integer, got 0"):
    bn.measure_split_statistics(np.zeros((2, 4, 1)), 0, np.ones(1))
  with pytest.raises(ValueError, match=r"M must be a positive integer, got -64"):
    bn.expectation_table(-64, (3,))


def test_expectations_scale_with_sigma2():
  """Every expectation is linear in sigma^2 (quadratic for the variance noise): at sigma^2 = 2,
  E[S_e] = 2 (M-P), E[S_a] = 2 (P-1), E(mu_j-mu)^2 = 2/K, E(delta_j^2-sigma^2)^2 = 4 (2K-1)/K^2
  (4 = sigma^4 at K = 1), and the table passes sigma^2 to every column."""
  assert bn.correct_within_ss(64, 4, 2.0) == 120.0
  assert bn.correct_between_ss(64, 4, 2.0) == 6.0
  assert bn.predicted_mean_noise(4, 2.0) == 0.5
  assert bn.predicted_variance_noise(1, 2.0) == 4.0
  assert bn.predicted_variance_noise(4, 2.0) == pytest.approx(4 * 7 / 16, rel=1e-12)
  (row,) = bn.expectation_table(64, (4,), sigma2=2.0)
  assert row == {"P": 4, "K": 16, "printed_e1": 126.0, "printed_e2": 126.0 + 96.0,
                 "correct_S_t": 126.0, "correct_S_e": 120.0, "correct_S_a": 6.0}


def test_zero_population_variance_is_refused():
  """Measurements are divided by each feature's sigma^2: a constant feature (sigma^2 = 0) would
  turn every average into inf/NaN, so it is refused with a message."""
  with pytest.raises(ValueError, match=r"sigma2 must be > 0 for every feature"):
    bn.measure_split_statistics(np.ones((2, 4, 2)), 2, np.array([1.0, 0.0]))


def test_variance_noise_prediction_averages_each_features_kurtosis():
  """With features of different kurtosis, the prediction is the average of the per-feature
  formulas ((K-1)/K)^2 (kurt/K - (K-3)/(K(K-1))) + 1/K^2, not the first feature's value."""
  x = np.random.default_rng(3).normal(size=(2, 8, 2))
  m = bn.measure_split_statistics(x, 2, np.ones(2), mu=np.zeros(2), kurt=np.array([1.8, 3.0]))
  K = 4
  pred = [(3 / 4) ** 2 * (k / K - 1 / 12) + 1 / 16 for k in (1.8, 3.0)]  # 0.26875, 0.4375
  assert m["predicted_var_noise"] == pytest.approx((pred[0] + pred[1]) / 2, rel=1e-12)


class _FixedDraws:
  """A stand-in for np.random.Generator whose integers() returns chosen example indices."""

  def __init__(self, idx):
    self.idx = np.asarray(idx)

  def integers(self, low, high, size):
    assert self.idx.shape == tuple(size)
    return self.idx


def test_bn_channel_noise_on_hand_chosen_draws():
  """Two examples (0 and 4: mean 2, variance 4) and a constant channel (dropped). Draws
  {0,0}, {0,1}, {1,1} give worker means 0, 2, 4 and biased variances 0, 4, 0, so both squared
  errors, normalised by sigma^2 and sigma^4, are 1, 0, 1: noise 2/3 with standard error
  sd(ddof=1)/sqrt(3) = 1/3; the prediction is Var(example mean) / (K sigma^2) = 4/(2*4)."""
  acts = np.array([[0.0, 5.0], [4.0, 5.0]])  # (N = 2, C = 2), channel 1 constant
  m = bn.measure_bn_channel_noise(acts, 2, 1, 3, _FixedDraws([[[0, 0]], [[0, 1]], [[1, 1]]]))
  assert (m["P"], m["K"], m["channels"], m["trials"]) == (1, 2, 1, 3)
  for name in ("mean_noise", "var_noise"):
    assert m[name] == pytest.approx(2 / 3, rel=1e-12), name
    assert m[name + "_se"] == pytest.approx(1 / 3, rel=1e-12), name
  assert m["predicted_mean_noise"] == pytest.approx(0.5, rel=1e-12)


def test_bn_channel_noise_draws_from_every_example():
  """Global batches are drawn with replacement from all N examples: with examples 0, 0, 3
  (mean 1, variance 2) and K = 1 the squared mean error is 1/2 or 2 (the last example), with
  expectation 1 = the prediction; never drawing the last example would give exactly 1/2."""
  acts = np.array([[0.0], [0.0], [3.0]])
  m = bn.measure_bn_channel_noise(acts, 1, 1, 400, np.random.default_rng(4))
  assert m["predicted_mean_noise"] == pytest.approx(1.0, rel=1e-12)
  # per-trial error: 1/2 w.p. 2/3, 2 w.p. 1/3 -> sd sqrt(2)/2; 5 sd of the mean of 400
  assert abs(m["mean_noise"] - 1.0) < 5 * (math.sqrt(2) / 2) / math.sqrt(400)


def test_kurtosis_of_constant_and_tiny_scale_columns():
  """Kurtosis is scale-free: [-s, s] repeated has kurtosis 1 at any scale, 1e-150 included
  (sigma^4 underflows to 0 there), and a constant column has none (NaN, without a 0/0
  RuntimeWarning: the max(var, 1e-300)**2 guard underflowed to 0 itself)."""
  import warnings
  x = np.stack([np.tile([-1.0, 1.0], 8), np.tile([-1e-150, 1e-150], 8), np.full(16, 3.0)], 1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    k = bn.kurtosis(x)
  np.testing.assert_allclose(k[:2], [1.0, 1.0], rtol=1e-12)
  assert np.isnan(k[2])
  np.testing.assert_allclose(bn.kurtosis(x[:, 0]), 1.0, rtol=1e-12)  # (1-D: a scalar)
