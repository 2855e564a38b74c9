"""Seed 003's theory as functions: the Theorem 1 bound, its conditions, and the tuning lemmas.

Notation (seed 003 §III): ``P`` learners, mini-batch ``B``, period ``K``, step
``eta``, block momentum ``mu``, ``N`` meta-iterations; problem constants ``L``
(gradient Lipschitz), ``sigma2`` (per-sample gradient variance), ``M`` (bound on
``||grad F||^2``), ``f_gap = F(w_1) - F*`` and ``delta`` in (0, 1).

Theorem 1 (eq. 3):

.. math::

   g(\\mu, N, \\eta; P, B, K) =
   \\frac{2(1-\\mu) f_{gap}}{N(K-1+\\delta)\\eta}
   + \\frac{L^2\\eta^2\\sigma^2 (2K-1)K(K-1)}{6(K-1+\\delta)B(1-\\mu)^2}
   + \\frac{2LK^2\\sigma^2\\eta}{PB(K-1+\\delta)(1-\\mu)}\\Big(1 + \\frac{\\mu^2}{2(1-\\mu)^2}\\Big)
   + \\frac{L\\eta\\mu^2K^2M}{(K-1+\\delta)(1-\\mu)^3}

valid when ``1 >= L^2 eta^2 (K+1)(K-2) / (2(1-mu)^2) + 2 eta L K/(1-mu)`` and
``1 - delta >= L^2 eta^2 / (1-mu)^2``. (§III.C restates the first condition with
a minus sign before ``2 eta L K/(1-mu)``; the proof's ``C_2 >= 0`` needs the plus,
which is used here.)

Lemma 6 (``S = N P B K`` fixed, ``eta, B, K`` fixed): the bound-optimal ``mu``
grows with ``P``; :func:`optimal_momentum` finds it by minimising ``g`` over
``mu``. Lemmas 5 and 7 (``S = N K`` fixed): under condition (11)/(12) the
bound-optimal ``K`` exceeds 1 and does not grow with ``mu``;
:func:`optimal_period` minimises ``g`` over integer ``K``. The lemmas' proofs are
omitted in the paper; these functions let one check them numerically.

:func:`estimate_constants` estimates ``L`` (top Hessian eigenvalue by power
iteration on Hessian-vector products), ``sigma2`` (per-example gradient
variance) and ``M`` (largest squared full-batch gradient norm seen) on a
small model.

Seed: ``seeds/003_d45cb4f33beceb9d.txt`` Theorem 1, Lemmas 5-7.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from mfopt import _checks

__all__ = ["ProblemConstants", "bound", "bound_terms", "conditions", "optimal_momentum",
           "optimal_period", "lemma5_condition", "estimate_constants"]


@dataclasses.dataclass(frozen=True)
class ProblemConstants:
  """Assumption 1's constants (explicit inputs of every bound)."""

  L: float
  sigma2: float
  M: float
  f_gap: float
  delta: float = 0.5

  def __post_init__(self):  # finite: L = inf made every bound NaN
    for name in ("L", "f_gap"):
      _checks.positive_number(name, getattr(self, name))
    for name in ("sigma2", "M"):
      _checks.nonnegative_number(name, getattr(self, name))
    _checks.number_where("delta", self.delta, lambda v: 0 < v < 1, "in (0, 1)")


def _check(mu, eta, P, B, K):  # finite: K = inf returned a NaN bound
  _checks.unit_interval("mu", mu)
  _checks.positive_number("eta", eta)
  for name, v in (("P", P), ("B", B), ("K", K)):
    _checks.number_where(name, v, lambda v: v >= 1, ">= 1")


def bound_terms(mu: float, N: float, eta: float, *, P: float, B: float, K: float,
                c: ProblemConstants) -> dict[str, float]:
  """The four terms of Theorem 1's bound (eq. 3): optimisation, local drift, noise, momentum."""
  _check(mu, eta, P, B, K)
  if not N > 0:
    raise ValueError(f"N must be positive, got {N!r}")
  den = K - 1 + c.delta
  om = 1.0 - mu
  return {
      "optimization": 2 * om * c.f_gap / (N * den * eta),
      "drift": c.L**2 * eta**2 * c.sigma2 * (2 * K - 1) * K * (K - 1) / (6 * den * B * om**2),
      "noise": 2 * c.L * K**2 * c.sigma2 * eta / (P * B * den * om) * (1 + mu**2 / (2 * om**2)),
      "momentum": c.L * eta * mu**2 * K**2 * c.M / (den * om**3),
  }


def bound(mu: float, N: float, eta: float, *, P: float, B: float, K: float,
          c: ProblemConstants) -> float:
  """``g(mu, N, eta; P, B, K)``: Theorem 1's bound on the mean squared gradient norm.

  Example:
    >>> from mfopt import theory
    >>> c = theory.ProblemConstants(L=1.0, sigma2=1.0, M=1.0, f_gap=1.0, delta=0.5)
    >>> round(theory.bound(0.0, 100, 0.01, P=8, B=32, K=4, c=c), 6)
    0.571798
  """
  return float(sum(bound_terms(mu, N, eta, P=P, B=B, K=K, c=c).values()))


def conditions(mu: float, eta: float, *, K: float, c: ProblemConstants) -> dict[str, Any]:
  """Theorem 1's two conditions: values of their right-hand sides and whether both hold."""
  _check(mu, eta, 1, 1, K)
  om = 1.0 - mu
  first = c.L**2 * eta**2 * (K + 1) * (K - 2) / (2 * om**2) + 2 * eta * c.L * K / om
  second = c.L**2 * eta**2 / om**2
  return {"step_condition": first, "step_ok": first <= 1.0,
          "delta_condition": second, "delta_ok": second <= 1.0 - c.delta,
          "ok": bool(first <= 1.0 and second <= 1.0 - c.delta)}


def optimal_momentum(P: float, *, samples: float, eta: float, B: float, K: float,
                     c: ProblemConstants, grid: Sequence[float] | None = None) -> float:
  """Bound-optimal ``mu`` for ``P`` learners with ``S = N P B K = samples`` fixed (Lemma 6).

  Minimises ``g(mu, S/(P B K), eta; P, B, K)`` over ``mu`` in ``grid`` (default:
  0 to 0.995 in steps of 0.0025) among the values where Theorem 1's conditions
  hold; returns NaN if none does.
  """
  grid = np.arange(0.0, 0.9951, 0.0025) if grid is None else np.asarray(grid, float)
  _check(0.0, eta, P, B, K)  # (P = 0 raised ZeroDivisionError; P = -1 returned NaN, "no mu")
  _checks.positive_number("samples", samples)
  n = samples / (P * B * K)
  best, best_mu = np.inf, float("nan")
  for mu in grid:
    if not conditions(mu, eta, K=K, c=c)["ok"]:
      continue
    val = bound(mu, n, eta, P=P, B=B, K=K, c=c)
    if val < best or math.isnan(best_mu):  # (the first admissible mu, even at an infinite
      best, best_mu = val, float(mu)        # bound: NaN is reserved for "none holds")
  return best_mu


def optimal_period(mu: float, *, samples: float, eta: float, P: float, B: float,
                   c: ProblemConstants, k_max: int = 256) -> int:
  """Bound-optimal integer ``K`` for momentum ``mu`` with ``S = N K = samples`` fixed (Lemmas 5, 7).

  Minimises ``g(mu, S/K, eta; P, B, K)`` over ``K = 1..k_max`` (a positive int) where Theorem 1's
  conditions hold; returns 0 if none does.
  """
  _checks.positive_int("k_max", k_max)  # (0 returned 0, "no K holds"; 2.7 was read as 2)
  _check(mu, eta, P, B, 1)  # (P = 0 returned 0, "no K holds", without saying why)
  _checks.positive_number("samples", samples)
  best, best_k = np.inf, 0
  for k in range(1, int(k_max) + 1):
    if not conditions(mu, eta, K=k, c=c)["ok"]:
      continue
    val = bound(mu, samples / k, eta, P=P, B=B, K=k, c=c)
    if val < best or best_k == 0:  # (the first admissible K, even at an infinite bound: 0 is
      best, best_k = val, k        # reserved for "none holds")
  return best_k


def lemma5_condition(mu: float, *, samples: float, eta: float, P: float, B: float,
                     c: ProblemConstants) -> bool:
  """Condition (11) = (12) of Lemmas 5 and 7 (``S = N K = samples``)."""
  _check(mu, eta, P, B, 1)  # (eta = -0.01 "held"; mu = 1.5 did not, without saying why)
  _checks.positive_number("samples", samples)
  d, om = c.delta, 1.0 - mu
  lhs = (1 - d) / d * c.f_gap / (samples * eta)
  rhs = (c.L**2 * eta**2 * c.sigma2 / (2 * B) / om**3
         + (3 * d - 1) / (2 * d) / om**2 * (
             mu**2 / om**2 * (c.L * c.sigma2 * eta / (P * B) + c.L * eta * c.M)
             + 2 * c.L * c.sigma2 * eta / (P * B)))
  return bool(lhs > rhs)


def estimate_constants(loss_fn: Callable[[Any, Any], jax.Array], params: Any, examples: Any, *,
                       f_star: float = 0.0, iters: int = 50, seed: int = 0,
                       delta: float = 0.5) -> ProblemConstants:
  """Estimates ``L``, ``sigma2``, ``M`` and ``f_gap`` at ``params`` on a small problem.

  Args:
    loss_fn: ``(params, example_batch) -> mean loss``; called with single examples
      (leading axis 1) for the per-example gradients.
    params: the point ``w_1``.
    examples: a pytree of arrays with a leading example axis (the data set, or a sample).
    f_star: a lower bound of ``F`` (0 for cross-entropy/squared losses), below ``F(w_1)``.
    iters: power-iteration steps for ``L``, the largest |eigenvalue| of the full-batch
      Hessian, estimated as ``||H v||`` for the unit iterate ``v``: it never decreases from
      one step to the next (for a symmetric ``H``) and tends to ``max |lambda|``. (The
      Rayleigh quotient ``|v^T H v|`` it replaced wanders between the top positive and
      negative eigenvalues at a saddle: 0.85-3.8 after 20 steps for eigenvalues {5, -4.9,
      1}.) An estimate stopped early is below ``L``, so a condition it passes may fail at the
      true ``L``: use enough steps (``experiments.block_momentum_mu_vs_p`` uses 20).

  Returns:
    :class:`ProblemConstants`; ``M`` is ``||grad F(w_1)||^2`` (a local value, not a
    global bound), ``sigma2`` the mean per-example ``||g_i - grad F||^2``.
  """
  _checks.positive_int("iters", iters)  # (0 failed as "L must be a positive number, got 0.0")
  flat, unravel = ravel_pytree(params)

  def full_loss(x):
    return loss_fn(unravel(x), examples)

  grad = jax.grad(full_loss)
  g = grad(flat)
  def hvp(v):
    return jax.jvp(grad, (flat,), (v,))[1]

  @jax.jit
  def power_iteration(v):
    def body(_, carry):
      v, _ = carry
      hv = hvp(v)
      norm = jnp.linalg.norm(hv)
      return hv / jnp.maximum(norm, 1e-30), norm
    return jax.lax.fori_loop(0, int(iters), body, (v, jnp.zeros([], v.dtype)))[1]

  v = jax.random.normal(jax.random.PRNGKey(seed), flat.shape, flat.dtype)
  lam = power_iteration(v / jnp.linalg.norm(v))
  per_example = jax.vmap(lambda e: jax.grad(lambda x: loss_fn(
      unravel(x), jax.tree.map(lambda a: a[None], e)))(flat))(examples)
  sigma2 = jnp.mean(jnp.sum(jnp.square(per_example - g), axis=1))
  f_w1 = float(full_loss(flat))
  if not f_star < f_w1:  # (clamped to 1e-12 silently: a lower bound above F made every bound ~0)
    raise ValueError(f"f_star must be a lower bound of F below F(w_1) = {f_w1!r}, got {f_star!r}")
  return ProblemConstants(L=float(jnp.abs(lam)), sigma2=float(sigma2), M=float(jnp.vdot(g, g)),
                          f_gap=f_w1 - f_star, delta=delta)
