"""The worker-stacked train step: synchronous equivalence, identical replicas, bf16 exchange."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from mfopt import models, parallel, train

LR = 0.3


def _model():
  return models.get_model("mlp", hidden=(16, 16), num_classes=5)


def _batch(rng, workers, per_worker, features=6):
  x = rng.normal(size=(workers, per_worker, features)).astype(np.float32)
  y = rng.integers(0, 5, size=(workers, per_worker)).astype(np.int32)
  return {"x": x, "y": y}


def _single_worker_sgd(model, params, x, y):
  """Reference: one plain SGD step of one model on the concatenated global batch."""
  def loss(p):
    logits, _ = models.apply_model(model, p, {}, x, train=True)
    return train.classification_loss(logits, y)[0]
  grads = jax.grad(loss)(params)
  return jax.tree.map(lambda p, g: p - LR * g, params, grads)


@pytest.mark.parametrize("num_workers,num_devices", [(8, 8), (16, 8), (4, 1)])
def test_sync_step_equals_single_worker_on_concatenated_batch(num_workers, num_devices):
  mesh = parallel.make_mesh(jax.devices()[:num_devices])
  model = _model()
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(LR))
  b = _batch(np.random.default_rng(num_workers), num_workers, 4)
  state = train.init_train_state(model, tx, b["x"][0], num_workers=num_workers, mesh=mesh, seed=3)
  params0 = parallel.unstack_worker(state.params)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=num_workers)
  state, _ = step(state, parallel.shard_workers(b, mesh))

  expected = _single_worker_sgd(model, params0, b["x"].reshape(-1, 6), b["y"].reshape(-1))
  stacked = jax.device_get(state.params)
  for w in range(num_workers):
    got = jax.tree.map(lambda a: a[w], stacked)
    chex_close = jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6),
                              got, expected)
    del chex_close
  # The step really moved the parameters (a no-op would fail above only by luck).
  moved = jax.tree.map(lambda a, e: float(np.abs(a - e).max()), expected, params0)
  assert max(jax.tree.leaves(moved)) > 1e-3


def test_replicas_stay_bitwise_identical_over_20_sync_steps():
  num_workers = 16
  mesh = parallel.make_mesh()
  model = _model()
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(LR, momentum=0.9))
  rng = np.random.default_rng(0)
  b = _batch(rng, num_workers, 4)
  state = train.init_train_state(model, tx, b["x"][0], num_workers=num_workers, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=num_workers)
  for _ in range(20):
    state, metrics = step(state, parallel.shard_workers(_batch(rng, num_workers, 4), mesh))
  # Different workers saw different data: their losses differ...
  assert np.ptp(np.asarray(metrics["loss"])) > 0
  # ...yet every replica holds exactly the same parameters and momentum.
  for leaf in jax.tree.leaves((state.params, state.opt_state)):
    a = np.asarray(leaf)
    assert (a == a[:1]).all()
  assert mfopt.comm_totals(state.opt_state)["all_reduces"] == 20


def _lowered_all_reduce_types(num_workers, comm_dtype):
  mesh = parallel.make_mesh()
  model = _model()
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES, comm_dtype=comm_dtype), optax.sgd(LR))
  b = _batch(np.random.default_rng(0), num_workers, 4)
  state = train.init_train_state(model, tx, b["x"][0], num_workers=num_workers, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=num_workers)
  text = step.lower(state, parallel.shard_workers(b, mesh)).as_text()
  # StableHLO: %r = "stablehlo.all_reduce"(%x) ... : (tensor<16x6xbf16>) -> tensor<...>
  types = re.findall(r'stablehlo\.all_reduce"?\(.*?\n?.*?:\s*\(tensor<[^>]*?x?([a-z]+\d+)>', text, re.S)
  return types, state, step, b, mesh


def test_bf16_comm_dtype_lowers_bf16_all_reduce_and_counts_half_the_bytes():
  types16, state16, step16, b, mesh = _lowered_all_reduce_types(8, jnp.bfloat16)
  types32, state32, step32, _, _ = _lowered_all_reduce_types(8, None)
  assert types16 and set(types16) == {"bf16"}, types16
  assert types32 and set(types32) == {"f32"}, types32
  state16, _ = step16(state16, parallel.shard_workers(b, mesh))
  state32, _ = step32(state32, parallel.shard_workers(b, mesh))
  t16, t32 = mfopt.comm_totals(state16.opt_state), mfopt.comm_totals(state32.opt_state)
  n_params = sum(x.size for x in jax.tree.leaves(parallel.unstack_worker(state16.params)))
  assert t32["payload_bytes"] == 4 * n_params
  assert t16["payload_bytes"] * 2 == t32["payload_bytes"]
  assert t16["all_reduces"] == t32["all_reduces"] == 1


def test_sync_gradients_single_worker_is_identity_and_counts_nothing():
  tx = mfopt.sync_gradients(None)
  g = {"a": jnp.arange(3.0)}
  state = tx.init(g)
  out, state = tx.update(g, state)
  np.testing.assert_array_equal(out["a"], g["a"])
  assert mfopt.comm_totals(state) == mfopt.comm_totals(tx.init(g))
  assert mfopt.comm_totals(state)["collectives"] == 0


def test_sync_gradients_rejects_integer_comm_dtype():
  with pytest.raises(ValueError, match="comm_dtype.*int8"):
    mfopt.sync_gradients("w", comm_dtype=jnp.int8)


@pytest.mark.parametrize("workers,devices", [(12, 8), (0, 1), (-4, 1)])
def test_workers_must_be_positive_multiple_of_devices(workers, devices):
  mesh = parallel.make_mesh(jax.devices()[:devices])
  with pytest.raises(ValueError, match=f"num_workers.*{workers}"):
    parallel.local_workers(workers, mesh)


@pytest.mark.parametrize("global_batch,workers,field", [(100, 8, "global_batch"),
                                                          (0, 8, "global_batch"),
                                                          (64, 0, "num_workers")])
def test_split_batch_errors_name_the_field(global_batch, workers, field):
  with pytest.raises(ValueError, match=field):
    train.split_batch(global_batch, workers)


def test_eval_uses_worker_average():
  """Evaluation sees the mean of the workers' parameters (checked on divergent replicas)."""
  mesh = parallel.make_mesh()
  model = _model()
  params, ms = models.init_model(model, jax.random.PRNGKey(0), np.zeros((2, 6), np.float32))
  stacked = jax.tree.map(lambda p: jnp.stack([p + i for i in range(8)]), params)
  state = train.TrainState(parallel.shard_workers(stacked, mesh), {}, ())
  avg, _ = train.averaged_model(state)
  expected = jax.tree.map(lambda p: p + 3.5, params)
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6), avg, expected)
