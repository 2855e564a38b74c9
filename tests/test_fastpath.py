"""The fast path equals the worker-stacked synchronous step (issue 8, target 4a).

Reference: ``mfopt.train.make_train_step`` with
``optax.chain(sync_gradients(WORKER_AXES), optax.sgd(lr, momentum=0.9))`` on a tiny CNN
with per-worker BatchNorm. Checked after several steps: parameters of every worker,
the momentum buffer, the per-worker BN running statistics and the per-worker losses;
plus the collectives the fast path runs (compiled HLO) and counts.
"""

import re

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import fastpath, models, parallel
from mfopt import train as train_lib

LR = 0.05
STEPS = 3
B = 4


def _batches(num_workers, steps, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    # Worker-dependent offsets make the per-worker BN statistics differ visibly.
    x = rng.normal(size=(num_workers, B, 8, 8, 1)).astype(np.float32)
    x += np.arange(num_workers, dtype=np.float32)[:, None, None, None, None]
    y = rng.integers(0, 3, size=(num_workers, B)).astype(np.int32)
    out.append({"x": x, "y": y})
  return out


MODEL = models.get_model("cnn", features=(4, 8), num_classes=3)


def _run(num_devices, num_workers, group_bn=None):
  mesh = mfopt.make_mesh(jax.devices()[:num_devices])
  inner = optax.sgd(LR, momentum=0.9)
  batches = _batches(num_workers, STEPS)
  ref_tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), inner)
  ref_state = train_lib.init_train_state(MODEL, ref_tx, batches[0]["x"][0],
                                         num_workers=num_workers, mesh=mesh)
  ref_step = train_lib.make_train_step(MODEL, ref_tx, mesh=mesh, num_workers=num_workers)
  fast_state = fastpath.init_train_state(MODEL, inner, batches[0]["x"][0],
                                         num_workers=num_workers, mesh=mesh)
  fast_step = fastpath.make_train_step(MODEL, inner, mesh=mesh, num_workers=num_workers,
                                       group_bn=group_bn)
  ref_metrics, fast_metrics = [], []
  for batch in batches:
    sharded = parallel.shard_workers(batch, mesh)
    ref_state, m = ref_step(ref_state, sharded)
    ref_metrics.append(jax.device_get(m))
    fast_state, m = fast_step(fast_state, sharded)
    fast_metrics.append(jax.device_get(m))
  hlo = fast_step.lower(fast_state, parallel.shard_workers(batches[0], mesh)).compile().as_text()
  return dict(mesh=mesh, ref=jax.device_get(ref_state), fast_state=fast_state,
              fast=jax.device_get(fast_state), ref_metrics=ref_metrics,
              fast_metrics=fast_metrics, hlo=hlo)


# (devices, workers, group_bn): all workers on one device; two workers on each of 8 devices;
# one worker per device (flax's BN on the flat batch); the vmap-over-groups path (group_bn=False).
CASES = [(1, 4, None), (8, 16, None), (8, 8, None), (1, 4, False)]


@pytest.fixture(scope="module", params=CASES,
                ids=[f"D{d}-W{w}" + ("-vmap" if g is False else "") for d, w, g in CASES])
def run(request):
  return request.param[:2], _run(*request.param)


def _assert_tree_close(a, b, **tol):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_params_and_momentum_equal_worker_stacked_step(run):
  (num_devices, num_workers), r = run
  ref, fast = r["ref"], r["fast"]
  per_device = num_workers // num_devices
  for w in range(num_workers):
    device = w // per_device
    pick = lambda t, i: jax.tree.map(lambda a: a[i], t)  # noqa: E731
    _assert_tree_close(pick(fast.params, device), pick(ref.params, w), rtol=2e-5, atol=2e-6)
    # opt_state: (sync_gradients counter, sgd momentum trace); compare the momentum.
    _assert_tree_close(pick(fast.opt_state[1], device), pick(ref.opt_state[1], w),
                       rtol=2e-5, atol=2e-6)
  # The parameters moved (the comparison is not between two initial states).
  moved = max(float(np.abs(a[0] - b).max()) for a, b in zip(
      jax.tree.leaves(fast.params),
      jax.tree.leaves(models.init_model(MODEL, jax.random.PRNGKey(0),
                                        np.zeros((B, 8, 8, 1), np.float32))[0])))
  assert moved > 1e-3


def test_bn_running_statistics_are_per_worker_and_equal(run):
  (_, num_workers), r = run
  ref_stats, fast_stats = r["ref"].model_state, r["fast"].model_state
  _assert_tree_close(fast_stats, ref_stats, rtol=2e-5, atol=2e-6)
  # Per-worker BN really is per worker: the running means differ between workers.
  mean0 = np.asarray(ref_stats["batch_stats"]["bn0"]["mean"])
  assert mean0.shape[0] == num_workers
  assert np.ptp(mean0, axis=0).max() > 1e-2


def test_per_worker_losses_equal(run):
  _, r = run
  for ref_m, fast_m in zip(r["ref_metrics"], r["fast_metrics"]):
    np.testing.assert_allclose(fast_m["loss"], ref_m["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fast_m["accuracy"], ref_m["accuracy"])
    np.testing.assert_allclose(fast_m["update_norm"], ref_m["update_norm"], rtol=1e-4)


_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def test_counters_report_the_collectives_executed(run):
  (num_devices, _), r = run
  hlo_collectives = len(_COLLECTIVE.findall(r["hlo"]))
  totals = fastpath.comm_report(r["fast_state"])
  assert totals["path"] == "fast path"
  param_bytes = mfopt.comm.tree_payload_bytes(jax.tree.map(lambda a: a[0], r["fast"].params))
  if num_devices == 1:
    assert hlo_collectives == 0
    assert totals["collectives"] == 0 and totals["payload_bytes"] == 0
  else:
    assert hlo_collectives >= 1
    assert totals["all_reduces"] == STEPS
    assert totals["payload_bytes"] == STEPS * param_bytes
  # No grouped convolution: every convolution has feature_group_count 1 (absent in HLO).
  assert "feature_group_count" not in r["hlo"]


def test_updated_state_is_written_in_place_not_copied(run):
  """The donated parameters and momentum are updated in place: the compiled step copies no
  computed value of a parameter's shape into its output. (Updating ``a[0]`` and returning
  ``a[None]`` made XLA copy every one of them; tests the fix in ``fastpath.make_train_step``.)"""
  _, r = run
  entry = r["hlo"][r["hlo"].index("ENTRY"):]
  shapes = {"[" + ",".join(map(str, a.shape)) + "]" for a in jax.tree.leaves(r["fast"].params)}
  copied = [line.strip() for line in entry.splitlines()
            if (m := re.search(r"= f32(\[[0-9,]*\])\{[0-9,]*\} copy\((%[\w.\-]+)\)", line))
            and m.group(1) in shapes and "parameter" not in _defining_op(entry, m.group(2))]
  assert len(shapes) >= 4 and not copied, copied[:3]


def test_copying_update_variant_computes_the_same_step():
  """``update_in_place=False`` (kept for the GPU comparison) is the same arithmetic, and it is
  the layout with the copies (so the in-place test above can tell the two apart)."""
  mesh = mfopt.make_mesh(jax.devices()[:1])
  inner = optax.sgd(LR, momentum=0.9)
  batches = [parallel.shard_workers(b, mesh) for b in _batches(4, 2)]
  out = {}
  for in_place in (True, False):
    state = fastpath.init_train_state(MODEL, inner, batches[0]["x"][0], num_workers=4, mesh=mesh)
    step = fastpath.make_train_step(MODEL, inner, mesh=mesh, num_workers=4,
                                    update_in_place=in_place)
    hlo = step.lower(state, batches[0]).compile().as_text()
    for b in batches:
      state, _ = step(state, b)
    out[in_place] = (jax.device_get(state), hlo[hlo.index("ENTRY"):])
  _assert_tree_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-7)
  copies = re.findall(r" copy\((%[\w.\-]+)\)", out[False][1])
  assert any("parameter" not in _defining_op(out[False][1], c) for c in copies)


def _defining_op(entry: str, name: str) -> str:
  m = re.search(rf"^\s*{re.escape(name)} = \S+ (\w[\w\-]*)\(", entry, re.M)
  return m.group(1) if m else ""


def test_to_train_state_matches_worker_stacked_layout(run):
  (_, num_workers), r = run
  state = fastpath.to_train_state(r["fast_state"], num_workers=num_workers, mesh=r["mesh"])
  _assert_tree_close(jax.device_get(state.params), r["ref"].params, rtol=2e-5, atol=2e-6)
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(r["ref"].opt_state)
  # called again (each evaluation or checkpoint does), it traces and compiles nothing: a jit
  # of a fresh closure per call traced, lowered and compiled its program every time (the
  # persistent cache may spare the compile, not the trace)
  compiles = []

  def listen(event, secs, **_):
    if event.startswith("/jax/core/compile/"):
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    fastpath.to_train_state(r["fast_state"], num_workers=num_workers, mesh=r["mesh"])
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []


def test_group_bn_runs_the_model_on_the_flat_batch():
  """The default path (mfopt's models) has no 5-D activation tensor: the model runs on the
  (W*B, ...) batch with GroupBatchNorm; group_bn=False keeps the vmap over groups."""
  mesh = mfopt.make_mesh(jax.devices()[:1])
  inner = optax.sgd(LR)
  batch = parallel.shard_workers(_batches(4, 1)[0], mesh)
  state = fastpath.init_train_state(MODEL, inner, batch["x"][0], num_workers=4, mesh=mesh)
  five_d = re.compile(r"tensor<4x4x8x8x4x")  # (W, B, H, W, C): the first conv's output
  flat = fastpath.make_train_step(MODEL, inner, mesh=mesh, num_workers=4)
  vmapped = fastpath.make_train_step(MODEL, inner, mesh=mesh, num_workers=4, group_bn=False)
  assert not five_d.search(flat.lower(state, batch).as_text())
  assert five_d.search(vmapped.lower(state, batch).as_text())
  with pytest.raises(ValueError, match="group_bn=True needs a model with a bn_groups field"):
    fastpath.make_train_step(models.get_model("mlp", hidden=(4,), num_classes=3), inner,
                             mesh=mesh, num_workers=4, group_bn=True)
  with pytest.raises(ValueError, match=r"group_bn must be True, False or None, got 1\b"):
    fastpath.make_train_step(MODEL, inner, mesh=mesh, num_workers=4, group_bn=1)
  with pytest.raises(ValueError, match="got bn_groups=2"):
    fastpath.make_train_step(models.get_model("cnn", features=(4,), num_classes=3, bn_groups=2),
                             inner, mesh=mesh, num_workers=4)


@pytest.mark.parametrize("inner", [
    lambda: mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, 3),
    lambda: optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1))],
    ids=["periodic_averaging", "sync_chain"])
def test_rejects_a_communicating_inner(inner):
  """The fast path makes the exchange itself: given periodic averaging it ran synchronous SGD
  and counted averaging all-reduces that never ran; given the reference chain, a second
  all-reduce per step."""
  mesh = mfopt.make_mesh(jax.devices()[:1])
  with pytest.raises(ValueError, match=r"inner must be a local optimizer .*communication count"):
    fastpath.init_train_state(MODEL, inner(), np.zeros((B, 8, 8, 1), np.float32),
                              num_workers=2, mesh=mesh)


def test_rejects_synchronised_bn():
  mesh = mfopt.make_mesh(jax.devices()[:1])
  model = models.get_model("cnn", features=(4,), num_classes=3, bn_axis_name="data")
  for num_workers in (2, 1):  # also at W = D, where the model itself has no BN groups to refuse
    with pytest.raises(ValueError, match="fast path needs per-worker BatchNorm .*'data'"):
      fastpath.make_train_step(model, optax.sgd(0.1), mesh=mesh, num_workers=num_workers)


@pytest.mark.parametrize("devices,comm_dtype", [(1, None), (2, np.float16)])
def test_fp16_dynamic_loss_scaling_equals_the_worker_stacked_step(devices, comm_dtype):
  """fp16 with inner = dynamic_loss_scale(sgd): the fast path scales the loss (a loss x1e-7,
  whose fp16 gradients flush to zero unscaled, still trains as the stacked step does) and an
  overflowing step (one worker's inputs x3e4: its fp16 forward overflows) keeps parameters,
  momentum and BN statistics on every worker, exactly as the worker-stacked step does.
  On 2 devices with an fp16 exchange the gradients travel loss-scaled, as in the stacked step
  (they went unscaled, flushed to 0, and nothing trained)."""
  from mfopt import precision
  mesh = mfopt.make_mesh(jax.devices()[:devices])
  model = precision.apply_policy(MODEL, "fp16")
  W = 4

  def tiny_loss(logits, labels):
    loss, aux = train_lib.classification_loss(logits, labels)
    return 1e-7 * loss, aux

  batches = _batches(W, 4, seed=5)
  batches[2] = dict(batches[2], x=batches[2]["x"] * np.array([1, 3e4, 1, 1], np.float32)[
      :, None, None, None, None])
  inner = precision.dynamic_loss_scale(optax.sgd(1e5, momentum=0.9))
  ref_tx = precision.dynamic_loss_scale(
      optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES, comm_dtype),
                  optax.sgd(1e5, momentum=0.9)))
  ref_state = train_lib.init_train_state(model, ref_tx, batches[0]["x"][0], num_workers=W,
                                         mesh=mesh)
  ref_step = train_lib.make_train_step(model, ref_tx, mesh=mesh, num_workers=W, donate=False,
                                       loss_fn=tiny_loss)
  fast_state = fastpath.init_train_state(model, inner, batches[0]["x"][0], num_workers=W,
                                         mesh=mesh, comm_dtype=comm_dtype)
  fast_step = fastpath.make_train_step(model, inner, mesh=mesh, num_workers=W, donate=False,
                                       loss_fn=tiny_loss, comm_dtype=comm_dtype)
  for i, batch in enumerate(batches):
    sharded = parallel.shard_workers(batch, mesh)
    ref_state, rm = ref_step(ref_state, sharded)
    fast_state, fm = fast_step(fast_state, sharded)
    rm, fm = jax.device_get((rm, fm))
    np.testing.assert_array_equal(fm["overflow"], rm["overflow"])
    np.testing.assert_array_equal(fm["loss_scale"], rm["loss_scale"])
    assert (fm["overflow"] == (1.0 if i == 2 else 0.0)).all()
    if i != 2:  # a real step, as large as the scaled stacked step's (not flushed to zero)
      assert fm["update_norm"][0] > 1e-3
      np.testing.assert_allclose(fm["update_norm"][0], rm["update_norm"][0], rtol=2e-2)
  fast = jax.device_get(fastpath.to_train_state(fast_state, num_workers=W, mesh=mesh))
  ref = jax.device_get(ref_state)
  for tree in ("params", "model_state"):
    for a, b in zip(jax.tree.leaves(getattr(fast, tree)), jax.tree.leaves(getattr(ref, tree))):
      assert np.isfinite(np.asarray(a, np.float32)).all()
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=2e-2, atol=2e-3)


def test_counter_reports_the_dtype_the_step_exchanges():
  """comm_dtype is given to init_train_state and to make_train_step; a state made with another
  one counted that dtype's bytes (236 B per step reported for a bf16 exchange of 59 params,
  118 B). The step's counter now holds the bytes it exchanges (params x the exchanged dtype),
  and the lowered program exchanges in that dtype."""
  mesh = mfopt.make_mesh(jax.devices()[:2])
  model = models.get_model("cnn", features=(4,), num_classes=3)
  batch = parallel.shard_workers(_batches(2, 1)[0], mesh)
  for init_dtype, step_dtype, size in ((None, "bf16", 2), ("bf16", None, 4)):
    state = fastpath.init_train_state(model, optax.sgd(0.1), batch["x"][0], num_workers=2,
                                      mesh=mesh, comm_dtype=init_dtype)
    step = fastpath.make_train_step(model, optax.sgd(0.1), mesh=mesh, num_workers=2,
                                    comm_dtype=step_dtype, donate=False)
    num_params = sum(a[0].size for a in jax.tree.leaves(jax.device_get(state.params)))
    text = step.lower(state, batch).as_text()
    assert ("bf16" in text) == (step_dtype == "bf16")
    state, _ = step(state, batch)
    totals = fastpath.comm_report(state)
    assert totals["all_reduces"] == 1 and totals["payload_bytes"] == num_params * size


def test_a_model_without_bn_groups_equals_sgd_on_the_global_batch():
  """A model without a bn_groups field (here an MLP, no BatchNorm) takes the vmap-over-groups
  path by default, and one step from the seeded initial point is plain SGD on the concatenated
  global batch of W*B examples (the fast path's claim: the mean of the per-worker losses is the
  global batch's loss); each worker's loss is its own batch's."""
  mesh = mfopt.make_mesh(jax.devices()[:1])
  model = models.get_model("mlp", hidden=(8,), num_classes=3)
  rng = np.random.default_rng(4)
  batch = {"x": rng.normal(size=(4, 2, 6)).astype(np.float32),
           "y": rng.integers(0, 3, size=(4, 2)).astype(np.int32)}
  state = fastpath.init_train_state(model, optax.sgd(LR), batch["x"][0], num_workers=4, mesh=mesh,
                                    seed=3)
  p0 = jax.tree.map(lambda a: a[0], jax.device_get(state.params))
  # the replica starts from the model initialised with the given seed (as the stacked step's)
  seeded, _ = models.init_model(model, jax.random.PRNGKey(3), batch["x"][0])
  jax.tree.map(np.testing.assert_array_equal, p0, seeded)
  step = fastpath.make_train_step(model, optax.sgd(LR), mesh=mesh, num_workers=4)
  state, metrics = step(state, parallel.shard_workers(batch, mesh))

  def loss(p, x, y):
    return train_lib.classification_loss(models.apply_model(model, p, {}, x, train=True)[0], y)[0]
  g = jax.jit(jax.grad(loss))(p0, batch["x"].reshape(8, 6), batch["y"].reshape(8))
  want = jax.tree.map(lambda p, d: p - LR * d, p0, g)
  got = jax.tree.map(lambda a: a[0], jax.device_get(state.params))
  _assert_tree_close(got, want, rtol=1e-5, atol=1e-6)
  assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got),
                                                         jax.tree.leaves(p0))) > 1e-4
  per_worker = jax.jit(jax.vmap(loss, in_axes=(None, 0, 0)))(p0, batch["x"], batch["y"])
  np.testing.assert_allclose(metrics["loss"], per_worker, rtol=1e-5)
