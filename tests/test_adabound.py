"""AdaBound/AMSBound, linear-scaling AdaBound and the hybrid against NumPy references.

The references below are written independently of ``mfopt.adabound``:
* ``np_adabound`` transcribes ``adabound`` 0.0.5 ``AdaBound.step`` (the authors' PyTorch code)
  line by line, in float64 Python/NumPy;
* ``np_hybrid`` transcribes seed 004 §2.2.1 (bounds over fractional epochs, the clip, the switch
  at T) and LARS from You et al. 2017 (``v = m v + lr * eta ||w||/||g + wd w|| (g + wd w)``).
Float64 runs use ``jax.enable_x64`` as a context manager, so nothing leaks into other tests.
"""

import importlib
import math

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from _steps import run_linear_field  # tests/ is on sys.path
# ``mfopt.adabound`` is the optimizer function; the module is reached through sys.modules.
ab = importlib.import_module("mfopt.adabound")

STEPS = 200


# ----------------------------------------------------------------------------- problems


def _quadratic(d=12, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(d, d))
  a = q @ q.T / d + np.diag(rng.uniform(0.1, 3.0, size=d))
  b = rng.normal(size=d)
  x0 = {"x": rng.normal(size=d)}

  def np_grad(p):
    return {"x": a @ p["x"] - b}

  def jax_loss(p):
    return 0.5 * p["x"] @ jnp.asarray(a, p["x"].dtype) @ p["x"] - jnp.asarray(b, p["x"].dtype) @ p["x"]

  return x0, np_grad, jax_loss


def _mlp(d=5, h=7, n=16, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d))
  y = np.sin(x.sum(1, keepdims=True))
  p0 = {"w1": rng.normal(size=(d, h)) / math.sqrt(d), "b1": np.zeros(h),
        "w2": rng.normal(size=(h, 1)) / math.sqrt(h), "b2": np.zeros(1)}

  def np_grad(p):
    z = x @ p["w1"] + p["b1"]
    a = np.tanh(z)
    out = a @ p["w2"] + p["b2"]
    r = (out - y) / n  # d/d out of 0.5*mean((out-y)^2)
    gw2 = a.T @ r
    gb2 = r.sum(0)
    da = r @ p["w2"].T * (1 - a ** 2)
    return {"w1": x.T @ da, "b1": da.sum(0), "w2": gw2, "b2": gb2}

  def jax_loss(p):
    dt = p["w1"].dtype
    out = jnp.tanh(jnp.asarray(x, dt) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return 0.5 * jnp.mean((out - jnp.asarray(y, dt)) ** 2)

  return p0, np_grad, jax_loss


PROBLEMS = {"quadratic": _quadratic, "mlp": _mlp}


# ----------------------------------------------------------------------------- references


def np_adabound(p0, grad_fn, steps, lr, final_lr=0.1, gamma=1e-3, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, amsbound=False, lr_at=None):
  """adabound 0.0.5 AdaBound.step, transcribed (one param group; lr_at(step0) = scheduler)."""
  p = {k: np.array(v, np.float64) for k, v in p0.items()}
  state = {k: {"step": 0, "exp_avg": np.zeros_like(v), "exp_avg_sq": np.zeros_like(v),
               "max_exp_avg_sq": np.zeros_like(v)} for k, v in p.items()}
  base_lr = lr
  traj = []
  for i in range(steps):
    group_lr = lr if lr_at is None else lr_at(i)
    grads = grad_fn(p)
    for k in p:
      grad, st = grads[k], state[k]
      st["step"] += 1
      if weight_decay != 0:
        grad = grad + weight_decay * p[k]
      beta1, beta2 = betas
      st["exp_avg"] = st["exp_avg"] * beta1 + (1 - beta1) * grad
      st["exp_avg_sq"] = st["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
      if amsbound:
        st["max_exp_avg_sq"] = np.maximum(st["max_exp_avg_sq"], st["exp_avg_sq"])
        denom = np.sqrt(st["max_exp_avg_sq"]) + eps
      else:
        denom = np.sqrt(st["exp_avg_sq"]) + eps
      bias_correction1 = 1 - beta1 ** st["step"]
      bias_correction2 = 1 - beta2 ** st["step"]
      step_size = group_lr * math.sqrt(bias_correction2) / bias_correction1
      fl = final_lr * group_lr / base_lr
      lower_bound = fl * (1 - 1 / (gamma * st["step"] + 1))
      upper_bound = fl * (1 + 1 / (gamma * st["step"]))
      step = np.clip(np.full_like(denom, step_size) / denom, lower_bound, upper_bound) * st["exp_avg"]
      p[k] = p[k] - step
    traj.append({k: v.copy() for k, v in p.items()})
  return traj


def np_hybrid(p0, grad_fn, steps, *, base_lr, num_workers, steps_per_epoch, alpha, warmup_epochs,
              b1=0.9, b2=0.999, eps=1e-8, decay=0.9, momentum=0.9, weight_decay=1e-4,
              trust=1e-3, switch=True, bias_correction=False):
  """Seed 004 §2.2.1 (AdaBound warmup + LARS SGD), written from the seed's equations.

  The seed's steps 4-6 use the raw moments: ``clip(alpha/sqrt(v), B_l, B_u) * m``;
  ``bias_correction`` adds the AdaBound reference's ``sqrt(1-b2^k)/(1-b1^k)`` to ``alpha``.
  """
  p = {k: np.array(v, np.float64) for k, v in p0.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  buf = {k: np.zeros_like(v) for k, v in p.items()}
  lrn = base_lr * num_workers
  big_t = warmup_epochs
  n_warm = 0  # warm-up updates done; update i starts at epoch i / steps_per_epoch
  traj, rates = [], []
  for i in range(steps):
    g = grad_fn(p)
    if not switch or i / steps_per_epoch < warmup_epochs - 1e-9:  # the epoch has not reached T
      n_warm += 1
      k_ = i + 1
      t = min(k_ / steps_per_epoch, big_t)  # fractional epoch, clamped at T
      b_u = lrn + 1 / ((1 - b2) * t) - 1 / ((1 - b2) * big_t)
      b_l = t / big_t * lrn
      for k in p:
        m[k] = b1 * m[k] + (1 - b1) * g[k]
        v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
        a_t = alpha * math.sqrt(1 - b2 ** k_) / (1 - b1 ** k_) if bias_correction else alpha
        rate = np.minimum(np.maximum(a_t / (np.sqrt(v2[k]) + eps), b_l), b_u)
        p[k] = p[k] - rate * m[k]
      rates.append((b_l, b_u))
    else:
      c = i - n_warm
      lr_c = lrn * decay ** (c // steps_per_epoch)
      for k in p:
        gk = g[k] + weight_decay * p[k]
        wn, gn = np.linalg.norm(p[k]), np.linalg.norm(gk)
        local = trust * wn / gn if wn > 0 and gn > 0 else 1.0
        buf[k] = momentum * buf[k] + lr_c * local * gk
        p[k] = p[k] - buf[k]
    traj.append({k: v.copy() for k, v in p.items()})
  return traj, rates


# ----------------------------------------------------------------------------- runner


def _run(tx, p0, jax_loss, steps, dtype):
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), p0)

  @jax.jit
  def go(params):
    def body(carry, _):
      p, s = carry
      g = jax.grad(jax_loss)(p)
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      return (p, s), p
    _, traj = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return traj

  return jax.device_get(go(params))


def _assert_traj(got, want, rtol):
  """Relative error of every step's parameters, scaled by that leaf's magnitude."""
  for k in want[0]:
    g = np.asarray(got[k], np.float64)
    w = np.stack([s[k] for s in want])
    scale = np.maximum(np.abs(w).max(axis=tuple(range(1, w.ndim)), keepdims=True), 1e-3)
    err = (np.abs(g - w) / scale).max()
    assert err <= rtol, f"leaf {k}: max relative error {err:.3e} > {rtol:.0e}"
  # The trajectory really moved (a no-op optimizer cannot pass).
  first, last = want[0], want[-1]
  assert max(np.abs(first[k] - last[k]).max() for k in first) > 1e-2


CONFIGS = [
    dict(lr=1e-3, final_lr=0.1, gamma=1e-3),
    dict(lr=1e-2, final_lr=0.05, gamma=1e-2, amsbound=True),
    dict(lr=3e-3, final_lr=0.3, gamma=0.1, weight_decay=1e-2),
    dict(lr=1e-2, final_lr=0.02, gamma=0.5, weight_decay=5e-3, amsbound=True,
         betas=(0.8, 0.99), eps=1e-6),
]


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
def test_adabound_matches_reference_float64(problem, cfg):
  kw = CONFIGS[cfg]
  p0, np_grad, jax_loss = PROBLEMS[problem]()
  want = np_adabound(p0, np_grad, STEPS, **kw)
  b1, b2 = kw.get("betas", (0.9, 0.999))
  with jax.enable_x64(True):
    tx = mfopt.adabound(kw["lr"], final_lr=kw["final_lr"], gamma=kw["gamma"], b1=b1, b2=b2,
                        eps=kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0),
                        amsbound=kw.get("amsbound", False))
    got = _run(tx, p0, jax_loss, STEPS, jnp.float64)
  _assert_traj(got, want, 1e-10)


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("cfg", [0, 3])
def test_adabound_matches_reference_float32(problem, cfg):
  kw = CONFIGS[cfg]
  p0, np_grad, jax_loss = PROBLEMS[problem]()
  want = np_adabound(p0, np_grad, STEPS, **kw)
  b1, b2 = kw.get("betas", (0.9, 0.999))
  tx = mfopt.adabound(kw["lr"], final_lr=kw["final_lr"], gamma=kw["gamma"], b1=b1, b2=b2,
                      eps=kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0),
                      amsbound=kw.get("amsbound", False))
  got = _run(tx, p0, jax_loss, STEPS, jnp.float32)
  _assert_traj(got, want, 1e-5)


def test_adabound_schedule_decays_the_bounds_like_the_reference():
  """With a scheduler the reference scales final_lr by lr/base_lr; so does mfopt."""
  p0, np_grad, jax_loss = _quadratic(seed=3)
  sched = lambda i: 1e-2 * 0.98 ** i  # noqa: E731
  want = np_adabound(p0, np_grad, STEPS, 1e-2, final_lr=0.2, gamma=0.05, lr_at=sched)
  with jax.enable_x64(True):
    # (optax's schedules return float32 even under x64, so the schedule is written out here)
    tx = mfopt.adabound(lambda c: 1e-2 * 0.98 ** c, final_lr=0.2, gamma=0.05)
    got = _run(tx, p0, jax_loss, STEPS, jnp.float64)
  _assert_traj(got, want, 1e-10)
  # and the schedule matters: a constant lr gives a different trajectory
  fixed = np_adabound(p0, np_grad, STEPS, 1e-2, final_lr=0.2, gamma=0.05)
  assert np.abs(fixed[-1]["x"] - want[-1]["x"]).max() > 1e-3


# ----------------------------------------------------------------------------- seed 004 §2.2.1

HYBRID = dict(base_lr=0.05, num_workers=4, steps_per_epoch=10, alpha=0.01, warmup_epochs=3)


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_linear_scaling_adabound_matches_seed_equations_float64(problem, bias_correction):
  p0, np_grad, jax_loss = PROBLEMS[problem]()
  steps = 45  # runs past T (30 steps): bounds then stay at lr*N
  want, _ = np_hybrid(p0, np_grad, steps, switch=False, bias_correction=bias_correction,
                      **HYBRID)
  with jax.enable_x64(True):
    tx = mfopt.linear_scaling_adabound(bias_correction=bias_correction, **HYBRID)
    got = _run(tx, p0, jax_loss, steps, jnp.float64)
  _assert_traj(got, want, 1e-10)
  # The option matters on this problem: the other reading leaves this path.
  other, _ = np_hybrid(p0, np_grad, steps, switch=False, bias_correction=not bias_correction,
                       **HYBRID)
  k = next(iter(want[0]))
  assert np.abs(other[0][k] - want[0][k]).max() > 1e-4


def test_linear_scaling_adabound_default_is_the_seeds_formula_first_step():
  """At k = 1 the seed's step is clip(alpha/sqrt((1-b2) g^2), B_l, B_u) * (1-b1) g, closed form."""
  alpha, b1, b2, g = 1e-3, 0.9, 0.999, 2.0
  tx = mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=8, steps_per_epoch=10**6,
                                     alpha=alpha, b1=b1, b2=b2, eps=0.0)
  u, _ = tx.update(jnp.array([g]), tx.init(jnp.zeros(1)), jnp.zeros(1))
  want = -alpha / math.sqrt(1 - b2) * (1 - b1)  # g cancels; B_l ~ 8e-8, B_u ~ 1e9: no clip
  np.testing.assert_allclose(float(u[0]), want, rtol=1e-6)


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_hybrid_matches_seed_equations_across_the_switch_float64(problem, bias_correction):
  p0, np_grad, jax_loss = PROBLEMS[problem]()
  steps = 70  # 30 AdaBound steps, then 4 SGD epochs (lr decays 3 times)
  kw = dict(HYBRID, decay=0.7, momentum=0.9, weight_decay=1e-3)
  want, _ = np_hybrid(p0, np_grad, steps, trust=0.5, bias_correction=bias_correction, **kw)
  with jax.enable_x64(True):
    tx = mfopt.hybrid_adabound_lars(trust_coefficient=0.5, bias_correction=bias_correction,
                                    **kw)
    got = _run(tx, p0, jax_loss, steps, jnp.float64)
  _assert_traj(got, want, 1e-10)
  # The two phases really differ: a run without the switch leaves the SGD phase's path.
  no_switch, _ = np_hybrid(p0, np_grad, steps, switch=False, **HYBRID)
  k = next(iter(want[0]))
  assert np.abs(no_switch[-1][k] - want[-1][k]).max() > 1e-4


def test_hybrid_switches_after_the_first_step_that_reaches_T():
  """With T x steps_per_epoch not whole (2.45 x 10), the warm-up runs until an update's epoch
  reaches T (25 updates, the last at t = 2.5 >= T, where both bounds equal lr N), then SGD.
  Rounding the switch down started SGD one update early, after a step at t = 2.4 whose bounds
  had not met (B_l = 0.98 lr N)."""
  p0, np_grad, jax_loss = PROBLEMS[sorted(PROBLEMS)[0]]()
  kw = dict(HYBRID, warmup_epochs=2.45, decay=0.7, weight_decay=1e-3)
  assert mfopt.hybrid_switch_step(2.45, 10) == 25 == mfopt.hybrid_switch_step(2.5, 10)
  assert mfopt.hybrid_switch_step(0.3, 10) == 3 and mfopt.hybrid_switch_step(1e-6, 1) == 1
  want, rates = np_hybrid(p0, np_grad, 40, trust=0.5, **kw)
  lrn = HYBRID["base_lr"] * HYBRID["num_workers"]
  assert len(rates) == 25 and np.allclose(rates[-1], lrn) and rates[-2][0] < 0.99 * lrn
  with jax.enable_x64(True):
    got = _run(mfopt.hybrid_adabound_lars(trust_coefficient=0.5, **kw), p0, jax_loss, 40,
               jnp.float64)
  _assert_traj(got, want, 1e-10)


def test_hybrid_switch_is_in_graph_one_trace():
  traces = []
  tx = mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=2, warmup_epochs=1)

  @jax.jit
  def step(p, s):
    traces.append(1)
    u, s = tx.update(2.0 * p, s, p)
    return optax.apply_updates(p, u), s

  p = jnp.linspace(-1.0, 1.0, 5)
  s = tx.init(p)
  seen = []
  for _ in range(6):
    p, s = step(p, s)
    seen.append((int(s.count), np.asarray(s.nu).copy()))
  assert len(traces) == 1
  assert [c for c, _ in seen] == [1, 2, 3, 4, 5, 6]
  # AdaBound's v moves during the 2 warmup steps, then freezes while LARS runs.
  assert not np.array_equal(seen[0][1], seen[1][1])
  for _, nu in seen[2:]:
    np.testing.assert_array_equal(nu, seen[1][1])


def _lars_phase_pair(hybrid_kw, lars_kw, steps, switch, params, grad_fn):
  """(hybrid run, reference run) over ``steps`` SGD steps after ``switch`` warmup steps."""
  hyb = mfopt.hybrid_adabound_lars(**hybrid_kw)
  sched = mfopt.hybrid_lars_learning_rate(
      num_workers=hybrid_kw["num_workers"], steps_per_epoch=hybrid_kw["steps_per_epoch"],
      base_lr=hybrid_kw["base_lr"], decay=hybrid_kw["decay"])
  ref = optax.lars(sched, **lars_kw)
  p_h, s_h = params, hyb.init(params)
  for _ in range(switch):  # the warmup, through the hybrid itself
    u, s_h = hyb.update(grad_fn(p_h), s_h, p_h)
    p_h = optax.apply_updates(p_h, u)
  p_r, s_r = p_h, ref.init(p_h)  # a fresh optax.lars from the switch point on
  for _ in range(steps):
    u, s_h = hyb.update(grad_fn(p_h), s_h, p_h)
    p_h = optax.apply_updates(p_h, u)
    u, s_r = ref.update(grad_fn(p_r), s_r, p_r)
    p_r = optax.apply_updates(p_r, u)
  return p_h, p_r


def test_hybrid_sgd_phase_equals_optax_lars_on_a_tree():
  """The hand-fused LARS phase against optax.lars itself (independent reference), on a tree
  with a zero-norm leaf (trust ratio 1) and lr decays inside the window."""
  rng = np.random.default_rng(5)
  params = {"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
            "b": jnp.zeros(4, jnp.float32),
            "s": jnp.asarray(rng.standard_normal(3), jnp.float32)}
  target = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  grad_fn = jax.jit(lambda p: jax.tree.map(lambda a, t: a - t + 0.1 * a ** 3, p, target))
  kw = dict(num_workers=4, steps_per_epoch=3, base_lr=0.05, warmup_epochs=2, decay=0.7,
            momentum=0.9, weight_decay=1e-2, trust_coefficient=0.3)
  got, want = _lars_phase_pair(kw, dict(weight_decay=1e-2, trust_coefficient=0.3, momentum=0.9),
                               steps=10, switch=6, params=params, grad_fn=grad_fn)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
  # and the comparison can fail: a different trust coefficient moves the SGD phase
  other, _ = _lars_phase_pair(dict(kw, trust_coefficient=0.31),
                              dict(weight_decay=1e-2, trust_coefficient=0.3, momentum=0.9),
                              steps=10, switch=6, params=params, grad_fn=grad_fn)
  assert np.abs(np.asarray(other["w"]) - np.asarray(want["w"])).max() > 1e-4


def test_hybrid_lars_trust_ratio_is_one_where_a_norm_is_zero():
  """The LARS phase uses trust ratio 1 for a tensor whose weight norm or gradient norm is 0
  (optax.lars, You et al.): a zero tensor (e.g. a bias still at its init) steps at the global
  rate lr N, and a zero gradient steps by 0; without the guard these were 0 and 0/0 = NaN."""
  tx = mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=1, warmup_epochs=1,
                                  base_lr=0.1, weight_decay=0.0)
  p = {"a": jnp.ones(3), "z": jnp.zeros(3)}
  s, update = tx.init(p), jax.jit(tx.update)
  u, s = update({"a": jnp.ones(3), "z": jnp.zeros(3)}, s, p)  # warm-up; z stays at 0
  p = optax.apply_updates(p, u)
  assert not np.asarray(p["z"]).any() and np.asarray(p["a"]).all()
  g = {"a": jnp.zeros(3), "z": jnp.array([1.0, -2.0, 0.5])}
  u, _ = update(g, s, p)  # the first LARS step: fresh momentum, lr N = 0.2
  np.testing.assert_array_equal(np.asarray(u["a"]), np.zeros(3))
  np.testing.assert_allclose(np.asarray(u["z"]), -0.2 * np.asarray(g["z"]), rtol=1e-6)


def test_defaults_are_the_reference_and_seed_values():
  """With no optional arguments, adabound is the reference package's AdaBound (lr 1e-3,
  final_lr 0.1, gamma 1e-3, betas 0.9/0.999, eps 1e-8), and linear-scaling AdaBound and the
  hybrid use seed 004 §3.1's T = 10, lr = 0.1, kappa = 0.9, wd = 1e-4 (the references'
  defaults): a changed default would silently change every run that relies on it."""
  p0, np_grad, jax_loss = _quadratic()
  seed = dict(base_lr=0.1, num_workers=4, steps_per_epoch=1, alpha=1e-3, warmup_epochs=10)
  want_ab = np_adabound(p0, np_grad, 30, 1e-3)
  want_ls, _ = np_hybrid(p0, np_grad, 14, switch=False, **seed)
  want_hy, _ = np_hybrid(p0, np_grad, 16, **seed)
  with jax.enable_x64(True):
    got_ab = _run(mfopt.adabound(), p0, jax_loss, 30, jnp.float64)
    got_ls = _run(mfopt.linear_scaling_adabound(num_workers=4, steps_per_epoch=1,
                                                base_lr=0.1), p0, jax_loss, 14, jnp.float64)
    got_hy = _run(mfopt.hybrid_adabound_lars(num_workers=4, steps_per_epoch=1), p0, jax_loss,
                  16, jnp.float64)
  _assert_traj(got_ab, want_ab, 1e-10)
  _assert_traj(got_ls, want_ls, 1e-10)
  _assert_traj(got_hy, want_hy, 1e-10)


def test_hybrid_under_worker_vmap_keeps_norm_loop_unbatched_and_matches():
  """With ``axis_name`` the LARS-norms loop (comm.gated) keeps one trip count under the worker
  vmap (the warmup does not read w and g twice), and the result equals the unbatched
  transform; without it the trip count is per worker."""
  kw = dict(num_workers=2, steps_per_epoch=2, warmup_epochs=1, trust_coefficient=0.5)
  w = 3
  params = jnp.stack([jnp.linspace(-1.0, 1.0, 5) * (i + 1) for i in range(w)])

  def run(tx, batched):
    def step(p, s):
      u, s = tx.update(2.0 * p + 0.3, s, p)
      return optax.apply_updates(p, u), s
    if batched:
      step = jax.vmap(step, axis_name="local")
    return jax.jit(step)

  hyb_ax = mfopt.hybrid_adabound_lars(axis_name="local", **kw)
  fn = run(hyb_ax, True)
  state = jax.vmap(hyb_ax.init)(params)
  scalar_trips = re.compile(r"cond_jaxpr=\{[^}]*\w+:bool\[\] = lt")
  assert scalar_trips.search(str(jax.make_jaxpr(fn)(params, state)))
  plain = mfopt.hybrid_adabound_lars(**kw)
  jaxpr_plain = str(jax.make_jaxpr(run(plain, True))(params, jax.vmap(plain.init)(params)))
  assert " while[" in jaxpr_plain and not scalar_trips.search(jaxpr_plain)  # per worker
  p, s = params, state
  for _ in range(5):
    p, s = fn(p, s)
  one = run(plain, False)
  for i in range(w):
    q, t = params[i], plain.init(params[i])
    for _ in range(5):
      q, t = one(q, t)
    np.testing.assert_allclose(p[i], q, rtol=1e-6, atol=1e-7)


def test_bounds_bind_early_in_warmup():
  """Some coordinates sit exactly at B_u and others exactly at B_l in the first steps."""
  n, spe, big_t = 8, 1, 10
  tx = ab.scale_by_linear_scaling_adabound(base_lr=0.1, num_workers=n, steps_per_epoch=spe,
                                           warmup_epochs=big_t)
  rng = np.random.default_rng(0)
  g = jnp.asarray(np.concatenate([rng.uniform(1e-8, 1e-6, 20), rng.uniform(1e-4, 1e-2, 20),
                                  rng.uniform(5.0, 50.0, 20)]) * rng.choice([-1, 1], 60),
                  jnp.float32)
  state = tx.init(g)
  for k in (1, 2, 3):
    u, state = tx.update(g, state, None)
    lo, hi = ab.linear_scaling_bounds(k / spe, base_lr=0.1, num_workers=n, warmup_epochs=big_t)
    rate = np.asarray(u) / np.asarray(state.mu)  # effective per-coordinate learning rate
    at_hi = np.isclose(rate, float(hi), rtol=1e-6)
    at_lo = np.isclose(rate, float(lo), rtol=1e-6)
    assert at_hi[:20].all() and at_lo[40:].all(), (k, rate)
    assert not (at_hi | at_lo)[20:40].any()  # the middle band is unclipped Adam
    # the unclipped Adam rate really lies outside the bounds for the clipped coordinates
    adam = 1e-3 / (np.sqrt(np.asarray(state.nu)) + 1e-8)  # the seed's alpha/sqrt(V_t)
    assert (adam[:20] > float(hi)).all() and (adam[40:] < float(lo)).all()
  # B_u falls and B_l rises with t, and both reach lr*N at T
  lo_t, hi_t = ab.linear_scaling_bounds(big_t, base_lr=0.1, num_workers=n, warmup_epochs=big_t)
  assert float(lo_t) == pytest.approx(0.8) and float(hi_t) == pytest.approx(0.8)
  assert float(ab.linear_scaling_bounds(0.0, base_lr=0.1, num_workers=n,
                                        warmup_epochs=big_t)[1]) == math.inf


def test_lars_learning_rate_counts_decay_from_the_switch():
  sched = ab.hybrid_lars_learning_rate(num_workers=8, steps_per_epoch=5, base_lr=0.1, decay=0.9)
  got = [float(sched(jnp.asarray(c))) for c in (0, 4, 5, 14, 15)]
  np.testing.assert_allclose(got, [0.8, 0.8, 0.72, 0.8 * 0.81, 0.8 * 0.729], rtol=1e-6)


@pytest.mark.parametrize("make,arg,value", [
    (lambda v: mfopt.adabound(1e-3, final_lr=v), "final_lr", -0.1),
    (lambda v: mfopt.adabound(1e-3, gamma=v), "gamma", 1.0),
    (lambda v: mfopt.adabound(1e-3, b1=v), "b1", 1.0),
    (lambda v: mfopt.adabound(1e-3, weight_decay=v), "weight_decay", -1.0),
    (lambda v: mfopt.adabound(v), "learning_rate", -1e-3),
    (lambda v: mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=v, steps_per_epoch=3),
     "num_workers", 0),
    (lambda v: mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=2, steps_per_epoch=v),
     "steps_per_epoch", 2.5),
    (lambda v: mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=3, decay=v), "decay", 0.0),
    (lambda v: mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=3, momentum=v),
     "momentum", 1.0),
    (lambda v: mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=3, warmup_epochs=v),
     "warmup_epochs", 0.0),
])
def test_bad_arguments_are_named(make, arg, value):
  with pytest.raises(ValueError, match=arg):
    make(value)


def test_switches_must_be_bools():
  """A truthy string must not switch a variant on: adabound(amsbound='no') ran AMSBound."""
  for make in (mfopt.linear_scaling_adabound, mfopt.hybrid_adabound_lars):
    with pytest.raises(ValueError, match="bias_correction must be True or False, got 'yes'"):
      make(base_lr=0.1, num_workers=2, steps_per_epoch=3, bias_correction="yes")
  for make in (mfopt.adabound, mfopt.scale_by_adabound):
    with pytest.raises(ValueError, match="amsbound must be True or False, got 'no'"):
      make(0.1, amsbound="no")
    with pytest.raises(ValueError, match="amsbound must be True or False, got 1"):
      make(0.1, amsbound=1)


def test_hybrid_names_a_bad_axis_name_when_built():
  with pytest.raises(ValueError, match="axis_name .*got 3"):
    mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=3, axis_name=3)


def test_hybrid_axis_name_is_harmless_outside_the_worker_vmap():
  """axis_name only keeps a cond unbatched; used where the axes are not bound (a plain jit,
  one worker) the transform still runs and equals the one without axis_name."""
  kw = dict(num_workers=2, steps_per_epoch=2, warmup_epochs=1)
  p = jnp.linspace(-1.0, 1.0, 5)
  outs = []
  for tx in (mfopt.hybrid_adabound_lars(axis_name=mfopt.WORKER_AXES, **kw),
             mfopt.hybrid_adabound_lars(**kw)):
    step = jax.jit(lambda q, s, tx=tx: tx.update(2.0 * q, s, q))
    q, s = p, tx.init(p)
    for _ in range(4):
      u, s = step(q, s)
      q = optax.apply_updates(q, u)
    outs.append(np.asarray(q))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_hybrid_warmup_step_does_not_read_the_lars_norms_every_step():
  """XLA:CPU's compiled AdaBound-phase step: the LARS norms live in the gated loop's body (run
  in the LARS phase only), not in the every-step kernels. Without the optimization barrier in
  the loop body, XLA's loop-invariant code motion hoisted the reductions out and the
  every-step traffic was 64 B/param (optax.adam: 40 on XLA:CPU, the hybrid 44)."""
  from experiments import bench_update
  n = 1 << 16
  params = jnp.ones((n,), jnp.float32)
  tx = mfopt.hybrid_adabound_lars(num_workers=8, steps_per_epoch=10**6)
  fn, state = bench_update.build_step(tx, params, params * 0.1, False)
  entry, bodies = bench_update.entry_traffic_bytes(fn.lower(state, params * 0.1).compile().as_text())
  fn_adam, state_adam = bench_update.build_step(optax.adam(1e-3), params, params * 0.1, False)
  adam, _ = bench_update.entry_traffic_bytes(
      fn_adam.lower(state_adam, params * 0.1).compile().as_text())
  assert entry <= adam + 4.5 * n, (entry / n, adam / n)
  assert len(bodies) == 1 and bodies[0] >= 8 * n  # the norms read w and g there


# ----------------------------------------------------------------------------- inject_hyperparams

_INJECT = [
    ("adabound", mfopt.adabound, dict(learning_rate=3e-3, final_lr=0.05),
     (), dict(learning_rate=3e-2)),
    ("adabound wd", mfopt.adabound,
     dict(learning_rate=3e-3, weight_decay=1e-2), (), dict(weight_decay=2.0)),
    ("linear_scaling_adabound", mfopt.linear_scaling_adabound,
     dict(base_lr=0.1, num_workers=4, steps_per_epoch=5, alpha=0.01),
     ("num_workers", "steps_per_epoch"), dict(alpha=0.2)),
    ("hybrid", mfopt.hybrid_adabound_lars,
     dict(num_workers=4, steps_per_epoch=2, warmup_epochs=1, decay=0.8),
     ("num_workers", "steps_per_epoch", "warmup_epochs"), dict(decay=0.1)),
]


@pytest.mark.parametrize("name,make,hyper,static,change", _INJECT, ids=[c[0] for c in _INJECT])
def test_inject_hyperparams_equals_the_plain_transform(name, make, hyper, static, change):
  """optax.inject_hyperparams hands hyperparameters over as jnp scalars (tracers under jit):
  the injected transform must equal the plain one, and a changed value must take effect."""
  p = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.full((2,), 0.3)}
  grad = lambda q: jax.tree.map(lambda a: 2.0 * a + 0.1, q)  # noqa: E731

  def run(tx, steps, mutate=None):
    s, q, out = tx.init(p), p, []
    step = jax.jit(tx.update)
    for i in range(steps):
      if mutate is not None and i == 3:
        s = mutate(s)
      u, s = step(grad(q), s, q)
      q = optax.apply_updates(q, u)
      out.append(q)
    return out

  injected = optax.inject_hyperparams(make, static_args=static)(**hyper)
  plain = make(**hyper)
  for a, b in zip(run(injected, 6), run(plain, 6)):
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5)  # float32 rounding

  def mutate(s):
    for k, v in change.items():
      s.hyperparams[k] = jnp.asarray(v, s.hyperparams[k].dtype)
    return s

  changed = run(injected, 6, mutate)
  assert float(jnp.abs(changed[-1]["w"] - run(plain, 6)[-1]["w"]).max()) > 1e-4


@pytest.mark.parametrize("amsbound", [False, True])
def test_an_lr_schedule_through_inject_hyperparams_moves_the_bounds_as_a_direct_one(amsbound):
  """Injected, the rate arrives as this step's value only; the bounds must still scale by
  lr_t / lr_0 (the reference's final_lr * lr / base_lr). They stayed at final_lr: the
  trajectory was off by 0.6 after 60 steps."""
  lr = optax.exponential_decay(0.1, 10, 0.1)
  kw = dict(final_lr=0.1, gamma=0.5, amsbound=amsbound)

  direct, _ = run_linear_field(mfopt.adabound(lr, **kw))
  injected, _ = run_linear_field(optax.inject_hyperparams(mfopt.adabound)(learning_rate=lr, **kw))
  np.testing.assert_allclose(injected, direct, rtol=0, atol=1e-5)  # (float32 rounding)
  # A rate set by hand moves the bounds too, as in the reference: at t = 1 a tiny gradient's
  # rate clips to the upper bound final * (1 + 1/gamma), final = final_lr * lr / base_lr.
  tx = optax.inject_hyperparams(mfopt.adabound)(learning_rate=0.1, **kw)
  state = tx.init({"w": jnp.zeros(2)})
  state.hyperparams["learning_rate"] = jnp.asarray(0.05, jnp.float32)
  g = jnp.full(2, 1e-6)
  u, _ = jax.jit(tx.update)({"w": g}, state, {"w": jnp.zeros(2)})  # (weight decay 0)
  final = 0.1 * 0.05 / 0.1
  np.testing.assert_allclose(np.asarray(u["w"]), -final * 3.0 * 0.1 * 1e-6, rtol=1e-5)  # m = 0.1 g


def test_empty_parameter_tree_updates_like_optax():
  # optax's transforms take an empty tree (e.g. a frozen model under optax.multi_transform);
  # the hybrid's LARS norm table used to fail to stack zero leaves. Past the switch too.
  for tx in (mfopt.adabound(), mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=2,
                                                              steps_per_epoch=1),
             mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=1, warmup_epochs=1)):
    state = tx.init({})
    for _ in range(3):
      updates, state = jax.jit(tx.update)({}, state, {})
    assert updates == {}


def test_the_hybrid_under_multisteps_equals_the_hybrid_on_mean_micro_gradients():
  """optax.MultiSteps(hybrid, 2) on micro-batch gradients g1, g2 is the hybrid on (g1+g2)/2,
  through the switch from AdaBound to LARS (S = 3 updates of AdaBound here)."""
  make = lambda: mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=2,  # noqa: E731
                                            warmup_epochs=1.5, base_lr=0.1, weight_decay=1e-3)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
  micro = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
           for _ in range(16)]
  multi = optax.MultiSteps(make(), every_k_schedule=2)
  sm, pm = multi.init(params), params
  plain = make()
  sp, pp = plain.init(params), params
  for i in range(0, 16, 2):
    for g in micro[i:i + 2]:
      u, sm = jax.jit(multi.update)(g, sm, pm)
      pm = optax.apply_updates(pm, u)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, micro[i], micro[i + 1])
    u, sp = jax.jit(plain.update)(mean, sp, pp)
    pp = optax.apply_updates(pp, u)
    for k in pp:
      np.testing.assert_allclose(np.asarray(pm[k]), np.asarray(pp[k]), rtol=1e-5, atol=1e-6,
                                 err_msg=f"update {i // 2 + 1}, {k}")
  assert float(jnp.abs(pp["w"] - params["w"]).max()) > 1e-3  # 8 updates: both phases ran


def test_gamma_zero_with_a_zero_final_lr_is_adam_not_nan():
  """gamma = 0 has no upper bound (+inf); with a final lr of 0 (final_lr=0, or a schedule
  decayed to 0) the bound was 0 x inf = NaN and so was every update."""
  p = {"w": jnp.ones(3)}
  g = {"w": jnp.array([1.0, -2.0, 0.5])}
  outs = []
  for final_lr in (0.0, 0.1):
    tx = mfopt.adabound(1e-3, final_lr=final_lr, gamma=0.0)
    u, _ = tx.update(g, tx.init(p), p)
    outs.append(np.asarray(u["w"]))
  assert np.isfinite(outs[0]).all()
  np.testing.assert_array_equal(outs[0], outs[1])  # bounds [0, inf) either way: Adam's step
  sched = optax.cosine_decay_schedule(1e-3, decay_steps=3)  # reaches exactly 0 at step 3
  tx = mfopt.adabound(sched, gamma=0.0)
  s = tx.init(p)
  for _ in range(5):
    u, s = tx.update(g, s, p)
    assert np.isfinite(np.asarray(u["w"])).all()


def test_hybrid_lars_norms_of_float16_parameters_do_not_overflow():
  """||w|| > 256 overflowed float16 before the float32 norms table saw it: inf/NaN steps."""
  tx = mfopt.hybrid_adabound_lars(num_workers=1, steps_per_epoch=1, warmup_epochs=1)
  for dtype in (jnp.float16, jnp.float32):
    p = {"w": jnp.full((3,), 200.0, dtype)}
    s = tx.init(p)
    for _ in range(2):  # step 0: AdaBound warm-up; step 1: LARS
      u, s = tx.update({"w": jnp.full((3,), 0.5, dtype)}, s, p)
    assert np.isfinite(np.asarray(u["w"], np.float32)).all(), dtype
    if dtype == jnp.float16:
      half = np.asarray(u["w"], np.float32)
  np.testing.assert_allclose(half, np.asarray(u["w"]), rtol=2e-3)
