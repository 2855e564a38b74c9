"""The contract suite every mfopt transform passes (ARCHITECTURE.md house style 4).

To add a transform, append ``(name, factory)`` to :data:`TRANSFORMS`. ``factory()``
returns a complete optimizer (an ``optax.GradientTransformation`` whose updates are
added to the parameters) with hyperparameters that converge on both test problems
within :data:`NUM_STEPS` steps; a transform that only communicates (e.g.
``sync_gradients``) is entered in front of a plain ``optax.sgd``. Communicating
transforms are built with ``axis_name=None`` (one worker) here; their multi-worker
behaviour is tested in their own files.

The contract (after optax ``contrib/_common_test.py``):

* jit-stable: the jitted ``init`` and ``update`` trace once; a second and third call
  with the returned state do not retrace (``chex.assert_max_traces``);
* dtype-stable: with float32 and bfloat16 parameters, every state leaf keeps its
  dtype and shape across steps and updates have the parameters' dtypes;
* converges: on a parabola and on the Rosenbrock function (from (0, 0) to (1, 1));
* composes: inside ``optax.chain`` (``chain(scale(2), tx)`` on ``g`` equals ``tx`` on
  ``2g``) and inside ``optax.MultiSteps`` (k=2 micro-steps apply ``tx`` to the mean
  gradient on every second step and a zero update in between).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import mfopt

NUM_STEPS = 5000

#: (name, factory) of every transform under contract. Other issues append theirs.
TRANSFORMS = [
    ("mf_sgd", lambda: mfopt.mf_sgd(1e-3, mf=0.9)),
    ("mf_nesterov", lambda: mfopt.mf_nesterov(1e-3, mf=0.9)),
    ("mf_adam(phi=adam)", lambda: mfopt.mf_adam(optax.cosine_decay_schedule(0.05, NUM_STEPS))),
    ("mf_adam(phi=paper)",
     lambda: mfopt.mf_adam(optax.cosine_decay_schedule(0.05, NUM_STEPS), phi="paper")),
    ("sync_gradients(None) -> sgd",
     lambda: optax.chain(mfopt.sync_gradients(None), optax.sgd(1e-3, momentum=0.9))),
    ("periodic_averaging(sgd, None, p=4)",
     lambda: mfopt.periodic_averaging(optax.sgd(1e-3, momentum=0.9), None, 4)),
    ("periodic_averaging(sgd, None, adpsgd)",
     lambda: mfopt.periodic_averaging(optax.sgd(1e-3, momentum=0.9), None, mfopt.adpsgd_period(
         learning_rate=1e-3, sampling_steps=100, warmup_steps=10))),
    ("block_momentum(sgd, None, K=4, mu=0.5)",
     lambda: mfopt.block_momentum(optax.sgd(1e-3, momentum=0.9), None, 4, momentum=0.5)),
    ("qsgd(None) -> sgd",
     lambda: optax.chain(mfopt.qsgd(None), optax.sgd(1e-3, momentum=0.9))),
    ("adabound", lambda: mfopt.adabound(1e-2, final_lr=1e-2)),
    ("amsbound + weight decay",
     lambda: mfopt.adabound(1e-2, final_lr=1e-2, weight_decay=1e-4, amsbound=True)),
    ("linear_scaling_adabound", lambda: mfopt.linear_scaling_adabound(
        base_lr=1e-3, num_workers=2, steps_per_epoch=100, alpha=1e-2, warmup_epochs=10)),
    ("hybrid_adabound_lars (switch at step 1000)", lambda: mfopt.hybrid_adabound_lars(
        num_workers=2, steps_per_epoch=100, base_lr=5e-4, alpha=1e-2, warmup_epochs=10,
        decay=0.99, trust_coefficient=1.0, weight_decay=0.0)),
    ("dynamic_loss_scale(sync_gradients(None) -> sgd)",
     lambda: mfopt.precision.dynamic_loss_scale(
         optax.chain(mfopt.sync_gradients(None), optax.sgd(1e-3, momentum=0.9)))),
]

TARGET = jnp.array([1.0, -1.0, 0.5])


def parabola(p):
  return jnp.sum(jnp.square(p["x"] - TARGET.astype(p["x"].dtype)))


def rosenbrock(p):
  x, y = p["x"][0], p["x"][1]
  return jnp.square(1.0 - x) + 100.0 * jnp.square(y - x**2)


PROBLEMS = {
    "parabola": (parabola, jnp.array([-1.0, 10.0, 1.0]), TARGET, 1e-2),
    "rosenbrock": (rosenbrock, jnp.array([0.0, 0.0]), jnp.array([1.0, 1.0]), 3e-2),
}

ids = [name for name, _ in TRANSFORMS]
cases = pytest.mark.parametrize("name,factory", TRANSFORMS, ids=ids)


@cases
def test_jit_stable(name, factory):
  chex.clear_trace_counter()  # counters are keyed by code, shared by optax.chain's closures
  tx = factory()
  init = jax.jit(chex.assert_max_traces(tx.init, n=1))
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  state = init(params)
  for i in range(3):  # a retrace on call 2 or 3 raises inside assert_max_traces
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1 * (i + 1)), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  init(params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@cases
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dtype_stable(name, factory, dtype):
  tx = factory()
  params = {"w": jnp.ones((4,), dtype), "b": jnp.zeros((2,), dtype)}
  state0 = tx.init(params)
  step = jax.jit(tx.update)
  state = state0
  for i in range(3):
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5 - i), params)
    updates, state = step(grads, state, params)
    for k in params:
      assert updates[k].dtype == dtype, (name, k, updates[k].dtype)
    params = optax.apply_updates(params, updates)
    for k in params:
      assert params[k].dtype == dtype, (name, k, params[k].dtype)
  before = jax.tree.map(lambda x: (jnp.asarray(x).dtype, jnp.shape(x)), state0)
  after = jax.tree.map(lambda x: (jnp.asarray(x).dtype, jnp.shape(x)), state)
  assert jax.tree.structure(before) == jax.tree.structure(after)
  assert jax.tree.leaves(before) == jax.tree.leaves(after), name


@pytest.mark.parametrize("build", [
    lambda: optax.inject_hyperparams(mfopt.adabound, hyperparam_dtype=jnp.float32)(
        learning_rate=0.1),
    lambda: optax.inject_hyperparams(
        mfopt.linear_scaling_adabound, static_args=("num_workers", "steps_per_epoch"),
        hyperparam_dtype=jnp.float32)(base_lr=0.1, num_workers=2, steps_per_epoch=10),
    lambda: optax.inject_hyperparams(
        mfopt.hybrid_adabound_lars,
        static_args=("num_workers", "steps_per_epoch", "warmup_epochs"),
        hyperparam_dtype=jnp.float32)(num_workers=2, steps_per_epoch=2, warmup_epochs=1),
], ids=["adabound", "linear_scaling_adabound", "hybrid"])
def test_bf16_state_stays_bf16_under_float32_injected_hyperparameters(build):
  """float32 b1/b2 (the fix the bf16 rounding error suggests) promoted the bf16 moments to
  float32 after one step: a second trace and a state unlike init's (mf_adam already cast)."""
  tx = build()
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  state0 = tx.init(params)
  traces = []

  def update(g, s, p):
    traces.append(1)  # (chex.assert_max_traces counts every inject_hyperparams "update_fn")
    return tx.update(g, s, p)

  step = jax.jit(update)
  state = state0
  for i in range(4):  # (the hybrid switches to LARS at step 2)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3 - 0.2 * i), params)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert len(traces) == 1
  assert (jax.tree.map(lambda x: jnp.asarray(x).dtype, state)
          == jax.tree.map(lambda x: jnp.asarray(x).dtype, state0))


@cases
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_converges(name, factory, problem):
  loss, x0, optimum, atol = PROBLEMS[problem]
  tx = factory()

  @jax.jit
  def run(params):
    def body(carry, _):
      p, s = carry
      g = jax.grad(loss)(p)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    (p, _), _ = lax.scan(body, (params, tx.init(params)), None, length=NUM_STEPS)
    return p

  final = run({"x": x0})["x"]
  np.testing.assert_allclose(np.asarray(final), np.asarray(optimum), atol=atol,
                             err_msg=f"{name} on {problem} from {x0}")


def _grads(i):
  return {"w": jnp.array([0.3, -1.0, 2.0]) * (1 + 0.5 * i), "b": jnp.array([0.1 - 0.2 * i])}


@cases
def test_inside_chain(name, factory):
  chained, plain = optax.chain(optax.scale(2.0), factory()), factory()
  params = {"w": jnp.ones(3), "b": jnp.zeros(1)}
  s1, s2 = chained.init(params), plain.init(params)
  for i in range(3):
    u1, s1 = chained.update(_grads(i), s1, params)
    u2, s2 = plain.update(jax.tree.map(lambda g: 2 * g, _grads(i)), s2, params)
    chex.assert_trees_all_close(u1, u2, rtol=1e-6, atol=1e-7)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(u1))
    params = optax.apply_updates(params, u1)


@cases
def test_inside_multisteps(name, factory):
  multi, plain = optax.MultiSteps(factory(), every_k_schedule=2), factory()
  params_m = params_p = {"w": jnp.ones(3), "b": jnp.zeros(1)}
  sm, sp = multi.init(params_m), plain.init(params_p)
  for i in range(4):
    um, sm = multi.update(_grads(i), sm, params_m)
    if i % 2 == 0:  # first micro-step: accumulate, no update
      chex.assert_trees_all_close(um, jax.tree.map(jnp.zeros_like, um))
    else:  # second: tx applied once to the mean of the two gradients
      mean = jax.tree.map(lambda a, b: (a + b) / 2, _grads(i - 1), _grads(i))
      up, sp = plain.update(mean, sp, params_p)
      chex.assert_trees_all_close(um, up, rtol=1e-6, atol=1e-7)
      params_p = optax.apply_updates(params_p, up)
    params_m = optax.apply_updates(params_m, um)
  chex.assert_trees_all_close(params_m, params_p, rtol=1e-6, atol=1e-7)


def _f32(v):
  return jnp.asarray(v, jnp.float32)  # a caller's jax array, as from a sweep or a schedule


# Hyperparameters given as jax arrays: a state that held the caller's array itself (adabound's
# base_lr, dynamic_loss_scale's scale: jnp.asarray returns its f32 input) had it deleted by the
# first donated step, and inject_hyperparams' state then held one buffer twice (a donation error).
ARRAY_HYPERPARAMETERS = {
    "mf_sgd": lambda: mfopt.mf_sgd(_f32(0.1), _f32(0.9)),
    "mf_adam": lambda: mfopt.mf_adam(_f32(0.1), _f32(0.9)),
    "adabound": lambda: mfopt.adabound(_f32(0.1)),
    "adabound(constant schedule)": lambda: mfopt.adabound(optax.constant_schedule(_f32(0.1))),
    "inject_hyperparams(adabound)": lambda: optax.inject_hyperparams(mfopt.adabound)(
        learning_rate=0.1),
    "hybrid_adabound_lars": lambda: mfopt.hybrid_adabound_lars(num_workers=2, steps_per_epoch=2,
                                                               base_lr=_f32(0.1)),
    "dynamic_loss_scale": lambda: mfopt.precision.dynamic_loss_scale(optax.sgd(0.1),
                                                                     init_scale=_f32(1024.0)),
    "block_momentum": lambda: mfopt.block_momentum(optax.sgd(0.1), None, 2, _f32(0.5)),
}


@pytest.mark.parametrize("name", sorted(ARRAY_HYPERPARAMETERS))
def test_donated_steps_leave_the_callers_arrays_alone(name):
  tx = ARRAY_HYPERPARAMETERS[name]()
  params = {"w": jnp.ones(3)}

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  donated = jax.jit(step, donate_argnums=(0, 1))
  p, s = jax.tree.map(jnp.copy, params), tx.init(params)
  for _ in range(2):
    p, s = donated(p, s, {"w": jnp.full(3, 0.5)})
  # the transform still works: its hyperparameters were not donated with the first state
  expected = jax.jit(step)(params, tx.init(params), {"w": jnp.full(3, 0.5)})
  chex.assert_trees_all_equal_shapes(expected, (p, s))


def test_shadowed_modules_have_aliases():
  """mfopt.qsgd / mfopt.adabound are the SPEC's transforms; their modules stay reachable."""
  import mfopt.adabound as a  # (the function: the package attribute shadows the module)
  import mfopt.qsgd as q
  assert a is mfopt.adabound and q is mfopt.qsgd and callable(q)
  assert mfopt._qsgd_module.quantize is __import__("mfopt.qsgd", fromlist=["quantize"]).quantize
  assert mfopt._adabound_module.scale_by_adabound is mfopt.scale_by_adabound
