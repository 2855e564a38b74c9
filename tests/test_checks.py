"""mfopt._checks: one meaning of "integer" everywhere (int or NumPy integer, never bool).

Before the shared module, entry points disagreed: some accepted ``True`` as one worker
(``isinstance(True, int)`` holds), some rejected ``np.int64(8)`` from a config or an
``np.arange`` loop. These tests pin the agreed meaning at the entry points that differed.
"""

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import _checks, costmodel, parallel
from mfopt.sim import ksync, server


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(1), np.uint8(2)])
def test_positive_int_accepts_python_and_numpy_integers(value):
  out = _checks.positive_int("n", value)
  assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [0, -3, True, False, np.bool_(True), 2.0, 2.5, "3", None,
                                   np.float32(4.0)])
def test_positive_int_rejects_with_name_and_value(value):
  with pytest.raises(ValueError, match=r"^n must be a positive integer, got ") as e:
    _checks.positive_int("n", value)
  assert repr(value) in str(e.value)


def test_owner_prefixes_the_message():
  with pytest.raises(ValueError, match=r"^MLP: num_classes must be a positive integer, got 0$"):
    _checks.positive_int("num_classes", 0, owner="MLP")


@pytest.mark.parametrize("fn,good,bad", [
    (_checks.nonnegative_int, [0, np.int64(5)], [-1, True, 0.0]),
    (_checks.positive_number, [1e-9, 3, np.float32(0.5)], [0.0, -1.0, float("nan"), True, "1"]),
    (_checks.nonnegative_number, [0.0, 2, np.float64(1.5)], [-1e-9, float("nan"), False]),
    (_checks.unit_interval, [0.0, 0.999, np.float32(0.5)], [1.0, -0.1, float("nan"), True]),
])
def test_domains(fn, good, bad):
  for v in good:
    assert fn("x", v) == v
  for v in bad:
    with pytest.raises(ValueError, match=r"^x must be "):
      fn("x", v)


# Entry points that used to accept True (bool is an int to Python) now reject it ...
@pytest.mark.parametrize("call,name", [
    (lambda v: costmodel.all_reduce_time(1e6, v, "10gbit"), "num_workers"),
    (lambda v: parallel.local_workers(v, parallel.make_mesh()), "num_workers"),
    (lambda v: server.SSP(staleness=v), "staleness"),
    (lambda v: server.EASGD(interval=v), "interval"),
    (lambda v: ksync.KTestConfig(k_min=v), "k_min"),
    (lambda v: server.KSyncConfig(k_rule=v), "k_rule"),
])
def test_bool_is_not_a_count(call, name):
  with pytest.raises(ValueError, match=rf"{name} must be .*got True"):
    call(True)


# ... and entry points that used to reject NumPy integers now accept them.
def test_numpy_integers_are_accepted_where_they_were_not():
  n = np.int64(8)
  a = mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=n, steps_per_epoch=np.int32(10))
  b = mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=8, steps_per_epoch=10)
  params = {"w": np.ones(3, np.float32)}
  ua, _ = a.update(params, a.init(params), params)
  ub, _ = b.update(params, b.init(params), params)
  np.testing.assert_array_equal(ua["w"], ub["w"])
  assert server.SSP(staleness=np.int64(2)).staleness == 2
  assert ksync.KTestConfig(k_min=np.int64(2), k_max=np.int64(4)).k_max == 4


# ----------------------------------------------------------------------------- real scalars


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int32(1),
                                   np.asarray(0.5), __import__("jax").numpy.asarray(0.5)])
def test_numbers_accept_python_numpy_and_0d_jax_scalars(value):
  assert _checks.positive_number("lr", value) is value


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), True, "0.1", None, np.ones(2),
                                   __import__("jax").numpy.asarray(-0.5)])
def test_numbers_reject_with_name_and_value(value):
  with pytest.raises(ValueError, match=r"^lr must be a positive number, got "):
    _checks.positive_number("lr", value)


def test_numpy_and_jax_scalars_reach_the_seed_000_helpers():
  import jax.numpy as jnp
  assert mfopt.linear_scaling_rule(np.float32(0.25), 128)(256) == 0.5
  assert mfopt.linear_scaling_rule(jnp.asarray(0.25), 128)(256) == 0.5
  assert mfopt.noise_scale(0.1, 100, 10, np.float32(0.5)) == pytest.approx(0.1 / 0.5 * 9)
  with pytest.raises(ValueError, match="momentum must be in"):
    mfopt.noise_scale(0.1, 100, 10, np.float32(1.0))


def test_adabound_learning_rate_must_be_positive():
  """lr = 0 would still step at the lower bound (the bounds do not scale with a constant lr),
  and a schedule's lr_0 divides: both are refused where they are built."""
  with pytest.raises(ValueError, match=r"learning_rate must be a positive number, got 0.0"):
    mfopt.adabound(0.0)
  with pytest.raises(ValueError, match=r"learning_rate\(0\) must be a positive number"):
    mfopt.adabound(lambda t: 0.0 * t)


# ----------------------------------------------------------------------------- caught when built
# Each of these was accepted and failed later (inside the first traced update, or at init) with
# a message that did not name the argument; now the constructor names it and its value.

@pytest.mark.parametrize("build,match", [
    (lambda: mfopt.sync_gradients(5), r"axis_name must be None .* got 5"),
    (lambda: mfopt.sync_gradients("data", comm_dtype="int8"), r"comm_dtype must be a floating dtype.*'int8'"),
    (lambda: mfopt.mf_sgd("0.1"), r"learning_rate must be a number or a schedule.*'0.1'"),
    (lambda: mfopt.mf_sgd(True), r"learning_rate must be a number or a schedule.*True"),
    (lambda: mfopt.mf_sgd(None), r"learning_rate must be a number or a schedule.*None"),
    (lambda: mfopt.mf_sgd(0.1, mf="abc"), r"mf must be a number or a schedule.*'abc'"),
    (lambda: mfopt.mf_adam(0.1, mf2=lambda t: 0.999), r"mf2 must be a constant in \[0, 1\)"),
    (lambda: mfopt.block_momentum(__import__("optax").sgd(0.1), None, 2, momentum="0.5"),
     r"momentum must be in \[0, 1\), got '0.5'"),
    (lambda: mfopt.periodic_averaging(None, None, 2), r"inner must be an optax.GradientTransformation"),
    (lambda: mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=4, low="0.7"),
     r"low must be in \(0, 1\], got '0.7'"),
    (lambda: mfopt.adpsgd_period(learning_rate=float("inf"), sampling_steps=4),
     r"learning_rate must be a finite positive number, got inf"),
    (lambda: mfopt.scheduled_period((4, 2), (1.5,)), r"boundaries\[0\] must be a positive integer, got 1.5"),
    (lambda: mfopt.qsgd(None, seed="x"), r"seed must be a non-negative integer, got 'x'"),
    (lambda: parallel.make_mesh(8), r"devices must be a sequence of jax.Device.*got 8"),
    (lambda: parallel.make_mesh(jax.devices), r"devices must be a sequence of jax.Device"),
    (lambda: parallel.make_mesh([jax.devices()[0]] * 2 + jax.devices()[1:2]),
     r"devices must be distinct, got CpuDevice\(id=0\) 2 times"),
])
def test_bad_arguments_fail_where_the_transform_is_built(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_comm_dtype_accepts_the_policy_names():
  import jax.numpy as jnp
  from mfopt import comm
  assert comm.comm_dtype_of("bf16") == jnp.bfloat16 and comm.comm_dtype_of("fp16") == jnp.float16
  assert comm.comm_dtype_of(jnp.bfloat16) == jnp.bfloat16 and comm.comm_dtype_of(None) is None


def test_bf16_hyperparameters_from_inject_hyperparams_are_numbers():
  # optax.inject_hyperparams hands bf16 params' hyperparameters over as 0-d bf16 arrays:
  # accepted like float32 ones (NumPy does not call bfloat16 a float; JAX does).
  import jax
  import jax.numpy as jnp
  import optax
  params = {"w": jnp.ones((3,), jnp.bfloat16)}
  tx = optax.inject_hyperparams(mfopt.mf_sgd)(learning_rate=0.1, mf=0.9)
  state = tx.init(params)
  assert state.hyperparams["mf"].dtype == jnp.bfloat16
  u, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  np.testing.assert_allclose(np.asarray(u["w"], np.float32), -0.1, rtol=1e-2)
  # A value bf16 rounding broke (0.999 -> 1.0) is refused, and the message says why.
  with pytest.raises(ValueError, match=r"b2 must be in \[0, 1\).*bfloat16 rounds.*"
                                       r"hyperparam_dtype=jnp.float32"):
    optax.inject_hyperparams(mfopt.adabound)(learning_rate=0.1).init(params)


def test_structural_arguments_injected_as_arrays_point_at_static_args():
  import jax.numpy as jnp
  import optax
  hint = r"a JAX array; a structural integer must be a Python int.*static_args"
  with pytest.raises(ValueError, match=r"period must be .*got Array\(2.*" + hint):
    optax.inject_hyperparams(mfopt.periodic_averaging)(optax.sgd(0.1), None, 2).init(
        {"w": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"bits must be .*" + hint):
    mfopt.qsgd(None, bits=jnp.asarray(4))


@pytest.mark.parametrize("owner,build", [
    ("sync_gradients", lambda: mfopt.sync_gradients("data")),
    ("periodic_averaging", lambda: mfopt.periodic_averaging(optax.sgd(0.1), "data", 2)),
    ("periodic_averaging", lambda: mfopt.block_momentum(optax.sgd(0.1), "data", 2)),
    ("qsgd", lambda: mfopt.qsgd("data")),
])
def test_an_update_outside_its_axis_names_binding_names_the_transform(owner, build):
  """JAX's own error ('unbound axis name ... call psum under jax.shard_map') names neither the
  transform nor its axis_name; the transform's check does."""
  import jax.numpy as jnp
  tx, params = build(), {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match=rf"^{owner}.*axis_name='data', but 'data' is not bound "
                     r"where its update runs"):
    tx.update(params, tx.init(params), params)
  # bound by vmap (a worker axis of size 2), the same transform runs
  run = jax.vmap(lambda g: tx.update(g, tx.init(g), g)[0], axis_name="data")
  out = run({"w": jnp.arange(6.0).reshape(2, 3)})
  assert out["w"].shape == (2, 3)


def test_small_helpers_name_bad_inputs():
  """From session 13's audit: each of these returned something wrong (another worker's slice,
  an empty stack, a negative time, zero communication) or failed with an unrelated error."""
  import jax.numpy as jnp
  import optax
  stacked = {"w": jnp.arange(12.0).reshape(4, 3)}
  with pytest.raises(ValueError, match=r"index must be < the number of workers 4, got 7"):
    parallel.unstack_worker(stacked, 7)
  np.testing.assert_array_equal(parallel.unstack_worker(stacked, 3)["w"], [9.0, 10.0, 11.0])
  with pytest.raises(ValueError, match=r"num_workers must be a positive integer, got 0"):
    parallel.stack_workers({"w": np.ones(3)}, 0)
  with pytest.raises(ValueError, match=r"payload_bytes must be a non-negative number, got -1000000.0"):
    costmodel.all_reduce_time(-1e6, 4, "10gbit")
  assert np.isnan(costmodel.all_reduce_time(float("nan"), 4, "10gbit"))  # a diverged run's
  assert _checks.positive_number("x", 2**64) == 2**64  # (np.isfinite raised on a huge int)
  with pytest.raises(ValueError, match=r"totals must hold mfopt.comm_totals\(state\)'s counts"):
    costmodel.communication_time({"bogus": 5}, 4, "10gbit")
  for wrap in (mfopt.precision.dynamic_loss_scale, mfopt.precision.skip_nonfinite):
    with pytest.raises(ValueError, match=r"inner must be an optax.GradientTransformation"):
      wrap(optax.sgd)


# ----------------------------------------------------------------------------- session 18 review
# Each was accepted and misbehaved later (a wrong counter, a crash mid-run, a flipped feature).

@pytest.mark.parametrize("build,match", [
    (lambda: mfopt.sync_gradients(("w", "w")), r"axis_name names an axis twice: \('w', 'w'\)"),
    (lambda: mfopt.sim.KTestConfig(variance_ucb="no"), r"variance_ucb must be True or False"),
    (lambda: mfopt.sim.ServerLink("10gbit", duplex="no"), r"duplex must be True or False"),
    (lambda: mfopt.check_mf_conditions(0.9, 0.1, 10, second_order="no"),
     r"second_order must be True or False"),
    (lambda: mfopt.check_mf_conditions("0.9", 0.1, 10), r"mf must be a number, .*'0.9'"),
    (lambda: mfopt.check_mf_conditions(0.9, None, 10), r"lr must be a number, .*None"),
    (lambda: mfopt.check_mf_conditions(True, 0.1, 10), r"mf must be a number, .*True"),
    (lambda: mfopt.sim.KSync("working"), r"config must be a mfopt.sim.KSyncConfig or None, got "
     r"'working' \(for the preset: mfopt.sim.ksync_preset\('working'\)"),
    (lambda: mfopt.sim.KSync({}), r"config must be a mfopt.sim.KSyncConfig or None, got \{\}"),
    (lambda: mfopt.sim.KSyncConfig(bb=None, lr_fallback=None), r"lr_fallback must be a "),
    (lambda: mfopt.sim.BBConfig(alpha0=0.01, alpha_min=1.0), r"alpha_min=1.0 is above"),
    (lambda: mfopt.sim.ComputeModel(speeds=2.0), r"speeds must be None or a sequence"),
    (lambda: mfopt.sim.ComputeModel(speeds=[1.0, float("inf")]), r"speeds must be a sequence "
     r"of finite positive numbers, got inf"),
    (lambda: mfopt.linear_scaling_bounds(1.0, base_lr=0.1, num_workers=8, warmup_epochs=2,
                                         b2=1.0), r"b2 must be in \[0, 1\), got 1.0"),
    (lambda: mfopt.mf_sgd(0.1, mf=0.9, validate_steps=0), r"validate_steps must be a positive "
     r"integer, got 0"),
    (lambda: mfopt.precision.get_policy(mfopt.precision.Policy(compute=5)),
     r"compute must be one of .*got 5"),
    (lambda: mfopt.precision.get_policy(mfopt.precision.Policy(compute=np.int8)),
     r"compute must be one of .*int8"),
    (lambda: mfopt.precision.dynamic_loss_scale(optax.sgd(0.1), growth_factor=0.5),
     r"growth_factor must be >= 1, got 0.5"),
])
def test_review_s18_bad_arguments_are_refused(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_theory_refuses_what_it_answered_wrongly():
  from mfopt import theory
  c = theory.ProblemConstants(L=1.0, sigma2=1.0, M=1.0, f_gap=1.0)
  with pytest.raises(ValueError, match=r"eta must be a positive number, got -0.01"):
    theory.lemma5_condition(0.5, samples=1e4, eta=-0.01, P=4, B=8, c=c)  # it "held"
  with pytest.raises(ValueError, match=r"k_max must be a positive integer, got 0"):
    theory.optimal_period(0.5, samples=1e4, eta=0.01, P=4, B=8, c=c, k_max=0)
  with pytest.raises(ValueError, match=r"K must be >= 1, got inf \(it must be finite\)"):
    theory.bound(0.5, 10, 0.01, P=4, B=8, K=float("inf"), c=c)
  with pytest.raises(ValueError, match=r"samples must be a positive number, got -100000.0"):
    theory.optimal_momentum(4, samples=-1e5, eta=0.01, B=8, K=2, c=c)
  with pytest.raises(ValueError, match=r"L must be a positive number, got inf"):
    theory.ProblemConstants(L=float("inf"), sigma2=1.0, M=1.0, f_gap=1.0)


def test_float64_comm_dtype_without_x64_is_counted_as_the_float32_it_sends():
  """x64 off: a float64 exchange runs in float32, but the counters charged 8 bytes a value."""
  assert not jax.config.jax_enable_x64
  params = {"w": np.zeros(1000, np.float32)}
  for dtype in (float, "float64", np.float64):
    tx = mfopt.sync_gradients("w", comm_dtype=dtype)
    state = jax.vmap(tx.init, axis_size=2)(jax.tree.map(lambda x: np.stack([x, x]), params))
    _, state = jax.vmap(tx.update, axis_name="w")(
        jax.tree.map(lambda x: np.stack([x, x]), params), state)
    assert mfopt.comm_totals(state)["all_reduce_bytes"] == 4000, dtype


def test_simulator_configs_hold_python_scalars():
  """A 0-d JAX momentum passed validation, then a jitted-step cache raised 'unhashable type'
  mid-run; a JAX learning rate was fingerprinted as 'ArrayImpl' (two rates looked the same)."""
  import jax.numpy as jnp
  a = server.BaseSGD(learning_rate=jnp.asarray(0.25), momentum=jnp.asarray(0.75))
  assert type(a.learning_rate) is float and type(a.momentum) is float
  assert hash(a) == hash(server.BaseSGD(learning_rate=0.25, momentum=0.75))
  assert server.plain_settings(a) != server.plain_settings(server.BaseSGD(learning_rate=0.5,
                                                                          momentum=0.75))
  assert type(mfopt.sim.BBConfig(alpha0=jnp.asarray(0.01)).alpha0) is float
  assert type(ksync.KTestConfig(confidence=np.float32(0.95)).confidence) is float
  assert server.plain_settings(jnp.arange(3.0)) == [0.0, 1.0, 2.0]


# ----------------------------------------------------------------------------- boundaries


def test_zero_d_integer_arrays_are_numbers_but_one_element_arrays_are_not():
  """A 0-d integer array (np.asarray(3), a jnp scalar) is a real scalar like a 0-d float one,
  while a 1-element vector is not a scalar: accepting it would let a shape bug through."""
  import jax.numpy as jnp
  for value in (np.asarray(3), jnp.asarray(2), np.asarray(np.int8(1))):
    assert _checks.positive_number("lr", value) is value
  for value in (np.ones(1), np.ones((1, 1)), jnp.ones(1)):
    with pytest.raises(ValueError, match=r"^lr must be a positive number, got "):
      _checks.positive_number("lr", value)


@pytest.mark.parametrize("value", [0, 7, np.int64(5), np.uint16(3), np.int8(0)])
def test_nonnegative_int_returns_a_python_int(value):
  """Like positive_int, the count comes back as a Python int whatever integer type came in (a
  NumPy integer left in a config serialises and fingerprints differently from the same int)."""
  out = _checks.nonnegative_int("n", value)
  assert out == int(value) and type(out) is int


def test_non_finite_numbers_are_refused_and_only_infinities_get_the_finite_hint():
  """inf and an int too large for a float are not finite (math.isfinite overflows on the latter),
  so both are refused with '(it must be finite)'; NaN is refused without that hint (NaN is not
  'too large', the hint would mislead)."""
  for value in (float("inf"), 10**400, np.float64("inf")):
    with pytest.raises(ValueError, match=r"^x must be a positive number, got .*\(it must be "
                                         r"finite\)$"):
      _checks.positive_number("x", value)
  with pytest.raises(ValueError, match=r"^x must be a non-negative number, got nan$"):
    _checks.nonnegative_number("x", float("nan"))
  assert _checks.positive_number("x", 10**300) == 10**300  # still a float-sized int


def test_finite_positive_number_excludes_zero_and_infinity():
  """Both ends of (0, inf) are open: a step size of 0 or -0.0 would freeze training and inf
  would make it NaN; the smallest subnormal and the largest float pass."""
  for value in (0.0, -0.0, 0, float("inf"), -1.0, float("nan")):
    with pytest.raises(ValueError, match=r"^lr must be a finite positive number, got "):
      _checks.finite_positive_number("lr", value)
  for value in (5e-324, 1.7e308, 1):
    assert _checks.finite_positive_number("lr", value) == value


def test_flag_accepts_numpy_bools_and_returns_python_bools():
  """A NumPy bool (a comparison result from a config) is a flag; it comes back as a Python bool
  so that identity checks (`is True`) and hashing of configs behave like for True/False."""
  assert _checks.flag("f", np.bool_(True)) is True
  assert _checks.flag("f", np.bool_(False)) is False
  assert _checks.flag("f", False) is False
  assert _checks.flag("f", None, allow_none=True) is None
  with pytest.raises(ValueError, match=r"^f must be True or False, got None$"):
    _checks.flag("f", None)
  with pytest.raises(ValueError, match=r"^f must be True, False or None, got 1$"):
    _checks.flag("f", 1, allow_none=True)


def test_transformation_needs_both_init_and_update():
  """An optax transformation has init and update: an object with only one of them would fail at
  its first use; when None is allowed, the message says so."""
  from types import SimpleNamespace
  both = SimpleNamespace(init=lambda p: None, update=lambda u, s, p=None: (u, s))
  assert _checks.transformation("inner", both) is both
  assert _checks.transformation("outer", None, allow_none=True) is None
  for half in (SimpleNamespace(init=both.init), SimpleNamespace(update=both.update)):
    with pytest.raises(ValueError, match=r"^inner must be an optax.GradientTransformation"):
      _checks.transformation("inner", half)
  with pytest.raises(ValueError, match=r"^outer must be None or an optax.GradientTransformation "
                                       r"\(e.g. optax.sgd\(0.1\), not optax.sgd\), got 3$"):
    _checks.transformation("outer", 3, allow_none=True)
  with pytest.raises(ValueError, match=r"^inner must be an optax.GradientTransformation"):
    _checks.transformation("inner", None)
