"""Local steps run no collective: the compiled train step, W = 8 on 8 devices and W = 16, 32.

Checks on ``train_step.lower(...).compile().as_text()``: every collective sits in
a computation reachable only from the sync branch of a ``conditional``; the local
branch reaches none; nothing outside a conditional reaches one. Then, with one
compiled executable (so no recompilation is possible), the sync branch runs
exactly floor(N/p) times for several periods p held in the state, counted by a
``jax.debug.callback`` inside the branch and by the transform's own CommStats.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from mfopt import averaging, models, parallel, train

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALL_RE = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                      r"%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")


def parse_hlo(text):
  """Computations -> (instruction lines, callees); conditionals as (computation, branch list)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    m = _COMP_RE.match(line.strip()) if line and not line.startswith(" ") else None
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None and line.startswith(" "):
      comps[current].append(line)
  calls, conditionals = {}, []
  for name, lines in comps.items():
    callees = set()
    for line in lines:
      callees.update(_CALL_RE.findall(line))
      b = _BRANCHES_RE.search(line)
      if b:
        branches = [x.strip().lstrip("%") for x in b.group(1).split(",")]
        conditionals.append((name, branches))
        callees.update(branches)
    calls[name] = callees
  return comps, calls, conditionals, entry


def _reach(calls, roots, stop=frozenset()):
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in seen or c in stop:
      continue
    seen.add(c)
    todo.extend(calls.get(c, ()))
  return seen


def _has_collective(lines):
  return any(re.search(rf"\b{op}(-start)?\(", line) for line in lines for op in COLLECTIVES)


def check_collectives_only_in_sync_branch(text):
  comps, calls, conditionals, entry = parse_hlo(text)
  with_coll = {c for c, lines in comps.items() if _has_collective(lines)}
  assert with_coll, "no collective at all in the program"
  # Branch 0 of a bool lax.cond is the false (local) branch, branch 1 the true (sync) one.
  sync_reach, local_reach = set(), set()
  for _, branches in conditionals:
    if len(branches) == 2:
      local_reach |= _reach(calls, [branches[0]])
      sync_reach |= _reach(calls, [branches[1]])
  assert sync_reach & with_coll, "no conditional whose sync branch holds a collective"
  assert not (local_reach & with_coll), "a collective is reachable from a local branch"
  all_branches = {b for _, bs in conditionals for b in bs}
  outside = _reach(calls, [entry], stop=frozenset(all_branches))
  assert not (outside & with_coll), (
      f"collectives outside any conditional: {sorted(outside & with_coll)}")
  return len(with_coll)


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
  """The controller with a host callback inside ``on_sync`` (which runs only in the sync branch)."""
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
  check_collectives_only_in_sync_branch(compiled.as_text())
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


def test_adpsgd_scalar_all_reduce_also_inside_sync_branch():
  ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=8, warmup_steps=2)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, ctl)
  _, state, step, batch = _setup(tx, 16)
  text = step.lower(state, batch).compile().as_text()
  check_collectives_only_in_sync_branch(text)
  assert re.search(r"f32\[\]\S* all-reduce\(", text)  # the S_k scalar exchange


def test_checker_catches_a_batched_predicate(monkeypatch):
  """Negative control: without unbatching, cond becomes select and collectives run every step."""
  monkeypatch.setattr(averaging, "_unbatched", lambda pred, axis_name: pred)
  tx = mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, 4)
  _, state, step, batch = _setup(tx, 16)
  with pytest.raises(AssertionError):
    check_collectives_only_in_sync_branch(step.lower(state, batch).compile().as_text())
