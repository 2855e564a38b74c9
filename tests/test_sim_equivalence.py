"""mfopt.sim against independent references: the mesh train step (BSP), sequential and delayed SGD (ASP)."""

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import data, models, parallel, sim, train


@pytest.fixture(scope="module")
def ds():
  return data.load("mnist1d")


@pytest.fixture(scope="module")
def linear():
  return models.get_model("mlp", hidden=(), num_classes=10)


def _np_grad(W, b, x, y):
  """Softmax-regression gradient in float64 NumPy (mean cross-entropy over the batch)."""
  x = x.reshape(len(x), -1).astype(np.float64)
  z = x @ W + b
  z -= z.max(1, keepdims=True)
  p = np.exp(z)
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  p /= len(y)
  return x.T @ p, p.sum(0)


def _wb(simulator, theta):
  head = simulator.unravel(theta)["head"]
  return np.asarray(head["kernel"], np.float64), np.asarray(head["bias"], np.float64)


def test_bsp_equals_synchronous_mesh_train_step(ds):
  model = models.get_model("mlp", hidden=(16,), num_classes=10)
  W, b, steps, lr = 8, 8, 6, 0.2
  mesh = parallel.make_mesh()
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(lr))
  batcher = data.WorkerBatcher(ds.train, num_workers=W, per_worker_batch=b, seed=3)
  state = train.init_train_state(model, tx, batcher.batch(0)["x"][0], num_workers=W, mesh=mesh, seed=3)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, donate=False)
  for s in range(steps):
    state, _ = step(state, parallel.shard_workers(batcher.batch(s), mesh))
  mesh_params = parallel.unstack_worker(state.params, 0)

  # Heterogeneous speeds, jitter and a slow network: timing must not change BSP's parameters.
  s_ = sim.Simulator(sim.BSP(sim.BaseSGD(lr, decay_rate=1.0)), model=model, dataset=ds,
                     num_workers=W, per_worker_batch=b, seed=3, network="1gbit",
                     compute=sim.ComputeModel(0.01, speed_spread=0.5, jitter_sigma=0.3))
  s_.run(max_server_steps=steps)
  assert s_.version == steps
  got = s_.unravel(s_.theta)
  assert jax.tree.structure(got) == jax.tree.structure(mesh_params)
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(mesh_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
  # the parameters moved, so the comparison is not between two initialisations
  moved = max(float(np.abs(np.asarray(a) - np.asarray(i)).max()) for a, i in zip(
      jax.tree.leaves(got), jax.tree.leaves(parallel.unstack_worker(
          train.init_train_state(model, tx, batcher.batch(0)["x"][0], num_workers=W, mesh=mesh,
                                 seed=3).params, 0))))
  assert moved > 1e-3
  assert 0 not in s_.versions  # version 0 is no longer referenced, so it was dropped


def test_asp_one_worker_is_sequential_sgd(ds, linear):
  lr, steps, b = 0.3, 25, 16
  s_ = sim.Simulator(sim.ASP(sim.BaseSGD(lr, decay_rate=1.0)), model=linear, dataset=ds,
                     num_workers=1, per_worker_batch=b, seed=1, network="10gbit",
                     compute=sim.ComputeModel(0.01, jitter_sigma=0.5))
  W, bias = _wb(s_, s_.theta)
  s_.run(max_server_steps=steps)
  batcher = data.WorkerBatcher(ds.train, num_workers=1, per_worker_batch=b, seed=1)
  for n in range(steps):
    batch = batcher.batch(n)
    gW, gb = _np_grad(W, bias, batch["x"][0], batch["y"][0])
    W, bias = W - lr * gW, bias - lr * gb
  gotW, gotb = _wb(s_, s_.theta)
  np.testing.assert_allclose(gotW, W, rtol=0, atol=2e-5)
  np.testing.assert_allclose(gotb, bias, rtol=0, atol=2e-5)
  assert s_.staleness == {0: steps}


def test_asp_equal_speeds_zero_comm_is_delayed_sgd(ds, linear):
  """Tie-break: equal times are served in scheduling order (worker order here).

  So in every round the workers' gradients are applied in worker order, and worker i
  pulls the version created by its own update: the NumPy reference below.
  """
  M, lr, steps, b = 4, 0.3, 42, 16
  s_ = sim.Simulator(sim.ASP(sim.BaseSGD(lr, decay_rate=1.0)), model=linear, dataset=ds,
                     num_workers=M, per_worker_batch=b, seed=2, network=None,
                     compute=sim.ComputeModel(1.0))
  W0, b0 = _wb(s_, s_.theta)
  s_.run(max_server_steps=steps)
  batcher = data.WorkerBatcher(ds.train, num_workers=M, per_worker_batch=b, seed=2)
  W, bias = W0.copy(), b0.copy()
  pulled = [(W0, b0)] * M
  pulled_version = [0] * M
  stale = {}
  for t in range(steps):
    i, n = t % M, t // M
    batch = batcher.batch(n)
    gW, gb = _np_grad(*pulled[i], batch["x"][i], batch["y"][i])
    stale[t - pulled_version[i]] = stale.get(t - pulled_version[i], 0) + 1
    W, bias = W - lr * gW, bias - lr * gb
    pulled[i], pulled_version[i] = (W, bias), t + 1
  gotW, gotb = _wb(s_, s_.theta)
  np.testing.assert_allclose(gotW, W, rtol=0, atol=2e-5)
  np.testing.assert_allclose(gotb, bias, rtol=0, atol=2e-5)
  assert s_.staleness == stale == {0: 1, 1: 1, 2: 1, 3: steps - 3}
  # the delayed reference differs from sequential SGD, so the test can tell them apart
  Ws, bs = W0.copy(), b0.copy()
  for t in range(steps):
    batch = batcher.batch(t // M)
    gW, gb = _np_grad(Ws, bs, batch["x"][t % M], batch["y"][t % M])
    Ws, bs = Ws - lr * gW, bs - lr * gb
  assert np.abs(Ws - W).max() > 1e-3


def test_ksync_fixed_k_equals_bsp_with_momentum(ds, linear):
  """k = M, no staleness, BB off: u = γu + lr ḡ, θ -= u is optax.sgd(lr, momentum=γ) on the mean."""
  M, lr, steps = 4, 0.1, 8
  common = dict(model=linear, dataset=ds, num_workers=M, per_worker_batch=8, seed=0,
                network="10gbit", compute=sim.ComputeModel(0.01, speed_spread=0.4))
  base = sim.BaseSGD(lr, decay_rate=1.0, momentum=0.9)
  a = sim.Simulator(sim.BSP(base), **common)
  a.run(max_server_steps=steps)
  k = sim.Simulator(sim.KSync(sim.KSyncConfig(gamma=0.9, k_rule=M, bb=None, lr_fallback=base)), **common)
  k.run(max_server_steps=steps)
  np.testing.assert_allclose(k.theta, a.theta, rtol=1e-5, atol=1e-6)
  plain = sim.Simulator(sim.BSP(sim.BaseSGD(lr, decay_rate=1.0)), **common)
  plain.run(max_server_steps=steps)
  assert np.abs(plain.theta - a.theta).max() > 1e-4  # momentum mattered
  assert [r[2] for r in k.k_trace] == [M] * steps
