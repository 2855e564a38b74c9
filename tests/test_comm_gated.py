"""mfopt.comm.gated: a conditional as a while loop of 0 or 1 trips (issue 8)."""

import contextlib

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


def _shard_map_run(tx, check_vma, steps=3):
  """``steps`` updates of ``tx`` in user code: ``jax.shard_map`` over a 1-D mesh of 8 devices,
  one worker per device, no ``vmap`` (the README's "your own shard_map code")."""
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("d",))
  shard = lambda t: jax.device_put(t, NamedSharding(mesh, P("d")))  # noqa: E731
  params = {"w": jnp.ones((8, 3)), "b": jnp.linspace(0.0, 1.0, 16).reshape(8, 2)}
  grads = {"w": jnp.arange(24.0).reshape(8, 3) / 24.0, "b": jnp.arange(16.0).reshape(8, 2) / 16.0}
  state = jax.vmap(tx.init)(params)

  def step(p, s, g):
    p, s, g = jax.tree.map(lambda x: x[0], (p, s, g))
    u, s = tx.update(g, s, p)
    return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, u), s))

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                            check_vma=check_vma))
  p, s = shard(params), shard(state)
  for _ in range(steps):
    p, s = f(p, s, shard(grads))
  return jax.device_get(p)


@pytest.mark.parametrize("name", ["periodic_averaging", "adpsgd", "block_momentum", "hybrid"])
def test_gated_transforms_trace_under_shard_map_with_check_vma(name):
  # JAX's default check_vma=True types a pmean's result invariant and this device's values
  # varying; the gate's loop carry must agree on the way in and out. Same numbers as
  # check_vma=False (where nothing is typed varying).
  import optax
  import mfopt
  make = {
      "periodic_averaging": lambda: mfopt.periodic_averaging(optax.sgd(0.1), "d", 2,
                                                             track_variance=True),
      "adpsgd": lambda: mfopt.periodic_averaging(optax.sgd(0.1, momentum=0.9), "d",
                                                 mfopt.adpsgd_period(learning_rate=0.1, p_init=1,
                                                                     sampling_steps=1)),
      "block_momentum": lambda: mfopt.block_momentum(optax.sgd(0.1), "d", 2, momentum=0.5),
      "hybrid": lambda: optax.chain(mfopt.sync_gradients("d"), mfopt.hybrid_adabound_lars(
          num_workers=8, steps_per_epoch=1, warmup_epochs=1)),
  }[name]
  want = _shard_map_run(make(), check_vma=False)
  got = _shard_map_run(make(), check_vma=True)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  if name == "periodic_averaging":  # NumPy: two local steps, the average, one local step
    g = np.arange(24.0).reshape(8, 3) / 24.0
    w = (np.ones((8, 3)) - 0.2 * g).mean(axis=0) - 0.1 * g
    np.testing.assert_allclose(np.asarray(got["w"]), w, rtol=1e-6)


def _meta_loss(make_tx, workers, steps=4):
  """The loss after ``steps`` updates as a function of the learning rate (optax's
  meta-learning pattern), with ``workers`` workers under ``vmap(axis_name="w")``."""
  # Workers disagree, and no coordinate of the mean gradient is 0 at the start (AdaBound's
  # sqrt(v) at v = 0 has an infinite derivative: NaN, as for optax.adam without eps_root).
  target = jnp.linspace(-1.0, 1.2, 3 * workers).reshape(workers, 3)

  def loss(p, t):
    return jnp.sum((p["w"] - t) ** 2)

  def meta(lr):
    tx = make_tx(lr)
    p = {"w": jnp.zeros((workers, 3))}
    s = jax.vmap(tx.init)(p)

    def one(p, s, t):
      u, s = tx.update(jax.grad(loss)(p, t), s, p)
      return jax.tree.map(jnp.add, p, u), s

    for _ in range(steps):
      p, s = jax.vmap(one, axis_name="w")(p, s, target)
    return jnp.mean(jax.vmap(loss)(p, target))

  return meta


@pytest.mark.parametrize("name", ["periodic_averaging", "block_momentum", "hybrid"])
def test_reverse_mode_grads_through_the_update_match_finite_differences(name):
  """jax.grad through a gated update: the loop's custom JVP (a select) and, under
  differentiable_gates, lax.cond give the same gradient with respect to the learning rate,
  forward mode agrees, and all match central finite differences (float32: within 2%). The
  loss itself is the same whichever way the gates were traced."""
  import optax
  import mfopt
  make = {
      "periodic_averaging": lambda lr: mfopt.periodic_averaging(optax.sgd(lr, momentum=0.5),
                                                                "w", 2),
      "block_momentum": lambda lr: mfopt.block_momentum(optax.sgd(lr), "w", 2, momentum=0.5),
      "hybrid": lambda lr: optax.chain(mfopt.sync_gradients("w"), mfopt.hybrid_adabound_lars(
          num_workers=2, steps_per_epoch=1, warmup_epochs=2, alpha=lr)),
  }[name]
  meta = _meta_loss(make, workers=2)
  lr = 0.05 if name != "hybrid" else 0.01
  g = float(jax.grad(meta)(lr))
  value = float(meta(lr))
  assert float(jax.jacfwd(meta)(lr)) == pytest.approx(g, rel=1e-5)
  with mfopt.differentiable_gates():
    assert float(jax.grad(meta)(lr)) == pytest.approx(g, rel=1e-5)
    assert float(meta(lr)) == pytest.approx(value, rel=1e-6)  # loops and conds agree
  h = lr * 1e-2
  fd = (float(meta(lr + h)) - float(meta(lr - h))) / (2 * h)
  assert abs(g) > 1e-3, g
  assert g == pytest.approx(fd, rel=2e-2), (g, fd)


@pytest.mark.parametrize("pred", [True, False])
def test_gated_derivatives_reach_the_carry_operands_and_closed_over_values(pred):
  """d/d(c, w, a) of gated(pred, c -> a * c + sum(w^2)): (a, 2w, c) when the gate opens,
  (1, 0, 0) when it does not, in reverse and forward mode. ``a`` is closed over by fn (the
  custom JVP needs it as an argument: a closed-over value would get no derivative)."""
  c0, w0, a0 = jnp.float32(1.5), jnp.asarray([0.5, -2.0]), jnp.float32(3.0)

  def f(c, w, a):
    return comm.gated(jnp.asarray(pred), lambda c, w: a * c + jnp.sum(jnp.square(w)), c, (w,))

  want = (a0, 2 * w0, c0) if pred else (1.0, np.zeros(2), 0.0)
  for got in (jax.grad(f, argnums=(0, 1, 2))(c0, w0, a0),
              jax.jacfwd(f, argnums=(0, 1, 2))(c0, w0, a0)):
    for x, y in zip(got, want):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
  assert float(f(c0, w0, a0)) == pytest.approx(float(a0 * c0 + 4.25) if pred else 1.5)


def test_a_shut_gate_keeps_an_infinite_branch_derivative_out_of_the_gradient():
  """Under vmap with a per-worker predicate the branch is evaluated for every worker; a
  worker whose gate is shut must get the identity's gradient, not 0 * inf = NaN from the
  branch (here sqrt at 0), as for lax.cond."""
  def f(c, open_):
    return comm.gated(open_, lambda c: jnp.sqrt(c), c)

  def total(c):
    return jnp.sum(jax.vmap(f)(c, jnp.asarray([True, False])))

  g = jax.grad(total)(jnp.asarray([4.0, 0.0]))
  np.testing.assert_array_equal(np.asarray(g), [0.25, 1.0])


def test_eager_gates_do_not_keep_what_fn_closed_over_alive():
  """jax.closure_convert caches on the function object; gated makes a new closure per call,
  so eager calls (tx.update outside jit) kept every closed-over array alive (30 calls closing
  over 4 MB each held 114 MiB). The uncached conversion keeps none."""
  import gc

  def live():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())

  before = live()
  def one_call(i):
    big = jnp.full((1 << 18,), float(i))  # 1 MiB, a fresh one each call
    return comm.gated(jnp.asarray(i % 2 == 0), lambda c: c + big[:3], jnp.zeros(3))

  for i in range(20):
    np.testing.assert_allclose(np.asarray(one_call(i)), float(i) if i % 2 == 0 else 0.0)
  assert live() - before < (1 << 20), (before, live())


def test_a_non_bool_predicate_opens_the_gate_once_in_value_and_derivative():
  # (an int 2 ran the loop twice, 4x, while the custom JVP took one trip: derivative 2)
  # (nonzero opens it: a negative one too, as a float fraction does)
  for pred, want in ((jnp.int32(2), 2.0), (jnp.float32(0.5), 2.0), (jnp.int32(-1), 2.0),
                     (jnp.float32(-0.5), 2.0), (jnp.int32(0), 1.0)):
    f = lambda x: comm.gated(pred, lambda c: c * 2.0, x)  # noqa: E731
    assert float(f(jnp.float32(1.5))) == 1.5 * want
    assert float(jax.grad(f)(jnp.float32(1.5))) == want


def test_closed_over_values_of_several_dtypes_keep_their_places_in_value_and_derivative():
  """fn closes over an int index (left as a constant: no derivative) before two float scalars
  (hoisted into arguments): each keeps its place. d/d(c, a, b) of sum(gated(c -> c[idx] * a +
  b^2 c)) with idx a permutation: (a + b^2, sum c, 2 b sum c) open, (1, 0, 0) shut."""
  idx = jnp.asarray([2, 0, 1])
  c0, a0, b0 = jnp.asarray([1.0, 2.0, 3.0]), jnp.float32(2.0), jnp.float32(0.5)
  for pred in (True, False):
    def f(c, a, b):
      return jnp.sum(comm.gated(jnp.asarray(pred), lambda c: c[idx] * a + b * b * c, c))

    value, want = (6.0 * 2.0 + 0.25 * 6.0, (np.full(3, 2.25), 6.0, 6.0)) if pred else (
        6.0, (np.ones(3), 0.0, 0.0))
    assert float(f(c0, a0, b0)) == pytest.approx(value, rel=1e-6)
    assert float(jax.jit(f)(c0, a0, b0)) == pytest.approx(value, rel=1e-6)
    for got in (jax.grad(f, argnums=(0, 1, 2))(c0, a0, b0),
                jax.jacfwd(f, argnums=(0, 1, 2))(c0, a0, b0)):
      for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)

  def complex_closed_over(a):  # inexact, not only floating, values are hoisted
    z = a * (1.0 + 2.0j)
    ones = jnp.ones(2, jnp.complex64)
    return jnp.real(jnp.sum(comm.gated(jnp.asarray(True), lambda c: c * z, ones)))

  assert float(jax.grad(complex_closed_over)(1.5)) == pytest.approx(2.0, rel=1e-6)  # d Re(2 a)


def test_mixed_varying_operands_and_an_invariant_result_under_checked_shard_map():
  """Under shard_map(check_vma=True), an invariant predicate and carry with a varying and an
  invariant operand (fn's result varies), and a varying carry that fn averages (its result
  is invariant): loop and lax.cond agree with the closed forms in value and derivative.
  Per device d with x_d = d: open, c x_d + 3c (sum 52c) and pmean((c x)^2) (sum 140 c^2);
  shut, c (sum 8c) and c x_d (sum 28c)."""
  import mfopt
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))

  def mixed(c, x, open_):  # (an invariant operand first: the varying one must cast it too)
    return comm.gated(open_ > 0.5, lambda c, y, x, z: c * x + y + z, c,
                      (c * 2.0, x[0], c))[None]

  def averaged(c, x, open_):
    return comm.gated(open_ > 0.5, lambda d: lax.pmean(d * d, "d"), c * x[0])[None]

  def total(per_device):
    def f(c, open_):
      g = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=P("d"))
      return jnp.sum(g(c, xs, open_))
    return f

  c = 0.5
  cases = {(mixed, 1.0): (52 * c, 52.0), (mixed, 0.0): (8 * c, 8.0),
           (averaged, 1.0): (140 * c * c, 280 * c), (averaged, 0.0): (28 * c, 28.0)}
  for differentiable in (False, True):
    with mfopt.differentiable_gates() if differentiable else contextlib.nullcontext():
      # (the value on its own: value_and_grad would run the custom JVP rule, not the loop)
      run = {f: (jax.jit(total(f)), jax.jit(jax.grad(total(f)))) for f in (mixed, averaged)}
      for (per_device, open_), want in cases.items():
        got = tuple(float(g(c, open_)) for g in run[per_device])  # traced here, in the context
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{differentiable} {open_}")


def test_a_predicate_varying_over_the_mesh_differentiates_under_checked_shard_map():
  """Under shard_map(check_vma=True) a per-device predicate with an invariant carry and
  operand: jax.grad raised (a varying where on an invariant tangent), and differentiable_gates'
  lax.cond gave a wrong gradient, then hung. Now both give d/dc sum_devices gated(x_d > 2.5,
  c -> c * 2c, c) = sum over devices of (4c if open else 1), at c = 0.5: 4 devices open of 8."""
  import mfopt
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))

  def per_device(c, x):
    return comm.gated(x[0] > 3.5, lambda c, o: c * o, c, (c * 2.0,))[None]

  def total(c):
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    return jnp.sum(f(c, xs))

  want = 4 * (4 * 0.5) + 4 * 1.0
  assert float(jax.grad(total)(0.5)) == pytest.approx(want, rel=1e-6)
  with mfopt.differentiable_gates():
    assert float(jax.grad(total)(0.5)) == pytest.approx(want, rel=1e-6)

  def closes_over(c, x):  # fn closes over the invariant c: the cond path refuses it
    return comm.gated(x[0] > 3.5, lambda d: d * c, c * x[0])[None]

  def total2(c):
    f = jax.shard_map(closes_over, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
    return jnp.sum(f(c, xs))

  # d/dc of (c * c x if open else c x): 2 c x where x > 3.5, x elsewhere
  x = np.arange(8.0)
  want2 = float(np.sum(np.where(x > 3.5, 2 * 0.5 * x, x)))
  assert float(jax.grad(total2)(0.5)) == pytest.approx(want2, rel=1e-6)
  with mfopt.differentiable_gates():
    with pytest.raises(ValueError, match=r"closes over a value that does not vary over the "
                                         r"mesh axes \['d'\]"):
      jax.grad(total2)(0.5)

  scale = jnp.float32(3.0)  # closed over, but a constant (no derivative): not refused

  def closes_over_a_constant(c, x):
    return comm.gated(x[0] > 3.5, lambda d: d * scale, c * x[0])[None]

  def total3(c):
    f = jax.shard_map(closes_over_a_constant, mesh=mesh, in_specs=(P(), P("d")),
                      out_specs=P("d"))
    return jnp.sum(f(c, xs))

  # 3 c x where x > 3.5, c x elsewhere: 72 c
  with mfopt.differentiable_gates():
    assert float(total3(0.5)) == pytest.approx(36.0, rel=1e-6)
    assert float(jax.grad(total3)(0.5)) == pytest.approx(72.0, rel=1e-6)


def test_axis_name_checks_refuse_an_empty_tuple_and_name_an_unbound_axis():
  """``()`` names no worker axis: refused where the transform is built (taken as "average over
  nothing", the exchange would be a silent no-op that is still counted). An axis that is not
  bound where the update runs is a ValueError naming the transform and the axis, not JAX's
  NameError about psum."""
  import optax
  import mfopt
  for build in (mfopt.sync_gradients, mfopt.qsgd,
                lambda a: mfopt.periodic_averaging(optax.sgd(0.1), a, 2)):
    with pytest.raises(ValueError, match=r"axis_name must be None .* got \(\)"):
      build(())
  assert comm.check_axis_name(["data", "local"]) == ("data", "local")
  p = {"w": jnp.ones(3)}
  for name, tx in (("periodic_averaging", mfopt.periodic_averaging(optax.sgd(0.1), "w", 2)),
                   ("qsgd", mfopt.qsgd("w")), ("sync_gradients", mfopt.sync_gradients("w"))):
    with pytest.raises(ValueError, match=rf"{name}.*axis_name='w', but 'w' is not bound"):
      tx.update(p, tx.init(p), p)


def test_a_vmap_axis_inside_a_checked_shard_map_is_refused_by_name():
  """A transform over ("data", "local") with "local" a vmap axis inside jax.shard_map's default
  check_vma=True: JAX's pvary failed with a bare AssertionError in unbatched's pmax; now a
  ValueError saying to pass check_vma=False, with which the same step runs."""
  import optax
  import mfopt
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("data",))
  tx = mfopt.block_momentum(optax.sgd(0.1), ("data", "local"), 2)
  params = {"w": jnp.ones((16, 3))}
  params, state = jax.device_put((params, jax.vmap(tx.init)(params)),
                                 NamedSharding(mesh, P("data")))

  def per_device(p, s):
    def one(p, s):
      u, s = tx.update({"w": p["w"] * 2.0}, s, p)
      return optax.apply_updates(p, u), s
    return jax.vmap(one, axis_name="local")(p, s)

  def run(check_vma):
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                 check_vma=check_vma))(params, state)

  with pytest.raises(ValueError, match=r"vmap axes \('local',\).*pass check_vma=False"):
    run(True)
  p, _ = run(False)
  np.testing.assert_allclose(np.asarray(p["w"]), 0.8, rtol=1e-6)  # one local step, 1 - 0.1 * 2


def test_a_payload_of_exactly_2_gib_is_split_and_read_back():
  """2**31 bytes is the first payload an int32 cannot hold: it is stored as (GiB, remainder)
  and read back exactly; one byte less stays a scalar."""
  big = comm.init_comm_stats(2**31, comm.CollectiveKind.ALL_REDUCE)
  assert big.payload_bytes.shape == (2,) and comm.payload_of(big) == 2**31
  below = comm.init_comm_stats(2**31 - 1, comm.CollectiveKind.ALL_GATHER)
  assert below.payload_bytes.shape == () and comm.payload_of(below) == 2**31 - 1
