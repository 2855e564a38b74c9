"""Periodic averaging, ADPSGD and block momentum against NumPy references written from the seeds.

The problem: a quadratic ``f(w) = 0.5 * sum(h * (w - w*)^2)`` with per-worker
deterministic gradient noise ``xi[k, i]``, 8 workers on 8 fake devices, 240 steps.
References are float32 NumPy re-derivations of seed 001 Alg. 1/2 and seed 003
Alg. 1; tolerance 1e-5 relative (SPEC: float32 reference, so a threshold
decision can only flip on a true tie).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from mfopt import averaging, parallel, train

W = 8
N = 240
D = 10
LR0 = 0.05
RTOL = 1e-5

_rng = np.random.default_rng(0)
H = _rng.uniform(0.5, 2.0, size=D).astype(np.float32)
W_STAR = _rng.normal(size=D).astype(np.float32)
W0 = (W_STAR + 3.0 * _rng.normal(size=D)).astype(np.float32)
NOISE = (0.5 * _rng.normal(size=(N, W, D))).astype(np.float32)


def schedule(k):
  """Step decay at 50% and 75% (seed 001's shape)."""
  return jnp.where(k < N // 2, LR0, jnp.where(k < 3 * N // 4, LR0 / 10, LR0 / 100)).astype(
      jnp.float32)


def np_lr(k):
  return np.float32(LR0 if k < N // 2 else (LR0 / 10 if k < 3 * N // 4 else LR0 / 100))


def _split(w):
  return {"a": w[:6], "b": w[6:].reshape(2, 2)}


def _join(tree):
  return np.concatenate([np.asarray(tree["a"]).reshape(-1), np.asarray(tree["b"]).reshape(-1)])


def np_grad(w, k):
  """Per-worker gradients (W, D) at iterate rows ``w`` (W, D)."""
  return (H * (w - W_STAR) + NOISE[k]).astype(np.float32)


def run_jax(tx, steps=N, mesh=None, num_workers=W):
  """Runs ``tx`` on the quadratic; returns (stacked params as (W, D), final stacked opt state)."""
  mesh = mesh or parallel.make_mesh()
  h, ws = jnp.asarray(H), jnp.asarray(W_STAR)

  def init(params):
    return tx.init(params)

  def step(params, opt_state, noise):
    w = jnp.concatenate([params["a"], params["b"].reshape(-1)])
    g = _split(h * (w - ws) + noise)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  w0 = np.broadcast_to(W0, (num_workers, D))
  params = parallel.shard_workers({"a": w0[:, :6].copy(), "b": w0[:, 6:].reshape(-1, 2, 2).copy()},
                                  mesh)
  opt_state = jax.jit(parallel.per_worker(init, mesh, num_workers))(params)
  stepper = jax.jit(parallel.per_worker(step, mesh, num_workers), donate_argnums=(0, 1))
  for k in range(steps):
    params, opt_state = stepper(params, opt_state, parallel.shard_workers(NOISE[k], mesh))
    if k % train.MAX_STEPS_IN_FLIGHT == 0:  # N = 240 queued steps could deadlock XLA:CPU
      jax.block_until_ready(params)  # (the newest, not yet donated)
  stacked = jax.device_get(params)
  out = np.stack([_join({"a": stacked["a"][i], "b": stacked["b"][i]}) for i in range(num_workers)])
  return out, opt_state


# ----------------------------------------------------------------------------- NumPy references


def np_cpsgd(p, momentum=0.0, steps=N):
  """Seed 001 Alg. 1 with optax-form momentum (trace = g + m trace; w -= lr trace)."""
  w = np.broadcast_to(W0, (W, D)).astype(np.float32).copy()
  trace = np.zeros_like(w)
  syncs = 0
  for k in range(steps):
    g = np_grad(w, k)
    trace = (g + np.float32(momentum) * trace).astype(np.float32)
    w = (w - np_lr(k) * trace).astype(np.float32)
    if (k + 1) % p == 0:
      w = np.broadcast_to(w.mean(0, dtype=np.float32), (W, D)).copy()
      syncs += 1
  return w, syncs


def np_adpsgd(p_init, k_s, warmup=0, low=0.7, high=1.3, steps=N):
  """Seed 001 Alg. 2, line by line (plain local SGD)."""
  w = np.broadcast_to(W0, (W, D)).astype(np.float32).copy()
  cnt, p, samples = 0, p_init, []
  periods, s_trace = [], []
  for k in range(steps):
    lr = np_lr(k)
    w = (w - lr * np_grad(w, k)).astype(np.float32)
    cnt += 1
    p_now = 1 if k < warmup else p
    if cnt == p_now:
      cnt = 0
      mean = w.mean(0, dtype=np.float32)
      s_k = np.float32(np.mean(np.sum((mean - w) ** 2, axis=1, dtype=np.float32),
                               dtype=np.float32))
      w = np.broadcast_to(mean, (W, D)).copy()
      periods.append(p_now)
      s_trace.append(np.float32(np.nan) if k < warmup else s_k)  # (Alg. 2 starts after it)
      if k < warmup:
        continue
      if k < k_s:
        samples.append(np.float32(s_k / lr))
      else:
        c2 = np.float32(np.sum(samples, dtype=np.float32) / np.float32(len(samples)))
        if s_k < np.float32(low) * lr * c2:
          p += 1
        elif s_k > np.float32(high) * lr * c2:
          p = max(1, p - 1)
  return w, periods, s_trace


def np_mavg(k_period, mu, steps=N, nesterov=False):
  """Seed 003 Alg. 1 (plain SGD learners); ``nesterov``: the anchor moves by ``d + mu v``
  (optax's Nesterov trace, ``v = mu v + d``) instead of ``v``."""
  anchor = W0.astype(np.float32).copy()
  v = np.zeros(D, np.float32)
  w = np.broadcast_to(anchor, (W, D)).copy()
  for k in range(steps):
    w = (w - np_lr(k) * np_grad(w, k)).astype(np.float32)
    if (k + 1) % k_period == 0:
      a = w.mean(0, dtype=np.float32)
      d = a - anchor
      v = (np.float32(mu) * v + d).astype(np.float32)
      step = (d + np.float32(mu) * v).astype(np.float32) if nesterov else v
      anchor = (anchor + step).astype(np.float32)
      w = np.broadcast_to(anchor, (W, D)).copy()
  return w


def _close(got, want, rtol=RTOL):
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("p,momentum", [(8, 0.0), (5, 0.9)])
def test_cpsgd_matches_numpy_alg1(p, momentum):
  tx = mfopt.periodic_averaging(optax.sgd(schedule, momentum=momentum or None),
                                mfopt.WORKER_AXES, mfopt.constant_period(p))
  got, state = run_jax(tx)
  want, syncs = np_cpsgd(p, momentum)
  _close(got, want)
  assert syncs == N // p
  totals = mfopt.comm_totals(state)
  assert totals["all_reduces"] == N // p
  assert totals["payload_bytes"] == N // p * D * 4
  # The iterate really moved and the workers agree after the last (k = N) sync.
  assert np.abs(got - W0).max() > 0.5
  if N % p == 0:
    assert np.ptp(got, axis=0).max() == 0


def test_adpsgd_matches_numpy_alg2_period_trace_and_params():
  k_s = N // 4
  ctl = mfopt.adpsgd_period(learning_rate=schedule, sampling_steps=k_s, p_init=4, warmup_steps=6)
  tx = mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, ctl, trace_length=256)
  got, state = run_jax(tx)
  want, periods, s_trace = np_adpsgd(4, k_s, warmup=6)
  trace = averaging.sync_trace(state)
  np.testing.assert_array_equal(trace["period"], periods)
  np.testing.assert_allclose(trace["sync_variance"], s_trace, rtol=1e-5)
  _close(got, want)
  # The controller really adapted: warm-up period 1, sampling at 4, then grew after the decay.
  assert periods[:6] == [1] * 6 and max(periods) > 4
  totals = mfopt.comm_totals(state)
  syncs, after_warmup = len(periods), len(periods) - 6
  # parameter exchange per sync, S_k scalar per sync of Alg. 2: the paper's warm-up is plain
  # period-1 averaging, and its S_k all-reduce doubled every warm-up step's collectives
  assert np.isnan(trace["sync_variance"][:6]).all() and np.isfinite(s_trace[6:]).all()
  assert totals["all_reduces"] == syncs + after_warmup
  assert totals["payload_bytes"] == syncs * D * 4 + after_warmup * 4
  s = averaging.find_averaging_state(state)
  assert int(np.asarray(s.param_comm.count)[0]) == syncs
  assert int(np.asarray(s.scalar_comm.count)[0]) == after_warmup
  np.testing.assert_allclose(trace["lr"], [np_lr(k - 1) for k in trace["step"]])


def test_adpsgd_warmup_s_k_when_asked_for():
  """sync_variance=True computes S_k at every sync, warm-up included (a diagnostic the caller
  asked for and pays one scalar all-reduce per sync for); the controller's own need starts
  after the warm-up."""
  ctl = mfopt.adpsgd_period(learning_rate=schedule, sampling_steps=N // 4, p_init=4,
                            warmup_steps=6)
  tx = mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, ctl, trace_length=256,
                                sync_variance=True)
  _, state = run_jax(tx)
  _, periods, _ = np_adpsgd(4, N // 4, warmup=6)
  trace = averaging.sync_trace(state)
  assert np.isfinite(trace["sync_variance"]).all() and len(trace["step"]) == len(periods)
  assert mfopt.comm_totals(state)["all_reduces"] == 2 * len(periods)


@pytest.mark.parametrize("mu,nesterov", [(0.0, False), (0.6, False), (0.6, True)])
def test_block_momentum_matches_numpy_mavg(mu, nesterov):
  tx = mfopt.block_momentum(optax.sgd(schedule), mfopt.WORKER_AXES, 6, momentum=mu,
                            nesterov=nesterov)
  got, _ = run_jax(tx)
  _close(got, np_mavg(6, mu, nesterov=nesterov))
  if nesterov:  # (the flag was ignored and no test noticed: the two forms differ here)
    assert np.abs(np_mavg(6, mu) - np_mavg(6, mu, nesterov=True)).max() > 10 * RTOL


def test_outer_sgd_momentum_is_mavg_and_momentum_zero_is_periodic_averaging():
  got_outer, _ = run_jax(mfopt.periodic_averaging(
      optax.sgd(schedule), mfopt.WORKER_AXES, 6, outer=optax.sgd(1.0, momentum=0.6)))
  _close(got_outer, np_mavg(6, 0.6))
  got_k0, _ = run_jax(mfopt.block_momentum(optax.sgd(schedule), mfopt.WORKER_AXES, 6, momentum=0))
  got_pa, _ = run_jax(mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, 6))
  np.testing.assert_allclose(got_k0, got_pa, rtol=1e-6, atol=1e-6)
  _close(got_pa, np_mavg(6, 0.0))


@pytest.mark.parametrize("make", [
    lambda **kw: mfopt.block_momentum(optax.sgd(schedule), mfopt.WORKER_AXES, 6, momentum=0.6,
                                      **kw),
    lambda **kw: mfopt.block_momentum(optax.sgd(schedule), mfopt.WORKER_AXES, 5, momentum=0.8,
                                      nesterov=True, comm_dtype=jnp.bfloat16, **kw),
    lambda **kw: mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, 4,
                                          comm_dtype=jnp.bfloat16, **kw),
], ids=["block_momentum", "nesterov_bf16_exchange", "periodic_bf16_exchange"])
def test_flat_anchor_equals_the_tree_anchor(make):
  """The anchor and the outer momentum as one flat vector per worker (block momentum's
  default where the parameters share a dtype) give the tree layout's parameters, and the
  state holds 2 arrays where the tree layout holds 2 per parameter leaf."""
  got_flat, state_flat = run_jax(make(flat_anchor=True), steps=60)
  got_tree, state_tree = run_jax(make(flat_anchor=False), steps=60)
  np.testing.assert_allclose(got_flat, got_tree, rtol=1e-6, atol=1e-6)
  flat = averaging.find_averaging_state(state_flat)
  tree = averaging.find_averaging_state(state_tree)
  assert flat.anchor.shape == (W, D) and set(tree.anchor) == {"a", "b"}  # (workers, params)
  np.testing.assert_allclose(flat.anchor, got_flat, rtol=1e-6)  # the anchor is the last sync's
  assert (len(jax.tree.leaves((flat.anchor, flat.outer_state)))
          < len(jax.tree.leaves((tree.anchor, tree.outer_state))))


def test_flat_anchor_default_and_errors():
  """block_momentum is flat where the parameters share one floating dtype and keeps the tree
  where they do not; ``flat_anchor=True`` then names the dtypes."""
  same = {"a": jnp.zeros(3), "b": jnp.ones((2, 2))}
  mixed = {"a": jnp.zeros(3), "b": jnp.ones((2, 2), jnp.bfloat16)}
  tx = mfopt.block_momentum(optax.sgd(0.1), None, 4)
  assert tx.init(same).anchor.shape == (7,)
  assert set(tx.init(mixed).anchor) == {"a", "b"}
  u, s = tx.update(mixed, tx.init(mixed), mixed)  # the tree path still runs
  assert u["b"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"flat_anchor=True needs parameters of one floating "
                                       r"dtype, got \['bfloat16', 'float32'\]"):
    mfopt.block_momentum(optax.sgd(0.1), None, 4, flat_anchor=True).init(mixed)
  with pytest.raises(ValueError, match=r"flat_anchor must be True, False or None, got 'yes'"):
    mfopt.periodic_averaging(optax.sgd(0.1), None, 4, flat_anchor="yes")
  with pytest.raises(ValueError, match=r"flat_anchor must be True, False or None, got 0"):
    mfopt.block_momentum(optax.sgd(0.1), None, 4, flat_anchor=0)  # 0 == False, but not a flag
  # The other switches too: 'no' used to run both variance diagnostics, and Nesterov.
  for arg in ("average_inner_state", "track_variance"):
    with pytest.raises(ValueError, match=rf"{arg} must be True or False, got 'no'"):
      mfopt.periodic_averaging(optax.sgd(0.1), None, 4, **{arg: "no"})
  with pytest.raises(ValueError, match=r"sync_variance must be True, False or None, got 'no'"):
    mfopt.periodic_averaging(optax.sgd(0.1), None, 4, sync_variance="no")
  with pytest.raises(ValueError, match=r"nesterov must be True or False, got 'no'"):
    mfopt.block_momentum(optax.sgd(0.1), None, 4, nesterov="no")
  # no anchor (no outer, no comm_dtype): nothing to flatten
  assert mfopt.periodic_averaging(optax.sgd(0.1), None, 4, flat_anchor=True).init(mixed).anchor == ()


def test_average_inner_state_averages_momentum_at_sync():
  p = 4
  tx = mfopt.periodic_averaging(optax.sgd(schedule, momentum=0.9), mfopt.WORKER_AXES, p,
                                average_inner_state=True)
  _, state = run_jax(tx, steps=2 * p)
  trace = averaging.find_averaging_state(state).inner_state[0].trace
  for leaf in jax.tree.leaves(trace):
    a = np.asarray(leaf)
    np.testing.assert_allclose(a, np.broadcast_to(a.mean(0), a.shape), rtol=1e-6, atol=1e-7)
  # Reference: momentum averaged at every sync.
  w = np.broadcast_to(W0, (W, D)).astype(np.float32).copy()
  tr = np.zeros_like(w)
  for k in range(2 * p):
    tr = np_grad(w, k) + np.float32(0.9) * tr
    w = w - np_lr(k) * tr
    if (k + 1) % p == 0:
      w = np.broadcast_to(w.mean(0), (W, D)).copy()
      tr = np.broadcast_to(tr.mean(0), (W, D)).copy()
  got = np.concatenate([np.asarray(trace["a"]), np.asarray(trace["b"]).reshape(W, -1)], axis=1)
  _close(got, tr, rtol=1e-5)
  s = averaging.find_averaging_state(state)
  assert int(np.asarray(s.param_comm.payload_bytes)[0]) == 2 * D * 4


def test_comm_dtype_exchanges_rounded_deltas_but_keeps_fp32_masters():
  p = 5
  tx = mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, p,
                                comm_dtype=jnp.bfloat16)
  got, state = run_jax(tx, steps=p)
  # Reference: anchor (= W0) + mean of the bf16-rounded deltas.
  w = np.broadcast_to(W0, (W, D)).astype(np.float32).copy()
  for k in range(p):
    w = w - np_lr(k) * np_grad(w, k)
  deltas = (w - W0).astype(jnp.bfloat16).astype(np.float32)
  want = W0 + deltas.mean(0)
  exact = w.mean(0)
  np.testing.assert_allclose(got[0], want, rtol=0, atol=4e-3 * np.abs(deltas).max())
  assert np.abs(got[0] - exact).max() > 0  # the exchange really was rounded...
  assert np.abs(got[0] - exact).max() < 1e-2 * np.abs(w - W0).max()  # ...only the deltas
  # ...and the masters are not bf16 numbers.
  assert np.any(got[0] != got[0].astype(jnp.bfloat16).astype(np.float32))
  assert mfopt.comm_totals(state)["payload_bytes"] == D * 2


def test_track_variance_gives_eq7_and_eq11():
  p = 4
  tx = mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, p, track_variance=True,
                                sync_variance=True, trace_length=8)
  _, state = run_jax(tx, steps=3 * p)
  trace = averaging.sync_trace(state)
  # Reference V_t: mean of Var[W_k] (eq. 7) over the p steps of each round (eq. 11).
  w = np.broadcast_to(W0, (W, D)).astype(np.float32).copy()
  v_t, acc, s_ref, var_k = [], 0.0, [], []
  for k in range(3 * p):
    var_k.append(np.mean(np.sum((w.mean(0) - w) ** 2, axis=1)))
    acc += var_k[-1]
    w = w - np_lr(k) * np_grad(w, k)
    if (k + 1) % p == 0:
      s_ref.append(np.mean(np.sum((w.mean(0) - w) ** 2, axis=1)))
      w = np.broadcast_to(w.mean(0), (W, D)).copy()
      v_t.append(acc / p)
      acc = 0.0
  np.testing.assert_allclose(trace["mean_variance"], v_t, rtol=1e-4)
  np.testing.assert_allclose(trace["sync_variance"], s_ref, rtol=1e-4)
  np.testing.assert_array_equal(trace["step"], [4, 8, 12])
  assert v_t[0] > 0
  # Per step (eq. 9 weights each step by its own lr): the last trace_length = 8 of 12 steps.
  per_step = mfopt.variance_trace(state)
  np.testing.assert_array_equal(per_step["step"], np.arange(4, 12))
  np.testing.assert_allclose(per_step["variance"], var_k[4:], rtol=1e-4, atol=1e-12)
  host = mfopt.variance_trace(jax.device_get(state))  # a host copy reads the same
  np.testing.assert_array_equal(host["variance"], per_step["variance"])
  # Fewer steps than trace_length: the steps done so far, from step 0 (no unwritten NaN slot)
  _, early = run_jax(tx, steps=5)
  part = mfopt.variance_trace(early)
  np.testing.assert_array_equal(part["step"], np.arange(5))
  np.testing.assert_allclose(part["variance"], var_k[:5], rtol=1e-4, atol=1e-12)
  with pytest.raises(ValueError, match=r"variance_trace needs .*track_variance=True"):
    mfopt.variance_trace(mfopt.periodic_averaging(
        optax.sgd(0.1), None, p, trace_length=8).init({"w": jnp.ones(2)}))
  # Diagnostic exchanges are counted apart from the algorithm's.
  s = averaging.find_averaging_state(state)
  assert int(np.asarray(s.diagnostics.variance_exchanges)[0]) == 2 * 3 * p
  assert mfopt.comm_totals(state)["all_reduces"] == 3 + 3  # params + S_k per sync


def test_parameter_variance_hook_and_metrics():
  stacked = {"a": jnp.asarray([[0.0, 2.0], [2.0, 0.0]])}
  assert float(averaging.parameter_variance(stacked)) == pytest.approx(2.0)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), None, mfopt.adpsgd_period(
      learning_rate=0.1, sampling_steps=8))
  state = tx.init({"w": jnp.ones(3)})
  m = averaging.averaging_metrics(state)
  assert int(m["period"]) == 4 and int(m["syncs"]) == 0


def test_scheduled_period_decreasing_20_then_5():
  ctl = mfopt.scheduled_period((20, 5), (100,))
  tx = mfopt.periodic_averaging(optax.sgd(0.01), None, ctl, sync_variance=True, trace_length=64)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  upd = jax.jit(tx.update)
  for _ in range(200):
    _, state = upd({"w": jnp.ones(3)}, state, params)
  trace = averaging.sync_trace(state)
  np.testing.assert_array_equal(trace["step"], list(range(20, 101, 20)) + list(range(105, 201, 5)))
  assert len(trace["step"]) == 100 // 20 + 100 // 5


def test_scheduled_period_boundary_step_takes_the_new_period():
  """periods[1] is in force from (0-based) step boundaries[0] on, that step included: with
  (3, 2) and boundary 4, step 4 completes a 2-step round (steps 3-4). Written out by hand; the
  test above never ended a round at its boundary, so side='left' passed it."""
  tx = mfopt.periodic_averaging(optax.sgd(0.01), None, mfopt.scheduled_period((3, 2), (4,)),
                                trace_length=16)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  upd = jax.jit(tx.update)
  for _ in range(10):
    _, state = upd({"w": jnp.ones(3)}, state, params)
  # syncs after steps 2 (p = 3), 4 (p = 2 from step 4), 6, 8: counts 3, 5, 7, 9
  np.testing.assert_array_equal(averaging.sync_trace(state)["step"], [3, 5, 7, 9])


@pytest.mark.parametrize("bad,match", [
    (lambda: mfopt.constant_period(0), r"p must be a positive integer, got 0"),
    (lambda: mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=2),
     r"sampling_steps must be >= warmup_steps \+ p_init = 4"),
    (lambda: mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=10, low=1.5),
     r"low must be in \(0, 1\], got 1.5"),
    (lambda: mfopt.block_momentum(optax.sgd(0.1), None, 4, momentum=1.0),
     r"momentum must be in \[0, 1\), got 1.0"),
    (lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, 4, comm_dtype=jnp.int8),
     r"comm_dtype must be a floating dtype"),
    (lambda: mfopt.scheduled_period((20,), (5,)), r"periods needs one more entry"),
    # low = 0 would never grow the period; a repeated boundary names a period never in force
    (lambda: mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=10, low=0.0),
     r"low must be in \(0, 1\], got 0.0"),
    (lambda: mfopt.scheduled_period((8, 4, 2), (5, 5)), r"boundaries must be strictly increasing"),
    (lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, mfopt.adpsgd_period(
        learning_rate=0.1, sampling_steps=8), sync_variance=False),
     r"sync_variance=False but the controller adpsgd\(.*\) needs S_k"),
])
def test_bad_arguments_are_named(bad, match):
  with pytest.raises(ValueError, match=match):
    bad()


def test_plain_vmap_axis_keeps_the_sync_loop_unbatched_and_matches_numpy():
  """Without shard_map (a bare vmap axis), the sync loop's trip count is unbatched too: its
  condition is one bool, not one per worker (which would run the body, collectives
  included, for all workers whenever any syncs, and select)."""
  tx = mfopt.periodic_averaging(optax.sgd(0.1), "w", 3)
  params = {"x": jnp.asarray(np.arange(12, dtype=np.float32).reshape(4, 3))}
  state = jax.vmap(tx.init, axis_name="w")(params)
  grads = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32))}
  jaxpr = str(jax.make_jaxpr(jax.vmap(tx.update, axis_name="w"))(grads, state, params))
  assert re.search(r"cond_jaxpr=\{[^}]*\w+:bool\[\] = lt", jaxpr), jaxpr
  step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="w"))
  p, want = params, np.arange(12, dtype=np.float32).reshape(4, 3)
  for k in range(3):
    u, state = step(grads, state, p)
    p = optax.apply_updates(p, u)
    want = want - 0.1 * np.asarray(grads["x"])
  np.testing.assert_allclose(np.asarray(p["x"]), np.broadcast_to(want.mean(0), (4, 3)), rtol=1e-6)



def test_cost_model_totals_are_exact_for_adpsgd_mixed_payloads():
  """ADPSGD mixes a parameter and a 4-byte all-reduce; the cost model's per-kind mean is exact
  because each collective's time is affine in its payload."""
  from mfopt import costmodel
  ctl = mfopt.adpsgd_period(learning_rate=schedule, sampling_steps=N // 4, p_init=4)
  tx = mfopt.periodic_averaging(optax.sgd(schedule), mfopt.WORKER_AXES, ctl)
  _, state = run_jax(tx, steps=40)
  syncs = 10  # period 4 throughout the sampling phase
  want = syncs * (costmodel.all_reduce_time(D * 4, W, "10gbit")
                  + costmodel.all_reduce_time(4, W, "10gbit"))
  got = costmodel.communication_time(mfopt.comm_totals(state), W, "10gbit")
  assert got == pytest.approx(want, rel=1e-12)


def _update_and_apply(tx):
  def step(state, grads):
    params, opt_state = state
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(step)


def _apply_transform(tx):
  def step(state, grads):
    params, opt_state = state
    params, opt_state, _ = train.apply_transform(tx, grads, opt_state, params)
    return params, opt_state
  return jax.jit(step)


def test_local_steps_match_the_inner_optimizer():
  """Between syncs the transform is ``inner``. Through ``apply_transform`` (the library's
  path) a local step writes ``p + u`` exactly as ``inner`` + ``optax.apply_updates`` does:
  bitwise equal. Through ``update`` + ``apply_updates`` it gives ``p + ((p + u) - p)``, which
  rounds to ``p + u`` (see periodic_averaging's comment). Parameters of very different
  magnitudes, including zeros, over 30 steps."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64,)) * np.logspace(-8, 3, 64), jnp.float32),
            "b": jnp.zeros((5,), jnp.float32)}
  inner = lambda: optax.sgd(0.05, momentum=0.9)  # noqa: E731
  tx = mfopt.periodic_averaging(inner(), None, 10**9)
  got, direct, want = ((params, tx.init(params)), (params, tx.init(params)),
                       (params, inner().init(params)))
  step_got, step_direct, step_want = (_update_and_apply(tx), _apply_transform(tx),
                                      _update_and_apply(inner()))
  for _ in range(30):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    got, direct, want = step_got(got, grads), step_direct(direct, grads), step_want(want, grads)
  for a, b, c in zip(jax.tree.leaves(got[0]), jax.tree.leaves(direct[0]),
                     jax.tree.leaves(want[0])):
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("kind", ["periodic", "block_momentum", "adpsgd", "bf16_exchange"])
def test_parameter_step_equals_update_and_apply_through_syncs(kind):
  """``apply_transform`` (the parameter step: the sync loop's result is the new parameters)
  against ``update`` + ``optax.apply_updates`` (the optax path) for 4 workers on a ``vmap``
  axis, 12 steps with period 3: parameters within float rounding, and the same state."""
  axis = "w"
  make = {
      "periodic": lambda: mfopt.periodic_averaging(optax.sgd(0.05, momentum=0.9), axis, 3),
      "block_momentum": lambda: mfopt.block_momentum(optax.sgd(0.05), axis, 3, momentum=0.7),
      "adpsgd": lambda: mfopt.periodic_averaging(
          optax.sgd(0.05), axis, mfopt.adpsgd_period(learning_rate=0.05, sampling_steps=4,
                                                     p_init=3)),
      "bf16_exchange": lambda: mfopt.periodic_averaging(optax.sgd(0.05), axis, 3,
                                                        comm_dtype=jnp.bfloat16),
  }[kind]
  tx = make()
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.normal(size=(4, 7, 3)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  state = jax.vmap(tx.init, axis_name=axis)(params)

  def optax_path(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def direct_path(p, s, g):
    p, s, _ = train.apply_transform(tx, g, s, p)
    return p, s

  f_optax = jax.jit(jax.vmap(optax_path, axis_name=axis))
  f_direct = jax.jit(jax.vmap(direct_path, axis_name=axis))
  a, b = (params, state), (params, state)
  for _ in range(12):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    a, b = f_optax(*a, g), f_direct(*b, g)
  for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  sa, sb = averaging.find_averaging_state(a[1]), averaging.find_averaging_state(b[1])
  assert int(sb.param_comm.count[0]) == int(sa.param_comm.count[0]) >= 3
  np.testing.assert_array_equal(sa.controller.period, sb.controller.period)
  np.testing.assert_array_equal(sa.count, sb.count)


def test_train_step_update_norm_is_the_inner_step():
  """The train step's ``update_norm`` for a transform with a parameter step is the norm of the
  inner optimizer's update, on local and sync steps alike (train.apply_transform). Two
  workers with different gradients: on the sync step (step 2) the applied update also holds
  the averaging jump, and the norm still leaves it out."""
  tx = mfopt.periodic_averaging(optax.sgd(0.5), "w", 2)
  params = {"w": jnp.asarray([[1.0, -2.0, 3.0], [0.0, 4.0, -1.0]])}
  grads = {"w": jnp.asarray([[0.3, 0.4, 0.0], [0.0, 0.6, 0.8]])}
  step = jax.jit(jax.vmap(lambda g, s, p: train.apply_transform(tx, g, s, p, optax.tree.norm),
                          axis_name="w"))
  state = jax.vmap(tx.init, axis_name="w")(params)
  inner_norm = 0.5 * np.linalg.norm(np.asarray(grads["w"]), axis=1)  # ||-lr g||: 0.25, 0.5
  for k in range(3):  # steps 1 (local), 2 (sync), 3 (local)
    new, state, norm = step(grads, state, params)
    applied = np.linalg.norm(np.asarray(new["w"] - params["w"]), axis=1)
    np.testing.assert_allclose(norm, inner_norm, rtol=1e-6)
    if k == 1:  # the sync step moved the parameters by more than the inner step
      assert np.all(np.abs(applied - inner_norm) > 1e-3), applied
    params = new


@pytest.mark.parametrize("kind", ["periodic", "block_momentum", "adpsgd"])
def test_local_step_moves_no_more_bytes_than_the_inner_optimizer(kind):
  """The compiled local step under the worker map (what bench_update times), through
  ``apply_transform``: the every-step kernels (``ENTRY``) read and write exactly what
  optax.sgd(momentum)'s step does (24 B/param); the averaging is in the sync loop's body,
  counted apart. With the ``lax.cond`` this replaced, the every-step kernels moved 36 B/param
  for all three (the conditional's results are not aliased with the donated state, so the
  new parameters were written into the conditional's result, then re-added into place)."""
  from experiments import bench_update
  n = 1 << 16
  params = {"w": jnp.ones((n,), jnp.float32)}
  grads = {"w": jnp.full((n,), 0.01, jnp.float32)}
  inner = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
  never = 10**9
  tx = {"periodic": lambda: mfopt.periodic_averaging(inner(), mfopt.WORKER_AXES, never),
        "block_momentum": lambda: mfopt.block_momentum(inner(), mfopt.WORKER_AXES, never),
        "adpsgd": lambda: mfopt.periodic_averaging(
            inner(), mfopt.WORKER_AXES, mfopt.adpsgd_period(learning_rate=0.1,
                                                            sampling_steps=never))}[kind]()

  def traffic(t):
    fn, state, g = bench_update.build_step(t, params, grads, True)
    return bench_update.entry_traffic_bytes(fn.lower(state, g).compile().as_text())

  base, base_branches = traffic(inner())
  assert base == pytest.approx(24 * n, rel=0.01) and base_branches == []
  entry, branches = traffic(tx)
  assert entry <= base * 1.01, (entry / n, base / n)
  assert len(branches) == 1 and branches[0] > 8 * n  # the sync body holds the averaging

def test_block_momentum_momentum_can_be_injected():
  """optax.inject_hyperparams(block_momentum) with the structural arguments static: ``momentum``
  is injected (a jnp scalar) and the transform equals the plain one; changing it takes effect.
  (A ``**kwargs`` signature made inject_hyperparams treat 'kwargs' as an argument.)"""
  static = ("inner", "axis_name", "period", "nesterov", "trace_length")  # the ints that shape it
  p = {"w": jnp.linspace(-1.0, 1.0, 5)}
  grad = lambda q: jax.tree.map(lambda a: a - 0.3, q)  # noqa: E731

  def run(tx, steps=8, new_momentum=None):
    s, q, out = tx.init(p), p, []
    for i in range(steps):
      if new_momentum is not None and i == 4:
        s.hyperparams["momentum"] = jnp.asarray(new_momentum, jnp.float32)
      u, s = jax.jit(tx.update)(grad(q), s, q)
      q = optax.apply_updates(q, u)
      out.append(q["w"])
    return out

  injected = optax.inject_hyperparams(mfopt.block_momentum, static_args=static)(
      optax.sgd(0.1), None, 2, momentum=0.6)
  plain = run(mfopt.block_momentum(optax.sgd(0.1), None, 2, momentum=0.6))
  np.testing.assert_allclose(np.stack(run(injected)), np.stack(plain), rtol=1e-6, atol=1e-7)
  assert np.abs(run(injected, new_momentum=0.0)[-1] - plain[-1]).max() > 1e-3


@pytest.mark.parametrize("make", [
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, 2, trace_length=4),
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, mfopt.adpsgd_period(
        learning_rate=0.1, p_init=2, sampling_steps=3), trace_length=4),
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, 2, outer=optax.sgd(0.7)),
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), None, 2, comm_dtype="bf16"),
    lambda: mfopt.block_momentum(optax.sgd(0.1), None, 2),
], ids=["trace", "adpsgd", "outer", "comm_dtype", "block_momentum"])
def test_state_from_an_eager_init_survives_a_donating_step(make):
  # The usual JAX idiom: an eager tx.init, then a jitted step that donates params and state.
  # The state must own its buffers (optax's do): no array shared between two state fields,
  # with the caller's params (the anchor), or with a constant the transform closes over.
  tx = make()
  params = {"w": jnp.ones((3,), jnp.float32), "b": jnp.ones((2,), jnp.bfloat16)}
  grads = {"w": jnp.full((3,), 0.5, jnp.float32), "b": jnp.full((2,), 0.5, jnp.bfloat16)}
  state = tx.init(params)
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  ids = [id(x) for x in leaves] + [id(x) for x in jax.tree.leaves(params)]
  assert len(ids) == len(set(ids))

  def step(p, s):
    u, s = tx.update(grads, s, p)
    return optax.apply_updates(p, u), s

  donating = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    params, state = donating(params, state)
  # The transform still traces anew (its closed-over constants were not donated).
  p2, _ = jax.jit(lambda p, s: step(p, s))(params, tx.init(params))
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(p2))


@pytest.mark.parametrize("which", ["block_momentum", "outer"])
def test_injected_float32_hyperparameters_on_a_mixed_dtype_tree(which):
  # inject_hyperparams gives float32 hyperparameters; the outer momentum trace of a bf16
  # leaf stays bf16 (the sync loop's carry keeps its dtypes), and the step matches a NumPy
  # re-derivation of block momentum (SPEC: v = mu v + (anchor - mean); w = anchor - v).
  params = {"w": jnp.ones((3,), jnp.float32), "b": jnp.ones((2,), jnp.bfloat16)}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  if which == "block_momentum":
    tx = optax.inject_hyperparams(mfopt.block_momentum, static_args=("period", "trace_length"))(
        optax.sgd(0.1), None, 2, momentum=0.5)
  else:
    tx = mfopt.periodic_averaging(optax.sgd(0.1), None, 2, outer=optax.inject_hyperparams(
        optax.sgd)(learning_rate=1.0, momentum=0.5))
  state, p = tx.init(params), params
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for _ in range(4):
    u, state = step(grads, state, p)
    p = optax.apply_updates(p, u)
  # one worker: mean = local; two local steps of -0.05 each per round
  v, w = 0.0, 1.0
  for _ in range(2):
    v = 0.5 * v + 0.1
    w = w - v
  np.testing.assert_allclose(np.asarray(p["w"]), w, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(p["b"], np.float32), w, rtol=1e-2)
  assert p["b"].dtype == jnp.bfloat16


def _scale_by_value():
  """An optax ExtraArgs transform that needs the extra argument ``value`` (like
  ``optax.contrib.reduce_on_plateau``): it multiplies the updates by it."""
  def update(updates, state, params=None, *, value, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: u * value, updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("wrap", [
    lambda inner: mfopt.periodic_averaging(inner, None, 2),
    lambda inner: mfopt.block_momentum(inner, None, 2),
    lambda inner: optax.chain(mfopt.periodic_averaging(inner, None, 2)),
    lambda inner: mfopt.precision.dynamic_loss_scale(inner),
], ids=["periodic_averaging", "block_momentum", "chain", "dynamic_loss_scale"])
def test_extra_args_reach_the_inner_optimizer(wrap):
  inner = optax.chain(optax.sgd(0.1), _scale_by_value())
  tx = wrap(inner)
  params = {"w": jnp.ones(3)}
  u, _ = jax.jit(lambda s, v: tx.update({"w": jnp.full(3, 0.5)}, s, params, value=v))(
      tx.init(params), jnp.asarray(3.0))
  np.testing.assert_allclose(np.asarray(u["w"]), -0.1 * 0.5 * 3.0, rtol=1e-6)  # step 1: local


def test_a_payload_of_2_gib_or_more_is_counted_not_refused():
  """The byte counter feeds reports only: a ~600M-parameter model's exchange (2.4 GB, more
  than an int32 holds) used to stop tx.init; it is stored as (GiB, remainder) and summed
  exactly on the host, also worker-stacked."""
  big = {"w": jax.ShapeDtypeStruct((600_000_000,), jnp.float32)}
  for tx in (mfopt.sync_gradients("data"),
             mfopt.periodic_averaging(optax.sgd(0.1), "data", 4),
             mfopt.block_momentum(optax.sgd(0.1), "data", 4)):
    jax.eval_shape(tx.init, big)  # no longer raises
  stats = mfopt.comm.init_comm_stats(2_400_000_123, mfopt.comm.CollectiveKind.ALL_REDUCE)
  stats = stats._replace(count=jnp.asarray(3, jnp.int32))
  want = 3 * 2_400_000_123
  assert mfopt.comm_totals(stats)["all_reduce_bytes"] == want
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), stats)
  assert mfopt.comm_totals(stacked)["payload_bytes"] == want
  assert mfopt.comm.payload_of(stacked) == 2_400_000_123
  small = mfopt.comm.init_comm_stats(1000, mfopt.comm.CollectiveKind.ALL_GATHER)
  assert small.payload_bytes.shape == () and mfopt.comm.payload_of(small) == 1000
  with pytest.raises(ValueError, match="payload_bytes must be a non-negative integer, got -1"):
    mfopt.comm.init_comm_stats(-1, mfopt.comm.CollectiveKind.ALL_REDUCE)


@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16])
def test_an_integer_parameter_leaf_is_kept_per_worker_and_floats_are_averaged(comm_dtype):
  """pmean turned an int leaf into a float and the sync loop refused the changed type."""
  tx = mfopt.periodic_averaging(optax.sgd(0.1), "w", 2, comm_dtype=comm_dtype)
  # the same start on every worker (comm_dtype's anchor needs it), different gradients
  params = {"x": jnp.ones((4, 3)), "n": jnp.arange(4, dtype=jnp.int32)}
  grads = {"x": jnp.arange(4.0)[:, None] * jnp.ones((4, 3)), "n": jnp.zeros((4,), jnp.int32)}
  state = jax.vmap(tx.init, axis_name="w")(params)
  step = jax.jit(jax.vmap(lambda g, s, p: mfopt.train.apply_transform(tx, g, s, p)[:2],
                          axis_name="w"))
  for _ in range(2):  # the second step averages
    params, state = step(grads, state, params)
  np.testing.assert_array_equal(params["n"], np.arange(4))
  assert params["n"].dtype == jnp.int32
  # worker i took two steps of -0.1 * i; the mean is 1 - 0.2 * 1.5 on every worker
  np.testing.assert_allclose(params["x"], np.full((4, 3), 0.7), rtol=1e-2 if comm_dtype else 1e-6)
  # the counted payload is the float leaf's alone
  assert int(mfopt.comm_totals(state)["payload_bytes"]) == 3 * (2 if comm_dtype else 4)


@pytest.mark.parametrize("make", [
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), "w", 2, comm_dtype=jnp.bfloat16),
    lambda: mfopt.block_momentum(optax.sgd(0.1), "w", 2),
    lambda: mfopt.hybrid_adabound_lars(num_workers=4, steps_per_epoch=1, warmup_epochs=1)],
    ids=["periodic_averaging_bf16", "block_momentum", "hybrid"])
def test_a_bool_parameter_leaf_is_never_moved_and_floats_are_unchanged_by_it(make):
  """A bool leaf kept with the parameters (a mask) has no subtraction or negation: these three
  raised JAX's dtype error where optax.sgd passes it. Its update is False now, and the float
  leaves follow exactly the run without it, through a scan (the state keeps its dtypes)."""
  tx = make()
  floats = {"x": jnp.ones((4, 3))}
  mixed = dict(floats, mask=jnp.array([[True, False]] * 4))
  grads = {"x": jnp.arange(12.0).reshape(4, 3) / 12.0, "mask": jnp.zeros((4, 2), bool)}

  def run(params):
    def steps(p, s, g):
      def step(carry, _):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None
      return jax.lax.scan(step, (p, s), None, length=3)[0][0]

    init = jax.vmap(tx.init, axis_name="w")(params)
    return jax.vmap(steps, axis_name="w")(params, init, {k: grads[k] for k in params})

  want, got = run(floats), run(mixed)
  np.testing.assert_array_equal(np.asarray(got["mask"]), np.asarray(mixed["mask"]))
  assert got["mask"].dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(want["x"]))
  assert float(jnp.abs(got["x"] - floats["x"]).max()) > 1e-3  # the floats did move


def test_a_flat_anchor_refuses_a_different_tree_of_the_same_size():
  """block_momentum's flat anchor (its default) unravelled the anchor and the outer momentum
  into any tree of the same size: params {a: (2,), b: (3,)} after init on {a: (3,), b: (2,)}
  moved under zero gradients. optax's tree-shaped states raise; this names the leaf."""
  tx = mfopt.block_momentum(optax.sgd(0.1), None, 1)
  state = tx.init({"a": jnp.zeros(3), "b": jnp.zeros(2)})
  with pytest.raises(ValueError, match=r"leaf \['a'\] is \(2,\) float32, init's was \(3,\)"):
    tx.update({"a": jnp.zeros(2), "b": jnp.zeros(3)}, state, {"a": jnp.ones(2), "b": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"its structure is PyTreeDef\(\{'c': \*"):
    tx.update({"c": jnp.zeros(5)}, state, {"c": jnp.ones(5)})
  # the same leaves under other names: the anchor's a would have become b, and b c
  square = mfopt.block_momentum(optax.sgd(0.1), None, 1)
  s2 = square.init({"a": jnp.zeros(3), "b": jnp.zeros(3)})
  with pytest.raises(ValueError, match=r"its structure is PyTreeDef\(\{'b': \*, 'c': \*"):
    square.update({"b": jnp.zeros(3), "c": jnp.zeros(3)}, s2, {"b": jnp.ones(3), "c": jnp.ones(3)})
  same = {"a": jnp.full(3, 2.0), "b": jnp.ones(2)}  # the init's layout: accepted
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, same), state, same)
  # one worker, fresh block momentum: the new params are the local step's, p - 0.1 g
  np.testing.assert_allclose(np.asarray(updates["a"]), np.full(3, -0.1), rtol=1e-6)


def test_a_flat_anchor_checks_dtypes_and_attribute_names_and_picks_the_matching_init_tree():
  """The layout check compares dtypes (a bfloat16 tree of init's shapes is refused), keeps
  attribute names other than nnx's ``.value`` (NamedTuples with other field names are another
  tree) and the leaves' order, and, after init on two trees, names the differing leaf of the
  one with the same leaf paths rather than the other tree's structure."""
  from typing import NamedTuple

  class XY(NamedTuple):
    x: jax.Array
    y: jax.Array

  class UV(NamedTuple):
    u: jax.Array
    v: jax.Array

  tx = mfopt.block_momentum(optax.sgd(0.1), None, 1)
  s_xy = tx.init(XY(jnp.zeros(3), jnp.zeros(3)))
  s_ab = tx.init({"a": jnp.zeros(3), "b": jnp.zeros(2)})
  uv = UV(jnp.ones(3), jnp.ones(3))
  with pytest.raises(ValueError, match=r"its structure is .*namedtuple\[UV\].*, init's was "):
    tx.update(uv, s_xy, uv)
  bf16 = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"leaf \['a'\] is \(3,\) bfloat16, init's was \(3,\) "
                                       r"float32"):
    tx.update(bf16, s_ab, bf16)
  swapped = {"a": jnp.ones(2), "b": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"leaf \['a'\] is \(2,\) float32, init's was \(3,\)"):
    tx.update(swapped, s_ab, swapped)
  # the same leaves in another order (an OrderedDict keeps its insertion order): the anchor's
  # values would land on the other leaves
  import collections
  ordered = mfopt.block_momentum(optax.sgd(0.1), None, 1)
  s_od = ordered.init(collections.OrderedDict(a=jnp.zeros(3), b=jnp.zeros(2)))
  ba = collections.OrderedDict(b=jnp.ones(2), a=jnp.ones(3))
  with pytest.raises(ValueError, match=r"its structure is .*OrderedDict\[\('b', 'a'\)\]"):
    ordered.update(ba, s_od, ba)


@pytest.mark.parametrize("make", [
    lambda flat: mfopt.block_momentum(optax.sgd(0.1), None, 2, momentum=0.5, flat_anchor=flat),
    lambda flat: mfopt.periodic_averaging(optax.sgd(0.1), None, 2, flat_anchor=flat,
                                          outer=optax.sgd(1.0, momentum=0.5))],
    ids=["block_momentum", "periodic_averaging_outer"])
def test_a_flat_anchor_accepts_flax_nnx_optimizer_trees(make):
  """nnx.Optimizer inits on a State of Param variables and updates with the plain arrays: the
  same leaves under another treedef. The flat anchor's layout check compared treedefs and
  refused every nnx update; the flat and the tree-shaped anchor now give the same params
  after a sync and a block-momentum step (5 steps, period 2)."""
  from flax import nnx
  x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
  y = jnp.linspace(0.5, -0.5, 8)

  def run(flat):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make(flat), wrt=nnx.Param)
    for _ in range(5):
      opt.update(model, nnx.grad(lambda m: jnp.mean((m(x)[:, 0] - y) ** 2))(model))
    return model.kernel[...], model.bias[...]

  (k_flat, b_flat), (k_tree, b_tree) = run(True), run(False)
  np.testing.assert_allclose(np.asarray(k_flat), np.asarray(k_tree), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(b_flat), np.asarray(b_tree), rtol=1e-6, atol=1e-7)
  start = nnx.Linear(4, 1, rngs=nnx.Rngs(0)).kernel[...]
  assert float(jnp.abs(k_flat - start).max()) > 1e-2  # it did train


def test_adpsgd_skips_a_sample_at_learning_rate_zero():
  """S_k / lr_k at lr_k = 0 (a warm-up from 0) is NaN: sampled, it froze the period for good."""
  sched = lambda k: jnp.where(k < 2, 0.0, 0.1)  # noqa: E731
  ctl = mfopt.adpsgd_period(learning_rate=sched, sampling_steps=8, p_init=1)
  st = ctl.init()
  for k, s_k in enumerate([0.5, 0.7, 0.2, 0.4]):  # sampled syncs at k = 0..3
    st = ctl.on_sync(st, jnp.asarray(k), jnp.asarray(s_k, jnp.float32))
  assert int(st.c2_count) == 2
  np.testing.assert_allclose(float(st.c2_sum / st.c2_count), (0.2 / 0.1 + 0.4 / 0.1) / 2, rtol=1e-6)
  # after sampling, the period adapts again (it stayed put with a NaN C2)
  st = ctl.on_sync(st, jnp.asarray(8), jnp.asarray(0.01, jnp.float32))  # << 0.7 * lr * C2
  assert int(st.period) == 2


def test_loss_scaling_refuses_a_local_algorithm_whose_local_steps_do_not_skip():
  from mfopt import precision
  params = {"w": jnp.ones(3)}
  for bare in (mfopt.periodic_averaging(optax.sgd(0.1), "w", 2),
               mfopt.block_momentum(optax.sgd(0.1), "w", 2)):
    with pytest.raises(ValueError, match=r"needs their local optimizer wrapped in "
                                         r"mfopt.precision.skip_nonfinite"):
      precision.with_policy(bare, "fp16").init(params)
  ok = mfopt.periodic_averaging(precision.skip_nonfinite(optax.sgd(0.1)), "w", 2)
  precision.with_policy(ok, "fp16").init(params)  # the documented way passes
  precision.dynamic_loss_scale(optax.sgd(0.1)).init(params)  # and anything without averaging


def test_adpsgd_period_never_falls_below_one():
  """Alg. 2's shrink is p = max(1, p - 1): with drift growing every step the period shrinks
  to 1 and stays there (without the floor it went 0, -1, ..., -23 and then took as many grow
  steps to come back; no test noticed)."""
  ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=4, p_init=2)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), "w", ctl, trace_length=64)
  p = {"w": jnp.zeros((2, 3))}
  s = jax.vmap(tx.init)(p)
  step = jax.jit(jax.vmap(tx.update, axis_name="w"))
  periods = []
  for k in range(30):  # the workers' drift grows every step: S_k > 1.3 lr C2, a shrink
    g = {"w": jnp.asarray([[1.0], [-1.0]]) * (k + 1.0) ** 2 * jnp.ones((2, 3))}
    u, s = step(g, s, p)
    p = optax.apply_updates(p, u)
    periods.append(int(averaging.find_averaging_state(s).controller.period[0]))
  assert min(periods) == 1 and periods[-10:] == [1] * 10, periods
  assert min(averaging.sync_trace(s)["period"]) >= 1


def test_adpsgd_without_a_c2_sample_keeps_its_period():
  """lr = 0 through the sampling phase (a delayed warm-up): no valid C2 sample, C2 = 0, and
  every later sync read as a shrink; the period fell to 1 unsaid. It now waits for a sample."""
  sched = lambda k: jnp.where(k < 16, 0.0, 0.1)  # noqa: E731
  ctl = mfopt.adpsgd_period(learning_rate=sched, sampling_steps=12, p_init=4)
  tx = mfopt.periodic_averaging(optax.sgd(sched), "w", ctl, trace_length=64)
  p = {"w": jnp.zeros((2, 3))}
  s = jax.vmap(tx.init)(p)
  step = jax.jit(jax.vmap(tx.update, axis_name="w"))
  for _ in range(40):
    u, s = step({"w": jnp.asarray([[1.0], [-1.0]]) * jnp.ones((2, 3))}, s, p)
    p = optax.apply_updates(p, u)
  ctl_state = averaging.find_averaging_state(s).controller
  assert int(ctl_state.c2_count[0]) == 0 and int(ctl_state.period[0]) == 4


def test_averaging_and_qsgd_counts_saturate_like_optax():
  """A plain + 1 wrapped to -2**31 after 2**31 - 1 steps: warm-up and scheduled periods
  started over. The counts now stop at the int32 maximum, as optax.safe_increment's do."""
  big = jnp.asarray(2**31 - 1, jnp.int32)
  ctl = mfopt.scheduled_period((20, 2), (1000,))
  state, _ = ctl.advance(ctl.init()._replace(count=big))
  assert int(state.count) == 2**31 - 1
  tx = mfopt.qsgd(None)
  qs = tx.init({"w": jnp.ones(3)})._replace(count=big)
  _, qs = tx.update({"w": jnp.ones(3)}, qs)
  assert int(qs.count) == 2**31 - 1
  # the transform's own count (it feeds the controller's K_s, warm-up and learning rate) and
  # the host schedule's replay of it
  pa = mfopt.periodic_averaging(optax.sgd(0.1), None, ctl)
  ps = pa.init({"w": jnp.ones(3)})
  ps = ps._replace(count=big, controller=ps.controller._replace(count=big))
  _, ps = pa.update({"w": jnp.ones(3)}, ps, {"w": jnp.ones(3)})
  assert int(ps.count) == int(ps.controller.count) == 2**31 - 1
  _, (count, _, _) = pa.update.host_schedule.next((2**31 - 1, 0, 2))
  assert count == 2**31 - 1


@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16])
def test_sync_gradients_exchanges_floating_leaves_only(comm_dtype):
  """Integer and bool gradient leaves came back as float means (2.33, 0.33; cast back under
  bf16: 2 and True) and float0 leaves (jax.grad(allow_int=True) of an integer parameter)
  crashed. Non-float leaves now stay each worker's own, as periodic_averaging keeps integer
  leaves, and the payload counts the floating leaves only."""
  g = {"w": jnp.arange(6.0).reshape(3, 2), "i": jnp.array([[1], [2], [4]], jnp.int32),
       "b": jnp.array([[True], [False], [False]])}
  tx = mfopt.sync_gradients("w", comm_dtype)
  out, state = jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="w")(g)
  np.testing.assert_array_equal(out["w"], np.broadcast_to(np.arange(6.0).reshape(3, 2).mean(0),
                                                          (3, 2)))
  for k in ("i", "b"):
    assert out[k].dtype == g[k].dtype
    np.testing.assert_array_equal(out[k], g[k])
  assert mfopt.comm.payload_of(state.comm) == 2 * jnp.dtype(comm_dtype or jnp.float32).itemsize

  def loss(p):
    return jnp.sum(p["w"] ** 2) * p["n"]

  params = {"w": jnp.ones((3, 2)), "n": jnp.ones((3,), jnp.int32)}
  grads = jax.vmap(jax.grad(loss, allow_int=True))(params)
  assert grads["n"].dtype == jax.dtypes.float0
  out, _ = jax.vmap(lambda x: tx.update(x, tx.init(x)), axis_name="w")(grads)
  assert out["n"].dtype == jax.dtypes.float0
  np.testing.assert_allclose(out["w"], 2.0)


def test_adpsgd_inclusive_argument_bounds_and_the_first_sample_after_warmup():
  """The documented bounds are inclusive: ``sampling_steps = warmup_steps + p_init`` (exactly
  one sampled sync), ``low = 1`` and ``high = 1`` are accepted. With ``p_init = 1`` the sync at
  ``k = warmup_steps`` is Alg. 2's first and is sampled (the warm-up syncs are not); an
  off-by-one warm-up test would drop it from C2."""
  ctl = mfopt.adpsgd_period(learning_rate=0.5, sampling_steps=6, p_init=4, warmup_steps=2,
                            low=1.0, high=1.0)
  st = ctl.init()
  for k in range(6):  # warm-up syncs at k = 0, 1 (period 1); then one round of 4: k = 5
    st, due = ctl.advance(st)
    if bool(due):
      st = ctl.on_sync(st, jnp.asarray(k), jnp.asarray(0.25, jnp.float32))
  assert int(st.c2_count) == 1 and int(st.count) == 6 and int(st.period) == 4
  np.testing.assert_allclose(float(st.c2_sum), 0.25 / 0.5, rtol=1e-6)
  with pytest.raises(ValueError, match=r"sampling_steps must be >= warmup_steps \+ p_init = 6 "
                                       r"\(at least one sampled sync for C2\), got 5"):
    mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=5, p_init=4, warmup_steps=2)
  ctl = mfopt.adpsgd_period(learning_rate=0.5, sampling_steps=4, p_init=1, warmup_steps=2)
  st = ctl.init()
  for k, s_k in enumerate([9.0, 9.0, 0.2, 0.6]):  # k = 0, 1 warm-up; k = 2, 3 sampled
    st = ctl.on_sync(st, jnp.asarray(k), jnp.asarray(s_k, jnp.float32))
  assert int(st.c2_count) == 2
  np.testing.assert_allclose(float(st.c2_sum) / 2, (0.2 / 0.5 + 0.6 / 0.5) / 2, rtol=1e-6)


def test_one_worker_counts_no_exchange_but_still_syncs():
  """With ``axis_name=None`` nothing crosses a wire: the parameter exchange, ADPSGD's S_k
  all-reduce and the variance diagnostic's all-reduces all count 0, while the syncs run
  (counting the scalar exchanges regardless would bill a single worker for communication)."""
  ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=2, p_init=2)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), None, ctl, track_variance=True)
  params = {"w": jnp.ones(3)}
  state, upd = tx.init(params), jax.jit(tx.update)
  for _ in range(4):
    _, state = upd({"w": jnp.ones(3)}, state, params)
  assert int(state.diagnostics.syncs) == 2  # after steps 2 and 4 (S_k = 0 = C2: p stays 2)
  assert set(mfopt.comm_totals(state).values()) == {0}
  assert int(state.diagnostics.variance_exchanges) == 0


def test_sync_trace_keeps_the_last_syncs_in_order_when_the_ring_wraps():
  """``trace_length`` is a ring buffer: after 7 syncs with room for 3, ``sync_trace`` gives the
  last three (steps 10, 12, 14) oldest first. A write index that stops at the end, or a read
  that ignores where the ring starts, returns stale or rotated records."""
  tx = mfopt.periodic_averaging(optax.sgd(0.01), None, 2, trace_length=3)
  params = {"w": jnp.ones(3)}
  state, upd = tx.init(params), jax.jit(tx.update)
  for _ in range(14):
    _, state = upd({"w": jnp.ones(3)}, state, params)
  trace = averaging.sync_trace(state)
  np.testing.assert_array_equal(trace["step"], [10, 12, 14])
  np.testing.assert_array_equal(trace["period"], [2, 2, 2])


def test_metrics_c2_is_the_mean_sample_and_parameter_variance_is_across_workers():
  """``averaging_metrics``' C2 is the mean of the samples S_k / lr_k (not their sum), and
  ``parameter_variance`` is eq. 7's mean over workers of ||mean_j w_j - w_i||^2: deviations
  from the worker mean, summed over leaves (not from each worker's own mean)."""
  ctl = mfopt.adpsgd_period(learning_rate=0.5, sampling_steps=8, p_init=1)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), None, ctl)
  st = ctl.init()
  for k, s_k in enumerate([0.1, 0.3]):
    st = ctl.on_sync(st, jnp.asarray(k), jnp.asarray(s_k, jnp.float32))
  m = averaging.averaging_metrics(tx.init({"w": jnp.ones(3)})._replace(controller=st))
  np.testing.assert_allclose(float(m["c2"]), (0.1 / 0.5 + 0.3 / 0.5) / 2, rtol=1e-6)
  stacked = {"a": np.asarray([[0.0, 0.0, 0.0], [2.0, 4.0, 6.0]], np.float32),
             "b": np.asarray([[[1.0]], [[3.0]]], np.float32)}
  # worker mean a: (1, 2, 3), b: 2; each worker is 1 + 4 + 9 + 1 = 15 from it
  want = np.mean(sum(np.sum((x - x.mean(0)) ** 2, axis=tuple(range(1, x.ndim)))
                     for x in stacked.values()))
  assert want == 15.0
  np.testing.assert_allclose(float(averaging.parameter_variance(stacked)), want, rtol=1e-6)


def test_a_flat_anchor_of_a_single_vector_leaf_owns_its_buffer():
  """Raveling one 1-D leaf returns that very array, so block momentum's flat anchor must be a
  copy: an alias of the caller's parameters is deleted by the first donating step. Checked with
  a donating step against block momentum by hand (2 local steps of -0.05 per round)."""
  tx = mfopt.block_momentum(optax.sgd(0.1), None, 2, momentum=0.5)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  assert state.anchor.shape == (3,) and state.anchor is not params["w"]
  assert all(x is not params["w"] for x in jax.tree.leaves(state))

  def step(p, s):
    u, s = tx.update({"w": jnp.full(3, 0.5)}, s, p)
    return optax.apply_updates(p, u), s

  donating = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(4):
    params, state = donating(params, state)
  v, w = 0.0, 1.0
  for _ in range(2):  # d = a - w~ = -0.1 per round; v = 0.5 v + d; w~ += v
    v = 0.5 * v - 0.1
    w += v
  np.testing.assert_allclose(np.asarray(params["w"]), w, rtol=1e-6)
