"""Seed 003 theory helper: Theorem 1's bound, its conditions, and Lemmas 5-7 checked numerically."""

import jax.numpy as jnp
import numpy as np
import pytest

from mfopt import theory

C = theory.ProblemConstants(L=1.0, sigma2=4.0, M=1.0, f_gap=10.0, delta=0.5)


def test_bound_at_mu_zero_is_k_avg_bound_and_terms_match_closed_form():
  """mu = 0 gives Zhou & Cong's K-AVG bound (seed 003 Remark 2), written out independently."""
  n, eta, p, b, k = 500, 0.01, 8, 32, 4
  d = C.delta
  kavg = (2 * C.f_gap / (n * (k - 1 + d) * eta)
          + C.L**2 * eta**2 * C.sigma2 * (2 * k - 1) * k * (k - 1) / (6 * (k - 1 + d) * b)
          + 2 * C.L * k**2 * C.sigma2 * eta / (p * b * (k - 1 + d)))
  assert theory.bound(0.0, n, eta, P=p, B=b, K=k, c=C) == pytest.approx(kavg, rel=1e-12)
  # With momentum: the optimisation term shrinks by (1 - mu); the others grow.
  t0 = theory.bound_terms(0.0, n, eta, P=p, B=b, K=k, c=C)
  t5 = theory.bound_terms(0.5, n, eta, P=p, B=b, K=k, c=C)
  assert t5["optimization"] == pytest.approx(0.5 * t0["optimization"])
  assert t5["drift"] == pytest.approx(4 * t0["drift"])
  assert t5["noise"] == pytest.approx(2 * t0["noise"] * (1 + 0.25 / (2 * 0.25)))
  assert t0["momentum"] == 0 and t5["momentum"] == pytest.approx(
      C.L * eta * 0.25 * k**2 * C.M / ((k - 1 + d) * 0.125))


def test_conditions_boundary_matches_quadratic_formula():
  k, mu = 6, 0.3
  # 1 = a x^2 + b x with x = eta L / (1 - mu): a = (K+1)(K-2)/2, b = 2K.
  a, b = (k + 1) * (k - 2) / 2, 2 * k
  x = (-b + np.sqrt(b * b + 4 * a)) / (2 * a)
  eta_max = x * (1 - mu) / C.L
  assert theory.conditions(mu, eta_max * 0.999, K=k, c=C)["step_ok"]
  assert not theory.conditions(mu, eta_max * 1.001, K=k, c=C)["step_ok"]
  assert not theory.conditions(mu, 0.8, K=1, c=C)["delta_ok"]  # (0.8/0.7)^2 > 0.5


def test_lemma6_optimal_momentum_grows_with_learners():
  """N P B K fixed: the bound-optimal mu does not decrease, and grows, as P increases."""
  c = theory.ProblemConstants(L=1.0, sigma2=20.0, M=0.05, f_gap=50.0, delta=0.5)
  mus = [theory.optimal_momentum(p, samples=2e6, eta=0.01, B=32, K=8, c=c) for p in (6, 12, 24, 48)]
  assert all(np.isfinite(mus))
  assert all(b >= a for a, b in zip(mus, mus[1:]))
  assert mus[-1] > mus[0] > 0
  # The optimum is a true minimiser on its grid: neighbours are no better.
  n = 2e6 / (6 * 32 * 8)
  g = lambda m: theory.bound(m, n, 0.01, P=6, B=32, K=8, c=c)  # noqa: E731
  assert g(mus[0]) <= g(mus[0] - 0.01) and g(mus[0]) <= g(mus[0] + 0.01)


def test_lemmas_5_and_7_optimal_period():
  """N K fixed; where condition (11)/(12) holds, K_opt(mu) > 1 and K_opt(mu) <= K_opt(0)."""
  c = theory.ProblemConstants(L=1.0, sigma2=1.0, M=0.1, f_gap=100.0, delta=0.5)
  samples, eta, p, b = 5e4, 0.005, 8, 16
  k0 = theory.optimal_period(0.0, samples=samples, eta=eta, P=p, B=b, c=c)
  assert theory.lemma5_condition(0.0, samples=samples, eta=eta, P=p, B=b, c=c)
  assert k0 > 1
  for mu in (0.3, 0.5, 0.7):
    assert theory.lemma5_condition(mu, samples=samples, eta=eta, P=p, B=b, c=c)
    k_mu = theory.optimal_period(mu, samples=samples, eta=eta, P=p, B=b, c=c)
    assert 1 < k_mu <= k0
  assert theory.optimal_period(0.9, samples=samples, eta=eta, P=p, B=b, c=c) < k0


def test_estimate_constants_on_a_quadratic_with_known_answers():
  """f_i(w) = 0.5 sum h (w - x_i)^2: L = max h, sigma2 = sum h^2 Var(x), grad F = h (w - mean x),
  and f_gap = F(w) - f_star (seed 003's F(w_1) - F*; adding the lower bound would loosen every
  Theorem 1 term f_gap enters)."""
  rng = np.random.default_rng(0)
  h = np.array([3.0, 1.0, 0.5], np.float32)
  x = rng.normal(size=(400, 3)).astype(np.float32)
  w = np.ones(3, np.float32)

  def loss(params, batch):
    return jnp.mean(0.5 * jnp.sum(h * (params["w"] - batch["x"]) ** 2, axis=1))

  f_star = 0.25
  est = theory.estimate_constants(loss, {"w": jnp.asarray(w)}, {"x": jnp.asarray(x)}, iters=30,
                                  f_star=f_star)
  assert est.L == pytest.approx(3.0, rel=1e-3)
  assert est.sigma2 == pytest.approx(float(np.sum(h**2 * x.var(0))), rel=1e-4)
  assert est.M == pytest.approx(float(np.sum((h * (w - x.mean(0))) ** 2)), rel=1e-4)
  f_w = float(np.mean(0.5 * np.sum(h * (w - x.astype(np.float64)) ** 2, axis=1)))
  assert est.f_gap == pytest.approx(f_w - f_star, rel=1e-5)


def test_estimate_constants_finds_max_abs_eigenvalue_at_a_saddle():
  """Hessian eigenvalues {5, -4.9, 1}: L = 5. The Rayleigh quotient |v^T H v| it used gave
  0.85-3.8 after 20 steps (v swings between the two top eigenvectors); ||H v|| rises towards 5
  from below at every seed."""
  a = jnp.diag(jnp.asarray([5.0, -4.9, 1.0]))

  def loss(p, batch):
    return 0.5 * p @ a @ p + 0.0 * jnp.sum(batch)

  for seed in range(3):
    est = theory.estimate_constants(loss, jnp.full(3, 0.1), jnp.ones((4, 1)), iters=60, seed=seed)
    assert 4.9 <= est.L <= 5.0 + 1e-5, (seed, est.L)


@pytest.mark.parametrize("kw,match", [({"L": 0.0}, r"L must be a positive number, got 0.0"),
                                      ({"delta": 1.0}, r"delta must be in \(0, 1\), got 1.0")])
def test_bad_constants(kw, match):
  args = dict(L=1.0, sigma2=1.0, M=1.0, f_gap=1.0, delta=0.5) | kw
  with pytest.raises(ValueError, match=match):
    theory.ProblemConstants(**args)


def test_bad_mu():
  with pytest.raises(ValueError, match=r"mu must be in \[0, 1\), got 1.0"):
    theory.bound(1.0, 10, 0.1, P=1, B=1, K=1, c=C)


@pytest.mark.parametrize("delta,mu", [(0.8, 0.0), (0.8, 0.7), (0.4, 0.5)])
def test_lemma5_condition_switches_where_eq11_written_out_says(delta, mu):
  """Eq. (11) written out from seed 003 (away from delta = 0.5, where (1-d)/d = d/(1-d) hid a
  swapped factor): the condition holds just below the crossing sample count S* and fails
  just above it."""
  c = theory.ProblemConstants(L=2.0, sigma2=3.0, M=0.4, f_gap=5.0, delta=delta)
  eta, P, B = 0.01, 4, 8
  om = 1.0 - mu
  rhs = (1 / om**3 * c.L**2 * eta**2 * c.sigma2 / (2 * B)
         + 1 / om**2 * (3 * delta - 1) / (2 * delta)
         * (mu**2 / om**2 * (c.L * c.sigma2 * eta / (P * B) + c.L * eta * c.M)
            + 2 * c.L * c.sigma2 * eta / (P * B)))
  s_star = (1 - delta) / delta * c.f_gap / (eta * rhs)  # lhs(S) = rhs at S = S*
  assert theory.lemma5_condition(mu, samples=s_star * 0.999, eta=eta, P=P, B=B, c=c)
  assert not theory.lemma5_condition(mu, samples=s_star * 1.001, eta=eta, P=P, B=B, c=c)


def test_searches_and_estimates_refuse_bad_arguments_naming_them():
  """optimal_momentum with P = 0 raised ZeroDivisionError and with P = -1 returned NaN ("no mu
  holds"); optimal_period(P=0) returned 0 ("no K holds"); estimate_constants(iters=0) failed
  as "L must be a positive number", and an f_star above F(w_1) was clamped to f_gap = 1e-12."""
  kw = dict(samples=1e5, eta=0.01, c=C)
  for bad in (dict(P=0, B=32, K=4), dict(P=-1, B=32, K=4), dict(P=8, B=0, K=4),
              dict(P=8, B=32, K=0)):
    name, value = next((k, v) for k, v in bad.items() if v < 1)
    with pytest.raises(ValueError, match=rf"{name} must be >= 1, got {value}"):
      theory.optimal_momentum(bad["P"], B=bad["B"], K=bad["K"], **kw)
  with pytest.raises(ValueError, match=r"P must be >= 1, got 0"):
    theory.optimal_period(0.5, P=0, B=32, **kw)
  with pytest.raises(ValueError, match=r"eta must be a positive number, got -0.01"):
    theory.optimal_period(0.5, P=8, B=32, samples=1e5, eta=-0.01, c=C)

  def loss(p, batch):
    return jnp.mean(0.5 * (p - batch) ** 2)  # F(1) = 0.5 on the examples {0}

  w, data = jnp.ones(1), jnp.zeros((4, 1))
  with pytest.raises(ValueError, match=r"iters must be a positive integer, got 0"):
    theory.estimate_constants(loss, w, data, iters=0)
  with pytest.raises(ValueError, match=r"f_star must be a lower bound of F below F\(w_1\) = 0.5, "
                                       r"got 0.75"):
    theory.estimate_constants(loss, w, data, f_star=0.75)
  assert theory.estimate_constants(loss, w, data, f_star=0.25, iters=5).f_gap == 0.25


def test_optimal_period_refuses_bad_B_even_where_no_K_holds():
  """B is checked up front: with eta = 1 and mu = 0.5 the delta condition L^2 eta^2 / (1-mu)^2
  = 4 > 1 - delta = 0.5 fails for every K, so a check left to the bound never runs and B = 0
  came back as 0 ("no K holds")."""
  kw = dict(samples=1e5, eta=1.0, P=8, c=C)
  assert theory.optimal_period(0.5, B=32, **kw) == 0  # no K holds (worked out above)
  with pytest.raises(ValueError, match=r"B must be >= 1, got 0"):
    theory.optimal_period(0.5, B=0, **kw)


def test_estimate_constants_refuses_f_star_equal_to_f_w1():
  """f_star must lie strictly below F(w_1): equal to it the gap f_gap is 0 and every bound
  built on it degenerates (F(w_1) = 0.5 here: 0.5 (w - 0)^2 at w = 1)."""
  def loss(p, batch):
    return jnp.mean(0.5 * (p - batch) ** 2)

  with pytest.raises(ValueError, match=r"f_star must be a lower bound of F below F\(w_1\) = 0.5, "
                                       r"got 0.5"):
    theory.estimate_constants(loss, jnp.ones(1), jnp.zeros((4, 1)), f_star=0.5, iters=2)


def _g_ref(mu, n, eta, p, b, k, c):
  """Seed 003 eq. (3) written out again, vectorised over mu or K."""
  om, den = 1.0 - mu, k - 1 + c.delta
  return (2 * om * c.f_gap / (n * den * eta)
          + c.L**2 * eta**2 * c.sigma2 * (2 * k - 1) * k * (k - 1) / (6 * den * b * om**2)
          + 2 * c.L * k**2 * c.sigma2 * eta / (p * b * den * om) * (1 + mu**2 / (2 * om**2))
          + c.L * eta * mu**2 * k**2 * c.M / (den * om**3))


def _holds_ref(mu, eta, k, c):
  """Theorem 1's two conditions, written out again (vectorised)."""
  om = 1.0 - mu
  step = c.L**2 * eta**2 * (k + 1) * (k - 2) / (2 * om**2) + 2 * eta * c.L * k / om
  return (step <= 1.0) & (c.L**2 * eta**2 / om**2 <= 1.0 - c.delta)


def test_delta_condition_boundary_away_from_half():
  """1 - delta >= L^2 eta^2 / (1-mu)^2 switches at eta = sqrt(1-delta)(1-mu)/L; at delta = 0.8
  a bound checked against delta instead of 1 - delta, or a (1-mu) missing its square, moves it."""
  c = theory.ProblemConstants(L=2.0, sigma2=1.0, M=1.0, f_gap=1.0, delta=0.8)
  mu = 0.3
  eta_max = np.sqrt(1 - 0.8) * (1 - mu) / 2.0
  # K = 1: the step condition is 2x - x^2 <= 1 with x = eta L / (1-mu), which always holds.
  below = theory.conditions(mu, eta_max * 0.999, K=1, c=c)
  above = theory.conditions(mu, eta_max * 1.001, K=1, c=c)
  assert below["delta_condition"] == pytest.approx(0.2 * 0.999**2, rel=1e-12)
  assert below["delta_ok"] and below["ok"]
  assert not above["delta_ok"] and not above["ok"]


def test_optimal_momentum_is_the_constrained_grid_minimiser():
  """optimal_momentum is the argmin of eq. (3) over mu = 0, 0.0025, ..., 0.995 among the mu
  where Theorem 1's conditions hold: with eta = 0.05 the unconstrained minimiser violates them,
  and with many learners and a small M the optimum lies above 0.9 (a shorter grid misses it)."""
  grid = np.arange(0.0, 0.9951, 0.0025)
  cases = [(dict(L=1.0, sigma2=20.0, M=0.05, f_gap=50.0), 48, 2e6, 0.05, 32, 8),
           (dict(L=1.0, sigma2=20.0, M=0.001, f_gap=500.0), 64, 1e8, 0.001, 32, 4)]
  wants, free = [], []
  for kw, p, s, eta, b, k in cases:
    c = theory.ProblemConstants(**kw, delta=0.5)
    vals = _g_ref(grid, s / (p * b * k), eta, p, b, k, c)
    wants.append(grid[np.argmin(np.where(_holds_ref(grid, eta, k, c), vals, np.inf))])
    free.append(grid[np.argmin(vals)])
    got = theory.optimal_momentum(p, samples=s, eta=eta, B=b, K=k, c=c)
    assert got == pytest.approx(wants[-1], abs=1e-9), (kw, got, wants[-1])
  assert free[0] > wants[0] + 0.1 and wants[1] > 0.9  # the cases probe what they claim to


@pytest.mark.parametrize("mu,sigma2,f_gap,k_max", [(0.5, 1.0, 100.0, 256), (0.0, 1.0, 100.0, 6),
                                                   (0.0, 10.0, 0.01, 256)])
def test_optimal_period_is_the_constrained_minimiser_over_1_to_k_max(mu, sigma2, f_gap, k_max):
  """optimal_period is the argmin of eq. (3) with N = S/K over K = 1..k_max (both ends
  included) where the conditions hold: the optimum can sit at k_max (6, below the free
  optimum 55) or at K = 1 (noise-dominated, where Lemma 5's condition fails)."""
  c = theory.ProblemConstants(L=1.0, sigma2=sigma2, M=0.1, f_gap=f_gap, delta=0.5)
  s, eta, p, b = 5e4, 0.005, 8, 16
  ks = np.arange(1, k_max + 1)
  vals = np.where(_holds_ref(mu, eta, ks, c), _g_ref(mu, s / ks, eta, p, b, ks, c), np.inf)
  want = int(ks[np.argmin(vals)])
  assert theory.optimal_period(mu, samples=s, eta=eta, P=p, B=b, c=c, k_max=k_max) == want
  if k_max == 6:
    assert want == 6
  if f_gap == 0.01:
    assert want == 1 and not theory.lemma5_condition(mu, samples=s, eta=eta, P=p, B=b, c=c)


def test_theory_refuses_degenerate_inputs_naming_them():
  """delta = 0 makes K - 1 + delta = 0 at K = 1, a fractional learner/batch/period count and
  N = 0 have no meaning in Theorem 1, a negative M turns the momentum term into a bonus, and
  conditions() at mu = 1 divides by zero: each is refused with its name."""
  with pytest.raises(ValueError, match=r"delta must be in \(0, 1\), got 0.0"):
    theory.ProblemConstants(L=1.0, sigma2=1.0, M=1.0, f_gap=1.0, delta=0.0)
  with pytest.raises(ValueError, match=r"M must be a non-negative number, got -1.0"):
    theory.ProblemConstants(L=1.0, sigma2=1.0, M=-1.0, f_gap=1.0)
  with pytest.raises(ValueError, match=r"K must be >= 1, got 0.5"):
    theory.bound(0.0, 10, 0.01, P=4, B=8, K=0.5, c=C)
  with pytest.raises(ValueError, match=r"P must be >= 1, got 0.5"):
    theory.bound(0.0, 10, 0.01, P=0.5, B=8, K=2, c=C)
  with pytest.raises(ValueError, match=r"N must be positive, got 0"):
    theory.bound(0.0, 0, 0.01, P=4, B=8, K=2, c=C)
  with pytest.raises(ValueError, match=r"mu must be in \[0, 1\), got 1.0"):
    theory.conditions(1.0, 0.01, K=2, c=C)
  with pytest.raises(ValueError, match=r"eta must be a positive number, got -0.01"):
    theory.conditions(0.5, -0.01, K=2, c=C)


def test_estimate_constants_power_iteration_rises_to_max_abs_eigenvalue():
  """Hessian eigenvalues {5, -4.8, 4.6, 1}: ||H v|| from a random unit start stays <= max|lambda|
  = 5 and reaches it within 1e-4 after 200 steps (slowly: ratio 0.96, so a loop cut short
  stops well below). The start vector follows ``seed`` (one step gives different estimates),
  and ``delta`` is passed through to the constants rather than reset to its default."""
  a = jnp.diag(jnp.asarray([5.0, -4.8, 4.6, 1.0]))

  def loss(p, batch):
    return 0.5 * p @ a @ p + 0.0 * jnp.sum(batch)

  def est(iters, seed=0, delta=0.5):
    return theory.estimate_constants(loss, jnp.full(4, 0.1), jnp.ones((2, 1)), iters=iters,
                                     seed=seed, delta=delta)

  one, one_b, long = est(1).L, est(1, seed=1).L, est(200, delta=0.8)
  assert one != pytest.approx(one_b, rel=1e-3)
  assert max(one, one_b) <= long.L + 1e-5 and long.L <= 5.0 * (1 + 1e-6)
  assert long.L == pytest.approx(5.0, rel=1e-4) and long.delta == 0.8


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the point)
def test_searches_return_an_admissible_value_when_the_bound_overflows():
  """NaN (mu) and 0 (K) mean "no value satisfies Theorem 1's conditions". With f_gap = 1e308 the
  bound is +inf wherever they hold, and the searches used to return those markers anyway (no
  value was < inf); they return the first admissible value now."""
  c = theory.ProblemConstants(L=1.0, sigma2=1.0, M=1.0, f_gap=1e308, delta=0.5)
  assert theory.conditions(0.0, 1e-3, K=4, c=c)["ok"]
  assert theory.bound(0.0, 1e-3, 1e-3, P=8, B=32, K=4, c=c) == np.inf
  assert theory.optimal_momentum(8, samples=1.0, eta=1e-3, B=32, K=4, c=c) == 0.0
  assert theory.optimal_period(0.0, samples=1e-3, eta=1e-3, P=8, B=32, c=c, k_max=4) == 1
