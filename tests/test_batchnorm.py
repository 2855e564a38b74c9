"""BN strategies (seed 004 §2.2.3) against a NumPy forward pass of conv -> BN statistics."""

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import batchnorm, models, parallel, train

W, B, L, C, F = 4, 6, 12, 2, 4


def _np_conv_same(x, k):
  """1-D 'SAME' convolution, kernel (3, C, F), no bias (flax nn.Conv with use_bias=False)."""
  xp = np.pad(x, ((0, 0), (1, 1), (0, 0)))
  return sum(np.einsum("nlc,cf->nlf", xp[:, i:i + x.shape[1]], k[i]) for i in range(3))


@pytest.fixture(scope="module")
def one_step():
  """Per strategy: worker-stacked model state after one training step, and the batch/params."""
  mesh = parallel.make_mesh(jax.devices()[:W])
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(W, B, L, C)) * np.arange(1, W + 1)[:, None, None, None]
       + np.arange(W)[:, None, None, None]).astype(np.float32)  # workers differ in mean and scale
  batch = {"x": x, "y": rng.integers(0, 3, size=(W, B)).astype(np.int32)}
  out = {}
  for name in batchnorm.STRATEGIES:
    s = batchnorm.get_strategy(name)
    model = models.get_model("cnn", features=(F,), num_classes=3, **s.model_kwargs())
    tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1))
    state = train.init_train_state(model, tx, x[0], num_workers=W, mesh=mesh, seed=2)
    kernel = np.asarray(parallel.unstack_worker(state.params)["conv0"]["kernel"])
    step = train.make_train_step(model, tx, mesh=mesh, num_workers=W)
    state, _ = step(state, parallel.shard_workers(batch, mesh))
    out[name] = jax.device_get(state.model_state)["batch_stats"]["bn0"]
  y = np.stack([_np_conv_same(x[w].astype(np.float64), kernel.astype(np.float64)) for w in range(W)])
  return out, y


def test_last_batch_is_all_worker_mean_of_last_batch_statistics(one_step):
  out, y = one_step
  mean_w = y.mean(axis=(1, 2))  # (W, F): each worker's own batch statistics
  var_w = y.var(axis=(1, 2))
  st = out["last_batch"]
  np.testing.assert_allclose(st["mean"], mean_w, rtol=1e-4, atol=1e-5)  # no moving average
  np.testing.assert_allclose(st["var"], var_w, rtol=1e-4, atol=1e-5)
  pop = batchnorm.population_statistics({"batch_stats": {"bn0": st}}, "last_batch")
  pop = pop["batch_stats"]["bn0"]
  assert pop["mean"].dtype == np.float32
  np.testing.assert_allclose(pop["mean"], mean_w.mean(0), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(pop["var"], var_w.mean(0), rtol=1e-4, atol=1e-5)
  # pooled: the variance of the union of the last batches
  pooled = batchnorm.population_statistics({"batch_stats": {"bn0": st}},
                                           batchnorm.get_strategy("last_batch", pooled=True))
  np.testing.assert_allclose(pooled["batch_stats"]["bn0"]["var"], y.var(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-5)
  assert np.abs(y.var(axis=(0, 1, 2)) - var_w.mean(0)).max() > 0.1  # the two options differ
  # a flax FrozenDict state (flax.core.freeze, a restored checkpoint) is pooled too: it fell
  # through to the plain mean
  from flax.core import freeze
  frozen = batchnorm.population_statistics(freeze({"batch_stats": {"bn0": st}}),
                                           batchnorm.get_strategy("last_batch", pooled=True))
  np.testing.assert_allclose(frozen["batch_stats"]["bn0"]["var"], y.var(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-5)


def test_moving_average_is_per_worker_ema(one_step):
  out, y = one_step
  st = out["moving_average"]
  np.testing.assert_allclose(st["mean"], 0.1 * y.mean(axis=(1, 2)), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(st["var"], 0.9 + 0.1 * y.var(axis=(1, 2)), rtol=1e-4, atol=1e-5)
  pop = batchnorm.population_statistics({"batch_stats": {"bn0": st}}, "moving_average")
  np.testing.assert_allclose(pop["batch_stats"]["bn0"]["var"], 0.9 + 0.1 * y.var(axis=(1, 2)).mean(0),
                             rtol=1e-4, atol=1e-5)


def test_sync_uses_global_batch_statistics_on_every_worker(one_step):
  out, y = one_step
  st = out["sync"]
  g_mean, g_var = y.mean(axis=(0, 1, 2)), y.var(axis=(0, 1, 2))
  for w in range(W):
    np.testing.assert_allclose(st["mean"][w], 0.1 * g_mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st["var"][w], 0.9 + 0.1 * g_var, rtol=1e-4, atol=1e-4)


def test_unknown_strategy_is_named():
  with pytest.raises(ValueError, match="BN strategy"):
    batchnorm.get_strategy("ghost")


def test_pooled_is_a_bool_for_last_batch_only():
  """pooled=True with moving_average or sync was accepted and dropped (pooled=False came
  back), and pooled="no" was stored as a true value."""
  for name in ("moving_average", "sync"):
    with pytest.raises(ValueError, match=rf"pooled=True applies to the 'last_batch' strategy "
                                         rf"only .*got pooled=True with '{name}'"):
      batchnorm.get_strategy(name, pooled=True)
    assert batchnorm.get_strategy(name).pooled is False
  with pytest.raises(ValueError, match=r"pooled must be a bool, got 'no'"):
    batchnorm.get_strategy("last_batch", pooled="no")
  assert batchnorm.get_strategy("last_batch", pooled=True).pooled is True


def test_pooled_refuses_integers_and_an_unknown_name_is_named_first():
  """pooled takes a bool only: 1 or 0 (ints, as a hand-written config might give) are refused
  like "no", and an unknown strategy with pooled=True is reported as unknown, not as a
  strategy that does not pool."""
  for bad in (1, 0):
    with pytest.raises(ValueError, match=rf"pooled must be a bool, got {bad}"):
      batchnorm.get_strategy("last_batch", pooled=bad)
  with pytest.raises(ValueError, match=r"BN strategy must be one of .*got 'ghost'"):
    batchnorm.get_strategy("ghost", pooled=True)


def test_population_statistics_refuse_one_replicas_state():
  """One replica's statistics ((C,) leaves) were averaged over their channels into scalars,
  which flax's BatchNorm broadcast in evaluation without complaint."""
  one = {"batch_stats": {"bn0": {"mean": np.zeros(3, np.float32), "var": np.ones(3, np.float32)}}}
  with pytest.raises(ValueError, match=r"worker-stacked .*\['batch_stats'\]\['bn0'\]\['mean'\] "
                                       r"of shape \(3,\)"):
    batchnorm.population_statistics(one)
  stacked = jax.tree.map(lambda x: np.stack([x, x + 2.0]), one)
  pop = batchnorm.population_statistics(stacked)["batch_stats"]["bn0"]
  np.testing.assert_array_equal(pop["mean"], np.ones(3))


def test_sync_strategy_takes_the_axis_of_your_own_shard_map():
  """model_kwargs(axis_name="data"): a "sync" CNN inside a one-axis jax.shard_map reduces its
  statistics over the global batch (the default names the library's ("data", "local"),
  unbound there)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  s = batchnorm.get_strategy("sync")
  assert s.model_kwargs()["bn_axis_name"] == parallel.WORKER_AXES
  model = models.get_model("cnn", features=(F,), num_classes=3, **s.model_kwargs(axis_name="data"))
  mesh = jax.make_mesh((W,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(W * B, L, C)) * np.repeat(np.arange(1, W + 1), B)[:, None, None]
       ).astype(np.float32)  # devices differ in scale
  params, model_state = models.init_model(model, jax.random.PRNGKey(0), x[:B])

  def stats(xs):
    _, new = model.apply({"params": params, **model_state}, xs, train=True,
                         mutable=["batch_stats"])
    return new["batch_stats"]["bn0"]["mean"][None]

  f = jax.jit(jax.shard_map(stats, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False))
  got = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("data")))))
  y = _np_conv_same(x.astype(np.float64), np.asarray(params["conv0"]["kernel"], np.float64))
  want = 0.1 * y.mean(axis=(0, 1))  # momentum 0.9 from 0: one step of the global batch mean
  for w in range(W):
    np.testing.assert_allclose(got[w], want, rtol=1e-4, atol=1e-5)
