"""AdaBound/AMSBound, linear-scaling AdaBound, and the hybrid AdaBound-warmup + LARS SGD.

Seed 004 (``seeds/004_634240290224c5bb.txt``): §2.1.1 (AdaBound, Luo et al. 2019) and
§2.2.1 (linear-scaling AdaBound as a warmup, then linear-scaling SGD with LARS and an
exponentially decaying learning rate). SPEC.md "Seed 004" resolves the seed's ambiguities; the
choices made here are listed in each docstring. Linear-scaling AdaBound uses the seed's raw
moments (no bias correction) unless ``bias_correction=True`` asks for the reference's.

AdaBound follows the authors' reference implementation, the ``adabound`` package (PyPI 0.0.5,
``adabound/adabound.py``), step for step::

    t += 1
    g = g + weight_decay * p                      # L2, added to the gradient
    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2 ;  (AMSBound: v_max = max(v_max, v))
    step = lr * sqrt(1 - b2^t) / (1 - b1^t)
    final = final_lr * lr / base_lr              # a decayed lr also decays the bounds
    lower = final * (1 - 1 / (gamma t + 1)) ;  upper = final * (1 + 1 / (gamma t))
    p -= clip(step / (sqrt(v) + eps), lower, upper) * m

Because the bounds clip the *lr-scaled* per-coordinate step, ``scale_by_adabound`` takes the
learning rate (unlike ``optax.scale_by_adam``): the ``scale_by_`` layer returns the positive
step, and the sign flip is the final ``optax.scale(-1)`` of the alias.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from mfopt import _checks
from mfopt.comm import (AxisName, HostSchedule, check_axis_name, gated, host_scalar, states_of,
                        unbatched)

__all__ = [
    "AdaBoundState",
    "LinearScalingAdaBoundState",
    "HybridState",
    "scale_by_adabound",
    "adabound",
    "scale_by_linear_scaling_adabound",
    "linear_scaling_adabound",
    "linear_scaling_bounds",
    "hybrid_adabound_lars",
    "hybrid_lars_learning_rate",
    "hybrid_switch_step",
]


# ----------------------------------------------------------------------------- validation


def _check_lr(name: str, value: Any) -> None:
  """AdaBound's learning rate: > 0, or a schedule whose ``schedule(0)`` is > 0.

  Not >= 0: with a constant rate the bounds do not scale with it, so ``lr = 0`` would still
  step at the lower bound; with a schedule, ``final_lr * lr_t / lr_0`` needs ``lr_0 != 0``
  (the reference divides by its ``base_lr`` the same way).
  """
  if callable(value):
    first = value(0)
    if not _checks.is_traced(first):
      _checks.number_where(f"{name}(0)", first, lambda v: v > 0,
                           "a positive number (the bounds scale by lr_t / lr_0)")
    return
  _checks.positive_number(name, value)


# ----------------------------------------------------------------------------- AdaBound


class AdaBoundState(NamedTuple):
  """State of :func:`scale_by_adabound`.

  Attributes:
    count: int32 number of updates so far (the reference's ``state['step']``).
    mu: first moment ``m`` (EMA of gradients).
    nu: second moment ``v`` (EMA of squared gradients).
    nu_max: running maximum of ``nu`` (AMSBound); an empty tuple for AdaBound.
    base_lr: float32 learning rate at step 0 (the reference's ``base_lr``): the bounds scale by
      ``lr_t / base_lr``. Kept in the state because under ``optax.inject_hyperparams`` each
      update sees only the current rate (a scalar), and a schedule or a changed rate must
      still move the bounds, as it does in the reference and with a schedule passed directly.
  """

  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates
  nu_max: Any
  base_lr: chex.Array


def _bias_correction(decay: float, t: jax.Array) -> jax.Array:
  """``1 - decay**t`` as ``-expm1(t log decay)``: accurate in float32 even for decay = 0.999."""
  if _checks.is_array(decay):  # optax.inject_hyperparams
    return jnp.where(decay == 0.0, 1.0, -jnp.expm1(t * jnp.log(jnp.where(decay == 0.0, 1.0, decay))))
  if decay == 0.0:
    return jnp.ones_like(t)
  return -jnp.expm1(t * math.log(decay))


def _float_count(count: jax.Array, tree: Any) -> jax.Array:
  """The step count in the widest floating dtype of ``tree`` (float64 under x64 tests)."""
  dtypes = [x.dtype for x in jax.tree.leaves(tree)] or [jnp.float32]
  return count.astype(jnp.result_type(*dtypes, jnp.float32))


def _update_moments(grads, mu, nu, b1, b2):
  """Adam's moment updates (optax's), cast back to the state's dtypes: a float32 ``b1``/``b2``
  (``optax.inject_hyperparams(..., hyperparam_dtype=jnp.float32)``, which the bf16 rounding
  hint suggests) promoted bf16 moments to float32 after one step, so ``jit`` traced twice and
  the state no longer matched ``init``'s (``mfopt.mf_adam`` casts the same way)."""
  return (optax.tree.cast_like(optax.tree.update_moment(grads, mu, b1, 1), mu),
          optax.tree.cast_like(optax.tree.update_moment_per_elem_norm(grads, nu, b2, 2), nu))


def _moments(grads, state, b1, b2, amsbound):
  mu, nu = _update_moments(grads, state.mu, state.nu, b1, b2)
  nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu) if amsbound else ()
  return mu, nu, nu_max


def _clipped_step(step_size, lower, upper, eps, mu, denom):
  """``clip(step_size / (sqrt(v) + eps), lower, upper) * m`` per leaf (AdaBound's step)."""

  def one(m, v):
    rate = jnp.clip((step_size / (jnp.sqrt(v) + eps)).astype(v.dtype),
                    lower.astype(v.dtype), upper.astype(v.dtype))
    return rate * m

  return jax.tree.map(one, mu, denom)


def scale_by_adabound(learning_rate: optax.ScalarOrSchedule, final_lr: float = 0.1,
                      gamma: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                      eps: float = 1e-8, amsbound: bool = False
                      ) -> optax.GradientTransformation:
  r"""AdaBound's bounded per-coordinate step (positive; no sign flip, no weight decay).

  .. math::
     \eta_t = \mathrm{clip}\Big(\frac{\alpha_t \sqrt{1-\beta_2^t}/(1-\beta_1^t)}
              {\sqrt{v_t}+\epsilon},\ \eta^{lo}_t,\ \eta^{hi}_t\Big),\quad
     u_t = \eta_t \odot m_t,

  with :math:`\eta^{lo}_t = f_t(1 - 1/(\gamma t + 1))`, :math:`\eta^{hi}_t = f_t(1 + 1/(\gamma t))`
  and :math:`f_t = \mathrm{final\_lr}\cdot\alpha_t/\alpha_0` (the reference's workaround so that a
  learning-rate schedule also decays the bounds). AMSBound replaces :math:`v_t` by its running
  maximum.

  Args:
    learning_rate: Adam learning rate ``alpha`` > 0 (a float or a schedule ``count -> lr``; with
      a schedule, ``alpha_0 = schedule(0)`` plays the reference's ``base_lr`` and must be > 0).
    final_lr: the SGD learning rate both bounds converge to.
    gamma: convergence speed of the bounds, in [0, 1).
    b1, b2: moment decay rates, in [0, 1).
    eps: added to ``sqrt(v)``, as in the reference.
    amsbound: use the running maximum of ``v`` (AMSBound).

  Returns:
    An ``optax.GradientTransformation`` with :class:`AdaBoundState`; its updates are the
    positive steps ``eta * m`` (apply with ``optax.scale(-1)``).

  Seed: 004 §2.1.1; reference: ``adabound`` 0.0.5 ``AdaBound.step``.
  """
  _check_lr("learning_rate", learning_rate)
  _checks.nonnegative_number("final_lr", final_lr)
  _checks.unit_interval("gamma", gamma)
  _checks.unit_interval("b1", b1)
  _checks.unit_interval("b2", b2)
  _checks.nonnegative_number("eps", eps)
  amsbound = _checks.flag("amsbound", amsbound)

  def init_fn(params):
    zeros = optax.tree.zeros_like(params)
    base = learning_rate(0) if callable(learning_rate) else learning_rate
    return AdaBoundState(count=jnp.zeros([], jnp.int32), mu=zeros,
                         nu=optax.tree.zeros_like(params),
                         nu_max=optax.tree.zeros_like(params) if amsbound else (),
                         # a copy: jnp.asarray kept the caller's f32 array itself, which a
                         # donated step then deleted (and inject_hyperparams held it twice)
                         base_lr=jnp.array(base, jnp.float32, copy=True))

  def update_fn(updates, state, params=None):
    del params
    mu, nu, nu_max = _moments(updates, state, b1, b2, amsbound)
    count = optax.safe_increment(state.count)
    if callable(learning_rate):
      lr = learning_rate(state.count)
      final = final_lr * lr / learning_rate(0)
    elif _checks.is_array(learning_rate):
      # optax.inject_hyperparams: the current rate only; the rate at step 0 is in the state
      lr = learning_rate
      final = final_lr * lr / state.base_lr.astype(jnp.result_type(lr, jnp.float32))
    else:
      lr, final = learning_rate, final_lr
    t = _float_count(count, mu)
    step_size = lr * jnp.sqrt(_bias_correction(b2, t)) / _bias_correction(b1, t)
    lower = final * (1.0 - 1.0 / (gamma * t + 1.0))
    # gamma = 0 (plain Adam: no upper bound) with a final lr of 0 (final_lr=0, or a schedule
    # decayed to 0) was 0 x inf = NaN; it is +inf, and any gamma > 0 is the formula unchanged
    gt = gamma * t
    upper = jnp.where(gt > 0, final * (1.0 + 1.0 / jnp.where(gt > 0, gt, 1.0)), jnp.inf)
    out = _clipped_step(step_size, lower, upper, eps, mu, nu_max if amsbound else nu)
    return out, AdaBoundState(count=count, mu=mu, nu=nu, nu_max=nu_max, base_lr=state.base_lr)

  return optax.GradientTransformation(init_fn, update_fn)


def adabound(learning_rate: optax.ScalarOrSchedule = 1e-3, final_lr: float = 0.1,
             gamma: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
             weight_decay: float = 0.0, amsbound: bool = False
             ) -> optax.GradientTransformation:
  r"""AdaBound / AMSBound (Luo et al. 2019) with the reference implementation's semantics.

  ``optax.chain(add_decayed_weights(weight_decay), scale_by_adabound(...), scale(-1))``: the
  L2 weight decay is added to the gradient before the moments, exactly as the ``adabound``
  package does (it is not AdamW-style decoupled decay). See :func:`scale_by_adabound` for
  the update rule.

  Args:
    learning_rate: Adam learning rate (float or schedule). Default 1e-3 as in the reference.
    final_lr: final SGD learning rate (default 0.1).
    gamma: convergence speed of the bound functions (default 1e-3).
    b1, b2, eps: Adam hyperparameters.
    weight_decay: L2 penalty added to the gradient (default 0).
    amsbound: AMSBound variant.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax, mfopt
    >>> tx = mfopt.adabound(1e-3, final_lr=0.1)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 0.5)}, state, params)
    >>> [round(float(u), 6) for u in updates["w"]]   # bounded: at t=1 the upper bound is ~100
    [-0.001, -0.001, -0.001]

  Seed: 004 §2.1.1 (SPEC.md: reference-implementation semantics).
  """
  _checks.nonnegative_number("weight_decay", weight_decay)
  parts = []
  # a JAX scalar (optax.inject_hyperparams, concrete at init, traced at update): always decay,
  # so that init and update build the same chain
  if isinstance(weight_decay, jax.Array) or weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  parts += [scale_by_adabound(learning_rate, final_lr, gamma, b1, b2, eps, amsbound),
            optax.scale(-1.0)]
  return optax.chain(*parts)


# ----------------------------------------------------------------------------- linear scaling


def linear_scaling_bounds(epoch, *, base_lr: float, num_workers: int, warmup_epochs: float,
                          b2: float = 0.999):
  r"""The seed's bounds at fractional epoch ``t`` (seed 004 §2.2.1).

  .. math::
     B_u = lr N + \frac{1}{(1-\beta_2) t} - \frac{1}{(1-\beta_2) T},\qquad
     B_l = \frac{t}{T}\, lr N,

  with ``t`` clamped to ``[0, T]`` (a choice: after the warmup both bounds stay at ``lr N``;
  the printed formulas would cross, ``B_l > B_u``). ``B_u = +inf`` at ``t = 0``.
  Works on Python floats and on traced arrays.

  Returns:
    ``(B_l, B_u)``.
  """
  _checks.positive_number("base_lr", base_lr)
  _checks.positive_int("num_workers", num_workers)
  _checks.positive_number("warmup_epochs", warmup_epochs)
  _checks.unit_interval("b2", b2)  # (b2 = 1 made B_u infinite, NaN made it NaN, silently)
  t = jnp.minimum(jnp.asarray(epoch), warmup_epochs)
  lrn = base_lr * num_workers
  lower = t / warmup_epochs * lrn
  # 1/((1-b2)t) - 1/((1-b2)T) written as (T-t)/((1-b2) t T): no cancellation, exactly lr*N at T
  upper = lrn + (warmup_epochs - t) / ((1.0 - b2) * t * warmup_epochs)
  return lower, upper


class LinearScalingAdaBoundState(NamedTuple):
  """State of :func:`scale_by_linear_scaling_adabound`: int32 ``count``, moments ``mu``, ``nu``."""

  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates


def _linear_scaling_hyper(*, base_lr, num_workers, steps_per_epoch, alpha, warmup_epochs, b1,
                          b2, eps, bias_correction) -> dict[str, Any]:
  """Validated hyperparameters of linear-scaling AdaBound (for :func:`_linear_scaling_step`)."""
  _checks.positive_number("base_lr", base_lr)
  _checks.positive_int("num_workers", num_workers)
  _checks.positive_int("steps_per_epoch", steps_per_epoch)
  _checks.positive_number("alpha", alpha)
  _checks.positive_number("warmup_epochs", warmup_epochs)
  _checks.unit_interval("b1", b1)
  _checks.unit_interval("b2", b2)
  _checks.nonnegative_number("eps", eps)
  bias_correction = _checks.flag("bias_correction", bias_correction)
  return dict(base_lr=base_lr, num_workers=num_workers, steps_per_epoch=steps_per_epoch,
              alpha=alpha, warmup_epochs=warmup_epochs, b1=b1, b2=b2, eps=eps,
              bias_correction=bias_correction)


def _linear_scaling_step(count, mu, nu, *, base_lr, num_workers, steps_per_epoch, alpha,
                         warmup_epochs, b1, b2, eps, bias_correction):
  """``clip(alpha_k / (sqrt(v) + eps), B_l, B_u) * m`` per leaf, at the ``count``-th update.

  ``alpha_k = alpha`` (the seed's formula), or with ``bias_correction`` the AdaBound
  reference's ``alpha sqrt(1 - b2^k) / (1 - b1^k)``.
  """
  t = _float_count(count, mu)
  step_size = alpha
  if bias_correction:
    step_size = alpha * jnp.sqrt(_bias_correction(b2, t)) / _bias_correction(b1, t)
  lower, upper = linear_scaling_bounds(t / steps_per_epoch, base_lr=base_lr,
                                       num_workers=num_workers, warmup_epochs=warmup_epochs,
                                       b2=b2)
  return _clipped_step(step_size, lower, upper, eps, mu, nu)


def scale_by_linear_scaling_adabound(*, base_lr: float, num_workers: int, steps_per_epoch: int,
                                     alpha: float = 1e-3, warmup_epochs: float = 10,
                                     b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                                     bias_correction: bool = False
                                     ) -> optax.GradientTransformation:
  r"""Linear-scaling AdaBound's step (positive, no sign): ``clip(alpha/sqrt(V_t), B_l, B_u) * m_t``.

  At the ``k``-th update (``k = 1, 2, ...``) the fractional epoch is ``t = k / steps_per_epoch``
  and the bounds are :func:`linear_scaling_bounds`. ``m_t`` and ``V_t`` are the raw moving
  averages, with no bias correction, as seed 004 §2.1.1/§2.2.1 print them (its Adam has none)
  and SPEC.md reads them. Choices:

  * ``bias_correction=True`` multiplies ``alpha`` by ``sqrt(1 - b2^k) / (1 - b1^k)`` before the
    clip, as the AdaBound reference implementation (package ``adabound``) and
    :func:`mfopt.adabound` do. Off by default: it changes the first steps' effective rate by up
    to ``sqrt(1 - b2)/(1 - b1)`` (0.32x at ``k = 1`` with the defaults), so a replication of
    the seed must not have it.
  * ``eps`` is added to ``sqrt(v)`` as in the reference (the seed has no ``eps``).
  * ``t`` is clamped at ``T``; from then on the step is ``lr N * m_t`` (linear-scaling SGD with
    EMA momentum).

  Args:
    base_lr: per-worker SGD learning rate ``lr`` (seed: 0.1).
    num_workers: ``N``, the linear-scaling factor.
    steps_per_epoch: optimizer steps per epoch of the global batch.
    alpha: Adam learning rate (the seed's "initial learning rate").
    warmup_epochs: ``T``.
    b1, b2, eps: Adam hyperparameters.
    bias_correction: Adam's bias correction of ``alpha`` (the AdaBound reference's); default
      ``False``, the seed's formula.

  Returns:
    An ``optax.GradientTransformation`` with :class:`LinearScalingAdaBoundState`.

  Seed: 004 §2.2.1 (bounds ``B_u``, ``B_l``; steps 2-6 of the warmup loop).
  """
  hyper = _linear_scaling_hyper(base_lr=base_lr, num_workers=num_workers,
                                steps_per_epoch=steps_per_epoch, alpha=alpha,
                                warmup_epochs=warmup_epochs, b1=b1, b2=b2, eps=eps,
                                bias_correction=bias_correction)

  def init_fn(params):
    return LinearScalingAdaBoundState(count=jnp.zeros([], jnp.int32),
                                      mu=optax.tree.zeros_like(params),
                                      nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu, nu = _update_moments(updates, state.mu, state.nu, b1, b2)
    count = optax.safe_increment(state.count)
    return (_linear_scaling_step(count, mu, nu, **hyper),
            LinearScalingAdaBoundState(count=count, mu=mu, nu=nu))

  return optax.GradientTransformation(init_fn, update_fn)


def linear_scaling_adabound(*, base_lr: float, num_workers: int, steps_per_epoch: int,
                            alpha: float = 1e-3, warmup_epochs: float = 10, b1: float = 0.9,
                            b2: float = 0.999, eps: float = 1e-8,
                            bias_correction: bool = False) -> optax.GradientTransformation:
  r"""Linear-scaling AdaBound (seed 004 §2.2.1): Adam whose per-coordinate rate is clipped to
  ``[B_l, B_u]``, moving smoothly from Adam (``t = 0``) to linear-scaling SGD ``lr N`` (``t = T``).

  .. math::  x_{t+1} = x_t - \mathrm{clip}(\alpha/\sqrt{V_t}, B_l, B_u)\, m_t

  See :func:`scale_by_linear_scaling_adabound` for the arguments and the choices made.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.linear_scaling_adabound(base_lr=0.1, num_workers=8, steps_per_epoch=10)
    >>> params = jnp.ones(2)
    >>> updates, _ = tx.update(jnp.array([1.0, 100.0]), tx.init(params), params)
    >>> # 1st: alpha/sqrt(v) = 1e-3/sqrt(1e-3) times m = 0.1; 2nd clipped at B_l = (0.1/10)*0.8,
    >>> # times m = 10
    >>> [round(float(u), 6) for u in updates]
    [-0.003162, -0.08]
  """
  return optax.chain(
      scale_by_linear_scaling_adabound(base_lr=base_lr, num_workers=num_workers,
                                       steps_per_epoch=steps_per_epoch, alpha=alpha,
                                       warmup_epochs=warmup_epochs, b1=b1, b2=b2, eps=eps,
                                       bias_correction=bias_correction),
      optax.scale(-1.0))


# ----------------------------------------------------------------------------- hybrid


class HybridState(NamedTuple):
  """State of :func:`hybrid_adabound_lars`: two parameter-sized buffers, not three.

  Attributes:
    count: int32 updates so far (both phases). AdaBound's own count is ``min(count, S)``
      and the SGD phase's is ``count - S`` (``S`` the switch step).
    mu: AdaBound's first moment ``m`` during the warmup; from the switch on, the LARS
      momentum buffer (reset to zero at the switch, as a fresh ``optax.lars`` would be).
    nu: AdaBound's second moment ``v`` (frozen after the switch).
  """

  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates


def hybrid_switch_step(warmup_epochs: float, steps_per_epoch: int) -> int:
  """The update count ``S = ceil(T * steps_per_epoch)`` (at least 1) at which
  :func:`hybrid_adabound_lars` switches to LARS SGD: updates ``0 .. S-1`` are the warm-up.

  The warm-up's last update is the first one whose epoch ``t = S / steps_per_epoch`` reaches
  ``T``, where both bounds equal ``lr N`` (SPEC.md: "at t = T both bounds equal lr*N, then
  SGD"). Rounding down, as this did before, switched to SGD before ``T`` when ``T *
  steps_per_epoch`` is not a whole number, after a step whose bounds had not met
  (``warmup_epochs=2.5`` with 11 steps per epoch switched at epoch 2.45, where the
  coordinates' 1%-99% rates were still 19.9x apart: ``notebooks/adabound_hybrid.ipynb``).
  The 1e-9 absorbs float rounding of a whole product (``0.3 * 10``).

  >>> from mfopt import hybrid_switch_step
  >>> hybrid_switch_step(2.5, 11), hybrid_switch_step(0.3, 10), hybrid_switch_step(10, 4)
  (28, 3, 40)
  """
  _checks.positive_number("warmup_epochs", warmup_epochs)
  _checks.positive_int("steps_per_epoch", steps_per_epoch)
  return max(1, int(math.ceil(warmup_epochs * steps_per_epoch - 1e-9)))


def hybrid_lars_learning_rate(*, num_workers: int, steps_per_epoch: int, base_lr: float = 0.1,
                              decay: float = 0.9) -> optax.Schedule:
  """The SGD phase's global learning rate as a function of steps since the switch.

  ``lr * N * decay ** floor(c / steps_per_epoch)`` for the ``c``-th SGD step (``c = 0, 1, ...``):
  the exponent is the number of *completed epochs since the switch*, so the first SGD epoch runs
  at ``lr N`` (where the warmup's bounds ended). The seed prints ``kappa^epoch``; counted from
  epoch 0 it would jump from ``lr N`` to ``lr N 0.9^T`` at the switch (SPEC.md: counted from
  the switch). Staircase per epoch, as the seed's per-epoch loop.
  """
  _checks.positive_int("num_workers", num_workers)
  _checks.positive_int("steps_per_epoch", steps_per_epoch)
  _checks.positive_number("base_lr", base_lr)
  _checks.number_where("decay", decay, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
  peak = base_lr * num_workers

  def schedule(count):
    return peak * decay ** (count // steps_per_epoch)

  return schedule


def hybrid_adabound_lars(*, num_workers: int, steps_per_epoch: int, base_lr: float = 0.1,
                         alpha: float = 1e-3, warmup_epochs: float = 10, decay: float = 0.9,
                         momentum: float = 0.9, weight_decay: float = 1e-4,
                         trust_coefficient: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, bias_correction: bool = False,
                         axis_name: AxisName = None) -> optax.GradientTransformation:
  r"""AdaBound warmup + linear-scaling SGD with LARS (seed 004 §2.2.1, "the hybrid").

  For the first ``S = ceil(T * steps_per_epoch)`` updates (:func:`hybrid_switch_step`):
  :func:`linear_scaling_adabound` (no weight decay: the seed adopts weight decay "in SGD").
  From update ``S`` on:
  ``optax.lars(lr_c, weight_decay, trust_coefficient=..., momentum=...)`` with
  :func:`hybrid_lars_learning_rate`, i.e.

  .. math::
     g' = g + \lambda w,\quad
     v \leftarrow \mu v + \alpha_c\, \tau \frac{\lVert w\rVert}{\lVert g'\rVert} g',\quad
     w \leftarrow w - v,\qquad \alpha_c = lr\, N\, \kappa^{\lfloor c/\text{steps\_per\_epoch}\rfloor}

  per parameter tensor (optax's LARS; trust ratio 1 where ``||w||`` or ``||g'||`` is 0).

  Choices: the LARS momentum buffer starts at zero at the switch (AdaBound's ``m`` is not
  carried over); the decay is counted from the switch (see :func:`hybrid_lars_learning_rate`);
  the LARS masks are optax's defaults (every tensor, biases and BN scales included). Epochs
  are counted in applied updates: under :func:`mfopt.precision.dynamic_loss_scale` a step
  reverted on overflow does not count, so the switch comes that many steps later.

  **Implementation** (a deviation from "reuse ``optax.lars``", for speed and memory; the
  LARS phase equals ``optax.lars`` to rounding, ``tests/test_adabound.py``). The phase switch is
  in the graph (no recompilation, no host sync), but not as a ``lax.cond`` over the two
  phases' updates and states: that passes the idle phase's parameter-sized state through a
  ``conditional`` (XLA copies it) and materialises the updates as the conditional's output,
  which cannot fuse into ``apply_updates`` (issue 8 profile: 3.5x ``optax.adam``'s time on
  XLA:CPU, 20 + 64 B/param of traffic against 40). Instead both phases' element-wise rules
  are computed in one fused pass and chosen by ``jnp.where`` (ALU work only, the step is
  memory bound: XLA:GPU compiles it to optax.adam's 28 B/param; XLA:CPU splits the pass and
  reads ``w`` once more, 44 against 40 B/param); the two phases share the moment buffers
  (:class:`HybridState`: LARS's momentum lives in AdaBound's ``m`` buffer after the switch,
  2 parameter-sized buffers instead of 3); and only the per-tensor LARS norms, which are extra reads of ``w`` and ``g``,
  sit in a loop of 0 or 1 trips whose results are scalars (:func:`mfopt.comm.gated`), so the
  warmup phase does not read them. (A ``lax.cond`` there kept them out of the warmup on
  XLA:CPU, but XLA:GPU turned it into a ``select`` and computed the norms every step: 36
  B/param against ``optax.adam``'s 28 in the deviceless H100 compile,
  ``bench_update --platform gpu-aot``.) Under the worker ``vmap`` the step count is batched;
  the loop then runs when any worker's count says so (all of them at once: the counts are
  equal) and selects its small norms table per worker, at the same cost (XLA:CPU, worker map:
  44.0 + [12.0] B/param with or without ``axis_name``). ``axis_name`` (the worker axes) makes
  the trip count unbatched (:func:`mfopt.comm.unbatched`: a local reduction, no
  communication) and drops that select. ``jax.grad`` through ``update`` goes through the
  loop's custom JVP (:func:`mfopt.comm.gated`; :func:`mfopt.differentiable_gates` makes the
  differentiated gate a ``lax.cond``). Measured on CPU
  (``python -m experiments.bench_update``, BENCHMARKS.md): AdaBound phase 0.96-1.08x
  ``optax.adam``'s time, LARS phase 0.27x ``optax.lars``'s.

  Args:
    num_workers: ``N``.
    steps_per_epoch: optimizer steps per epoch of the global batch.
    base_lr: per-worker SGD learning rate ``lr``.
    alpha: AdaBound's (Adam) learning rate during the warmup.
    warmup_epochs: ``T``.
    decay: ``kappa``, per-epoch decay of the SGD learning rate.
    momentum: LARS momentum.
    weight_decay: L2 weight decay of the SGD phase.
    trust_coefficient: LARS trust coefficient (You et al.: 0.001).
    b1, b2, eps: AdaBound's Adam hyperparameters.
    bias_correction: bias-correct the warmup's ``alpha`` as the AdaBound reference does
      (default ``False``: the seed's formula; see :func:`scale_by_linear_scaling_adabound`).
    axis_name: the worker axes (e.g. :data:`mfopt.WORKER_AXES`) when the transform runs
      inside the worker ``vmap``; only used to keep the norms loop's trip count unbatched,
      never to communicate. ``None`` (default) is always correct and costs the same.

  Returns:
    An ``optax.GradientTransformation`` with :class:`HybridState`.

  Example:
    >>> import jax.numpy as jnp, mfopt
    >>> tx = mfopt.hybrid_adabound_lars(num_workers=8, steps_per_epoch=10, warmup_epochs=1)
    >>> state = tx.init(jnp.ones(3))
    >>> int(state.count)
    0

  Seed: 004 §2.2.1 (both loops), §3.1 (defaults T=10, lr=0.1, kappa=0.9, wd=1e-4).
  """
  axis_name = check_axis_name(axis_name)
  _checks.unit_interval("momentum", momentum)
  _checks.nonnegative_number("weight_decay", weight_decay)
  _checks.positive_number("trust_coefficient", trust_coefficient)
  _checks.number_where("decay", decay, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
  for name, value in (("warmup_epochs", warmup_epochs), ("steps_per_epoch", steps_per_epoch)):
    if _checks.is_traced(value):
      raise ValueError(f"{name} must be a concrete number (it fixes the switch step), got a "
                       f"tracer {value!r}; with optax.inject_hyperparams, list it in static_args")
  hyper = _linear_scaling_hyper(base_lr=base_lr, num_workers=num_workers,
                                steps_per_epoch=steps_per_epoch, alpha=alpha,
                                warmup_epochs=warmup_epochs, b1=b1, b2=b2, eps=eps,
                                bias_correction=bias_correction)
  switch = hybrid_switch_step(warmup_epochs, steps_per_epoch)
  lars_lr = hybrid_lars_learning_rate(num_workers=num_workers, steps_per_epoch=steps_per_epoch,
                                      base_lr=base_lr, decay=decay)
  # The LARS-norm gate opens at the switch for good; the host replays that from the count
  # (mfopt.comm.static_gates: on XLA:GPU the device-side gate blocks the host every step).
  schedule = HostSchedule(read=lambda opt_state: host_scalar(_hybrid_state(opt_state).count),
                          next=lambda count: (count >= switch, count + 1))

  def init_fn(params):
    return HybridState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                       nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("hybrid_adabound_lars needs params (LARS trust ratio, weight decay)")
    count = state.count
    in_warmup = count < switch
    pick = lambda a, b: jnp.where(in_warmup, a, b)  # noqa: E731
    # AdaBound's moments; its own count stops at S (clamped so that it never overflows).
    k = jnp.minimum(count, switch)
    ab_mu, ab_nu = _update_moments(updates, state.mu, state.nu, b1, b2)
    # LARS (optax.lars = add_decayed_weights, scale_by_trust_ratio, scale_by_learning_rate,
    # trace): g' = g + wd w, v = momentum v - lr tau ||w||/||g'|| g'. The norms are the only
    # part in the gated loop; its operands are w and g (g' is formed inside, not materialised).

    ws, gs = jax.tree.leaves(params), jax.tree.leaves(updates)

    table_dtype = functools.reduce(jnp.promote_types, [x.dtype for x in ws + gs], jnp.float32)

    def norms(_, ws, gs):  # one (n_leaves, 2) array: one loop buffer, not 2 scalars per leaf
      if not ws:  # no parameters (an empty tree): an empty table, as optax's transforms do
        return jnp.zeros((0, 2), table_dtype)
      return jnp.stack([
          # squared in the table's (float32 or wider) dtype: a float16 tensor of norm > 256
          # overflowed to inf (optax.lars does), and LARS stepped inf/NaN
          jnp.stack([jnp.sqrt(jnp.sum(jnp.square(w.astype(table_dtype)))),
                     jnp.sqrt(jnp.sum(jnp.square(g.astype(table_dtype)
                                                 + weight_decay * w.astype(table_dtype))))])
          for w, g in zip(ws, gs)])

    # warmup: the trust ratio is not used; skip the two reads (zeros: never read). A carry of
    # 2 scalars per leaf cost one copy kernel each on XLA:GPU (322 on the ResNet-50 tree).
    # w and g go in as operands, not closed over (see gated: loop-invariant code motion).
    table = gated(unbatched(count, axis_name) >= switch, norms,
                  jnp.zeros((len(ws), 2), table_dtype), (ws, gs), owner=schedule)
    leaf_norms = [(table[i, 0].astype(w.dtype), table[i, 1].astype(g.dtype))
                  for i, (w, g) in enumerate(zip(ws, gs))]
    neg_lr = -lars_lr(jnp.maximum(count - switch, 0))
    restart = count == switch  # a fresh optax.lars momentum at the switch

    def lars_one(g, w, m, norm):
      w_norm, g_norm = norm
      ratio = trust_coefficient * w_norm / g_norm
      ratio = jnp.where((w_norm == 0) | (g_norm == 0), jnp.ones([], g.dtype), ratio)
      prev = jnp.where(restart, jnp.zeros([], m.dtype), m)
      return ((g + weight_decay * w) * ratio * neg_lr.astype(g.dtype)
              + momentum * prev).astype(m.dtype)

    treedef = jax.tree.structure(updates)
    lars_v = jax.tree.map(lars_one, updates, params, state.mu,
                          jax.tree.unflatten(treedef, leaf_norms))
    new_mu = jax.tree.map(pick, ab_mu, lars_v)
    new_nu = jax.tree.map(pick, ab_nu, state.nu)
    # The update is a function of the *new* buffers only (AdaBound: -clip(.)(nu) * mu, LARS:
    # v = mu), so XLA writes mu and nu in place and reads them once more for w (no copies).
    ab_step = _linear_scaling_step(k + 1, new_mu, new_nu, **hyper)
    # (a bool leaf, a mask kept with the parameters, has no negation and is never moved)
    new_updates = jax.tree.map(
        lambda a, m: jnp.zeros_like(m) if m.dtype == jnp.bool_ else pick(-a, m), ab_step, new_mu)
    return new_updates, HybridState(count=optax.safe_increment(count), mu=new_mu, nu=new_nu)

  update_fn.host_schedule = schedule
  return optax.GradientTransformation(init_fn, update_fn)


def _hybrid_state(opt_state: Any) -> HybridState:
  found = states_of(opt_state, HybridState)
  if not found:
    raise ValueError("no HybridState in opt_state (is this a hybrid_adabound_lars state?)")
  return found[0]
