"""Per-worker Barzilai-Borwein step with Armijo backtracking (seed 002 Alg. 2, spec §3-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mfopt import data, models, sim
from mfopt.sim import bb as bb_lib
from mfopt.sim.run import COMPUTING


def quad_loss(theta, x, y):
  del y
  return 0.5 * jnp.sum(x * theta ** 2)


def _inputs(theta, theta_prev, g_prev, alpha_prev=0.05, k=1.0, r=0.0, v_hat=0.0, c_a=0.0, has_prev=True):
  f = np.float32
  return bb_lib.BBInputs(jnp.asarray(theta, f), jnp.asarray(theta_prev, f), jnp.asarray(g_prev, f),
                         f(alpha_prev), np.bool_(has_prev), f(k), np.bool_(False), f(r), f(v_hat), f(c_a))


@pytest.mark.parametrize("nu", ["cheap", "exact"])
def test_deterministic_quadratic_full_batch_step_is_one_over_nu(nu):
  rng = np.random.default_rng(0)
  d = 50
  a = rng.uniform(1.0, 1.5, d).astype(np.float32)
  theta_prev = rng.normal(size=d).astype(np.float32)
  theta = (theta_prev - 0.3 * a * theta_prev).astype(np.float32)
  g_prev = (a * theta_prev).astype(np.float32)  # B = N: the gradient is exact
  cfg = sim.BBConfig(alpha0=0.05, nu=nu, clamp=False)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=1))
  out = step(_inputs(theta, theta_prev, g_prev), a, jnp.zeros(()))
  s = theta.astype(np.float64) - theta_prev
  nu_ref = (s @ (a * s)) / (s @ s)
  assert bool(out.bb_applied) and int(out.num_backtracks) == 0 and not bool(out.hit_limit)
  np.testing.assert_allclose(float(out.alpha), 1.0 / nu_ref, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out.grad), a * theta, rtol=1e-6)


def test_smoothing_clamp_and_safeguards():
  rng = np.random.default_rng(1)
  d = 20
  a = rng.uniform(1.0, 2.0, d).astype(np.float32)
  tp = rng.normal(size=d).astype(np.float32)
  th = (tp - 0.1 * a * tp).astype(np.float32)
  gp = a * tp
  s = th.astype(np.float64) - tp
  nu_ref = (s @ (a * s)) / (s @ s)
  # B = k b = 10 < N = 100: w = 0.1, α̃ = (1 - r)/ν, clamped to [1e-6, 10 α0]
  cfg = sim.BBConfig(alpha0=0.01, max_bt=0)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=2, dataset_size=100))
  out = step(_inputs(th, tp, gp, alpha_prev=0.02, k=5.0, r=0.3), a, jnp.zeros(()))
  expected = 0.9 * 0.02 + 0.1 * min(0.7 / nu_ref, 0.1)
  np.testing.assert_allclose(float(out.alpha), expected, rtol=1e-6)
  # r is capped at 1 - eps
  out = step(_inputs(th, tp, gp, alpha_prev=0.02, k=5.0, r=5.0), a, jnp.zeros(()))
  np.testing.assert_allclose(float(out.alpha), 0.9 * 0.02 + 0.1 * max(1e-3 / nu_ref, 1e-6), rtol=1e-5)
  # negative curvature <s, y> <= 0: keep α_prev
  out = step(_inputs(th, tp, -gp, alpha_prev=0.02), -a, jnp.zeros(()))
  assert not bool(out.bb_applied) and float(out.alpha) == np.float32(0.02)
  # ‖s‖² <= 1e-12: keep α_prev
  out = step(_inputs(tp, tp, gp, alpha_prev=0.02), a, jnp.zeros(()))
  assert not bool(out.bb_applied) and float(out.alpha) == np.float32(0.02)


def test_armijo_never_returns_a_violating_step_unless_at_the_limit():
  rng = np.random.default_rng(2)
  d_in, c = 6, 4

  def loss(theta, x, y):
    logits = x @ theta.reshape(d_in, c)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

  n_hit = n_ok = 0
  max_bt = 3
  cfg = sim.BBConfig(alpha0=1.0, max_bt=max_bt)
  step = jax.jit(jax.vmap(bb_lib.make_bb_step(loss, cfg, batch_size=8, dataset_size=1000)))
  B = 128
  theta = rng.normal(scale=2.0, size=(B, d_in * c)).astype(np.float32)
  x = rng.normal(scale=3.0, size=(B, 8, d_in)).astype(np.float32)
  y = rng.integers(0, c, size=(B, 8))
  alpha0 = np.exp(rng.uniform(np.log(1e-3), np.log(1e3), B)).astype(np.float32)
  zeros = np.zeros_like(theta)
  f32 = lambda v: np.full(B, v, np.float32)  # noqa: E731
  inp = bb_lib.BBInputs(theta, zeros, zeros, alpha0, np.zeros(B, bool), f32(1), np.zeros(B, bool),
                        f32(0), f32(0), f32(0))
  out = jax.device_get(step(inp, x, y))
  single = jax.jit(loss)
  for i in range(B):
    alpha, g = float(out.alpha[i]), np.asarray(out.grad[i])
    lhs = float(single(theta[i] - np.float32(alpha) * g, x[i], y[i]))
    rhs = float(out.loss[i]) - 0.1 * alpha * float(g @ g)
    violated = lhs > rhs + 1e-6 * abs(rhs)
    assert alpha == pytest.approx(float(alpha0[i]) * 0.5 ** int(out.num_backtracks[i]), rel=1e-6)
    if bool(out.hit_limit[i]):
      n_hit += 1
      assert int(out.num_backtracks[i]) == max_bt
    else:
      n_ok += 1
      assert not violated, (max_bt, i, lhs, rhs)
  assert n_hit > 0 and n_ok > 0  # both branches were exercised


def test_simulator_counts_backtrack_limit_hits():
  ds = data.load("mnist1d")
  model = models.get_model("mlp", hidden=(), num_classes=10)
  # α_0 = 1e5 cannot be cut to an Armijo step in 10 halvings at first; later the carried α is small
  cfg = sim.KSyncConfig(bb=sim.BBConfig(alpha0=1e5, max_bt=10, clamp=False))
  s = sim.Simulator(sim.KSync(cfg), model=model, dataset=ds, num_workers=4, per_worker_batch=16,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=0.3))
  hits = []
  orig = s._finish_compute

  def spy(w):
    if not s.w_computed[w]:
      s._flush()
    hits.append((s.out[w].hit_limit, s.out[w].num_backtracks))
    orig(w)

  s._finish_compute = spy
  s.run(max_samples=16 * 40)
  r = s.result().summary
  assert r["bb_steps"] == len(hits) == 40
  assert r["bb_hit_limit"] == sum(h for h, _ in hits) > 0
  assert r["bb_backtracks"] == sum(n for _, n in hits)
  assert all(n == 10 for h, n in hits if h)
  assert r["bb_hit_limit"] < len(hits)  # and not every step hit it


def test_bb_config_errors_name_the_argument():
  with pytest.raises(ValueError, match="nu"):
    sim.BBConfig(nu="approx")
  with pytest.raises(ValueError, match="alpha0"):
    sim.BBConfig(alpha0=0.0)
  with pytest.raises(ValueError, match="max_bt"):
    sim.BBConfig(max_bt=-1)


@pytest.mark.parametrize("option,want", [
    ({}, 0.5 * 0.1 + 0.5 * 0.8 / 2.0),
    # nu = (<s, y> - c_a V) / <s, s> = (1.5 - 0.05 x 0.5) / 0.75
    ({"nu_bias_correction": True}, 0.5 * 0.1 + 0.5 * 0.8 / ((1.5 - 0.05 * 0.5) / 0.75)),
    # k grew: alpha_prev doubled before the smoothing
    ({"double_on_k_increase": True}, 0.5 * 0.2 + 0.5 * 0.8 / 2.0),
])
def test_bb_options_by_hand(option, want):
  """The two optional BB rules, by hand (no test ran either; a flipped sign or a missing
  doubling passed). Loss 0.5 x th^2 with x = 2: g = 2 th; th = 1, th_prev = 1.5, g_prev = 3
  (cheap nu): s = -0.5, y = -1 per coordinate, <s, y> = 1.5, <s, s> = 0.75, nu = 2. k b / N =
  4 / 8 = 0.5 weights 1/nu x (1 - r) = 0.8 / nu against alpha_prev = 0.1."""
  cfg = sim.BBConfig(alpha0=0.1, clamp=False, **option)
  step = jax.jit(bb_lib.make_bb_step(lambda th, x, y: 0.5 * jnp.sum(x * th ** 2), cfg,
                                     batch_size=4, dataset_size=8))
  f = np.float32
  inp = bb_lib.BBInputs(theta=jnp.ones(3), theta_prev=jnp.full(3, 1.5), g_prev=jnp.full(3, 3.0),
                        alpha_prev=f(0.1), has_prev=np.bool_(True), k=f(1.0),
                        k_grew=np.bool_(True), r=f(0.2), v_hat=f(0.5), c_a=f(0.05))
  out = step(inp, jnp.full(3, 2.0), None)
  assert bool(out.bb_applied) and int(out.num_backtracks) == 0
  np.testing.assert_allclose(float(out.alpha), want, rtol=1e-6)


@pytest.mark.parametrize("dampening", [False, True])
def test_simulator_bias_correction_uses_the_step_pushed_with_g_prev(dampening):
  """c_a (spec caution 2) is g_prev's coefficient inside s = theta - theta_prev: the server
  summed alpha_pushed x g_prev and divided by k (x (1 - gamma) when dampened). With a floor the
  carried step differs from the pushed one (Armijo cut it below the floor), and c_a built from
  the carried step over-corrected nu. A g_prev that arrived stale was merged into u after the
  version its worker then pulled was built: it is not in s, and c_a is 0 (it was not)."""
  ds = data.load("mnist1d")
  model = models.get_model("mlp", hidden=(), num_classes=10)
  bb = sim.BBConfig(alpha0=50.0, clamp=False, nu_bias_correction=True, alpha_floor_factor=0.5)
  cfg = sim.KSyncConfig(bb=bb, gamma=0.9, dampening=dampening)
  s = sim.Simulator(sim.KSync(cfg), model=model, dataset=ds, num_workers=3, per_worker_batch=16,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=0.3))
  seen, stale = [], np.zeros(3, bool)  # (was worker w's last push stale on arrival?)
  bb_fn, flush, on_push = s._bb, s._flush, s.strategy.on_push

  def spy_push(sim_, w):
    stale[w] = sim_.msg[w].version != sim_.version
    on_push(sim_, w)

  def spy_flush():
    pending = [w for w in range(s.num_workers) if s.w_phase[w] == COMPUTING
               and not s.w_computed[w]]
    pushed = [s.lr_traces[w][-1][1] if s.lr_traces[w] else np.nan for w in pending]

    def spy_bb(inputs, x, y):
      for i, w in enumerate(pending):
        if bool(inputs.has_prev[i]):
          seen.append((float(inputs.c_a[i]), pushed[i], float(inputs.k[i]),
                       float(s.alpha_carry[w]), bool(stale[w])))
      return bb_fn(inputs, x, y)

    s._bb = spy_bb
    try:
      flush()
    finally:
      s._bb = bb_fn

  s._flush, s.strategy.on_push = spy_flush, spy_push
  s.run(max_samples=16 * 30)
  damp = 0.1 if dampening else 1.0
  assert len(seen) >= 20
  for c_a, pushed, k, _, was_stale in seen:
    np.testing.assert_allclose(c_a, 0.0 if was_stale else pushed * damp / max(k, 1.0),
                               rtol=1e-6)
  # the cases that tell them apart happened: the floor lifted the carried step, and a g_prev
  # arrived stale
  assert any(carry > pushed * (1 + 1e-6) for _, pushed, _, carry, _ in seen)
  assert any(was_stale for *_, was_stale in seen)
  # a checkpoint written before alpha_pushed existed restores c_a's old input, the carried step
  d = s.state_dict()
  del d["alpha_pushed"], d["w_push_fresh"]
  s.load_state_dict(d)
  np.testing.assert_array_equal(s.alpha_pushed, s.alpha_carry)
  assert s.w_push_fresh.all()  # (and counted every push as fresh)


def test_bias_correction_is_refused_with_exact_nu():
  """Caution 2's correction removes cheap nu's bias (g_prev inside s); exact nu takes both
  gradients on one batch and has none, so subtracting c_a V_hat there biased it downwards."""
  with pytest.raises(ValueError, match="nu_bias_correction=True corrects cheap"):
    sim.BBConfig(nu="exact", nu_bias_correction=True)
  assert sim.BBConfig(nu="cheap", nu_bias_correction=True).nu_bias_correction


def _quad_inputs(theta, theta_prev, g_prev, alpha_prev, *, k=1.0, r=0.0, has_prev=True,
                 k_grew=False):
  f = np.float32
  return bb_lib.BBInputs(jnp.asarray(theta, f), jnp.asarray(theta_prev, f),
                         jnp.asarray(g_prev, f), f(alpha_prev), np.bool_(has_prev), f(k),
                         np.bool_(k_grew), f(r), f(0.0), f(0.0))


def test_bb_update_is_skipped_on_a_degenerate_pair():
  """Spec §3.1 safeguards: with <s, y> = 0 (the gradient did not change), with ||s||^2 <= 1e-12
  (the worker pulled almost the same version) or with a non-finite <s, y> (an overflowed
  previous gradient), nu is meaningless (0, a tiny-difference quotient, inf) and alpha_prev is
  kept; using it pushed the step to the clamp's 10 alpha_0 or 1e-6 end."""
  cfg = sim.BBConfig(alpha0=0.1, max_bt=0)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  a = jnp.full(3, 2.0)  # L = sum(th^2), g = 2 th
  th = np.array([1.0, -0.5, 0.25], np.float32)
  cases = {
      "y = 0": _quad_inputs(th, th + 0.5, 2 * th, 0.05),  # s != 0, g_prev = g
      "tiny s": _quad_inputs(np.zeros(3), [1e-7, 0, 0], [1.0, 0, 0], 0.05),  # <s,y> = 1e-7
      "inf y": _quad_inputs(th, th - 0.5, [-np.inf, 0, 0], 0.05),  # <s,y> = +inf
  }
  for name, inp in cases.items():
    out = step(inp, a, None)
    assert not bool(out.bb_applied), name
    assert float(out.alpha) == np.float32(0.05), (name, float(out.alpha))
  # and a regular pair does apply it: s = -0.5, y = -1 per coordinate, nu = 2, w = 1/2
  out = step(_quad_inputs(th, th + 0.5, 2 * th + 1.0, 0.05), a, None)
  assert bool(out.bb_applied)
  np.testing.assert_allclose(float(out.alpha), 0.5 * 0.05 + 0.5 * 0.5, rtol=1e-6)


def test_bb_deterministic_case_and_default_clamp():
  """Eq. 26 with B = k b >= N (here B = N exactly): alpha = clip(1/nu) with weight 1 and no
  noise factor (r is ignored), and the default clamp's top is 10 alpha_0. Treating B = N as
  the noisy case scaled the step by 1 - r."""
  a = jnp.full(3, 2.0)
  th = np.ones(3, np.float32)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, sim.BBConfig(alpha0=0.1, max_bt=0),
                                     batch_size=4, dataset_size=8))
  # s = -0.5, y = -1 per coordinate: nu = 2, 1/nu = 0.5 (inside [1e-6, 1])
  out = step(_quad_inputs(th, th + 0.5, 2 * th + 1.0, 0.05, k=2.0, r=0.5), a, None)
  assert bool(out.bb_applied)
  np.testing.assert_allclose(float(out.alpha), 0.5, rtol=1e-6)
  # y = -1e-3: nu = 2e-3, 1/nu = 500 is clamped to 10 alpha_0 = 1
  out = step(_quad_inputs(th, th + 0.5, 2 * th + 1e-3, 0.05, k=2.0, r=0.5), a, None)
  np.testing.assert_allclose(float(out.alpha), 1.0, rtol=1e-6)


def test_armijo_accepts_the_first_step_that_satisfies_it():
  """Backtracking returns the largest alpha_prev rho^j satisfying Armijo (19) with c = 0.1 and
  rho = 1/2 (the defaults). L = 0.5 ||th||^2 at th = 1: L(th - a g) <= L - c a ||g||^2 iff
  (1 - a)^2 <= 1 - 2 c a iff a <= 2 - 2c = 1.8, so 1.7 is accepted at once and 13.6 after 3
  halvings; a stricter test (or a first trial skipped) backtracked further than needed."""
  step = jax.jit(bb_lib.make_bb_step(quad_loss, sim.BBConfig(alpha0=1.0), batch_size=1,
                                     dataset_size=2))
  th = np.ones(3, np.float32)
  for alpha_prev, want, nb in ((1.7, 1.7, 0), (13.6, 1.7, 3), (1.9, 0.95, 1)):
    out = step(_quad_inputs(th, th, th, alpha_prev, has_prev=False), jnp.ones(3), None)
    assert not bool(out.bb_applied) and not bool(out.hit_limit)
    np.testing.assert_allclose(float(out.alpha), want, rtol=1e-6)
    assert int(out.num_backtracks) == nb, alpha_prev


def test_floor_lifts_the_carried_step_by_alpha0():
  """The optional floor is alpha_floor_factor x alpha_0 and applies to the step carried to the
  next step only: the pushed step stays the Armijo-accepted one (here 1.0, from 8 after 3
  halvings on L = 0.5 ||th||^2, accepted for a <= 1.8) and the carried one is 0.5 x 4 = 2."""
  cfg = sim.BBConfig(alpha0=4.0, alpha_floor_factor=0.5)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  th = np.ones(3, np.float32)
  out = step(_quad_inputs(th, th, th, 8.0, has_prev=False), jnp.ones(3), None)
  np.testing.assert_allclose([float(out.alpha), float(out.alpha_carry)], [1.0, 2.0], rtol=1e-6)


def test_doubling_on_k_increase_needs_a_previous_step():
  """double_on_k_increase (ensmallen's reset rule) doubles alpha_prev when k grew since the
  worker's previous pull; on a worker's first step there is no previous step and alpha_0 is
  used as it is (the first pull sees k grow from nothing)."""
  cfg = sim.BBConfig(alpha0=0.5, double_on_k_increase=True, max_bt=0)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  th = np.ones(3, np.float32)
  first = step(_quad_inputs(th, th, th, 0.5, has_prev=False, k_grew=True), jnp.ones(3), None)
  # with a previous pull of the same version (s = 0: no BB update) the doubling applies
  later = step(_quad_inputs(th, th, th, 0.5, has_prev=True, k_grew=True), jnp.ones(3), None)
  assert not bool(first.bb_applied) and not bool(later.bb_applied)
  np.testing.assert_allclose([float(first.alpha), float(later.alpha)], [0.5, 1.0], rtol=1e-6)


def test_bb_update_skips_a_step_whose_squared_length_equals_min_step_sq():
  """Spec §3.1 skips the BB update when ||s||^2 <= min_step_sq, so a step exactly at the
  threshold (0.25 here, exact in binary) keeps alpha_prev and only a longer one applies eq. 26;
  a '>=' test let the boundary step through."""
  cfg = sim.BBConfig(alpha0=0.1, max_bt=0, min_step_sq=0.25)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  a = jnp.full(3, 2.0)  # g = 2 th
  th = np.array([1.0, -0.5, 0.25], np.float32)
  # s = (-0.5, 0, 0): ||s||^2 = 0.25; y = (-1, 0, 0): <s, y> = 0.5 > 0
  at = step(_quad_inputs(th, th + [0.5, 0, 0], 2 * th + [1.0, 0, 0], 0.05), a, None)
  assert not bool(at.bb_applied) and float(at.alpha) == np.float32(0.05)
  # s = (-0.5, -0.5, 0): ||s||^2 = 0.5, <s, y> = 1, nu = 2; w = 1/2: 0.5 x 0.05 + 0.5 x 0.5
  past = step(_quad_inputs(th, th + [0.5, 0.5, 0], 2 * th + [1.0, 1.0, 0], 0.05), a, None)
  assert bool(past.bb_applied)
  np.testing.assert_allclose(float(past.alpha), 0.5 * 0.05 + 0.5 * 0.5, rtol=1e-6)


def test_a_bb_step_with_b_above_n_is_the_clipped_pure_step():
  """Eq. 26 with B = k b > N: the weight is min(1, B/N) = 1, so alpha = clip(1/nu, 1e-6,
  10 alpha_0) whatever alpha_prev was (a weight B/N = 1.5 extrapolated past 1/nu); and the
  default clamp's lower end 1e-6 lifts a very sharp curvature's 1/nu = 1.25e-7 to it (without
  it the step collapsed towards 0)."""
  step = jax.jit(bb_lib.make_bb_step(quad_loss, sim.BBConfig(alpha0=0.1, max_bt=0),
                                     batch_size=4, dataset_size=8))
  th = np.ones(3, np.float32)
  a = jnp.full(3, 2.0)  # g = 2 th
  # s = -0.5 per coordinate; y = -1 gives nu = 2, y = -4e6 gives nu = 8e6; B = 3 x 4 = 12 > 8
  for y, want in ((1.0, 0.5), (4e6, 1e-6)):
    out = step(_quad_inputs(th, th + 0.5, 2 * th + y, 0.05, k=3.0, r=0.5), a, None)
    assert bool(out.bb_applied)
    np.testing.assert_allclose(float(out.alpha), want, rtol=1e-6)


def test_alpha_min_may_be_zero_but_not_negative():
  """The clamp's lower end is documented '>= 0': 0 (no floor beyond positivity) is a valid
  setting and must not be refused, while a negative minimum is refused by name."""
  assert sim.BBConfig(alpha_min=0.0).alpha_min == 0.0
  with pytest.raises(ValueError, match="alpha_min"):
    sim.BBConfig(alpha_min=-1e-6)


def test_armijo_accepts_a_step_that_meets_the_bound_with_equality():
  """Eq. 19 accepts alpha when L(th - alpha g) <= L(th) - c alpha ||g||^2, equality included.
  L = 0.5 ||th||^2 at th = 1 (3 coordinates), c = 1/4, alpha = 1.5: both sides are 0.375 exactly
  in binary, so the step is taken at once; a strict '<' halved it to 0.75."""
  cfg = sim.BBConfig(alpha0=1.0, armijo_c=0.25)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  th = np.ones(3, np.float32)
  out = step(_quad_inputs(th, th, th, 1.5, has_prev=False), jnp.ones(3), None)
  assert 0.5 * 3 * (1 - 1.5) ** 2 == 1.5 - 0.25 * 1.5 * 3 == 0.375
  assert int(out.num_backtracks) == 0 and not bool(out.hit_limit)
  assert float(out.alpha) == 1.5


def test_hit_limit_is_false_when_the_last_allowed_backtrack_satisfies_armijo():
  """hit_limit means 'max_bt backtracks and Armijo still violated'. On L = 0.5 ||th||^2 at th = 1
  (accepted iff alpha <= 1.8) 13.6 needs exactly 3 halvings (1.7): with max_bt = 3 that step is
  accepted and must not be counted as a limit hit, while 27.2 stops at 3.4 and is one."""
  cfg = sim.BBConfig(alpha0=1.0, max_bt=3)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=1, dataset_size=2))
  th = np.ones(3, np.float32)
  for alpha_prev, want, hit in ((13.6, 1.7, False), (27.2, 3.4, True)):
    out = step(_quad_inputs(th, th, th, alpha_prev, has_prev=False), jnp.ones(3), None)
    assert int(out.num_backtracks) == 3
    np.testing.assert_allclose(float(out.alpha), want, rtol=1e-6)
    assert bool(out.hit_limit) == hit, alpha_prev


def test_a_clamp_whose_ends_coincide_is_accepted_and_pins_the_step():
  """alpha_min equal to alpha_max_factor x alpha_0 is a legitimate (fixed-step) clamp, only a
  minimum *above* the maximum is contradictory: it is accepted, and every BB step is clipped
  to that one value (here 1.0 = 2 x 0.5, whatever 1/nu is)."""
  cfg = sim.BBConfig(alpha0=0.5, alpha_max_factor=2.0, alpha_min=1.0, max_bt=0)
  step = jax.jit(bb_lib.make_bb_step(quad_loss, cfg, batch_size=2, dataset_size=2))
  th = np.ones(3, np.float32)
  for y in (1.0, 1e-3, 1e3):  # nu = 2 y: 1/nu from 5e-4 to 500
    out = step(_quad_inputs(th, th + 0.5, 2 * th + y, 0.05), jnp.full(3, 2.0), None)
    assert bool(out.bb_applied) and float(out.alpha) == 1.0, y
