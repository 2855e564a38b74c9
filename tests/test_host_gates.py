"""Host-decided gates (``make_train_step(host_gates=...)``, ``mfopt.comm.static_gates``).

On XLA:GPU a device-side gate (``mfopt.comm.gated``) blocks the host once per step; the
library then compiles the step with the gate shut and open and lets the host replay the
schedule (BENCHMARKS.md, session 6). These tests pin that the replay is the device's
decision, that both ways give the same numbers, and that a wrong replay is caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from mfopt import comm, models, parallel, train

W = 4


def _model():
  return models.get_model("mlp", hidden=(8,), num_classes=5)


def _batches(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(W, 4, 6)).astype(np.float32),
           "y": rng.integers(0, 5, size=(W, 4)).astype(np.int32)} for _ in range(steps)]


def _controllers():
  return {
      "constant": mfopt.constant_period(3),
      "scheduled": mfopt.scheduled_period((3, 1, 2), (4, 7)),
      # one worker: S_k = 0 < low * lr * C2 is false while C2 = 0, so add warmup and sampling
      "adpsgd": mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=5, p_init=2,
                                    warmup_steps=2),
  }


@pytest.mark.parametrize("name", ["constant", "scheduled", "adpsgd"])
def test_host_schedule_replays_the_devices_sync_decisions(name):
  """The host replay (read once, re-read after a sync if adaptive) predicts every step's
  ``due`` of the device-side controller, over 16 steps (several rounds; ADPSGD's period
  changes: the period is recorded to make sure)."""
  ctl = _controllers()[name]
  # two workers under vmap whose drift shrinks: S_k > 0 falls, so ADPSGD grows its period
  tx = mfopt.periodic_averaging(optax.sgd(0.1), "w", ctl, sync_variance=True)
  schedule = tx.update.host_schedule
  assert schedule.reread_after_open == (name == "adpsgd")
  params = {"w": jnp.zeros((2, 3))}
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="w"))
  host = schedule.read(state)
  device_due, host_due, periods = [], [], []
  for k in range(16):
    gate, host = schedule.next(host)
    syncs = int(state.diagnostics.syncs[0])
    grads = {"w": jnp.asarray([[1.0], [-1.0]]) * jnp.full((2, 3), 1.0 / (k + 1) ** 2)}
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    device_due.append(int(state.diagnostics.syncs[0]) > syncs)
    host_due.append(bool(gate))
    periods.append(int(state.controller.period[0]))
    if gate and schedule.reread_after_open:
      host = schedule.read(state)
  assert host_due == device_due
  assert sum(device_due) >= 4
  if name == "adpsgd":
    assert len(set(periods)) > 1, periods  # the adaptive period really moved


def _run(tx, host_gates, steps=9, mesh_devices=2):
  mesh = parallel.make_mesh(jax.devices()[:mesh_devices])
  model = _model()
  state = train.init_train_state(model, tx, np.zeros((1, 6), np.float32), num_workers=W,
                                 mesh=mesh, seed=0)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, host_gates=host_gates)
  metrics = []
  for b in _batches(steps):
    state, m = step(state, parallel.shard_workers(b, mesh))
    metrics.append(m)
  return step, state, metrics


def _doubling_controller():
  """A user's controller: its own on_sync doubles the period at every sync (no uses_variance);
  its host_period keeps the period the host last read. The host used to re-read only ADPSGD's
  state after a sync, so fit's gate-mismatch check failed on the GPU default."""
  from mfopt.averaging import PeriodController, PeriodState

  def init():
    return PeriodState(count=jnp.zeros([], jnp.int32), cnt=jnp.zeros([], jnp.int32),
                       period=jnp.ones([], jnp.int32), c2_sum=jnp.zeros([], jnp.float32),
                       c2_count=jnp.zeros([], jnp.int32))

  def advance(s):
    return s._replace(count=s.count + 1, cnt=s.cnt + 1), s.cnt + 1 >= s.period

  def on_sync(s, k, s_k):
    return s._replace(cnt=jnp.zeros_like(s.cnt), period=s.period * 2)

  return PeriodController(init, advance, on_sync, uses_variance=False, name="doubling",
                          host_period=lambda count, period: (period, period))


TRANSFORMS = {
    "user_controller": lambda: mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES,
                                                        _doubling_controller()),
    "periodic": lambda: mfopt.periodic_averaging(optax.sgd(0.1, momentum=0.9),
                                                 mfopt.WORKER_AXES, 3),
    "block_momentum": lambda: mfopt.block_momentum(optax.sgd(0.1), mfopt.WORKER_AXES, 2,
                                                   momentum=0.5),
    "adpsgd": lambda: mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES,
                                               _controllers()["adpsgd"]),
    "hybrid": lambda: mfopt.hybrid_adabound_lars(num_workers=W, steps_per_epoch=2,
                                                 warmup_epochs=2),
    # the hybrid inside periodic averaging: the host decides the averaging gate only (its
    # decision was forced on the hybrid's LARS gate too: zero norms after the switch)
    "averaged_hybrid": lambda: mfopt.periodic_averaging(
        mfopt.hybrid_adabound_lars(num_workers=W, steps_per_epoch=2, warmup_epochs=1,
                                   axis_name=mfopt.WORKER_AXES), mfopt.WORKER_AXES, 3),
    # the synchronous hybrid: optax.chain dropped the schedule, mfopt.chain keeps it
    "sync_hybrid": lambda: mfopt.chain(
        mfopt.sync_gradients(mfopt.WORKER_AXES),
        mfopt.hybrid_adabound_lars(num_workers=W, steps_per_epoch=2, warmup_epochs=2)),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_host_gated_step_equals_device_gated_step(name):
  """Same parameters bitwise and same collective counts after 9 steps (three sync rounds,
  the hybrid's switch at step 4); the host's gate never disagrees with the device."""
  step, s_host, m_host = _run(TRANSFORMS[name](), True)
  ref, s_dev, m_dev = _run(TRANSFORMS[name](), False)
  assert isinstance(step, train.HostGatedStep) and not isinstance(ref, train.HostGatedStep)
  for a, b in zip(jax.tree.leaves(s_host.params), jax.tree.leaves(s_dev.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert mfopt.comm_totals(s_host.opt_state) == mfopt.comm_totals(s_dev.opt_state)
  assert all(int(np.max(np.asarray(m["gate_mismatch"]))) == 0 for m in m_host)
  assert "gate_mismatch" not in m_dev[0]
  np.testing.assert_array_equal(np.asarray(m_host[-1]["loss"]), np.asarray(m_dev[-1]["loss"]))
  expected_open = {"periodic": 3, "block_momentum": 4, "hybrid": 5, "sync_hybrid": 5,
                   "averaged_hybrid": 3, "user_controller": 3}  # (periods 1, 2, 4: steps 1, 3, 7)
  if name in expected_open:
    assert step.opened == expected_open[name]


def test_a_users_gated_transform_without_an_owner_is_host_decided():
  """HostSchedule's docstring pattern (gated(...) without owner=, update.host_schedule): host
  gates still decide it; with owners introduced it was refused ('traced no gated call')."""
  def every_other():
    def init(params):
      return {"count": jnp.zeros([], jnp.int32)}

    def update(updates, state, params=None):
      c = state["count"]
      updates = comm.gated(comm.unbatched(c, mfopt.WORKER_AXES) % 2 == 1,
                           lambda u: jax.lax.pmean(u, mfopt.WORKER_AXES), updates)
      return jax.tree.map(lambda x: -0.1 * x, updates), {"count": c + 1}

    update.host_schedule = comm.HostSchedule(
        read=lambda st: comm.host_scalar(jax.tree.leaves(st)[0]),
        next=lambda c: (c % 2 == 1, c + 1))
    return optax.GradientTransformation(init, update)

  step, s_host, m_host = _run(every_other(), True, steps=4)
  _, s_dev, _ = _run(every_other(), False, steps=4)
  assert isinstance(step, train.HostGatedStep) and step.opened == 2
  assert all(int(np.max(np.asarray(m["gate_mismatch"]))) == 0 for m in m_host)
  for a, b in zip(jax.tree.leaves(s_host.params), jax.tree.leaves(s_dev.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)  # (pmean's rounding)


def test_chain_keeps_one_host_schedule_and_refuses_two():
  hybrid = mfopt.hybrid_adabound_lars(num_workers=W, steps_per_epoch=2, warmup_epochs=2)
  assert getattr(optax.chain(mfopt.sync_gradients("w"), hybrid).update, "host_schedule",
                 None) is None  # why mfopt.chain exists
  assert mfopt.chain(mfopt.sync_gradients("w"), hybrid).update.host_schedule is \
      hybrid.update.host_schedule
  assert not hasattr(mfopt.chain(mfopt.sync_gradients("w"), optax.sgd(0.1)).update,
                     "host_schedule")
  with pytest.raises(ValueError, match=r"chain: 2 transforms carry a host_schedule"):
    mfopt.chain(hybrid, TRANSFORMS["periodic"]())


def test_local_program_has_no_gate_loop_and_no_collective():
  """The shut step is the no-communication program: no gated loop, no all-reduce; the open
  one all-reduces the parameters unconditionally (no loop either)."""
  mesh = parallel.make_mesh(jax.devices()[:2])
  model, tx = _model(), TRANSFORMS["periodic"]()
  state = train.init_train_state(model, tx, np.zeros((1, 6), np.float32), num_workers=W,
                                 mesh=mesh, seed=0)
  batch = parallel.shard_workers(_batches(1)[0], mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, host_gates=True)
  texts = {g: s.lower(state, batch).compile().as_text() for g, s in step.steps.items()}
  device = train.make_train_step(model, tx, mesh=mesh, num_workers=W, host_gates=False)
  device_text = device.lower(state, batch).compile().as_text()
  assert comm.GATE_SCOPE in device_text  # the reference has the gated loop
  for text in texts.values():
    assert not any(" while(" in line and comm.GATE_SCOPE in line for line in text.splitlines())
  assert "all-reduce" not in texts[False]
  assert "all-reduce" in texts[True]


def test_a_wrong_host_schedule_is_caught_by_fit(monkeypatch):
  """A replay that is one step off runs the wrong program; the device's predicate says so
  (gate_mismatch) and fit stops at the next log instead of training on silently."""
  dataset = mfopt.data.load("digits")
  model = models.get_model("mlp", hidden=(8,), num_classes=dataset.num_classes)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, 3)
  good = tx.update.host_schedule
  wrong = comm.HostSchedule(read=good.read,
                            next=lambda h: (good.next(h)[0] is False, good.next(h)[1]))
  # the host replays the wrong copy; the transform's gate is still the one `good` owns
  monkeypatch.setattr(train, "host_schedule", lambda tx, host_gates=None: wrong)
  kw = dict(model=model, tx=tx, dataset=dataset, num_workers=W, per_worker_batch=4,
            num_steps=4, log_every=4, progress=False, mesh=parallel.make_mesh(jax.devices()[:2]))
  with pytest.raises(RuntimeError, match="host gates: at step 1 "):
    train.fit(host_gates=True, **kw)
  monkeypatch.undo()
  result = train.fit(host_gates=True, **kw)  # the real schedule trains, nothing logged extra
  assert "train_gate_mismatch" not in result.history[-1]
  assert result.summary["collectives"] == 1  # one sync (step 3) in 4 steps


def test_a_state_that_is_not_the_last_output_is_read_again():
  """Resuming from another state (e.g. a checkpoint) re-reads the schedule from it."""
  mesh = parallel.make_mesh(jax.devices()[:2])
  model, tx = _model(), TRANSFORMS["periodic"]()
  state0 = train.init_train_state(model, tx, np.zeros((1, 6), np.float32), num_workers=W,
                                  mesh=mesh, seed=0)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=W, host_gates=True,
                               donate=False)
  batch = parallel.shard_workers(_batches(1)[0], mesh)
  state = state0
  for _ in range(2):
    state, _ = step(state, batch)
  # continuing, step 3 (index 2) syncs; from state0 again it would be step 1: local
  assert step.next_gate(state) is True
  assert step.next_gate(state0) is False  # not the last output: read from state0 itself
  assert step.next_gate(state) is True  # a query: the host copy of `state` is unchanged
  _, m = step(state, batch)
  assert step.opened == 1 and int(np.max(np.asarray(m["gate_mismatch"]))) == 0
  restarted, m0 = step(state0, batch)  # resume from state0: step 1 again, local
  assert step.opened == 1 and int(np.max(np.asarray(m0["gate_mismatch"]))) == 0
  assert step.next_gate(restarted) is False and step.next_gate(restarted) is False


def test_host_gates_errors_name_the_argument():
  mesh = parallel.make_mesh(jax.devices()[:2])
  with pytest.raises(ValueError, match=r"host_gates=True needs a transform with "
                                       r"update.host_schedule"):
    train.make_train_step(_model(), optax.sgd(0.1), mesh=mesh, num_workers=W, host_gates=True)
  # default on CPU: the device-side gate (a plain jitted step)
  step = train.make_train_step(_model(), TRANSFORMS["periodic"](), mesh=mesh, num_workers=W)
  assert not isinstance(step, train.HostGatedStep)


def test_static_gates_run_or_skip_the_body_and_record_the_predicate():
  calls = []
  for open_ in (False, True):
    with comm.static_gates(open_) as preds:
      out = comm.gated(jnp.asarray(True), lambda c, x: c + x, jnp.zeros(2), (jnp.ones(2),))
    calls.append((np.asarray(out).tolist(), len(preds), bool(preds[0])))
  assert calls == [([0.0, 0.0], 1, True), ([1.0, 1.0], 1, True)]
  # outside the context: the device-side loop decides
  out = comm.gated(jnp.asarray(False), lambda c, x: c + x, jnp.zeros(2), (jnp.ones(2),))
  assert np.asarray(out).tolist() == [0.0, 0.0]


def test_fit_with_auto_lowering_and_host_gates_trains_like_the_device_gated_vmap_step():
  """``lowering="auto"`` times host-gated candidates (each re-reads the schedule from the
  state copy it is handed) and the chosen one continues from the caller's state."""
  dataset = mfopt.data.load("digits")
  model = models.get_model("mlp", hidden=(8,), num_classes=dataset.num_classes)
  tx = mfopt.periodic_averaging(optax.sgd(0.1, momentum=0.9), mfopt.WORKER_AXES, 3)
  kw = dict(model=model, tx=tx, dataset=dataset, num_workers=8, per_worker_batch=4,
            num_steps=7, log_every=7, progress=False, mesh=parallel.make_mesh(jax.devices()[:2]))
  auto = train.fit(lowering="auto", host_gates=True, **kw)
  ref = train.fit(lowering="vmap", host_gates=False, **kw)
  assert auto.summary["collectives"] == ref.summary["collectives"] == 2
  for a, b in zip(jax.tree.leaves(auto.state.params), jax.tree.leaves(ref.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
