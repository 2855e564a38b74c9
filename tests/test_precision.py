"""Mixed precision: policy parsing, bf16/fp16 vs fp32 training, fp16 dynamic loss scaling.

Overflow is injected by scaling one worker's inputs so that the *backward* pass overflows
fp16 under the loss scale (the forward pass stays finite).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import mfopt
from mfopt import models, parallel, precision, train

W = 4
FEATURES, CLASSES, B = 6, 5, 8


def _mesh():
  return parallel.make_mesh(jax.devices()[:W])


def _batch(rng, scale_worker=None, factor=1.0):
  x = rng.normal(size=(W, B, FEATURES)).astype(np.float32)
  if scale_worker is not None:
    x[scale_worker] *= factor
  y = rng.integers(0, CLASSES, size=(W, B)).astype(np.int32)
  return {"x": x, "y": y}


def _model(policy):
  return precision.apply_policy(models.get_model("mlp", hidden=(32,), num_classes=CLASSES), policy)


def _np(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


# ----------------------------------------------------------------------------- policy


def test_policy_parsing_and_errors():
  p = precision.get_policy("params=float32,compute=bfloat16,output=float32")
  assert p.compute == jnp.bfloat16 and not p.needs_loss_scaling
  assert precision.get_policy("fp16").needs_loss_scaling
  assert precision.get_policy("compute=fp32").compute == jnp.float32
  m = precision.apply_policy(models.get_model("cnn"), "bf16")
  assert m.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="params"):
    precision.get_policy("params=bfloat16,compute=bfloat16")
  with pytest.raises(ValueError, match="compute"):
    precision.get_policy("compute=int8")
  with pytest.raises(ValueError, match="policy field"):
    precision.get_policy("weights=float32")
  with pytest.raises(ValueError, match="backoff_factor"):
    precision.dynamic_loss_scale(optax.sgd(0.1), backoff_factor=2.0)
  # named errors, not TypeErrors or silent acceptance of bools and strings
  for kw, match in ((dict(init_scale="1"), r"init_scale must be a positive number, got '1'"),
                    (dict(init_scale=True), r"init_scale must be a positive number, got True"),
                    (dict(growth_factor=float("nan")), r"growth_factor must be >= 1, got nan"),
                    (dict(backoff_factor="0.5"), r"backoff_factor must be in \(0, 1\), got '0.5'")):
    with pytest.raises(ValueError, match=match):
      precision.dynamic_loss_scale(optax.sgd(0.1), **kw)


def test_scale_rule_equals_flax_dynamic_scale():
  """next_dynamic_scale(ds, finite) reproduces DynamicScale.value_and_grad's own update."""
  rng = np.random.default_rng(0)
  flags = rng.random(40) < 0.8
  ours = DynamicScale(growth_interval=3, fin_steps=jnp.zeros([], jnp.int32),
                      scale=jnp.asarray(2.0 ** 10, jnp.float32))
  theirs = ours
  fn = jax.jit(lambda ds, c: ds.value_and_grad(lambda x: x * c)(jnp.float32(1.0)))
  scales = []
  for f in flags:
    theirs, finite, _, _ = fn(theirs, jnp.float32(1.0 if f else np.inf))
    assert bool(finite) == bool(f)
    ours = precision.next_dynamic_scale(ours, jnp.asarray(f))
    assert float(ours.scale) == float(theirs.scale)
    assert int(ours.fin_steps) == int(theirs.fin_steps)
    scales.append(float(ours.scale))
  assert max(scales) > 2.0 ** 10 and min(scales) < 2.0 ** 10  # it grew and shrank


# ----------------------------------------------------------------------------- accuracy


@pytest.fixture(scope="module")
def fifty_steps():
  """Final params after 50 synchronous SGD steps in fp32, bf16 and fp16 (+loss scaling)."""
  mesh = _mesh()
  out = {}
  for name in ("fp32", "bf16", "fp16"):
    model = _model(name)
    tx = precision.with_policy(
        optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1, momentum=0.9)), name)
    rng = np.random.default_rng(7)
    b0 = _batch(rng)
    state = train.init_train_state(model, tx, b0["x"][0], num_workers=W, mesh=mesh, seed=1)
    p0 = parallel.unstack_worker(state.params)
    step = train.make_train_step(model, tx, mesh=mesh, num_workers=W)
    queued = []
    for _ in range(50):
      state, metrics = step(state, parallel.shard_workers(_batch(rng), mesh))
      queued.append(metrics)
      train.wait_for_old_steps(queued)  # 50 queued all-reduce steps could deadlock XLA:CPU
    out[name] = (p0, parallel.unstack_worker(state.params), _np(metrics), _np(state.opt_state))
  return out


@pytest.mark.parametrize("name,tol", [("bf16", 5e-2), ("fp16", 1e-2)])  # measured 2.4e-2, 2.0e-3
def test_low_precision_stays_close_to_fp32_over_50_steps(fifty_steps, name, tol):
  """Stated tolerance: ||p_lp - p_fp32|| <= tol * ||p_fp32 - p_0|| (relative to the distance moved)."""
  p0, p32, _, _ = fifty_steps["fp32"]
  _, plp, metrics, opt_state = fifty_steps[name]
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  moved = np.linalg.norm(flat(p32) - flat(p0))
  err = np.linalg.norm(flat(plp) - flat(p32)) / moved
  assert moved > 0.5
  assert err < tol, f"{name}: relative deviation {err:.2e}"
  assert err > 1e-7  # it really computed in low precision
  # Master weights stay float32.
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(plp))
  if name == "fp16":
    assert (metrics["overflow"] == 0).all() and (metrics["loss_scale"] > 0).all()


# ----------------------------------------------------------------------------- overflow


def test_fp16_overflow_sync_skips_on_every_worker_and_halves_scale():
  mesh = _mesh()
  model = _model("fp16")
  tx = precision.dynamic_loss_scale(
      optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1, momentum=0.9)))
  rng = np.random.default_rng(0)
  b = _batch(rng)
  state = train.init_train_state(model, tx, b["x"][0], num_workers=W, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, donate=False)
  for _ in range(2):
    state, m = step(state, parallel.shard_workers(_batch(rng), mesh))
  assert (np.asarray(m["overflow"]) == 0).all()
  before = _np(state)
  scale0 = before.opt_state.dynamic_scale.scale[0]
  # Worker 2's inputs x300: its fp16 backward pass overflows under the loss scale.
  state, m = step(state, parallel.shard_workers(_batch(rng, scale_worker=2, factor=300.0), mesh))
  after = _np(state)
  assert np.isfinite(np.asarray(m["loss"])).all()  # the forward pass was fine
  np.testing.assert_array_equal(np.asarray(m["overflow"]), np.ones(W))
  np.testing.assert_array_equal(after.opt_state.dynamic_scale.scale, np.full(W, scale0 / 2))
  # Skipped on every worker: parameters, momentum, BN-free model state all unchanged.
  for a, c in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params)):
    np.testing.assert_array_equal(a, c)
  trace_after = after.opt_state.inner_state[1][0].trace
  trace_before = before.opt_state.inner_state[1][0].trace
  jax.tree.map(np.testing.assert_array_equal, trace_after, trace_before)
  # The all-reduce did run and is counted; the non-finite flag needed no extra collective.
  assert mfopt.comm_totals(after.opt_state)["all_reduces"] == 3
  # Next step is normal again at the halved scale, and the replicas are still identical.
  state, m = step(state, parallel.shard_workers(_batch(rng), mesh))
  final = _np(state)
  assert (np.asarray(m["overflow"]) == 0).all()
  np.testing.assert_array_equal(final.opt_state.dynamic_scale.scale, np.full(W, scale0 / 2))
  for leaf in jax.tree.leaves(final.params):
    assert (leaf == leaf[:1]).all()
  assert any(np.abs(a - c).max() > 0 for a, c in zip(jax.tree.leaves(final.params),
                                                     jax.tree.leaves(before.params)))


def _local_tx(period):
  inner = precision.skip_nonfinite(optax.sgd(0.1, momentum=0.9))
  if period is None:  # local steps only, no averaging: the reference for the averaged run
    return precision.dynamic_loss_scale(inner)
  return precision.dynamic_loss_scale(mfopt.periodic_averaging(inner, mfopt.WORKER_AXES, period))


def test_fp16_overflow_local_algorithm_skips_one_worker_and_averages_on_schedule():
  mesh = _mesh()
  model = _model("fp16")
  txs = {"avg": _local_tx(2), "local": _local_tx(None)}
  rng = np.random.default_rng(1)
  batches = [_batch(rng), _batch(rng, scale_worker=1, factor=300.0), _batch(rng),
             _batch(rng, scale_worker=3, factor=300.0), _batch(rng)]
  states, steps = {}, {}
  for k, tx in txs.items():
    states[k] = train.init_train_state(model, tx, batches[0]["x"][0], num_workers=W, mesh=mesh)
    steps[k] = train.make_train_step(model, tx, mesh=mesh, num_workers=W, donate=False)
  hist = {k: [] for k in txs}
  for b in batches[:2]:
    for k in txs:
      states[k], m = steps[k](states[k], parallel.shard_workers(b, mesh))
      hist[k].append((_np(states[k]), _np(m)))
  # Step 0 (local) identical in both runs; step 1 is due: worker 1 overflowed and skipped its
  # local step, yet the averaging happened, over worker 1's unchanged parameters.
  s_avg, m_avg = hist["avg"][1]
  s_loc, m_loc = hist["local"][1]
  np.testing.assert_array_equal(m_avg["overflow"], [0, 1, 0, 0])
  np.testing.assert_array_equal(s_avg.opt_state.dynamic_scale.scale, [2.0 ** 15, 2.0 ** 14] + [2.0 ** 15] * 2)
  p_before = hist["local"][0][0].params
  for leaf_loc, leaf_before in zip(jax.tree.leaves(s_loc.params), jax.tree.leaves(p_before)):
    np.testing.assert_array_equal(leaf_loc[1], leaf_before[1])  # worker 1 skipped
    assert np.abs(leaf_loc[0] - leaf_before[0]).max() > 0       # worker 0 stepped
  for leaf_avg, leaf_loc in zip(jax.tree.leaves(s_avg.params), jax.tree.leaves(s_loc.params)):
    np.testing.assert_allclose(leaf_avg, np.broadcast_to(leaf_loc.mean(0), leaf_avg.shape),
                               rtol=1e-6, atol=1e-7)
  avg_state = mfopt.averaging.find_averaging_state(s_avg.opt_state)
  assert (np.asarray(avg_state.count) == 2).all() and (np.asarray(avg_state.param_comm.count) == 1).all()
  # Worker 1's local optimizer state (momentum) is the one from before the skipped step.
  tr_now = avg_state.inner_state.inner_state[0].trace
  tr_before = mfopt.averaging.find_averaging_state(hist["avg"][0][0].opt_state).inner_state.inner_state[0].trace
  for a, c in zip(jax.tree.leaves(tr_now), jax.tree.leaves(tr_before)):
    np.testing.assert_array_equal(a[1], c[1])
    assert np.abs(a[0] - c[0]).max() > 0
  # Steps 2 (local, worker 3 overflows at 3) and 3 (due): averaging still every 2 steps.
  state = states["avg"]
  for b in batches[2:4]:
    state, m = steps["avg"](state, parallel.shard_workers(b, mesh))
  avg_state = mfopt.averaging.find_averaging_state(_np(state).opt_state)
  assert (np.asarray(avg_state.count) == 4).all() and (np.asarray(avg_state.param_comm.count) == 2).all()
  for leaf in jax.tree.leaves(_np(state).params):
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(_np(m)["overflow"], [0, 0, 0, 1])
  np.testing.assert_array_equal(_np(state).opt_state.overflows, [0, 1, 0, 1])


def test_plain_optimizer_compiles_to_the_same_step():
  """Without dynamic_loss_scale the train step's program is unchanged (no loss-scale ops)."""
  mesh = _mesh()
  model = _model("fp32")
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1))
  b = _batch(np.random.default_rng(0))
  state = train.init_train_state(model, tx, b["x"][0], num_workers=W, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, donate=False)
  batch = parallel.shard_workers(b, mesh)
  _, metrics = step(state, batch)
  assert set(metrics) == {"loss", "accuracy", "update_norm"}
  assert precision.loss_scale_of(state.opt_state) is None
  # The loss-scaled step adds finiteness checks of the gradients/updates; the plain one has
  # none of them (it is the step a plain optimizer would compile).
  plain_checks = step.lower(state, batch).as_text().count("stablehlo.is_finite")
  scaled_tx = precision.dynamic_loss_scale(tx)
  scaled_state = train.init_train_state(model, scaled_tx, b["x"][0], num_workers=W, mesh=mesh)
  scaled = train.make_train_step(model, scaled_tx, mesh=mesh, num_workers=W, donate=False)
  scaled_checks = scaled.lower(scaled_state, batch).as_text().count("stablehlo.is_finite")
  assert scaled_checks > plain_checks


# ----------------------------------------------------------------------------- fp16 all-reduce


def _sync_fp16(grads, scale, *, wrap):
  """sync_gradients(('a', 'b'), fp16) over a 2 x 2 grid of workers (nested vmap)."""
  sync = mfopt.sync_gradients(("a", "b"), comm_dtype=jnp.float16)
  tx = precision.dynamic_loss_scale(optax.chain(sync, optax.sgd(1.0)), init_scale=scale) \
      if wrap else sync

  def one(g):
    state = tx.init({"w": g})
    if not wrap:
      return tx.update({"w": g}, state, loss_scale=scale)[0]["w"], None
    u, s = tx.update({"w": g}, state, {"w": g})
    return -u["w"], s.dynamic_scale.scale

  return jax.vmap(jax.vmap(one, axis_name="b"), axis_name="a")(grads.reshape(2, 2, -1))


def test_fp16_all_reduce_sends_loss_scaled_gradients():
  # Gradients around 1e-8, below fp16's smallest subnormal (6e-8): the unscaled fp16 exchange
  # flushes almost all of them to zero; loss-scaled and pre-divided they arrive within fp16's
  # relative precision of the float32 mean (a NumPy reference).
  rng = np.random.default_rng(0)
  g = (1e-8 * rng.normal(size=(4, 64))).astype(np.float32)
  ref = g.mean(axis=0)
  unscaled, _ = _sync_fp16(jnp.asarray(g), None, wrap=False)
  assert np.mean(np.asarray(unscaled)[0, 0] == 0) > 0.5
  scaled, _ = _sync_fp16(jnp.asarray(g), 2.0 ** 15, wrap=False)
  for out in np.asarray(scaled).reshape(4, -1):
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
  # Through dynamic_loss_scale, which passes its scale to the chain: the same numbers.
  via, scales = _sync_fp16(jnp.asarray(g), 2.0 ** 15, wrap=True)
  np.testing.assert_allclose(np.asarray(via).reshape(4, -1)[0], ref, rtol=0,
                             atol=2e-3 * np.abs(ref).max())
  np.testing.assert_array_equal(np.asarray(scales), np.full((2, 2), 2.0 ** 15))


def test_fp16_all_reduce_without_loss_scaling_overflows_only_where_the_mean_would():
  # 4 workers' gradients of 3e4: their fp16 sum (1.2e5) is past fp16's 65504, their mean is
  # not. lax.pmean sums first (inf on every worker); pre-divided, the mean arrives.
  g = np.full((4, 8), 3e4, np.float32)
  g[:, 0] = [6e4, 6e4, -6e4, 3e4]  # mean 15000
  out, _ = _sync_fp16(jnp.asarray(g), None, wrap=False)
  out = np.asarray(out).reshape(4, -1)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, np.broadcast_to(g.mean(0), (4, 8)), rtol=1e-3)


def test_fp16_all_reduce_overflow_is_an_overflowing_step_on_every_worker():
  # One worker's gradient 20 x scale 2**15 / 4 workers = 163840 > 65504: the fp16 sum is inf
  # everywhere, so every worker reverts the step and halves its scale (the scales stay equal).
  g = np.full((4, 8), 1e-3, np.float32)
  g[3] = 20.0
  upd, scales = _sync_fp16(jnp.asarray(g), 2.0 ** 15, wrap=True)
  np.testing.assert_array_equal(np.asarray(upd), 0.0)
  np.testing.assert_array_equal(np.asarray(scales), np.full((2, 2), 2.0 ** 14))
  # At a scale where it fits, the same gradients are averaged (float32 reference).
  upd, scales = _sync_fp16(jnp.asarray(g), 2.0 ** 10, wrap=True)
  np.testing.assert_allclose(np.asarray(upd).reshape(4, -1), np.broadcast_to(g.mean(0), (4, 8)),
                             rtol=2e-3)


def test_fp16_all_reduce_in_the_train_step_matches_fp32_exchange():
  # On the device mesh (shard_map axis x vmap axis): one fp16-policy step exchanging fp16
  # gradients lands within fp16 rounding of the same step exchanging float32 ones.
  mesh = _mesh()
  model = _model("fp16")
  rng = np.random.default_rng(3)
  b = _batch(rng)
  out = {}
  for name, dt in (("fp16", jnp.float16), ("fp32", None)):
    tx = precision.dynamic_loss_scale(
        optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES, comm_dtype=dt), optax.sgd(0.5)))
    state = train.init_train_state(model, tx, b["x"][0], num_workers=W, mesh=mesh)
    step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, donate=False)
    init = _np(state.params)
    state, m = step(state, parallel.shard_workers(b, mesh))
    assert (np.asarray(m["overflow"]) == 0).all()
    out[name] = jax.tree.map(lambda a, c: a - c, _np(state.params), init)
  for a, c in zip(jax.tree.leaves(out["fp16"]), jax.tree.leaves(out["fp32"])):
    assert np.abs(c).max() > 0
    np.testing.assert_allclose(a, c, rtol=0, atol=2e-3 * np.abs(c).max())


def test_fit_logs_the_learning_rate_of_the_optimizers_own_count_under_fp16_overflows():
  """Overflowing fp16 steps do not advance the optimizer's count: the logged learning_rate is
  the schedule at that count (read back from the inner optax state), not at the global step."""
  from mfopt import data
  dataset = data.load("synthetic", num_train=256, num_test=32, input_shape=(FEATURES,),
                      num_classes=CLASSES)
  schedule = optax.linear_schedule(0.0, 0.01, transition_steps=100)  # lr grows with the count
  # 2**40 overflows fp16 in the backward pass until halving brings the scale down
  tx = precision.dynamic_loss_scale(
      optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(schedule)),
      init_scale=2.0 ** 40)
  res = train.fit(model=_model("fp16"), tx=tx, dataset=dataset, num_workers=W,
                  per_worker_batch=B, num_steps=40, mesh=_mesh(), log_every=20,
                  learning_rate=schedule, progress=False)
  s = _np(res.state.opt_state)
  overflows = int(s.overflows[0])
  count = int(s.inner_state[1][-1].count[0])  # optax.sgd's scale_by_learning_rate count
  assert 5 < overflows < 40 and count == 40 - overflows
  assert res.history[-1]["learning_rate"] == pytest.approx(float(schedule(count - 1)), rel=1e-6)
  assert res.history[-1]["learning_rate"] < float(schedule(39))  # not the nominal value


@pytest.mark.parametrize("wrap", [
    lambda tx: precision.skip_nonfinite(tx),
    lambda tx: precision.dynamic_loss_scale(optax.apply_if_finite(tx, 5)),
    lambda tx: precision.dynamic_loss_scale(precision.skip_nonfinite(tx))],
    ids=["skip_nonfinite", "dls(apply_if_finite)", "dls(skip_nonfinite)"])
@pytest.mark.parametrize("comm", [
    lambda: mfopt.periodic_averaging(precision.skip_nonfinite(optax.sgd(0.1)), "w", 2),
    lambda: optax.chain(mfopt.sync_gradients("w"), optax.sgd(0.1))],
    ids=["periodic_averaging", "sync_gradients"])
def test_a_per_worker_skip_around_a_communicating_transform_is_refused(wrap, comm):
  """Documented, not enforced: one worker's overflow left its averaging counter a step behind
  the others' ([4 4 3 4] after 4 steps), and across devices a collective would wait."""
  with pytest.raises(ValueError, match=r"must wrap a local optimizer, got one that communicates"):
    jax.vmap(wrap(comm()).init, axis_name="w")({"w": jnp.zeros((2, 3))})


def test_policy_object_with_the_parsers_dtype_names_and_numpy_bn_momentum():
  assert precision.get_policy(precision.Policy(compute="bf16")).name == \
      "params=float32,compute=bfloat16,output=float32"
  model = mfopt.models.get_model("cnn", features=(4,), num_classes=3, bn_momentum=np.float32(0.9))
  assert model.bn_momentum == np.float32(0.9)
  with pytest.raises(ValueError, match=r"bn_momentum must be in \[0, 1\), got False"):
    mfopt.models.get_model("cnn", features=(4,), num_classes=3, bn_momentum=False)


def test_skip_nonfinite_wraps_a_one_worker_transform():
  """axis_name=None exchanges nothing: its counters hold no payload, and wrapping it is fine."""
  for tx in (optax.chain(mfopt.sync_gradients(None), optax.sgd(0.1)),
             mfopt.periodic_averaging(optax.sgd(0.1), None, 2)):
    state = precision.skip_nonfinite(tx).init({"w": jnp.zeros(3)})
    assert state is not None
  # under jit the payload is a tracer: the wrapped transform counts as communicating
  with pytest.raises(ValueError, match=r"must wrap a local optimizer"):
    jax.jit(precision.skip_nonfinite(
        optax.chain(mfopt.sync_gradients("w"), optax.sgd(0.1))).init)({"w": jnp.zeros(3)})


def test_half_is_ieee_float16_with_loss_scaling():
  """The dtype name "half" is IEEE binary16 (NumPy's ``np.half``), as "fp16" is: mapping it to
  bfloat16 would silently drop the dynamic loss scale float16's narrow range needs."""
  half = np.dtype(np.half)
  p = precision.get_policy("half")
  assert jnp.dtype(p.compute) == half == jnp.dtype(precision.get_policy("fp16").compute)
  assert p.needs_loss_scaling
  assert jnp.dtype(precision.get_policy("compute=half").compute) == half


def test_with_policy_checks_loss_scale_arguments_whatever_the_policy():
  """A misspelt or invalid loss-scale argument passed silently for bf16 / fp32 policies and
  failed only once the config switched to fp16 (a review)."""
  for policy in ("fp32", "bf16", "fp16"):
    with pytest.raises(TypeError, match="init_scal"):
      precision.with_policy(optax.sgd(0.1), policy, init_scal=5.0)
    with pytest.raises(ValueError, match="growth_factor"):
      precision.with_policy(optax.sgd(0.1), policy, growth_factor=-3)
  tx = optax.sgd(0.1)
  assert precision.with_policy(tx, "bf16", init_scale=8.0) is tx  # valid: unchanged
  scaled = precision.with_policy(tx, "fp16", init_scale=8.0)
  assert float(precision.loss_scale_of(scaled.init(jnp.zeros(2))).scale) == 8.0


def test_a_local_algorithm_needs_skip_nonfinite_not_any_apply_if_finite():
  """optax.apply_if_finite with a finite max_consecutive_errors passed the local-algorithm
  check, then let a non-finite update through after that many: dynamic_loss_scale reverted
  that worker alone and the workers' averaging counters parted ([2, 3] after 5 steps). Only
  skip_nonfinite's marked state is accepted; it keeps its type through update (a jit or scan
  carry must not change structure)."""
  vinit = lambda tx: jax.vmap(tx.init, axis_name="w")({"w": jnp.zeros((2, 3))})  # noqa: E731
  bad = precision.dynamic_loss_scale(
      mfopt.periodic_averaging(optax.apply_if_finite(optax.sgd(0.1), 2), "w", 4))
  with pytest.raises(ValueError, match=r"needs their local optimizer wrapped in mfopt.precision"
                                       r".skip_nonfinite.*max_consecutive_errors"):
    vinit(bad)
  tx = precision.skip_nonfinite(optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(3)})
  assert type(state) is precision.SkipNonfiniteState
  for g in (jnp.ones(3), jnp.full(3, jnp.nan)):
    u, state = jax.jit(tx.update)({"w": g}, state)
    assert type(state) is precision.SkipNonfiniteState
  assert int(state.total_notfinite) == 1 and float(jnp.abs(u["w"]).max()) == 0.0
  good = precision.dynamic_loss_scale(mfopt.periodic_averaging(tx, "w", 4))
  assert len(mfopt.comm.states_of(vinit(good), precision.SkipNonfiniteState)) == 1


def test_init_scale_must_be_a_normal_float32_and_loss_scales_do_not_nest():
  """init_scale=1e39 became inf in float32: every gradient NaN, every step reverted, and
  inf x 0.5 stays inf, so training stalled for good; a nested dynamic_loss_scale built and
  failed in update with a TypeError about keyword arguments."""
  big = float(np.finfo(np.float32).max)
  for bad in (1e39, 1e-46):
    with pytest.raises(ValueError, match=rf"init_scale must be a normal float32 number, in "
                                         rf"\[1.18e-38, 3.403e\+38\], got {re.escape(repr(bad))}"):
      precision.dynamic_loss_scale(optax.sgd(0.1), init_scale=bad)
  s = precision.dynamic_loss_scale(optax.sgd(0.1), init_scale=big).init({"w": jnp.zeros(2)})
  assert float(s.dynamic_scale.scale) == big
  nested = precision.dynamic_loss_scale(precision.dynamic_loss_scale(optax.sgd(0.1)))
  with pytest.raises(ValueError, match=r"must not wrap another dynamic_loss_scale"):
    nested.init({"w": jnp.zeros(2)})


def test_float16_gradients_exchanged_in_their_own_dtype_are_divided_first_and_scaled():
  """sync_gradients chose the divide-first (and loss-scaled) exchange on comm_dtype alone:
  float16 gradients with comm_dtype=None summed first, so 8 workers' 1e4 came back inf where
  the mean (NumPy) is finite, and gradients below fp16's subnormals were sent unscaled. Each
  leaf now goes by the dtype it crosses the wire in; float32 leaves beside them are a plain
  pmean."""
  rng = np.random.default_rng(4)
  big = np.full((8, 4), 1e4, np.float16) + rng.integers(0, 8, (8, 4)).astype(np.float16)
  # fp16 subnormals (~17 ulps of 6e-8 each): divided by 8 unscaled they keep ~2 ulps
  tiny = (1e-6 * rng.normal(size=(8, 64))).astype(np.float16)
  f32 = rng.normal(size=(8, 3)).astype(np.float32)
  for comm_dtype in (None, jnp.float16):
    tx = mfopt.sync_gradients("w", comm_dtype)
    step = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="w")
    out = step({"big": jnp.asarray(big), "f32": jnp.asarray(f32)})
    assert out["big"].dtype == jnp.float16 and out["f32"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out["big"][0], np.float32),
                               big.astype(np.float64).mean(0), rtol=4e-3)  # a few fp16 ulps
    want_f32 = f32.mean(0) if comm_dtype is None else f32.astype(np.float16).astype(
        np.float64).mean(0)
    np.testing.assert_allclose(np.asarray(out["f32"][0]), want_f32, rtol=2e-3, atol=1e-3)
  # loss-scaled under dynamic_loss_scale's extra argument, comm_dtype=None: float16 leaves
  # scaled (the tiny values survive the wire), a float32 leaf untouched by the scale
  tx = mfopt.sync_gradients("w")
  step = jax.vmap(lambda g: tx.update(g, tx.init(g), loss_scale=jnp.float32(2.0 ** 15))[0],
                  axis_name="w")
  out = step({"tiny": jnp.asarray(tiny), "f32": jnp.asarray(f32)})
  ref = tiny.astype(np.float64).mean(0)
  ulp = 2.0 ** -24  # fp16's subnormal spacing: the result is cast back to fp16
  assert np.abs(np.asarray(out["tiny"][0], np.float64) - ref).max() <= ulp
  np.testing.assert_allclose(np.asarray(out["f32"][0]), f32.mean(0), rtol=1e-6, atol=1e-7)
  unscaled = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="w")(
      {"tiny": jnp.asarray(tiny)})["tiny"][0]  # divided first without a scale: 8 roundings
  assert np.abs(np.asarray(unscaled, np.float64) - ref).max() > ulp


def test_init_scale_range_includes_the_smallest_normal_float32():
  """The accepted range is closed at both ends: the smallest normal float32 (2**-126) is a
  valid loss scale and is stored exactly; a strict lower bound refused it."""
  tiny = 2.0**-126
  assert tiny == float(np.finfo(np.float32).tiny)
  s = precision.dynamic_loss_scale(optax.sgd(0.1), init_scale=tiny).init({"w": jnp.zeros(2)})
  assert float(s.dynamic_scale.scale) == tiny


def test_skip_nonfinite_passes_extra_arguments_to_the_inner_transform():
  """skip_nonfinite's update forwards keyword arguments (e.g. reduce_on_plateau's value) to
  the wrapped transform; dropping them fails any inner transform that needs one."""
  def scale_by_value():
    def update(updates, state, params=None, *, value, **extra):
      del params, extra
      return jax.tree.map(lambda u: u * value, updates), state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

  tx = precision.skip_nonfinite(scale_by_value())
  state = tx.init({"w": jnp.zeros(2)})
  u, state = tx.update({"w": jnp.array([1.0, -2.0])}, state, value=3.0)
  np.testing.assert_array_equal(np.asarray(u["w"]), [3.0, -6.0])
  assert type(state) is precision.SkipNonfiniteState


def test_loss_scale_growth_saturates_at_the_largest_float32():
  """A scale at float32's largest value that is due to grow stays there (flax's rule clamps the
  growth): an unclamped doubling gives inf, inf times the backoff stays inf, and every later
  step would then overflow and be reverted for good."""
  big = float(np.finfo(np.float32).max)
  tx = precision.dynamic_loss_scale(optax.sgd(1.0), init_scale=big, growth_interval=1)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for _ in range(3):  # fin_steps 0 -> 1, then a growth is due at every step
    u, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert float(state.dynamic_scale.scale) == big and bool(state.finite)
    np.testing.assert_array_equal(np.asarray(u["w"]), [-1.0, -1.0])


def test_skip_nonfinite_skips_any_number_of_consecutive_overflows():
  """A local optimizer under fp16 may overflow many steps in a row while its scale backs off
  (15 halvings from 2**15 to 1): every such step is skipped. A wrapper that gives up after a
  few (optax.apply_if_finite's max_consecutive_errors) lets an inf update into the weights."""
  tx = precision.skip_nonfinite(optax.sgd(0.1, momentum=0.9))
  state = tx.init({"w": jnp.zeros(3)})
  update = jax.jit(tx.update)
  for _ in range(20):
    u, state = update({"w": jnp.full(3, jnp.inf)}, state)
    np.testing.assert_array_equal(np.asarray(u["w"]), np.zeros(3))
  u, state = update({"w": jnp.ones(3)}, state)  # momentum untouched: the first step is -lr * g
  np.testing.assert_allclose(np.asarray(u["w"]), np.full(3, -0.1), rtol=1e-6)
