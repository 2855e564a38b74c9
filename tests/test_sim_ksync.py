"""The k-test of seed 002 (spec §2.2-2.3): Welford statistics, Tests A/B, and the k rule."""

import numpy as np
import pytest

from mfopt import sim
from mfopt.sim import ksync


def test_welford_matches_two_pass_numpy():
  rng = np.random.default_rng(0)
  g = rng.normal(3.0, 2.0, size=(9, 500)) * rng.uniform(0.1, 5, size=500)
  w = sim.Welford(500)
  for n, row in enumerate(g, start=1):
    w.add(row.astype(np.float32))
    ref = g[:n].astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(w.mean, ref.mean(0), rtol=1e-12, atol=1e-12)
    if n >= 2:
      np.testing.assert_allclose(w.variance, ref.var(0, ddof=1), rtol=1e-10, atol=1e-12)


def test_t_quantiles_match_the_spec_table():
  table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 31: 2.040}
  for df, t in table.items():
    assert ksync.t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)
  assert ksync.t_quantile(0.95, 2) == pytest.approx(2.920, abs=1e-3)


def test_k_test_statistics_match_numpy_and_the_decision_rule():
  rng = np.random.default_rng(1)
  g = rng.normal(0.3, 1.0, size=(5, 200))
  w = sim.Welford(200)
  for row in g:
    w.add(row)
  cfg = sim.KTestConfig(theta=0.9, ci_mode="upper_abs")
  res = sim.k_test(w, cfg)
  gbar, s2 = g.mean(0), g.var(0, ddof=1)
  e_hat = s2.sum() / 5
  assert res.e_hat == pytest.approx(e_hat, rel=1e-12)
  assert res.test_a == (e_hat <= 0.81 * gbar @ gbar)
  mu = np.abs(gbar) + 2.776 * np.sqrt(s2 / 5)
  assert res.test_b == (e_hat <= 0.81 * mu @ mu)
  lower = sim.k_test(w, sim.KTestConfig(ci_mode="lower_abs"))
  mu_lo = np.maximum(np.abs(gbar) - ksync.t_quantile(0.975, 4) * np.sqrt(s2 / 5), 0)
  assert lower.test_b == (e_hat <= 0.81 * mu_lo @ mu_lo)


def test_variance_ucb_replaces_v_hat_in_test_a_only():
  """Spec §2.2: V̂_up = (k-1) V̂ / χ²_{a/2, k-1} "in place of V̂ in Test A"; Test B and the
  broadcast Ê, V̂ keep the plain estimate. Checked against SciPy on random cases where the
  two readings disagree (lower_abs is where Test B binds)."""
  from scipy import stats
  rng = np.random.default_rng(7)
  cfg = sim.KTestConfig(ci_mode="lower_abs", variance_ucb=True)
  b_decided_by_plain = 0
  for _ in range(200):
    n, d = int(rng.integers(2, 9)), 20
    g = rng.normal(rng.normal(0, 1, d), rng.uniform(0.1, 2.0), size=(n, d))
    w = sim.Welford(d)
    for row in g:
      w.add(row)
    res = sim.k_test(w, cfg)
    gbar, s2 = g.mean(0), g.var(0, ddof=1)
    e_hat = s2.sum() / n
    e_up = (n - 1) * s2.sum() / stats.chi2.ppf(0.025, n - 1) / n
    mu = np.maximum(np.abs(gbar) - stats.t.ppf(0.975, n - 1) * np.sqrt(s2 / n), 0)
    assert res.e_hat == pytest.approx(e_hat, rel=1e-10)
    assert res.v_hat == pytest.approx(s2.sum(), rel=1e-10)
    assert res.test_a == (e_up <= 0.81 * gbar @ gbar)
    assert res.test_b == (e_hat <= 0.81 * mu @ mu)
    b_decided_by_plain += (e_hat <= 0.81 * mu @ mu) != (e_up <= 0.81 * mu @ mu)
  assert b_decided_by_plain > 0  # cases where using V̂_up in Test B would have changed it


def test_identical_gradients_keep_k_at_k_min():
  rng = np.random.default_rng(2)
  for k_min in (2, 3):
    cfg = sim.KTestConfig(k_min=k_min)
    for _ in range(10):
      g = rng.normal(size=1000)
      k, res = sim.choose_k([g] * 16, cfg, num_workers=16)
      assert k == k_min and res.passed and res.e_hat == 0.0


def test_zero_mean_noise_reaches_k_max_at_every_step():
  rng = np.random.default_rng(3)
  d, M = 10_000, 16
  for mode in ("upper_signed", "upper_abs", "lower_abs", "off"):
    cfg = sim.KTestConfig(theta=0.5, ci_mode=mode)
    for _ in range(5):  # five server steps, fresh noise each
      k, res = sim.choose_k(rng.normal(size=(M, d)), cfg, num_workers=M)
      assert k == M and not res.test_a
  # with a k_max cap the rule stops at the cap
  k, _ = sim.choose_k(rng.normal(size=(M, d)), sim.KTestConfig(theta=0.5, k_max=8), num_workers=M)
  assert k == 8


def test_signal_plus_noise_gives_intermediate_k():
  """k follows the noise-to-signal ratio.

  With μ = 1 in every coordinate and noise σ: Ê ≈ σ²d/n and ‖ḡ‖² ≈ d(1 + σ²/n), so
  Test A passes once n >= σ²(1-ϑ²)/ϑ² (= 18.75 for σ = 2.5, ϑ = 0.5).
  """
  rng = np.random.default_rng(4)
  d, M, sigma, theta = 2000, 32, 2.5, 0.5
  ks = [sim.choose_k(1.0 + rng.normal(scale=sigma, size=(M, d)),
                     sim.KTestConfig(theta=theta, ci_mode="off"), num_workers=M)[0]
        for _ in range(20)]
  predicted = sigma**2 * (1 - theta**2) / theta**2
  assert abs(np.median(ks) - predicted) <= 2.5, ks


def test_test_a_boundary_is_inclusive():
  """Test A is E <= theta^2 ||g||^2 (spec eq. 13), equality included. Two 1-D gradients 3 and
  1: mean 2, s^2 = 2, E = s^2/2 = 1 = 0.5^2 x 2^2 exactly; and all-zero gradients (E = 0 =
  ||g||^2) pass at k_min instead of waiting for k_max."""
  w = sim.Welford(1)
  for g in (3.0, 1.0):
    w.add(np.array([g]))
  res = sim.k_test(w, sim.KTestConfig(theta=0.5, ci_mode="off"))
  assert (res.e_hat, res.grad_sq_norm) == (1.0, 4.0) and res.test_a and res.passed
  k, res = sim.choose_k(np.zeros((6, 5)), sim.KTestConfig(), num_workers=6)
  assert k == 2 and res.passed


def test_k_needs_both_tests_to_pass():
  """The update waits until Test A and Test B pass (spec §2.2 decision rule). 1-D gradients
  3, 1, 2, 2 with theta = 0.9 and ci_mode = lower_abs: Test A passes from n = 2 (E = 1 <=
  0.81 x 4), but the interval's lower end max(2 - t* s/sqrt(n), 0) is 0 at n = 2, 3 (t* =
  12.706, 4.303) and 2 - 3.182 sqrt(1/6) = 0.70 at n = 4, where E = 1/6 <= 0.81 x 0.49."""
  grads = [np.array([v]) for v in (3.0, 1.0, 2.0, 2.0, 2.0, 2.0)]
  k, res = sim.choose_k(grads, sim.KTestConfig(ci_mode="lower_abs"), num_workers=6)
  assert k == 4 and res.test_a and res.test_b
  assert sim.choose_k(grads, sim.KTestConfig(ci_mode="off"), num_workers=6)[0] == 2


def test_k_max_above_the_worker_count_is_capped_at_it():
  """k_max bounds k by the BSP limit M: a preset's k_max = 8 with 4 workers stops at 4 (there
  are never more than M fresh gradients at a version), it does not wait for an 8th."""
  cfg = sim.KTestConfig(theta=0.5, k_max=8)
  assert cfg.resolved_k_max(4) == 4 and cfg.resolved_k_max(16) == 8
  k, res = sim.choose_k(np.random.default_rng(5).normal(size=(4, 1000)), cfg, num_workers=4)
  assert k == 4 and not res.test_a  # zero-mean noise never passes Test A


def test_ktest_config_errors_name_the_argument():
  with pytest.raises(ValueError, match="ci_mode"):
    sim.KTestConfig(ci_mode="upper")
  with pytest.raises(ValueError, match="k_max"):
    sim.KTestConfig(k_min=4, k_max=2)
  with pytest.raises(ValueError, match="confidence"):
    sim.KTestConfig(confidence=1.5)
  with pytest.raises(ValueError, match=r"k_min must be >= 2 .*got 1"):  # (it ran as 2)
    sim.KTestConfig(k_min=1)


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.95, 0.99])
def test_reaverage_horizon_keeps_every_staleness_the_cutoff_keeps(gamma):
  """The re-average slots are pruned past the horizon; it must be the largest tau with
  gamma**tau >= cutoff, the test stale gradients are merged by. floor(log cut / log gamma)
  gave 1 for gamma = 0.9, cut = 0.81 (1.9999999999999998): slot v was pruned before its
  tau = 2 gradients arrived, and they were dropped."""
  for tau in range(1, 12):
    for cut in (gamma ** tau, np.nextafter(gamma ** tau, 1.0), np.nextafter(gamma ** tau, 0.0)):
      s = sim.ksync_preset("working", stale_merge="reaverage", gamma=gamma, stale_cutoff=cut)
      want = max(t for t in range(0, 200) if gamma ** t >= cut)
      assert s._horizon() == want, (tau, cut)


def _replay_ksync_server(received, theta0, gamma, damp, theta_c, conf, k_max, merge):
  """An independent NumPy (float64, scipy t-quantile) server of spec §1.2/§2.2/§2.3/§4, fed the
  messages the simulator's server received, in order: the k of each update, the final θ and
  the broadcast of each update, ``(r = Ê/‖ḡ‖², V̂)`` (``None`` after a one-gradient update)."""
  from scipy import stats
  theta, u = theta0.astype(np.float64).copy(), np.zeros(theta0.shape, np.float64)
  t, fresh, kbuf, slots, ks, bcasts = 0, [], {}, {}, [], []
  scale = (1 - gamma) if damp else 1.0
  for version_then, v, g, a in received:
    assert version_then == t
    g = g.astype(np.float64)
    if v == t:  # fresh: Welford statistics, then Tests A and B (or k_max)
      fresh.append((g, a))
      n = len(fresh)
      done = n >= k_max
      bcast = None
      if n >= 2:
        G = np.stack([x for x, _ in fresh])
        gbar, s2 = G.mean(0), G.var(0, ddof=1)
        e_hat = s2.sum() / n
        mu = gbar + stats.t.ppf(1 - (1 - conf) / 2, n - 1) * np.sqrt(s2 / n)
        done = done or (e_hat <= theta_c ** 2 * gbar @ gbar and e_hat <= theta_c ** 2 * mu @ mu)
        bcast = (e_hat / (gbar @ gbar), s2.sum())
      if done:
        mean = sum(a_ * x for x, a_ in fresh) / n
        u = gamma * u + scale * mean
        theta = theta - u
        kbuf[t], slots[t] = n, (mean, n)
        ks.append(n)
        bcasts.append(bcast)
        t, fresh = t + 1, []
    else:  # stale by tau: merged into the momentum, weighted gamma^(tau-1)
      tau = t - v
      if merge == "additive":
        u = u + gamma ** (tau - 1) * scale * a / kbuf[v] * g
      else:
        mean, cnt = slots[v]
        new = (mean * cnt + a * g) / (cnt + 1)
        u = u + gamma ** (tau - 1) * scale * (new - mean)
        slots[v] = (new, cnt + 1)
  return theta, ks, bcasts


@pytest.mark.parametrize("preset,overrides,workers", [
    ("faithful", {}, 6), ("working", {}, 8), ("working", {"stale_merge": "reaverage"}, 8)])
def test_ksync_server_equals_an_independent_replay_of_its_messages(preset, overrides, workers):
  """Adaptive k end to end: the simulator's k sequence and final θ equal a NumPy server's fed
  the same messages (heterogeneous workers on a 1 Gbit/s link, so gradients arrive stale)."""
  from mfopt import data, models
  strat = sim.ksync_preset(preset, alpha0=0.05, **overrides)
  s = sim.Simulator(strat, model=models.get_model("mlp", hidden=(8,), num_classes=10),
                    dataset=data.load("mnist1d"), num_workers=workers, per_worker_batch=8, seed=1,
                    network="1gbit",
                    compute=sim.ComputeModel(0.01, speed_spread=0.5, jitter_sigma=0.3))
  theta0, received, on_push, bcasts = s.theta.copy(), [], strat.on_push, []

  def spy(sim_, w):
    m = sim_.msg[w]
    version = sim_.version
    received.append((version, m.version, m.grad.copy(), float(m.alpha)))
    on_push(sim_, w)
    if sim_.version > version:  # an update: what the workers' BB steps receive with θ
      bcasts.append((sim_.broadcast.get("r"), sim_.broadcast.get("v_hat")))

  strat.on_push = spy
  s.run(max_server_steps=40)
  c = strat.config
  assert c.stale_cutoff is None or c.stale_cutoff < c.gamma ** 40  # no stale gradient dropped
  theta, ks, want_bcasts = _replay_ksync_server(received, theta0, c.gamma, c.dampening,
                                                c.ktest.theta, c.ktest.confidence, strat.k_max,
                                                c.stale_merge)
  assert ks == [int(k) for _, _, k in s.k_trace]
  # the broadcast r = Ê/‖ḡ‖² and V̂ feed the BB steps (r from V̂ instead of Ê passed every test)
  assert len(bcasts) == len(want_bcasts) and all(b is not None for b in want_bcasts)
  np.testing.assert_allclose(np.array(bcasts, float), np.array(want_bcasts), rtol=2e-4)
  assert len(set(ks)) > 1 and strat.merged > 0  # k adapted, and stale gradients were merged
  np.testing.assert_allclose(s.theta, theta, rtol=0, atol=2e-6)
