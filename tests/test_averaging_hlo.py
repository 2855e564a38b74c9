"""Local steps run no collective: the compiled train step, W = 8 on 8 devices and W = 16, 32.

Checks on ``train_step.lower(...).compile().as_text()``: every collective sits in a
computation reachable only from the body of the sync loop (a ``while`` of 0 or 1 trips,
named by ``mfopt.comm.GATE_SCOPE`` in its metadata) or from the sync branch of a
``conditional``; nothing reaches one otherwise. Then, with one compiled executable (so no
recompilation is possible), the sync body runs exactly floor(N/p) times for several periods p
held in the state, counted by a ``jax.debug.callback`` inside it and by the transform's own
CommStats.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from experiments import _bench
from mfopt import averaging, comm, models, parallel, train

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _has_collective(lines):
  return any(re.search(rf"\b{op}(-start)?\(", line) for line in lines for op in COLLECTIVES)


def check_collectives_only_in_sync_loop(text):
  """Every collective is reached only through a sync body; returns how many computations hold one."""
  comps, entry = _bench.hlo_computations(text)
  where = _bench.hlo_reachable(comps, entry)  # computation -> reached only via a sync body
  with_coll = {c for c in where if _has_collective(comps[c])}
  assert with_coll, "no collective at all in the program"
  sync_bodies = [b for lines in comps.values() for line in lines
                 for b in _bench.hlo_gated_bodies(line)]
  assert sync_bodies, "no sync loop in the program"
  outside = sorted(c for c in with_coll if not where[c])
  assert not outside, f"collectives outside the sync loop: {outside}"
  return len(with_coll)


def test_gate_scope_names_agree():
  assert _bench.GATE_SCOPE == comm.GATE_SCOPE


def test_checker_on_hand_written_modules():
  """The checker passes a collective inside the sync loop and fails one outside it, or one in
  an ordinary loop."""
  def module(scope, collective_in_entry):
    name = f"jit(step)/vmap({scope})/while"
    entry_op = ("  %ar = f32[4]{0} all-reduce(%p), to_apply=%sum\n" if collective_in_entry
                else "")
    return (
        "HloModule m\n\n"
        "%sum (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"
        "%body (x: f32[4]) -> f32[4] {\n  %x = f32[4]{0} parameter(0)\n"
        "  ROOT %r = f32[4]{0} all-reduce(%x), to_apply=%sum\n}\n\n"
        "%cond (x: f32[4]) -> pred[] {\n  %x = f32[4]{0} parameter(0)\n"
        "  ROOT %c = pred[] constant(false)\n}\n\n"
        "ENTRY %main (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n" + entry_op +
        f"  ROOT %w = f32[4]{{0}} while(%p), condition=%cond, body=%body, "
        f"metadata={{op_name=\"{name}\"}}\n}}\n")

  assert check_collectives_only_in_sync_loop(module(comm.GATE_SCOPE, False)) == 1
  with pytest.raises(AssertionError, match="outside the sync loop"):
    check_collectives_only_in_sync_loop(module(comm.GATE_SCOPE, True))
  with pytest.raises(AssertionError, match="no sync loop"):
    check_collectives_only_in_sync_loop(module("scan", False))


def _model():
  return models.get_model("mlp", hidden=(8,), num_classes=3)


def _batch(rng, workers, per_worker=2, features=4):
  return {"x": rng.normal(size=(workers, per_worker, features)).astype(np.float32),
          "y": rng.integers(0, 3, size=(workers, per_worker)).astype(np.int32)}


def _setup(tx, num_workers):
  mesh = parallel.make_mesh()
  model = _model()
  b = _batch(np.random.default_rng(0), num_workers)
  state = train.init_train_state(model, tx, b["x"][0], num_workers=num_workers, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=num_workers)
  batch = parallel.shard_workers(b, mesh)
  return mesh, state, step, batch


_CALLS = []


def _counting(ctl):
  """The controller with a host callback inside ``on_sync`` (which runs only in the sync loop body)."""
  def on_sync(state, k, s_k):
    jax.debug.callback(lambda kk: _CALLS.append(np.asarray(kk).reshape(-1).tolist()), k)
    return ctl.on_sync(state, k, s_k)
  return ctl._replace(on_sync=on_sync)


@pytest.mark.parametrize("num_workers", [8, 16, 32])
def test_constant_period_hlo_and_exact_sync_count_without_recompiling(num_workers):
  tx = mfopt.periodic_averaging(optax.sgd(0.1, momentum=0.9), mfopt.WORKER_AXES,
                                _counting(mfopt.constant_period(3)))
  mesh, state0, step, batch = _setup(tx, num_workers)
  compiled = step.lower(state0, batch).compile()
  check_collectives_only_in_sync_loop(compiled.as_text())
  n = 11
  for p in (2, 3, 5):
    state = jax.tree.map(jnp.copy, state0)
    s = averaging.find_averaging_state(state.opt_state)
    period = jax.device_put(jnp.full((num_workers,), p, jnp.int32), s.controller.period.sharding)
    opt_state = state.opt_state._replace(controller=s.controller._replace(period=period))
    state = state._replace(opt_state=opt_state)
    _CALLS.clear()
    for _ in range(n):
      state, _ = compiled(state, batch)
    jax.effects_barrier()
    steps_seen = sorted({k for call in _CALLS for k in call})
    assert steps_seen == [k - 1 for k in range(p, n + 1, p)]  # 0-based k of steps p, 2p, ...
    # The callback fires once per sync per worker (vmap) or per device: count distinct syncs.
    assert sum(len(c) for c in _CALLS) == (n // p) * num_workers
    totals = mfopt.comm_totals(state.opt_state)
    assert totals["all_reduces"] == n // p
    params = np.asarray(jax.device_get(jax.tree.leaves(state.params)[0]))
    assert np.ptp(params, axis=0).max() > 0  # n % p != 0 after the last step: workers differ


def test_adpsgd_scalar_all_reduce_also_inside_the_sync_loop():
  ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=8, warmup_steps=2)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, ctl)
  _, state, step, batch = _setup(tx, 16)
  text = step.lower(state, batch).compile().as_text()
  check_collectives_only_in_sync_loop(text)
  assert re.search(r"f32\[\]\S* all-reduce\(", text)  # the S_k scalar exchange


def test_adpsgd_warmup_s_k_all_reduce_is_in_a_conditional_of_the_vmapped_step():
  """ADPSGD skips S_k's scalar all-reduce at warm-up syncs. The step count deciding it is
  batched under the worker vmap, where a cond on it became a select that ran the all-reduce
  at every sync while the counter said it had not: the compiled step must keep the scalar
  all-reduce in a conditional's branch (the parameter all-reduce stays outside it)."""
  ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=8, warmup_steps=2)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, ctl)
  _, state, step, batch = _setup(tx, 16)
  comps, _ = _bench.hlo_computations(step.lower(state, batch).compile().as_text())
  branches = set()
  for lines in comps.values():
    for line in lines:
      if " conditional(" in line:
        m = re.search(r"branch_computations=\{([^}]*)\}", line)
        pairs = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
        branches |= ({b.strip().lstrip("%") for b in m.group(1).split(",")} if m else set(pairs))

  def holds(pattern):
    return {c for c, lines in comps.items() if any(re.search(pattern, ln) for ln in lines)}

  scalar = holds(r"= f32\[\]\S* all-reduce\(")
  assert scalar and scalar <= branches, (scalar, branches)
  assert holds(r"\) all-reduce\(|\] all-reduce\(|\}\S* all-reduce\(") - branches  # params


def test_checker_catches_a_collective_outside_the_sync_loop():
  """Negative control on a real program: the variance diagnostic all-reduces every step."""
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, 4, track_variance=True)
  _, state, step, batch = _setup(tx, 16)
  with pytest.raises(AssertionError, match="outside the sync loop"):
    check_collectives_only_in_sync_loop(step.lower(state, batch).compile().as_text())
