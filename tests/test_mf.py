"""Seed 000 MF optimizers against optax and against NumPy implementations written from the paper.

Every trajectory comparison runs one jitted, vmapped ``lax.scan`` over a whole grid of
(learning rate, MF) pairs: the hyperparameters are traced arguments, so a grid costs one
compilation per (optimizer pair, problem), not one per grid point.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import mfopt
from _steps import run_linear_field  # tests/ is on sys.path
from mfopt import mf as mf_lib

T = 50
MFS = (0.0, 0.5, 0.9, 0.99)
DIM = 10


# ----------------------------------------------------------------------------- problems


def _quadratic():
  """Random SPD quadratic 0.5 x'Ax - b'x (eigenvalues in [0.1, 1]) plus fixed per-step noise."""
  rng = np.random.default_rng(0)
  q, _ = np.linalg.qr(rng.normal(size=(DIM, DIM)))
  a = (q * np.linspace(0.1, 1.0, DIM)) @ q.T
  b = rng.normal(size=DIM)
  noise = 0.1 * rng.normal(size=(T, DIM))
  x0 = rng.normal(size=DIM)
  return a, b, noise, x0


A, B, NOISE, X0 = _quadratic()


def quad_grad_np(x, t):
  return A @ x - B + NOISE[t]


def quad_grad(x, t):
  return {"x": jnp.asarray(A, jnp.float32) @ x["x"] - jnp.asarray(B, jnp.float32)
          + jnp.asarray(NOISE, jnp.float32)[t]}


def _mlp_problem():
  rng = np.random.default_rng(1)
  xs = rng.normal(size=(T, 16, 8)).astype(np.float32)
  ys = rng.integers(0, 3, size=(T, 16))
  params = {"w1": rng.normal(size=(8, 16)).astype(np.float32) / np.sqrt(8),
            "b1": np.zeros(16, np.float32),
            "w2": rng.normal(size=(16, 3)).astype(np.float32) / 4,
            "b2": np.zeros(3, np.float32)}
  return jnp.asarray(xs), jnp.asarray(ys), jax.tree.map(jnp.asarray, params)


MLP_X, MLP_Y, MLP_INIT = _mlp_problem()


def mlp_grad(p, t):
  def loss(p):
    h = jnp.tanh(MLP_X[t] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, MLP_Y[t]).mean()
  return jax.grad(loss)(p)


PROBLEMS = {
    "quadratic": (quad_grad, {"x": jnp.asarray(X0, jnp.float32)}),
    "mlp": (mlp_grad, MLP_INIT),
}


def _trajectory(make_tx, grad_fn, init):
  """jit(vmap(lr, mf -> params after every step)) for one optimizer factory."""
  def run(lr, mf):
    tx = make_tx(lr, mf)

    def body(carry, t):
      p, s = carry
      u, s = tx.update(grad_fn(p, t), s, p)
      p = optax.apply_updates(p, u)
      return (p, s), p

    _, traj = lax.scan(body, (init, tx.init(init)), jnp.arange(T))
    return traj
  return jax.jit(jax.vmap(run))


def _grid(lrs):
  lr, mf = np.meshgrid(np.asarray(lrs, np.float32), np.asarray(MFS, np.float32), indexing="ij")
  return jnp.asarray(lr.ravel()), jnp.asarray(mf.ravel())


PAIRS = {
    # name: (ours, reference, learning rates, atol). The SGD forms differ only by float32
    # reassociation (lr*(mf*t + g) vs mf*(lr*t) + lr*g): each is 3-4e-6 from a float64 run of
    # the same steps on the MLP (optax's own float32 error), and JAX 0.11 put them 2.6e-6 apart
    # (0.10: 1.9e-6), so 5e-6 (2e-6 failed there). Adam at lr=0.1 on the MLP amplifies
    # last-bit differences of XLA's fusion (seen: 3.5e-6 on weights of size ~0.1) -> 1e-5.
    "mf_sgd == optax.sgd(momentum)": (
        lambda lr, m: mfopt.mf_sgd(lr, mf=m), lambda lr, m: optax.sgd(lr, momentum=m),
        (0.01, 0.05, 0.2), 5e-6),
    "mf_nesterov == optax.sgd(nesterov)": (
        lambda lr, m: mfopt.mf_nesterov(lr, mf=m),
        lambda lr, m: optax.sgd(lr, momentum=m, nesterov=True), (0.01, 0.05, 0.2), 5e-6),
    "mf_adam(phi=adam) == optax.adam": (
        lambda lr, m: mfopt.mf_adam(lr, mf1=m, mf2=0.999, eps=1e-8),
        lambda lr, m: optax.adam(lr, b1=m, b2=0.999, eps=1e-8), (1e-3, 1e-2, 1e-1), 1e-5),
}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_equals_optax_at_constant_lr(pair, problem):
  ours, ref, lrs, atol = PAIRS[pair]
  grad_fn, init = PROBLEMS[problem]
  lr, mf = _grid(lrs)
  got = _trajectory(ours, grad_fn, init)(lr, mf)
  want = _trajectory(ref, grad_fn, init)(lr, mf)
  moved = 0.0
  for k in got:
    g, w = np.asarray(got[k]), np.asarray(want[k])
    assert np.all(np.isfinite(w)), k
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=atol, err_msg=f"{pair} {problem} {k}")
    moved = max(moved, float(np.abs(w[:, -1] - np.asarray(init[k])).max()))
  assert moved > 0.05  # the trajectories went somewhere: equality is not trivially of zeros


# ----------------------------------------------------------------------------- NumPy references


def np_algorithm1(lrs, mfs, x0, grad, nesterov=False):
  """Algorithm 1 of seed 000 as printed: v = MF v + lr_t g; theta -= v (float64)."""
  x, v, out = np.array(x0, np.float64), np.zeros_like(x0, dtype=np.float64), []
  for t in range(len(lrs)):
    g = grad(x, t)
    v = mfs[t] * v + lrs[t] * g
    x = x - (mfs[t] * v + lrs[t] * g if nesterov else v)
    out.append(x.copy())
  return np.array(out)


def np_optax_momentum(lrs, mf, x0, grad):
  """optax.sgd(schedule, momentum): t = mf t + g; theta -= lr_t t (float64)."""
  x, tr, out = np.array(x0, np.float64), np.zeros_like(x0, dtype=np.float64), []
  for t in range(len(lrs)):
    tr = mf * tr + grad(x, t)
    x = x - lrs[t] * tr
    out.append(x.copy())
  return np.array(out)


def np_algorithm2(lr, mf1s, mf2, eps, x0, grad, phi):
  """Algorithm 2 of seed 000 (float64): printed phi, or Adam with exact bias correction."""
  x = np.array(x0, np.float64)
  m, v, prod, out = np.zeros_like(x), np.zeros_like(x), 1.0, []
  for t in range(len(mf1s)):
    g = grad(x, t)
    b1 = mf1s[t]
    m = b1 * m + (1 - b1) * g
    v = mf2 * v + (1 - mf2) * g**2
    prod *= b1
    if phi == "paper":
      step = m * np.sqrt(1 - mf2) / ((np.sqrt(v) + eps) * (1 - b1))
    else:
      step = (m / (1 - prod)) / (np.sqrt(v / (1 - mf2 ** (t + 1))) + eps)
    x = x - lr * step
    out.append(x.copy())
  return np.array(out)


DECAY = 0.93  # lr_t = lr0 * DECAY**t


@pytest.fixture(scope="module")
def decayed_runs():
  """mf_sgd and optax.sgd under the same exponential decay, over the MF grid (one compile each)."""
  sched = optax.exponential_decay(0.2, transition_steps=1, decay_rate=DECAY)
  grad_fn, init = PROBLEMS["quadratic"]
  lr, mf = _grid((0.2,))
  ours = _trajectory(lambda _, m: mfopt.mf_sgd(sched, mf=m), grad_fn, init)(lr, mf)["x"]
  ref = _trajectory(lambda _, m: optax.sgd(sched, momentum=m), grad_fn, init)(lr, mf)["x"]
  return np.asarray(ours), np.asarray(ref), np.asarray(mf)


def test_mf_sgd_under_decay_matches_numpy_algorithm1(decayed_runs):
  ours, _, mfs = decayed_runs
  lrs = 0.2 * DECAY ** np.arange(T)
  for i, m in enumerate(mfs):
    want = np_algorithm1(lrs, np.full(T, float(m)), X0, quad_grad_np)
    np.testing.assert_allclose(ours[i], want, rtol=1e-5, atol=1e-5, err_msg=f"mf={m}")


def test_mf_sgd_differs_from_optax_under_decay_by_predicted_amount(decayed_runs):
  ours, ref, mfs = decayed_runs
  lrs = 0.2 * DECAY ** np.arange(T)
  for i, m in enumerate(mfs):
    predicted = (np_algorithm1(lrs, np.full(T, float(m)), X0, quad_grad_np)
                 - np_optax_momentum(lrs, float(m), X0, quad_grad_np))
    measured = ours[i] - ref[i]
    np.testing.assert_allclose(measured, predicted, atol=2e-5, err_msg=f"mf={m}")
    if m == 0:
      assert np.abs(predicted).max() == 0.0  # plain SGD: the two forms coincide
    else:
      # A real difference, far above the float32 tolerance used above.
      assert np.abs(predicted).max() > 0.02, (m, np.abs(predicted).max())


def test_mf_sgd_and_nesterov_with_mf_schedule_match_numpy():
  mf_sched = optax.linear_schedule(0.5, 0.95, transition_steps=T)
  mfs = np.array([float(mf_sched(t)) for t in range(T)])
  grad_fn, init = PROBLEMS["quadratic"]
  run = _trajectory(lambda lr, _: mfopt.mf_sgd(lr, mf=mf_sched), grad_fn, init)
  run_n = _trajectory(lambda lr, _: mfopt.mf_nesterov(lr, mf=mf_sched), grad_fn, init)
  lr = jnp.asarray([0.05], jnp.float32)
  np.testing.assert_allclose(np.asarray(run(lr, lr)["x"][0]),
                             np_algorithm1(np.full(T, 0.05), mfs, X0, quad_grad_np),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(run_n(lr, lr)["x"][0]),
                             np_algorithm1(np.full(T, 0.05), mfs, X0, quad_grad_np, nesterov=True),
                             rtol=1e-5, atol=1e-5)


def test_mf_adam_paper_phi_matches_numpy_printed_phi():
  grad_fn, init = PROBLEMS["quadratic"]
  lr, mf = _grid((1e-3, 1e-2))
  got = np.asarray(_trajectory(lambda l, m: mfopt.mf_adam(l, mf1=m, phi="paper"),
                               grad_fn, init)(lr, mf)["x"])
  for i in range(len(lr)):
    want = np_algorithm2(float(lr[i]), np.full(T, float(mf[i])), 0.999, 1e-8, X0,
                         quad_grad_np, "paper")
    np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-5,
                               err_msg=f"lr={lr[i]} mf1={mf[i]}")
  # The printed phi is not Adam: at mf1=0.9 its trajectory differs from optax.adam's.
  adam = np_algorithm2(1e-2, np.full(T, 0.9), 0.999, 1e-8, X0, quad_grad_np, "adam")
  paper = np_algorithm2(1e-2, np.full(T, 0.9), 0.999, 1e-8, X0, quad_grad_np, "paper")
  assert np.abs(adam - paper).max() > 1e-2


def test_mf_adam_with_increasing_mf1_schedule_matches_numpy():
  sched = optax.linear_schedule(0.8, 0.99, transition_steps=T)
  mfs = np.array([float(sched(t)) for t in range(T)])
  grad_fn, init = PROBLEMS["quadratic"]
  lr = jnp.asarray([0.01], jnp.float32)
  for phi in ("adam", "paper"):
    got = _trajectory(lambda l, _: mfopt.mf_adam(l, mf1=sched, phi=phi), grad_fn, init)(lr, lr)
    want = np_algorithm2(0.01, mfs, 0.999, 1e-8, X0, quad_grad_np, phi)
    np.testing.assert_allclose(np.asarray(got["x"][0]), want, rtol=1e-4, atol=1e-5, err_msg=phi)


def test_mf_adam_with_an_mf1_schedule_through_inject_hyperparams_equals_the_direct_schedule():
  """Injected, MF1 arrives as this step's value only; the bias correction must still be the
  product of the values so far (it was 1 - MF1_t**t: off by 2e-2 after 60 steps)."""
  sched = optax.linear_schedule(0.5, 0.99, 50)
  direct, _ = run_linear_field(mfopt.mf_adam(0.05, sched))
  injected, _ = run_linear_field(
      optax.inject_hyperparams(mfopt.mf_adam)(learning_rate=0.05, mf1=sched))
  np.testing.assert_allclose(injected, direct, rtol=0, atol=1e-5)  # (float32 rounding)
  # constant gradient, MF2 = 0: every bias-corrected Adam step is exactly -lr
  tx = optax.inject_hyperparams(mfopt.mf_adam)(learning_rate=1.0, mf1=sched, mf2=0.0)
  s = tx.init(jnp.zeros(1))
  for _ in range(3):
    u, s = tx.update(jnp.ones(1), s)
    np.testing.assert_allclose(np.asarray(u), [-1.0], rtol=1e-6)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("build,match", [
    (lambda: mfopt.mf_sgd(0.1, mf=1.0), r"mf must be in \[0, 1\), got 1.0"),
    (lambda: mfopt.mf_sgd(0.1, mf=-0.1), r"mf must be in \[0, 1\), got -0.1"),
    (lambda: mfopt.mf_nesterov(0.1, mf=1.5), r"mf must be in \[0, 1\), got 1.5"),
    (lambda: mfopt.mf_sgd(-0.1, mf=0.9), r"learning_rate must be finite and >= 0, got -0.1"),
    (lambda: mfopt.mf_adam(-1e-3), r"learning_rate must be finite and >= 0, got -0.001"),
    (lambda: mfopt.mf_adam(1e-3, mf1=1.0), r"mf1 must be in \[0, 1\), got 1.0"),
    (lambda: mfopt.mf_adam(1e-3, mf2=1.0), r"mf2 must be in \[0, 1\), got 1.0"),
    (lambda: mfopt.mf_adam(1e-3, eps=0.0), r"eps must be a positive number, got 0.0"),
    (lambda: mfopt.mf_adam(1e-3, eps="1e-8"), r"eps must be a positive number, got '1e-8'"),
    (lambda: mfopt.mf_adam(1e-3, eps=float("inf")),
     r"eps must be a positive number, got inf \(it must be finite\)"),
    (lambda: mfopt.adabound(1e-3, final_lr=float("inf")),
     r"final_lr must be a non-negative number, got inf \(it must be finite\)"),
    (lambda: mfopt.linear_scaling_adabound(base_lr=float("inf"), num_workers=4,
                                           steps_per_epoch=10),
     r"base_lr must be a positive number, got inf"),
    (lambda: mfopt.hybrid_lars_learning_rate(num_workers=0, steps_per_epoch=10),
     r"num_workers must be a positive integer, got 0"),
    (lambda: mfopt.linear_scaling_bounds(1, base_lr=-0.1, num_workers=4, warmup_epochs=1),
     r"base_lr must be a positive number, got -0.1"),
    (lambda: mfopt.mf_adam(1e-3, phi="adamw"), r"phi must be one of .*'adamw'"),
    (lambda: mfopt.mf_adam(1e-3, mf1=optax.linear_schedule(0.99, 0.9, 10), validate_steps=20),
     r"mf1 must not decrease .* at step 0 then"),
    (lambda: mfopt.mf_sgd(0.1, mf=optax.linear_schedule(0.9, 1.0, 10), validate_steps=20),
     r"mf must be in \[0, 1\), got 1.0 at step 10"),
    (lambda: mfopt.mf_sgd(optax.linear_schedule(0.1, -0.1, 10), validate_steps=20),
     r"learning_rate must be finite and >= 0, got -0.0\d* at step 6"),
    (lambda: mfopt.mf_sgd(0.1, mf=optax.constant_schedule(0.9), validate_steps=0),
     r"validate_steps must be a positive integer, got 0"),
])
def test_bad_arguments_raise_at_construction(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_validate_steps_evaluates_a_schedule_once_on_all_steps_and_per_step_otherwise():
  """A vectorisable schedule is called once on arange(T) (one call per step took 15 s for a
  20k-step run's lr and MF); one written for a scalar step is still checked step by step."""
  shapes = []

  def mf(t):
    shapes.append(np.shape(t))
    return optax.linear_schedule(0.9, 0.999, 500)(t)

  mfopt.mf_sgd(0.1, mf=mf, validate_steps=400)
  assert shapes == [(400,)]
  shapes.clear()  # built inside jit around a traced value: nothing is concrete, one call
  jax.jit(lambda m: mfopt.mf_sgd(0.1, mf=lambda t: mf(t) * m, validate_steps=400)
          .init(jnp.zeros(1)))(jnp.float32(1.0))
  assert shapes == [(400,)]
  scalar_only = lambda t: 0.9 if int(t) < 7 else 1.5  # (int() of a vector raises)
  with pytest.raises(ValueError, match=r"mf must be in \[0, 1\), got 1.5 at step 7"):
    mfopt.mf_sgd(0.1, mf=scalar_only, validate_steps=10)
  # a schedule that ignores its step (optax.constant_schedule returns a 0-d array for a vector
  # of steps) is checked step by step, each step named
  with pytest.raises(ValueError, match=r"mf must be in \[0, 1\), got 1.5 at step 0"):
    mfopt.mf_sgd(0.1, mf=optax.constant_schedule(1.5), validate_steps=10)
  mfopt.mf_sgd(0.1, mf=optax.constant_schedule(0.5), validate_steps=10)
  with jax.enable_x64(True):  # values read at their own precision (a float64 MF just below 1
    # is in [0, 1); rounded to float32 it was 1.0), as the step-by-step path reads them
    below_one = lambda t: jnp.full(jnp.shape(t), 1 - 1e-12, jnp.float64)  # noqa: E731
    assert mfopt.mf._values(below_one, 3, "mf") == [1 - 1e-12] * 3
    mfopt.mf_sgd(0.1, mf=below_one, validate_steps=3)


def test_injected_mf1_under_x64_keeps_a_float64_bias_correction():
  """An injected or scheduled MF1 divides by 1 - prod(MF1_s), whose product was kept in
  float32 even for float64 parameters: 2.5e-9 off optax.adam, whose correction is float64."""
  with jax.enable_x64(True):
    rng = np.random.RandomState(0)
    params = jnp.asarray(rng.randn(5))
    tx = optax.inject_hyperparams(mfopt.mf_adam)(learning_rate=0.01, mf1=0.9)
    ref = optax.adam(0.01, b1=0.9)
    s, r = tx.init(params), ref.init(params)
    assert s.inner_state[0].mf1_product.dtype == jnp.float64
    for _ in range(20):
      g = jnp.asarray(rng.randn(5))
      (u, s), (v, r) = tx.update(g, s), ref.update(g, r)
      np.testing.assert_allclose(u, v, rtol=0, atol=1e-14)
  # float32 parameters keep the float32 product (and optax's own float32 rounding)
  assert mfopt.mf_adam(0.01).init(jnp.zeros(2, jnp.bfloat16))[0].mf1_product.dtype == jnp.float32


def test_valid_schedules_pass_validation_and_ranges_unchecked_by_default():
  mfopt.mf_adam(1e-3, mf1=optax.linear_schedule(0.9, 0.99, 10), validate_steps=20)
  # A decreasing mf is legal for first order, and ranges are not evaluated unless asked.
  mfopt.mf_sgd(0.1, mf=optax.linear_schedule(0.99, 0.9, 10), validate_steps=20)
  mfopt.mf_sgd(0.1, mf=optax.linear_schedule(0.9, 1.0, 10))  # reaches 1.0 only at step 10


def test_second_order_mf1_schedule_is_checked_for_2b_without_validate_steps():
  """SPEC: "MF does not decrease" is checked for the second-order optimizer. A decreasing mf1
  schedule built without validate_steps was accepted; it is now evaluated on steps
  0..DEFAULT_MF1_CHECK_STEPS-1 in one vectorised call (validate_steps=T sets the window)."""
  n = mfopt.mf.DEFAULT_MF1_CHECK_STEPS
  assert n == 10_000
  with pytest.raises(ValueError, match=r"mf1 must not decrease .* got mf1=0\.99\d* at step 0 "
                                       r"then 0\.9799\d* at step 1 \(checked on steps 0\.\.9999;"):
    mfopt.mf_adam(1e-3, mf1=optax.linear_schedule(0.99, 0.9, 9))
  late = lambda t: jnp.where(t < n + 5, 0.9, 0.5)  # noqa: E731  (drops after the window)
  early = lambda t: jnp.where(t < 4321, 0.9, 0.5)  # noqa: E731
  with pytest.raises(ValueError, match=r"at step 4320 then 0\.5 at step 4321"):
    mfopt.scale_by_mf_adam(mf1=early)
  mfopt.mf_adam(1e-3, mf1=late)
  with pytest.raises(ValueError, match=rf"at step {n + 4} then 0\.5"):
    mfopt.mf_adam(1e-3, mf1=late, validate_steps=n + 6)
  # increasing schedules pass, a float32 cosine one included (rounding is not a decrease)
  mfopt.mf_adam(1e-3, mf1=optax.linear_schedule(0.9, 0.99, 1000))
  mfopt.mf_adam(1e-3, mf1=lambda t: 0.99 - 0.09 * optax.cosine_decay_schedule(1.0, n)(t))
  # a schedule that cannot take a vector of steps is not evaluated (documented)
  mfopt.mf_adam(1e-3, mf1=lambda t: 0.9 if t < 5 else 0.8)


def test_default_mf1_check_tolerates_float32_rounding_and_defers_to_validate_steps():
  """Mathematically increasing mf1 schedules whose float32 values dip by an ulp are accepted (a
  check without the rounding allowance refused them), a schedule that returns one number for
  any step is left unchecked, and validate_steps=T replaces the default window, so a drop
  after step T (after the run) is accepted."""
  n = mfopt.mf.DEFAULT_MF1_CHECK_STEPS
  lerp = lambda t: 0.9 * (1 - t / n) + 0.9001 * (t / n)  # noqa: E731  (+1e-8 per step)
  exact = lerp(np.arange(n, dtype=np.float64))
  assert np.all(np.diff(exact) > 0)  # increasing in exact arithmetic
  dips = np.diff(np.asarray(lerp(jnp.arange(n, dtype=jnp.int32)), np.float64))
  assert dips.min() < 0 and dips.min() > -4 * np.finfo(np.float32).eps  # float32 rounding only
  mfopt.mf_adam(1e-3, mf1=lerp)
  mfopt.mf_adam(1e-3, mf1=lambda t: 0.9)  # noqa: E731  (a scalar for a vector of steps)
  drop_at_30 = lambda t: jnp.where(t < 30, 0.9, 0.5)  # noqa: E731
  mfopt.mf_adam(1e-3, mf1=drop_at_30, validate_steps=20)
  with pytest.raises(ValueError, match=r"at step 29 then 0\.5 at step 30"):
    mfopt.mf_adam(1e-3, mf1=drop_at_30, validate_steps=31)


# ----------------------------------------------------------------------------- formulas


def _seed_table1():
  """Table 1 parsed from the seed text when it is present (it is outside the repository)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  for path in (root.parent / "shared" / "seeds", root / "seeds"):
    files = sorted(path.glob("000_*.txt")) if path.exists() else []
    if files:
      text = files[0].read_text()
      block = text[text.index("**Table 1**"):text.index("**Table 1**") + 400]
      pairs = re.findall(r"(\d+)\s+(0\.\d+)", block)
      return {int(b): float(lr) for b, lr in pairs}
  return None


# Table 1 of seed 000 (§4.1.2), transcribed.
TABLE1 = {32: 0.0125, 64: 0.025, 128: 0.05, 256: 0.1, 512: 0.2, 1024: 0.4, 2048: 0.8}


def test_linear_scaling_rule_reproduces_table1_exactly():
  parsed = _seed_table1()
  if parsed is not None:
    assert parsed == TABLE1  # the transcription is the seed's table
  rule = mfopt.linear_scaling_rule(0.05, 128)
  for batch, lr in TABLE1.items():
    assert rule(batch) == lr, (batch, rule(batch), lr)  # exact equality, not allclose
  assert mf_lib.PAPER_TABLE1 == TABLE1
  assert mfopt.linear_scaling_rule(0.1, 256)(96) == 0.0375
  with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
    rule(0)
  with pytest.raises(ValueError, match="base_lr must be a finite number > 0, got -0.05"):
    mfopt.linear_scaling_rule(-0.05, 128)


@pytest.mark.parametrize("lr,n,m,mom", [(0.05, 50_000, 128, 0.0), (0.4, 50_000, 1024, 0.9),
                                        (0.0125, 4000, 32, 0.99), (1.0, 10, 10, 0.5)])
def test_noise_scale_is_eq2(lr, n, m, mom):
  assert mfopt.noise_scale(lr, n, m, mom) == pytest.approx(lr / (1 - mom) * (n / m - 1), rel=1e-15)
  # eq. (1) is the m = 0 case, and g(m) / g(0) = 1 / (1 - m)
  assert mfopt.noise_scale(lr, n, m, mom) * (1 - mom) == pytest.approx(mfopt.noise_scale(lr, n, m))


def test_noise_scale_under_linear_scaling_depends_on_momentum_only_for_small_batches():
  rule = mfopt.linear_scaling_rule(0.05, 128)
  n = 10**9
  g = [mfopt.noise_scale(rule(m), n, m, 0.9) for m in TABLE1]
  assert max(g) / min(g) == pytest.approx(1.0, abs=1e-5)
  assert mfopt.noise_scale(rule(128), n, 128, 0.99) / g[2] == pytest.approx(10.0, rel=1e-4)
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.0"):
    mfopt.noise_scale(0.1, 100, 10, 1.0)
  with pytest.raises(ValueError, match="batch_size must be <= dataset_size=100, got 200"):
    mfopt.noise_scale(0.1, 100, 200)


def test_check_mf_conditions_agrees_with_direct_evaluation_of_2a_on_a_grid():
  for mf in (0.0, 0.5, 0.9, 0.99, 0.999, 1.0, 1.2):
    for lr in (1e-3, 0.05, 1.0, 10.0, 200.0):
      for T_ in (1, 10, 100, 1000):
        lhs = T_ if mf == 1.0 else (1 - mf**T_) / (1 - mf)  # the printed ratio
        direct = lhs < T_ / lr and mf < 1
        report = mfopt.check_mf_conditions(mf, lr, T_)
        assert bool(report) == direct, (mf, lr, T_, str(report))
  # (2b): MF < 1 and non-decreasing, on constants, sequences and schedules.
  assert mfopt.check_mf_conditions(0.9, 1e-3, 10, second_order=True)
  assert not mfopt.check_mf_conditions(1.0, 1e-3, 10, second_order=True)
  assert mfopt.check_mf_conditions([0.9, 0.95, 0.95, 0.99], 1e-3, 4, second_order=True)
  bad = mfopt.check_mf_conditions([0.9, 0.95, 0.93, 0.99], 1e-3, 4, second_order=True)
  assert not bad
  assert "decreases at step 2: 0.95 -> 0.93" in str(bad)
  assert mfopt.check_mf_conditions(optax.linear_schedule(0.9, 0.99, 50), 1e-3, 60,
                                   second_order=True)


def test_check_mf_conditions_takes_per_step_values_as_a_jax_array():
  mfs = np.linspace(0.5, 0.9, 10)
  want = mfopt.check_mf_conditions(mfs, 1e-3, 10, second_order=True)
  got = mfopt.check_mf_conditions(jnp.asarray(mfs), 1e-3, 10, second_order=True)
  assert [c.holds for c in got.conditions] == [c.holds for c in want.conditions]
  assert bool(got) == bool(want) and len(got.conditions) > 1  # (it raised TypeError)
  # a 0-d array is a constant, as mf_sgd takes it (it was read as a sequence of 1 value)
  want = str(mfopt.check_mf_conditions(0.9, 0.05, 100))
  for scalar in (jnp.float32(0.9), np.array(0.9)):
    assert str(mfopt.check_mf_conditions(scalar, 0.05, 100)) == want
  assert str(mfopt.check_mf_conditions(0.9, np.array(0.05), 100)) == want


def test_check_mf_conditions_evaluates_a_schedule_as_step_by_step():
  """One call on all steps where the schedule is elementwise (optax's), a step at a time where
  it is not (Python control flow on the step): the same values (to float32 rounding: XLA
  fuses the vectorized formula differently, 1e-7 apart at 3 of 300 steps)."""
  sched = optax.linear_schedule(0.5, 0.95, 300)

  def scalar_only(t):
    return 0.5 if int(t) < 150 else 0.95  # int() of an array of steps raises

  calls = []

  def counted(t):
    calls.append(t)
    return sched(t)

  mfopt.mf._schedule_values("mf", counted, 300)
  assert len(calls) == 1  # one call on all steps, not 300
  for s in (sched, scalar_only):
    vals = mfopt.mf._schedule_values("mf", s, 300)
    np.testing.assert_allclose(vals, [float(s(jnp.asarray(t, jnp.int32))) for t in range(300)],
                               rtol=1e-6)


def test_check_mf_conditions_report_is_readable():
  ok = mfopt.check_mf_conditions(0.9, 0.05, 100)
  text = str(ok)
  assert "all hold" in text and "9.99973 < 2000" in text and "[ok] (2a) MF < 1" in text
  bad = mfopt.check_mf_conditions(0.99, 50.0, 100)
  assert not bad
  assert "VIOLATED" in str(bad) and "[FAIL] (2a) sum rule" in str(bad) and "63.3968 < 2" in str(bad)
  assert [c.holds for c in bad.conditions] == [False, True]
  sched = mfopt.check_mf_conditions(optax.linear_schedule(0.5, 0.9, 10), 0.1, 20)
  assert "worst case over the schedule" in str(sched)
  for args, match in [((0.9, 0.1, 0), "num_steps must be a positive integer, got 0"),
                      ((0.9, -0.1, 10), "lr must be >= 0, got -0.1"),
                      ((-0.5, 0.1, 10), "mf must be >= 0, got -0.5"),
                      (([0.9, 0.9], 0.1, 3), "mf as a sequence must have num_steps=3 values, got 2")]:
    with pytest.raises(ValueError, match=re.escape(match)):
      mfopt.check_mf_conditions(*args)


def test_mf_adam_float16_state_steps_as_optax_adam_does():
  """Its docstring said a float16 v that underflowed to 0 gave a finite m / eps step here
  where optax.adam gave inf; both step -inf (eps = 1e-8 is 0 in float16), and equal
  optax.adam bitwise over gradients from underflow to large (a review)."""
  p = jnp.zeros(3, jnp.float16)
  g = jnp.array([1e-4, 3e-2, 30.0], jnp.float16)
  mine, ref = mfopt.mf_adam(1e-3), optax.adam(1e-3)
  sm, sr = mine.init(p), ref.init(p)
  for _ in range(3):
    um, sm = mine.update(g, sm, p)
    ur, sr = ref.update(g, sr, p)
    np.testing.assert_array_equal(np.asarray(um), np.asarray(ur))
  assert np.isneginf(np.asarray(um)[0]) and np.isfinite(np.asarray(um)[1:]).all()


def test_a_slowly_decreasing_mf1_schedule_is_refused():
  """(2b) forbids any decrease of MF1, not only a large one: a schedule falling by 1e-4 per step
  (hundreds of float32 ulps at 0.95) is refused by the default check and with validate_steps;
  a tolerance wider than float32 rounding would let such a schedule through."""
  slow = lambda t: 0.95 - 1e-4 * t  # noqa: E731
  for kwargs in ({}, {"validate_steps": 5}):
    with pytest.raises(ValueError, match=r"mf1 must not decrease .* got mf1=0\.9[45]\d* at step 0 "
                                         r"then 0\.949\d* at step 1"):
      mfopt.mf_adam(1e-3, mf1=slow, **kwargs)


def test_mf_adam_paper_phi_adds_eps_outside_the_square_root():
  """The printed phi divides by (sqrt(v) + eps). With gradients of 1e-6, sqrt(v) ~ 3e-8 is
  comparable to eps = 1e-8, so eps inside the root (sqrt(v + eps) ~ 1e-4) would shrink the
  step about 2000-fold; checked against the formula evaluated in float64 over two steps."""
  mf1, mf2, eps, g = 0.9, 0.999, 1e-8, 1e-6
  tx = mfopt.scale_by_mf_adam(mf1, mf2, eps, phi="paper")
  state = tx.init(jnp.zeros(2))
  m = v = 0.0
  for _ in range(2):
    u, state = tx.update(jnp.full(2, g, jnp.float32), state)
    m, v = mf1 * m + (1 - mf1) * g, mf2 * v + (1 - mf2) * g * g
    want = m * np.sqrt(1 - mf2) / ((np.sqrt(v) + eps) * (1 - mf1))
    assert want > 0.5  # eps is not negligible here, nor dominant
    np.testing.assert_allclose(np.asarray(u), want, rtol=1e-5)


def test_check_mf_conditions_takes_the_worst_case_of_varying_values():
  """With per-step values, (2a) is evaluated at the largest MF and the largest learning rate
  (its left side grows with MF, its right side falls with lr): one step at lr = 50, or MF
  decaying from 0.99, violates the closed form even though the smallest lr or the final MF
  would satisfy it."""
  T = 100
  lhs = (1 - 0.99**T) / (1 - 0.99)  # 63.4, the printed ratio at MF = 0.99
  assert T / 50.0 < lhs < T / 1e-3
  lrs = np.full(T, 1e-3)
  lrs[10] = 50.0
  assert not mfopt.check_mf_conditions(0.99, lrs, T)
  assert mfopt.check_mf_conditions(0.99, 1e-3, T)
  mfs = np.linspace(0.99, 0.0, T)  # at its final MF = 0 the left side is 1 < 2
  assert not mfopt.check_mf_conditions(mfs, 50.0, T)
  assert mfopt.check_mf_conditions(0.0, 50.0, T)
