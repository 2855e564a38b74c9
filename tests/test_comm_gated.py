"""mfopt.comm.gated: a conditional as a while loop of 0 or 1 trips (issue 8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _bench
from mfopt import comm


def _fn(c):
  return {"a": c["a"] * 2.0 + 1.0, "n": c["n"] + 1}


@pytest.mark.parametrize("pred", [True, False])
def test_gated_runs_the_body_once_or_not_at_all(pred):
  carry = {"a": jnp.arange(4.0), "n": jnp.zeros([], jnp.int32)}
  got = jax.jit(lambda p, c: comm.gated(p, _fn, c))(jnp.asarray(pred), carry)
  want = _fn(carry) if pred else carry
  np.testing.assert_array_equal(got["a"], want["a"])
  assert int(got["n"]) == int(want["n"]) == (1 if pred else 0)


def test_gated_under_vmap_with_a_per_worker_predicate_selects_per_worker():
  """A batched predicate is still correct (the loop runs for all, results are selected)."""
  carry = {"a": jnp.arange(6.0).reshape(3, 2), "n": jnp.zeros([3], jnp.int32)}
  pred = jnp.asarray([True, False, True])
  got = jax.vmap(lambda p, c: comm.gated(p, _fn, c))(pred, carry)
  np.testing.assert_array_equal(got["n"], [1, 0, 1])
  np.testing.assert_array_equal(got["a"][1], carry["a"][1])
  np.testing.assert_array_equal(got["a"][0], carry["a"][0] * 2.0 + 1.0)


def test_the_compiled_loop_is_named_and_found_by_the_hlo_helpers():
  text = jax.jit(lambda p, c: comm.gated(p, _fn, c)).lower(
      True, {"a": jnp.ones(8), "n": jnp.zeros([], jnp.int32)}).compile().as_text()
  lines = [line for line in text.splitlines() if _bench.hlo_is_gated_loop(line)]
  assert len(lines) == 1 and _bench.hlo_gated_bodies(lines[0])
  comps, entry = _bench.hlo_computations(text)
  where = _bench.hlo_reachable(comps, entry)
  assert where[_bench.hlo_gated_bodies(lines[0])[0]] is True  # sync-steps-only work


def _entry_reductions(fn, *args):
  comps, entry = _bench.hlo_computations(jax.jit(fn).lower(*args).compile().as_text())
  return sum("reduce" in line for line in comps[entry])


def test_operands_reach_fn_and_their_work_stays_in_the_loop():
  """Work on ``operands`` runs only when the gate opens: passed as operands, the reduction
  stays in the loop's body; closed over, XLA:CPU's loop-invariant code motion hoists it into
  the every-step program (the negative control)."""
  w = jnp.linspace(-1.0, 1.0, 1 << 12)

  def via_operands(p, w):
    return comm.gated(p, lambda c, w: c + jnp.sum(jnp.square(w)), jnp.zeros([]), (w,))

  def closed_over(p, w):
    return comm.gated(p, lambda c: c + jnp.sum(jnp.square(w)), jnp.zeros([]))

  assert float(via_operands(True, w)) == pytest.approx(float(jnp.sum(jnp.square(w))), rel=1e-6)
  assert float(via_operands(False, w)) == 0.0
  assert _entry_reductions(via_operands, True, w) == 0
  assert _entry_reductions(closed_over, True, w) > 0
