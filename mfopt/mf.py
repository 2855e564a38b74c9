"""Momentum-like factor (MF) optimizers of seed 000, and its helper formulas.

Seed: ``seeds/000_6d1af7101f82a674.txt`` (Tang et al., "Increasing Momentum-Like
Factors"), Algorithm 1 (first order), Algorithm 2 (second order), §2.1 eq. (2)
(noise scale), §4.1.2 Table 1 (linear scaling rule), §4.3.2 conditions (2a)/(2b).

Two layers, as in optax: ``scale_by_mf_*`` builds the direction and
``mf_*(learning_rate, ...)`` flips the sign. One deviation from that split is
forced by the paper: Algorithm 1 keeps the learning rate *inside* the momentum
buffer (line 5, ``v_t = MF v_{t-1} + xi_t g_t``), so :func:`scale_by_mf_sgd` and
:func:`scale_by_mf_nesterov` take the learning rate; they still return the
positive direction and the alias negates it.

Algorithm 1 versus ``optax.sgd(lr, momentum=mf)``. optax keeps the learning rate
outside the buffer (``t = mf t + g``, ``theta -= lr_t t``). With a constant
learning rate the two are the same map (``v = lr t``); under a schedule they
differ: Algorithm 1 applies the learning rate of the step at which a gradient
arrived to it for ever after, optax rescales the whole accumulated buffer by the
current one. After a decay step, optax's step shrinks at once, Algorithm 1's
decays with the buffer (geometrically, rate ``mf``). ``tests/test_mf.py`` proves
both facts against a NumPy implementation of each form.

Validation. Constructors raise ``ValueError`` naming the argument and value for a
constant ``mf`` outside [0, 1) and a negative constant learning rate. With
``validate_steps=T`` every value of a scheduled ``mf`` (and learning rate) over
steps ``0..T-1`` is checked, and for the second-order optimizer also that ``mf1``
does not decrease (condition (2b) of §4.3.2). Without it, the second-order
optimizer still checks (2b) ("MF does not decrease is checked for second-order",
SPEC.md) on steps ``0..DEFAULT_MF1_CHECK_STEPS-1`` in one vectorised call of the
schedule; the range of a schedule is not checked by default (a schedule may leave
[0, 1) after a run ends). A schedule that cannot take a vector of steps, and values
that are JAX tracers (an optimizer built inside ``jit`` with traced
hyperparameters, as the equivalence tests do), cannot be checked this way and are
skipped. That includes ``optax.inject_hyperparams``: it hands the optimizer only the current
value, so ``inject_hyperparams(mf_adam)(..., mf1=schedule)`` is not checked for (2b) (check the
schedule with :func:`check_mf_conditions` ``(second_order=True)``), and a value written into
``state.hyperparams`` during a jitted run is not range-checked (``mf=1.5`` trains on and
diverges; outside ``jit`` the update raises).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mfopt import _checks

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]

__all__ = [
    "MFSGDState", "MFAdamState", "scale_by_mf_sgd", "scale_by_mf_nesterov", "scale_by_mf_adam",
    "mf_sgd", "mf_nesterov", "mf_adam", "linear_scaling_rule", "noise_scale",
    "check_mf_conditions", "MFConditionsReport", "PAPER_TABLE1",
]

#: Table 1 of seed 000 (§4.1.2): batch size -> learning rate (linear scaling from 0.05 @ 128).
PAPER_TABLE1: dict[int, float] = {32: 0.0125, 64: 0.025, 128: 0.05, 256: 0.1, 512: 0.2,
                                  1024: 0.4, 2048: 0.8}


# ----------------------------------------------------------------------------- validation


def _concrete(value: Any) -> float | None:
  """``float(value)`` for a concrete scalar; ``None`` for a tracer (cannot be checked)."""
  try:
    return float(np.asarray(value))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _values(value: ScalarOrSchedule, validate_steps: int | None, name: str = "value"
            ) -> list[float]:
  """The concrete values of a constant or (if ``validate_steps``) a schedule, for checks.

  A constant must be a real scalar (Python/NumPy number, 0-d array; a tracer is unchecked):
  ``"0.1"`` or ``True`` would pass ``float()`` and fail inside the update instead.
  """
  if validate_steps is not None:  # (0, -3 and 1.5 passed when the values were constants)
    _checks.positive_int("validate_steps", validate_steps)
  if not callable(value):
    ok, _ = _checks.real_scalar(value)
    if not ok:
      raise ValueError(f"{name} must be a number or a schedule (a callable of the step), "
                       f"got {value!r}")
  if callable(value):
    if validate_steps is None:
      return []
    n = _checks.positive_int("validate_steps", validate_steps)
    try:  # one call on all steps (optax's schedules are elementwise); one call per step took
      # 0.75 ms, 15 s for a 20k-step run's lr and MF before the optimizer was even built
      many = value(jnp.arange(n, dtype=jnp.int32))
      if isinstance(many, jax.core.Tracer):  # closes over traced values: no step is concrete
        return []
      if np.shape(many) == (n,):
        return np.asarray(many, np.float64).tolist()
    except Exception:  # noqa: BLE001  (a schedule written for a scalar step, e.g. `if t < k`)
      pass
    out = [_concrete(value(jnp.asarray(t, jnp.int32))) for t in range(n)]
    return [v for v in out if v is not None]
  v = _concrete(value)
  return [] if v is None else [v]


def _check_mf(name: str, value: ScalarOrSchedule, validate_steps: int | None,
              non_decreasing: bool = False) -> None:
  values = _values(value, validate_steps, name)
  for t, v in enumerate(values):
    if not (0.0 <= v < 1.0):
      where = f" at step {t}" if callable(value) else ""
      raise ValueError(f"{name} must be in [0, 1), got {v!r}{where}"
                       f"{_checks._low_precision_hint(value)}")
  if non_decreasing and callable(value) and validate_steps is None:
    _check_non_decreasing_by_default(name, value)
  elif non_decreasing and callable(value):
    for t in range(1, len(values)):
      if values[t] < values[t - 1]:
        raise ValueError(
            f"{name} must not decrease for a second-order optimizer (seed 000 §4.3.2 (2b)), "
            f"got {name}={values[t - 1]!r} at step {t - 1} then {values[t]!r} at step {t}")


#: Steps a second-order optimizer's ``mf1`` schedule is checked on for (2b) when
#: ``validate_steps`` is not given (one vectorised evaluation; ``validate_steps`` sets
#: the window, e.g. for a schedule that decreases only after the run).
DEFAULT_MF1_CHECK_STEPS = 10_000


def _check_non_decreasing_by_default(name: str, value: ScalarOrSchedule) -> None:
  """(2b) for a schedule without ``validate_steps``: ``value(arange(n))`` must not decrease.
  Skipped when the schedule does not map a vector of steps to a vector of concrete values.
  A float32 schedule's rounding is tolerated (4 ulp at 1.0)."""
  n = DEFAULT_MF1_CHECK_STEPS
  try:
    out = value(jnp.arange(n, dtype=jnp.int32))
    values = None if isinstance(out, jax.core.Tracer) else np.asarray(out, np.float64)
  except Exception:  # pylint: disable=broad-except  (not vectorisable: unchecked, documented)
    return
  if values is None or values.shape != (n,):
    return
  drops = np.flatnonzero(np.diff(values) < -4 * np.finfo(np.float32).eps)
  if drops.size:
    t = int(drops[0])
    raise ValueError(
        f"{name} must not decrease for a second-order optimizer (seed 000 §4.3.2 (2b)), got "
        f"{name}={float(values[t])!r} at step {t} then {float(values[t + 1])!r} at step {t + 1} "
        f"(checked on steps 0..{n - 1}; validate_steps=T checks steps 0..T-1 instead)")


def _check_lr(value: ScalarOrSchedule, validate_steps: int | None) -> None:
  for t, v in enumerate(_values(value, validate_steps, "learning_rate")):
    if not (v >= 0.0 and math.isfinite(v)):
      where = f" at step {t}" if callable(value) else ""
      raise ValueError(f"learning_rate must be finite and >= 0, got {v!r}{where}")


def _at(value: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return value(count) if callable(value) else value


# ----------------------------------------------------------------------------- first order


class MFSGDState(NamedTuple):
  """State of :func:`scale_by_mf_sgd` / :func:`scale_by_mf_nesterov`.

  Attributes:
    count: int32 step counter (the schedules are evaluated at it, from 0).
    velocity: ``v`` of Algorithm 1, already scaled by the learning rate; same
      dtypes as the parameters.
  """

  count: jax.Array
  velocity: optax.Params


def _scale_by_alg1(learning_rate: ScalarOrSchedule, mf: ScalarOrSchedule, nesterov: bool,
                   validate_steps: int | None) -> optax.GradientTransformation:
  _check_lr(learning_rate, validate_steps)
  _check_mf("mf", mf, validate_steps)

  def init_fn(params):
    return MFSGDState(count=jnp.zeros([], jnp.int32),
                      velocity=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    lr = _at(learning_rate, state.count)
    m = _at(mf, state.count)
    velocity = jax.tree.map(lambda v, g: (m * v + lr * g).astype(v.dtype),
                            state.velocity, updates)
    if nesterov:
      direction = jax.tree.map(lambda v, g: (m * v + lr * g).astype(g.dtype), velocity, updates)
    else:
      direction = jax.tree.map(lambda v, g: v.astype(g.dtype), velocity, updates)
    count = optax.safe_int32_increment(state.count)
    return direction, MFSGDState(count=count, velocity=velocity)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_mf_sgd(learning_rate: ScalarOrSchedule, mf: ScalarOrSchedule = 0.9, *,
                    validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""Algorithm 1 of seed 000 without the final sign: the velocity ``v_t`` itself.

  .. math::  v_t = \mathrm{MF}_t\, v_{t-1} + \xi_t\, g_t, \qquad \text{output } v_t

  (the parameter step is ``theta_t = theta_{t-1} - v_t``, see :func:`mf_sgd`).
  Takes the learning rate because Algorithm 1 puts it inside the buffer (see the
  module docstring: this is where it departs from optax's momentum).

  Args:
    learning_rate: ``xi_t``, a constant or an optax schedule of the step count.
    mf: the momentum-like factor, a constant in [0, 1) or a schedule.
    validate_steps: if given, schedules are evaluated on steps ``0..T-1`` at
      construction and every value is checked.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`MFSGDState`.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.scale_by_mf_sgd(0.1, mf=0.5)
    >>> s = tx.init(jnp.zeros(2))
    >>> u, s = tx.update(jnp.ones(2), s)
    >>> u, s = tx.update(jnp.ones(2), s)
    >>> u  # 0.5 * 0.1 + 0.1
    Array([0.15, 0.15], dtype=float32)

  Seed 000, Algorithm 1 line 5.
  """
  return _scale_by_alg1(learning_rate, mf, False, validate_steps)


def scale_by_mf_nesterov(learning_rate: ScalarOrSchedule, mf: ScalarOrSchedule = 0.9, *,
                         validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""Nesterov form of Algorithm 1 (seed 000 §4.4.1, "NAG"), without the final sign.

  .. math::  v_t = \mathrm{MF}_t v_{t-1} + \xi_t g_t, \qquad
             \text{output } \mathrm{MF}_t v_t + \xi_t g_t

  The paper gives no formula for NAG with MF; this is the form optax and
  PyTorch use (Sutskever et al. 2013, ref. [49] of the seed) with the learning
  rate moved into the buffer as Algorithm 1 does. At a constant learning rate it
  equals ``optax.sgd(lr, momentum=mf, nesterov=True)``.

  Args:
    learning_rate: ``xi_t``, constant or schedule.
    mf: momentum-like factor in [0, 1), constant or schedule.
    validate_steps: see :func:`scale_by_mf_sgd`.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`MFSGDState`.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.scale_by_mf_nesterov(0.1, mf=0.5)
    >>> u, _ = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)))
    >>> u  # v = 0.1; 0.5 * 0.1 + 0.1
    Array([0.15], dtype=float32)
  """
  return _scale_by_alg1(learning_rate, mf, True, validate_steps)


def mf_sgd(learning_rate: ScalarOrSchedule, mf: ScalarOrSchedule = 0.9, *,
           validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""SGD with a momentum-like factor, Algorithm 1 of seed 000 exactly as printed.

  .. math::  v_t = \mathrm{MF}_t\, v_{t-1} + \xi_t\, g_t, \qquad \theta_t = \theta_{t-1} - v_t

  Equals ``optax.sgd(lr, momentum=mf)`` for a constant learning rate; under a
  learning-rate schedule it differs by design (the learning rate is inside the
  buffer; module docstring). ``mf=0`` is plain SGD.

  Args:
    learning_rate: ``xi_t``, a constant >= 0 or an optax schedule.
    mf: the momentum-like factor ``MF`` in [0, 1), constant or schedule.
    validate_steps: if given, check schedules on steps ``0..T-1`` at construction.

  Returns:
    An ``optax.GradientTransformation`` (``scale_by_mf_sgd`` then a sign flip).

  Raises:
    ValueError: ``mf`` outside [0, 1) or a negative learning rate.

  Example:
    >>> import jax.numpy as jnp, optax, mfopt
    >>> tx = mfopt.mf_sgd(optax.exponential_decay(0.1, 1, 0.5), mf=0.9)
    >>> params = jnp.zeros(1)
    >>> s = tx.init(params)
    >>> for _ in range(2):
    ...   u, s = tx.update(jnp.ones(1), s)
    >>> u  # 0.9 * 0.1 + 0.05 (optax's momentum would give 0.05 * 1.9 = 0.095)
    Array([-0.14], dtype=float32)
  """
  return optax.chain(scale_by_mf_sgd(learning_rate, mf, validate_steps=validate_steps),
                     optax.scale(-1.0))


def mf_nesterov(learning_rate: ScalarOrSchedule, mf: ScalarOrSchedule = 0.9, *,
                validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""Nesterov momentum with the learning rate inside the buffer (seed 000 §4.4.1).

  .. math::  v_t = \mathrm{MF}_t v_{t-1} + \xi_t g_t, \qquad
             \theta_t = \theta_{t-1} - (\mathrm{MF}_t v_t + \xi_t g_t)

  Equals ``optax.sgd(lr, momentum=mf, nesterov=True)`` at a constant learning
  rate. See :func:`scale_by_mf_nesterov` for the choice of form.

  Args:
    learning_rate: constant >= 0 or schedule.
    mf: momentum-like factor in [0, 1), constant or schedule.
    validate_steps: see :func:`mf_sgd`.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.mf_nesterov(0.1, mf=0.9)
    >>> u, _ = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)))
    >>> u
    Array([-0.19], dtype=float32)
  """
  return optax.chain(scale_by_mf_nesterov(learning_rate, mf, validate_steps=validate_steps),
                     optax.scale(-1.0))


# ----------------------------------------------------------------------------- second order

PHIS = ("adam", "paper")


class MFAdamState(NamedTuple):
  """State of :func:`scale_by_mf_adam`.

  Attributes:
    count: int32 step counter.
    mu: first moment ``m_t`` (parameter dtypes).
    nu: second moment ``v_t`` (parameter dtypes).
    mf1_product: ``prod_{s<=t} MF1_s`` in float32, or the widest float dtype of
      the parameters if that is wider (float64 parameters under ``jax_enable_x64``
      kept a float32 product, 2.5e-9 off optax.adam); the exact bias correction
      ``1 - prod MF1_s`` of ``m_t`` when ``mf1`` is a schedule (for a constant
      ``mf1`` the correction is ``1 - mf1**t`` as in optax, and this is unused).
  """

  count: jax.Array
  mu: optax.Params
  nu: optax.Params
  mf1_product: jax.Array


def scale_by_mf_adam(mf1: ScalarOrSchedule = 0.9, mf2: float = 0.999, eps: float = 1e-8,
                     phi: str = "adam", *,
                     validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""Algorithm 2 of seed 000 without learning rate and sign: ``phi(m_t, v_t, MF1, MF2)``.

  .. math::
     m_t = \mathrm{MF}_1 m_{t-1} + (1-\mathrm{MF}_1) g_t, \quad
     v_t = \mathrm{MF}_2 v_{t-1} + (1-\mathrm{MF}_2) g_t^2

  ``phi="adam"`` (bias-corrected Adam, Kingma & Ba; equals ``optax.scale_by_adam``):

  .. math::  \phi = \frac{m_t / (1 - \mathrm{MF}_1^t)}{\sqrt{v_t / (1-\mathrm{MF}_2^t)} + \epsilon}

  ``phi="paper"`` (the function printed in §3.2 and Appendix A1, as printed):

  .. math::  \phi = \frac{m_t \sqrt{1 - \mathrm{MF}_2}}{(\sqrt{v_t} + \epsilon)(1 - \mathrm{MF}_1)}

  The printed phi is not Adam's bias correction: it uses ``1-MF`` where Adam uses
  ``1-MF^t``, so its first step is ``~sign(g)`` and its steady-state step for a
  constant gradient is ``sqrt(1-MF2)/(1-MF1)`` (0.316 at 0.9/0.999) times
  ``sign(g)``, not 1. Implemented as printed, because the paper's analysis (A1)
  relies on the ``1/(1-MF1)`` factor.

  With a scheduled ``mf1``, ``phi="adam"`` divides by ``1 - prod_s MF1_s`` (the
  exact sum of the weights of ``m_t``; it reduces to ``1 - MF1^t`` for a
  constant) and ``phi="paper"`` uses the current ``MF1_t``. ``mf2`` is a constant
  (the seed varies only MF1).

  Args:
    mf1: ``MF1`` in [0, 1), constant or schedule (must not decrease: (2b)).
    mf2: ``MF2`` in [0, 1).
    eps: ``epsilon`` > 0 added to ``sqrt(v)``.
    phi: ``"adam"`` or ``"paper"``.
    validate_steps: if given, check the ``mf1`` schedule on steps ``0..T-1``,
      including that it does not decrease; if not, that it does not decrease on
      steps ``0..DEFAULT_MF1_CHECK_STEPS-1`` (see the module docstring).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`MFAdamState`.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.scale_by_mf_adam(phi="paper")
    >>> u, _ = tx.update(jnp.full(1, 2.0), tx.init(jnp.zeros(1)))
    >>> u.round(4)  # (0.1*2) * sqrt(0.001) / ((sqrt(0.001*4) + 1e-8) * 0.1) ~ 1
    Array([1.], dtype=float32)
  """
  if phi not in PHIS:
    raise ValueError(f"phi must be one of {PHIS}, got {phi!r}")
  _check_mf("mf1", mf1, validate_steps, non_decreasing=True)
  if callable(mf2):
    raise ValueError(f"mf2 must be a constant in [0, 1) (MF2 is not scheduled in seed 000), "
                     f"got the callable {mf2!r}")
  _check_mf("mf2", mf2, None)
  _checks.positive_number("eps", eps)

  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
    floats = [d for d in (jnp.result_type(x) for x in jax.tree.leaves(params))
              if jnp.issubdtype(d, jnp.floating)]
    wide = functools.reduce(jnp.promote_types, floats, jnp.dtype(jnp.float32))
    return MFAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros(),
                       mf1_product=jnp.ones([], wide))

  def update_fn(updates, state, params=None):
    del params
    b1 = _at(mf1, state.count)
    mu = jax.tree.map(lambda m, g: (b1 * m + (1 - b1) * g).astype(m.dtype), state.mu, updates)
    nu = jax.tree.map(lambda v, g: (mf2 * v + (1 - mf2) * jnp.square(g)).astype(v.dtype),
                      state.nu, updates)
    count = optax.safe_int32_increment(state.count)
    product = (state.mf1_product * b1).astype(state.mf1_product.dtype)
    if phi == "adam":
      # A schedule, or a value injected by optax.inject_hyperparams (which may be a schedule's
      # current value): 1 - prod(MF1_s), the exact sum of the EMA's weights. A constant:
      # 1 - MF1**t, as optax.tree_bias_correction (optax.adam to float32 rounding: optax
      # computes the power in its own jitted helper, so eager steps can differ by ~1e-5).
      c1 = 1 - product if callable(mf1) or _checks.is_array(mf1) else 1 - b1**count
      c2 = 1 - mf2**count
      direction = jax.tree.map(
          lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, updates)
    else:
      scale = math.sqrt(1 - mf2) if isinstance(mf2, (int, float)) else jnp.sqrt(1 - mf2)
      direction = jax.tree.map(
          lambda m, v, g: (m * scale / ((jnp.sqrt(v) + eps) * (1 - b1))).astype(g.dtype),
          mu, nu, updates)
    return direction, MFAdamState(count=count, mu=mu, nu=nu, mf1_product=product)

  return optax.GradientTransformation(init_fn, update_fn)


def mf_adam(learning_rate: ScalarOrSchedule, mf1: ScalarOrSchedule = 0.9, mf2: float = 0.999,
            eps: float = 1e-8, phi: str = "adam", *,
            validate_steps: int | None = None) -> optax.GradientTransformation:
  r"""Adam with momentum-like factors, Algorithm 2 of seed 000.

  .. math::  \theta_t = \theta_{t-1} - \xi_t\, \phi(m_t, v_t, \mathrm{MF}_1, \mathrm{MF}_2)

  ``phi="adam"`` equals ``optax.adam(lr, b1=mf1, b2=mf2, eps=eps)`` (to float32 rounding);
  ``phi="paper"`` is the printed §3.2 function (see :func:`scale_by_mf_adam` for both and for
  how the printed one differs). Here the learning rate sits outside the moments,
  as in Algorithm 2 line 7, so optax's ``scale_by_learning_rate`` is reused.
  With float16 parameters (and so float16 moments) it steps ``-inf`` where ``v`` underflowed
  to 0, as ``optax.adam`` does (``eps=1e-8`` is 0 in float16: g = 1e-4 steps -inf in both).
  With bfloat16 parameters the moments are bfloat16 too (as in ``optax.adam``), and
  ``MF2 = 0.999`` is below bfloat16's resolution near 1: ``0.999 v`` rounds back to ``v``, so
  ``v`` stops decaying and steps shrink after the gradients do. Keep the parameters and state
  float32, as :mod:`mfopt.precision`'s policies do (float32 master weights).

  Args:
    learning_rate: ``xi_t``, constant >= 0 or schedule.
    mf1, mf2, eps, phi, validate_steps: see :func:`scale_by_mf_adam`.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: ``mf1``/``mf2`` outside [0, 1), negative learning rate, unknown
      ``phi``, or a decreasing ``mf1`` schedule (on steps ``0..validate_steps-1``, or
      ``0..DEFAULT_MF1_CHECK_STEPS-1`` without it). Not under ``optax.inject_hyperparams``,
      which passes only the current value (see the module docstring).

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.mf_adam(0.01, mf1=0.95)
    >>> u, _ = tx.update(jnp.full(2, 3.0), tx.init(jnp.zeros(2)))
    >>> u.round(5)  # Adam's first step is ~lr * sign(g)
    Array([-0.01, -0.01], dtype=float32)
  """
  _check_lr(learning_rate, validate_steps)
  return optax.chain(scale_by_mf_adam(mf1, mf2, eps, phi, validate_steps=validate_steps),
                     optax.scale_by_learning_rate(learning_rate))


# ----------------------------------------------------------------------------- formulas


def linear_scaling_rule(base_lr: float = 0.05, base_batch: int = 128) -> Callable[[int], float]:
  r"""The linear scaling rule of seed 000 §2.2 / §4.1.2: ``batch -> base_lr * batch / base_batch``.

  .. math::  \xi(M) = \xi_0 \frac{M}{M_0}

  The product is formed exactly on the decimal value of ``base_lr`` (Python
  ``fractions``) and rounded once, so ``linear_scaling_rule(0.05, 128)``
  returns the decimals of Table 1 exactly (``0.0125, 0.025, ..., 0.8``).

  Args:
    base_lr: learning rate at ``base_batch`` (> 0).
    base_batch: reference batch size (positive int).

  Returns:
    A function ``batch_size -> learning_rate`` (raises ``ValueError`` for a
    non-positive batch).

  Example:
    >>> import mfopt
    >>> rule = mfopt.linear_scaling_rule(0.05, 128)
    >>> [rule(b) for b in (32, 1024, 2048)]
    [0.0125, 0.4, 0.8]
  """
  _checks.number_where("base_lr", base_lr, lambda v: 0 < v < math.inf, "a finite number > 0")
  base_lr = float(base_lr)
  _checks.positive_int("base_batch", base_batch)
  exact = fractions.Fraction(repr(float(base_lr)))

  def rule(batch_size: int) -> float:
    return float(exact * _checks.positive_int("batch_size", batch_size) / int(base_batch))

  return rule


def noise_scale(lr: float, dataset_size: int, batch_size: int, momentum: float = 0.0) -> float:
  r"""SGD noise scale of seed 000 eq. (2) (Smith & Le 2018): ``g = lr/(1-m) (N/M - 1)``.

  .. math::  g = \frac{\xi}{1-m}\left(\frac{N}{M} - 1\right)

  ``momentum=0`` is eq. (1). Under the linear scaling rule ``lr/M`` is constant,
  so for ``M << N`` the scale depends on the momentum only, ``g ~ 1/(1-m)``.

  Args:
    lr: learning rate ``xi`` >= 0.
    dataset_size: ``N`` (positive int).
    batch_size: ``M``, 1 <= M <= N.
    momentum: ``m`` in [0, 1).

  Returns:
    The noise scale ``g`` (float).

  Example:
    >>> import mfopt
    >>> mfopt.noise_scale(0.1, 50_000, 128, momentum=0.9)  # doctest: +ELLIPSIS
    389.6...
  """
  _checks.number_where("lr", lr, lambda v: 0 <= v < math.inf, "a finite number >= 0")
  _checks.positive_int("dataset_size", dataset_size)
  _checks.positive_int("batch_size", batch_size)
  if batch_size > dataset_size:
    raise ValueError(f"batch_size must be <= dataset_size={dataset_size}, got {batch_size!r}")
  _checks.unit_interval("momentum", momentum)
  return float(lr) / (1 - float(momentum)) * (dataset_size / batch_size - 1)


@dataclasses.dataclass(frozen=True)
class Condition:
  """One checked condition: its name, the formula, whether it holds, and the numbers."""

  name: str
  formula: str
  holds: bool
  detail: str


@dataclasses.dataclass(frozen=True)
class MFConditionsReport:
  """Result of :func:`check_mf_conditions`; ``str(report)`` is a readable summary."""

  holds: bool
  conditions: tuple[Condition, ...]
  second_order: bool
  num_steps: int

  def __bool__(self) -> bool:
    return self.holds

  def __str__(self) -> str:
    kind = "second-order (2b)" if self.second_order else "first-order (2a)"
    lines = [f"seed 000 §4.3.2 convergence conditions, {kind}, T={self.num_steps}: "
             + ("all hold" if self.holds else "VIOLATED")]
    for c in self.conditions:
      lines.append(f"  [{'ok' if c.holds else 'FAIL'}] {c.name}: {c.formula} -- {c.detail}")
    return "\n".join(lines)


def _schedule_values(name: str, value: Any, num_steps: int) -> np.ndarray:
  if callable(value):
    vals = None
    try:  # one call on all steps (optax's schedules are elementwise): 20k steps took 5 s
      out = np.asarray(value(jnp.arange(num_steps, dtype=jnp.int32)), dtype=np.float64)
      if out.shape == (num_steps,):
        vals = out
    except Exception:  # noqa: BLE001  (a schedule written for a scalar step, e.g. `if t < k`)
      pass
    if vals is None:
      vals = np.array([float(value(jnp.asarray(t, jnp.int32))) for t in range(num_steps)])
  elif (isinstance(value, (Sequence, np.ndarray, jax.Array)) and not isinstance(value, str)
        and np.ndim(value) > 0):  # (a 0-d array is a constant, as mf_sgd takes it)
    vals = np.asarray(value, dtype=np.float64).reshape(-1)
    if vals.size != num_steps:
      raise ValueError(f"{name} as a sequence must have num_steps={num_steps} values, "
                       f"got {vals.size}")
  else:
    ok, v = _checks.real_scalar(value)
    if not ok or v is None:  # ("0.9" and True were read as 0.9 and 1.0; None raised float's error)
      raise ValueError(f"{name} must be a number, a schedule or a sequence of num_steps numbers, "
                       f"got {value!r}")
    vals = np.full(num_steps, float(v))
  if not np.all(np.isfinite(vals)):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return vals


def check_mf_conditions(mf: Any, lr: Any, num_steps: int,
                        second_order: bool = False) -> MFConditionsReport:
  r"""Checks the MF convergence conditions (2a)/(2b) of seed 000 §4.3.2.

  (2a), first order: :math:`\frac{1-\mathrm{MF}^T}{1-\mathrm{MF}} < \frac{T}{\xi}`
  and :math:`\mathrm{MF} < 1`. (2b), second order: :math:`\mathrm{MF} < 1` at
  every step and MF does not decrease.

  The left side of (2a) is evaluated as :math:`\sum_{k<T} \mathrm{MF}^k` (equal
  to the printed ratio for MF != 1 and finite at MF = 1). For schedules, the
  printed condition is for constants; we evaluate it at the worst case over the
  run, ``max_t MF_t`` and ``max_t lr_t`` (the left side grows with MF, the right
  side falls with lr), and say so in the report. ``mf >= 1`` is *reported* as a
  violated condition (that is the point of the check), not raised.

  Args:
    mf: constant, optax schedule, or a length-``num_steps`` sequence.
    lr: learning rate, same forms (>= 0).
    num_steps: ``T`` > 0.
    second_order: check (2b) instead of (2a).

  Returns:
    An :class:`MFConditionsReport` (truthy iff all conditions hold).

  Raises:
    ValueError: ``num_steps <= 0``, negative ``mf`` or ``lr``, non-finite values.

  Example:
    >>> import mfopt
    >>> print(mfopt.check_mf_conditions(0.9, 0.05, 100))  # doctest: +NORMALIZE_WHITESPACE
    seed 000 §4.3.2 convergence conditions, first-order (2a), T=100: all hold
      [ok] (2a) sum rule: (1 - MF^T) / (1 - MF) < T / lr -- 9.99973 < 2000 (MF=0.9, lr=0.05)
      [ok] (2a) MF < 1: MF < 1 -- max MF = 0.9
  """
  T = _checks.positive_int("num_steps", num_steps)
  second_order = _checks.flag("second_order", second_order)
  mfs = _schedule_values("mf", mf, T)
  lrs = _schedule_values("lr", lr, T)
  if np.any(mfs < 0):
    raise ValueError(f"mf must be >= 0, got {mf!r}")
  if np.any(lrs < 0):
    raise ValueError(f"lr must be >= 0, got {lr!r}")
  varying = len(set(mfs.tolist())) > 1 or len(set(lrs.tolist())) > 1
  mf_max, lr_max = float(mfs.max()), float(lrs.max())
  conditions = []
  if not second_order:
    lhs = float(np.sum(mf_max ** np.arange(T, dtype=np.float64)))
    rhs = math.inf if lr_max == 0 else T / lr_max
    note = " (worst case over the schedule: max MF, max lr)" if varying else ""
    conditions.append(Condition(
        "(2a) sum rule", "(1 - MF^T) / (1 - MF) < T / lr", lhs < rhs,
        f"{lhs:.6g} < {rhs:.6g} (MF={mf_max:.6g}, lr={lr_max:.6g}){note}"))
    conditions.append(Condition("(2a) MF < 1", "MF < 1", mf_max < 1,
                                f"max MF = {mf_max:.6g}"))
  else:
    conditions.append(Condition("(2b) MF < 1", "MF_t < 1 for all t", mf_max < 1,
                                f"max MF = {mf_max:.6g}"))
    drops = np.nonzero(np.diff(mfs) < 0)[0]
    if drops.size:
      t = int(drops[0])
      detail = (f"decreases at step {t + 1}: {mfs[t]:.6g} -> {mfs[t + 1]:.6g} "
                f"({drops.size} decrease(s))")
    else:
      detail = f"MF goes {mfs[0]:.6g} -> {mfs[-1]:.6g} without decreasing"
    conditions.append(Condition("(2b) MF non-decreasing", "MF_{t+1} >= MF_t", drops.size == 0,
                                detail))
  return MFConditionsReport(holds=all(c.holds for c in conditions),
                            conditions=tuple(conditions), second_order=bool(second_order),
                            num_steps=T)
