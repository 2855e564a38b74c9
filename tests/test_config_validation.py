"""Property tests: every invalid config or constructor argument raises one clear error, valid ones never do.

For each public transform constructor on main and for the quickstart config,
hypothesis draws every argument either from a *valid* or an *invalid* strategy.
The oracle is this file's own statement of each argument's domain (SPEC.md and
the constructors' docstrings), not the code under test: if any drawn argument is
invalid, the call must raise a single ``ValueError`` whose message names one of
the invalid arguments and shows its value; if all are valid, it must not raise.
Nothing is compiled: the checks run at construction, before any ``jit``.
"""

import math
import re

import jax.numpy as jnp
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mfopt
from mfopt import runner

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

nan = st.just(math.nan)
finite = st.floats(allow_nan=False, allow_infinity=False)


def unit():  # [0, 1)
  return st.floats(0.0, 1.0, exclude_max=True), st.one_of(
      st.floats(-1e3, -1e-6), st.floats(1.0, 1e3), nan)


def nonneg():
  return st.floats(0.0, 1e3), st.one_of(st.floats(-1e3, -1e-6), nan)


def positive():
  return st.floats(1e-6, 1e3), st.one_of(st.floats(-1e3, 0.0), nan)


def pos_int(high=64):
  return st.integers(1, high), st.one_of(st.integers(-50, 0), st.just(2.5), st.just(True))


def choice(valid, invalid):
  return st.sampled_from(valid), st.sampled_from(invalid)


def _draw(data, domains):
  """Each field valid, or (probability 1/4) invalid: ``(values, the invalid ones)``."""
  values, bad = {}, {}
  for name, (valid, invalid) in domains.items():
    if data.draw(st.booleans(), label=f"{name} invalid?") and data.draw(st.booleans()):
      values[name] = data.draw(invalid, label=name)
      bad[name] = values[name]
    else:
      values[name] = data.draw(valid, label=name)
  return values, bad


def _names(field, message):
  """The message names ``field`` as a whole word ("p" is not found inside "steps")."""
  return re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", message) is not None


def _check_call(data, fn, domains, fixed=(), kwargs_fixed=None, joint=None):
  """Draws each argument valid or invalid and checks the outcome against the oracle."""
  drawn, bad = _draw(data, domains)
  kwargs = {**dict(kwargs_fixed or {}), **drawn}
  if joint is not None:
    bad.update(joint(kwargs, bad))  # cross-field rules of the domain, e.g. a >= b + c
  if not bad:
    fn(*fixed, **kwargs)  # must not raise
    return
  with pytest.raises(ValueError) as info:
    fn(*fixed, **kwargs)
  message = str(info.value)
  named = [n for n in bad if _names(n, message)]
  assert named, f"error {message!r} names none of the invalid fields {bad}"
  assert any(_shows(bad[n], message) for n in named), message


def _shows(value, message):
  """The message shows the value (repr, str, or a dtype's name)."""
  forms = {repr(value), str(value)}
  if isinstance(value, type) or hasattr(value, "dtype"):
    try:
      forms.add(str(jnp.dtype(value)))
    except TypeError:
      pass
  return any(f in message for f in forms)


# --------------------------------------------------------------------------------- transforms

# A switch: True or False; a truthy string ('no' switched AMSBound on) or 0/1 is refused.
FLAG = choice([True, False], ["no", "yes", 1, 0, None])

CONSTRUCTORS = {
    "sync_gradients": (lambda **k: mfopt.sync_gradients(mfopt.WORKER_AXES, **k), {
        "comm_dtype": choice([None, jnp.bfloat16, jnp.float16, jnp.float32],
                             [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_])}, None),
    "qsgd": (lambda **k: mfopt.qsgd(mfopt.WORKER_AXES, **k), {
        "bits": (st.integers(2, 8), st.one_of(st.integers(-3, 1), st.integers(9, 64),
                                              st.just(8.0), st.just(True))),
        "bucket_size": pos_int(4096),
        "seed": (st.integers(0, 2**32 - 1), st.one_of(st.integers(-5, -1), st.just(2**32),
                                                      st.just(2**40)))}, None),
    "mf_sgd": (mfopt.mf_sgd, {"learning_rate": nonneg(), "mf": unit()}, None),
    "mf_nesterov": (mfopt.mf_nesterov, {"learning_rate": nonneg(), "mf": unit()}, None),
    "mf_adam": (mfopt.mf_adam, {"learning_rate": nonneg(), "mf1": unit(), "mf2": unit(),
                                "eps": (st.floats(1e-12, 1.0), st.one_of(
                                    st.floats(-1.0, 0.0), nan)),
                                "phi": choice(["adam", "paper"], ["Adam", "sgd", ""])}, None),
    "constant_period": (mfopt.constant_period, {"p": pos_int()}, None),
    "adpsgd_period": (mfopt.adpsgd_period, {
        "learning_rate": positive(), "sampling_steps": (st.integers(0, 200), st.just(10.5)),
        "p_init": pos_int(16),
        "warmup_steps": (st.integers(0, 50), st.one_of(st.integers(-10, -1), st.just(1.5))),
        "low": (st.floats(1e-3, 1.0), st.one_of(st.floats(-1.0, 0.0), st.floats(1.001, 5.0), nan)),
        "high": (st.floats(1.0, 5.0), st.one_of(st.floats(-1.0, 0.999), nan))},
        # sampling must leave one sampled sync after the warm-up (SPEC/docstring)
        lambda k, bad: ({"sampling_steps": k["sampling_steps"]}
                        if not {"sampling_steps", "warmup_steps", "p_init"} & set(bad)
                        and k["sampling_steps"] < k["warmup_steps"] + k["p_init"] else {})),
    "periodic_averaging": (lambda **k: mfopt.periodic_averaging(
        optax.sgd(0.1), mfopt.WORKER_AXES, **k), {
        # (a non-positive int period is checked below: its error names `p`, not `period`)
        "period": (st.integers(1, 32), st.sampled_from(["4", 2.0, None])),
        "trace_length": (st.integers(0, 100), st.one_of(st.integers(-5, -1), st.just(1.5))),
        "comm_dtype": choice([None, jnp.bfloat16, jnp.float32], [jnp.int8, jnp.int32]),
        "average_inner_state": FLAG, "track_variance": FLAG,
        "sync_variance": choice([None, True, False], ["no", 1, 0])}, None),
    "block_momentum": (lambda **k: mfopt.block_momentum(optax.sgd(0.1), mfopt.WORKER_AXES, 4, **k),
                       {"momentum": unit(), "nesterov": FLAG}, None),
    "adabound": (mfopt.adabound, {"learning_rate": positive(), "final_lr": nonneg(),
                                  "gamma": unit(), "b1": unit(), "b2": unit(), "eps": nonneg(),
                                  "weight_decay": nonneg(), "amsbound": FLAG}, None),
    "linear_scaling_adabound": (mfopt.linear_scaling_adabound, {
        "base_lr": positive(), "num_workers": pos_int(), "steps_per_epoch": pos_int(1000),
        "alpha": positive(), "warmup_epochs": positive(), "b1": unit(), "b2": unit(),
        "eps": nonneg(), "bias_correction": FLAG}, None),
    "hybrid_adabound_lars": (mfopt.hybrid_adabound_lars, {
        "num_workers": pos_int(), "steps_per_epoch": pos_int(1000), "base_lr": positive(),
        "alpha": positive(), "warmup_epochs": positive(),
        "decay": (st.floats(1e-3, 1.0), st.one_of(st.floats(-1.0, 0.0), st.floats(1.001, 2.0), nan)),
        "momentum": unit(), "weight_decay": nonneg(), "trust_coefficient": positive(),
        "bias_correction": FLAG,
        "axis_name": choice([None, "data", ("data", "local")], [3, ("data", 3), ()])},
        # (any T > 0 is one warm-up step at least: hybrid_switch_step rounds up)
        None),
    "hybrid_switch_step": (mfopt.hybrid_switch_step, {
        "warmup_epochs": positive(), "steps_per_epoch": pos_int(1000)}, None),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@SETTINGS
@given(data=st.data())
def test_constructor_rejects_exactly_the_invalid_arguments(name, data):
  fn, domains, joint = CONSTRUCTORS[name]
  _check_call(data, fn, domains, joint=joint)


def test_every_public_transform_constructor_is_covered():
  """A new public constructor on main must get a row above (or be listed as not a constructor)."""
  not_constructors = {"check_mf_conditions", "linear_scaling_rule", "noise_scale", "comm_totals",
                      "averaging_metrics", "sync_trace", "variance_trace", "make_mesh",
                      "scheduled_period",
                      "differentiable_gates",  # a context manager
                      "chain",  # optax.chain keeping a host schedule (tests/test_host_gates.py)
                      # seed-004 bound/schedule formulas (functions of the epoch), not transforms
                      "linear_scaling_bounds", "hybrid_lars_learning_rate"}
  public = {n for n in dir(mfopt) if not n.startswith("_") and callable(getattr(mfopt, n))
            and n[0].islower() and not n.startswith("scale_by_")
            and getattr(getattr(mfopt, n), "__module__", "").startswith("mfopt.")}
  missing = public - set(CONSTRUCTORS) - not_constructors
  assert not missing, f"add property-test rows for {sorted(missing)}"


# --------------------------------------------------------------------------------- experiment config

QUICKSTART_DOMAINS = {
    "num_workers": (st.sampled_from([1, 2, 4, 8, 16]), st.integers(-16, 0)),
    "global_batch": (st.just(None), st.integers(-64, 0)),  # None: a valid multiple, drawn below
    "num_steps": pos_int(500),
    "log_every": pos_int(50),
    "datasets": choice([("digits",), ("mnist1d",), ("digits", "mnist1d")],
                       [("cifar",), ("digits", "imagenet"), ("MNIST1D",)]),
    "algorithms": (st.lists(st.sampled_from(sorted(runner.load_experiment("quickstart").ALGORITHMS)),
                            min_size=1, max_size=3, unique=True).map(tuple),
                   st.sampled_from([("sgd",), ("sync SGD",), ("adam", "sync Adam (optax)")])),
}


@SETTINGS
@given(data=st.data())
def test_quickstart_config_rejects_exactly_the_invalid_fields(data):
  values, bad = _draw(data, QUICKSTART_DOMAINS)
  if values["global_batch"] is None:
    workers = values["num_workers"] if values["num_workers"] > 0 else 8
    values["global_batch"] = workers * data.draw(st.integers(1, 32), label="per_worker_batch")
  models = data.draw(st.sampled_from(["mlp", "cnn"]), label="model")
  values["models"] = (models,) * len(values["datasets"])
  if data.draw(st.booleans(), label="models wrong length?") and data.draw(st.booleans()):
    values["models"] = values["models"] + ("mlp",)
    bad["models"] = values["models"]
  overrides = [f"{k}={v!r}" for k, v in values.items()]
  if not bad:
    _, config = runner.prepare("quickstart", quick=True, overrides=overrides)
    assert config.num_steps == values["num_steps"]
    return
  with pytest.raises(runner.ConfigError) as info:
    runner.prepare("quickstart", quick=True, overrides=overrides)
  message = str(info.value)
  named = [n for n in bad if f"'{n}'" in message or f"{n} " in message]
  assert named, f"{message!r} names none of {bad}"
  assert any(repr(bad[n]) in message or str(bad[n]) in message for n in named), message


def test_periodic_averaging_nonpositive_int_period_names_period():
  with pytest.raises(ValueError, match=r"period must be .*got 0"):
    mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, 0)


def test_a_controller_of_your_own_with_a_bad_field_is_named():
  """uses_variance="no" was read as True (an extra all-reduce per sync); a non-callable hook
  failed later inside the step without naming the controller."""
  good = mfopt.constant_period(2)
  for field, value, match in (("uses_variance", "no", r"uses_variance must be a bool, got 'no'"),
                              ("on_sync", 3, r"on_sync must be callable, got 3"),
                              ("host_period", "x", r"host_period must be callable or None")):
    with pytest.raises(ValueError, match=r"period \(constant\(p=2\)\): " + match):
      mfopt.periodic_averaging(optax.sgd(0.1), mfopt.WORKER_AXES, good._replace(**{field: value}))
