"""Per-worker Barzilai-Borwein step size with Armijo backtracking (seed 002 Algorithm 2, spec §3-4).

One worker step (jitted, vmappable over workers) on flat parameter vectors:

.. code-block:: text

  L0, g = value_and_grad(L_D)(θ)                      # D = this step's batch
  α = α_prev
  if the worker has a previous pulled version θ_prev:
    s = θ - θ_prev
    y = g - g_prev              (nu="cheap", spec eq. 25)
      | g - ∇L_D(θ_prev)        (nu="exact", spec eq. 22; one extra backward pass)
    if ⟨s,s⟩ > 1e-12 and ⟨s,y⟩ > 0 and all finite:
      ν = (⟨s,y⟩ - c_a V̂ [if nu_bias_correction]) / ⟨s,s⟩
      B = k b
      if B >= N:  α̃ = 1/ν,                       w = 1
      else:       α̃ = (1/ν)(1 - min(r, 1-ε)),    w = B/N
      α = (1-w) α_prev + w clip(α̃, α_min, α_max)     (eq. 26)
  while L_D(θ - α g) > L0 - c α ‖g‖² and nb < max_bt:   (eq. 19)
    α = ρ α;  nb += 1

``k``, ``r = Ê/‖ḡ‖²`` and ``V̂`` come from the server's last update (broadcast
with θ, spec assumption 7). ``c_a`` is the coefficient of the worker's own
previous gradient inside ``s`` (the step it pushed with that gradient over k,
times ``1-γ`` when momentum is dampened), the bias correction of spec caution 2.

Choices where the spec leaves room (each a named option of :class:`BBConfig`):
the floor ``alpha_floor_factor * α_0`` is applied to the step size *carried to
the next step*, not to the step pushed now, so the pushed step always satisfies
Armijo unless the backtrack limit was hit (then ``hit_limit`` is True and the
simulator counts it). ``double_on_k_increase`` is ensmallen's rule (off).

Reference: ``seeds/002_7eb60581c949cce6.txt`` Sec. 3.4 (equations lost);
``spec/seed-002-async-ksync.md`` §3, §4, §7 cautions 2-3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mfopt import _checks

NU_MODES = ("cheap", "exact")


@dataclasses.dataclass(frozen=True)
class BBConfig:
  """Options of the per-worker BB step (defaults = the spec's, ``faithful``).

  Args:
    alpha0: initial step size α_0 (Table 3 LR) [A].
    nu: ``"cheap"`` (eq. 25, default) or ``"exact"`` (eq. 22) [A].
    armijo_c, backtrack, max_bt: Armijo constant c = 0.1, factor ρ = 0.5, at most 10 backtracks [R/A].
    clamp: clip α̃ to ``[alpha_min, alpha_max_factor * alpha0]`` = [1e-6, 10 α_0] [A].
    alpha_floor_factor: optional floor ``α_carried >= factor * α_0`` (None = off; 1e-3 in ``working``) [A].
    eps: r is capped at ``1 - eps`` in ``1 - min(r, 1-eps)`` [A].
    min_step_sq: skip the BB update if ``‖s‖² <= min_step_sq`` (1e-12) [A].
    nu_bias_correction: subtract ``c_a V̂`` from ``⟨s,y⟩`` (spec caution 2) [A]; ``c_a`` is
      the coefficient of the worker's previous gradient in ``s``: ``α_pushed·damp/k`` if that
      gradient arrived fresh, 0 if it arrived stale (merged after the version the worker then
      pulled was built) or was dropped. Cheap ν only: exact ν has no such bias (refused).
    double_on_k_increase: double α when k grew since the last pull (ensmallen) [A].
  """

  alpha0: float = 0.01
  nu: str = "cheap"
  armijo_c: float = 0.1
  backtrack: float = 0.5
  max_bt: int = 10
  clamp: bool = True
  alpha_min: float = 1e-6
  alpha_max_factor: float = 10.0
  alpha_floor_factor: float | None = None
  eps: float = 1e-3
  min_step_sq: float = 1e-12
  nu_bias_correction: bool = False
  double_on_k_increase: bool = False

  def __post_init__(self):
    _checks.python_scalars(self)
    w = _checks.number_where  # finite real scalars only (a string or inf used to slip through)
    w("alpha0", self.alpha0, lambda v: v > 0, "> 0")
    if self.nu not in NU_MODES:
      raise ValueError(f"nu must be one of {NU_MODES}, got {self.nu!r}")
    w("armijo_c", self.armijo_c, lambda v: 0 < v < 1, "in (0, 1)")
    w("backtrack", self.backtrack, lambda v: 0 < v < 1, "in (0, 1)")
    _checks.nonnegative_int("max_bt", self.max_bt)
    for flag in ("clamp", "nu_bias_correction", "double_on_k_increase"):
      _checks.flag(flag, getattr(self, flag))
    if self.nu_bias_correction and self.nu == "exact":  # (spec caution 2: cheap ν's bias)
      raise ValueError("nu_bias_correction=True corrects cheap ν's bias (spec caution 2); "
                       "nu='exact' has none to remove: use nu='cheap' or leave it off")
    w("alpha_min", self.alpha_min, lambda v: v >= 0, ">= 0")
    w("alpha_max_factor", self.alpha_max_factor, lambda v: v > 0, "> 0")
    if self.clamp and self.alpha_min > self.alpha_max_factor * self.alpha0:  # (clip then
      # returned the maximum for every step, silently)
      raise ValueError(f"alpha_min={self.alpha_min!r} is above the clamp's maximum "
                       f"alpha_max_factor * alpha0 = {self.alpha_max_factor * self.alpha0!r}")
    w("eps", self.eps, lambda v: 0 < v < 1, "in (0, 1)")
    w("min_step_sq", self.min_step_sq, lambda v: v >= 0, ">= 0")
    if self.alpha_floor_factor is not None:
      w("alpha_floor_factor", self.alpha_floor_factor, lambda v: v > 0, "> 0 or None")


class BBInputs(NamedTuple):
  """Per-worker inputs of one step (leading worker axis when vmapped)."""

  theta: jax.Array       # (d,) the version pulled now
  theta_prev: jax.Array  # (d,) the version pulled before (zeros if none)
  g_prev: jax.Array      # (d,) this worker's previous gradient (zeros if none)
  alpha_prev: jax.Array  # () step size carried from the previous step
  has_prev: jax.Array    # () bool
  k: jax.Array           # () float, k of the server's last update
  k_grew: jax.Array      # () bool, k increased since this worker's previous pull
  r: jax.Array           # () noise ratio Ê/‖ḡ‖² of the server's last update
  v_hat: jax.Array       # () V̂ of the server's last update
  c_a: jax.Array         # () coefficient of g_prev inside s (bias correction)


class BBOutputs(NamedTuple):
  loss: jax.Array        # () L_D(θ)
  grad: jax.Array        # (d,)
  alpha: jax.Array       # () step size pushed with the gradient (Armijo-accepted)
  alpha_carry: jax.Array  # () step size carried to the next step (alpha with the floor)
  num_backtracks: jax.Array  # () int32
  hit_limit: jax.Array   # () bool: max_bt reached with Armijo still violated
  bb_applied: jax.Array  # () bool: the BB update (26) was applied this step


def make_bb_step(loss_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], cfg: BBConfig, *,
                 batch_size: int, dataset_size: int) -> Callable[[BBInputs, jax.Array, jax.Array], BBOutputs]:
  """Builds the (unjitted, vmappable) worker step ``(inputs, x, y) -> BBOutputs``.

  Args:
    loss_fn: ``(theta_flat, x, y) -> scalar`` mean loss on the batch.
    cfg: :class:`BBConfig`.
    batch_size: per-worker batch b.
    dataset_size: N.

  Example (quadratic, B = N, clamp off)::

    step = make_bb_step(lambda th, x, y: 0.5 * jnp.sum(x * th**2), BBConfig(clamp=False),
                        batch_size=1, dataset_size=1)
  """
  vg = jax.value_and_grad(loss_fn)
  alpha_hi = cfg.alpha_max_factor * cfg.alpha0 if cfg.clamp else jnp.inf
  alpha_lo = cfg.alpha_min if cfg.clamp else 0.0

  def step(inp: BBInputs, x, y) -> BBOutputs:
    theta = inp.theta
    loss0, g = vg(theta, x, y)
    alpha = inp.alpha_prev.astype(jnp.float32)
    if cfg.double_on_k_increase:
      alpha = jnp.where(inp.k_grew & inp.has_prev, 2 * alpha, alpha)
    s = theta - inp.theta_prev
    if cfg.nu == "exact":
      y_diff = g - jax.grad(loss_fn)(inp.theta_prev, x, y)
    else:
      y_diff = g - inp.g_prev
    ss = jnp.vdot(s, s)
    sy = jnp.vdot(s, y_diff)
    if cfg.nu_bias_correction:
      sy = sy - inp.c_a * inp.v_hat
    nu = sy / jnp.where(ss > 0, ss, 1.0)
    finite = jnp.isfinite(ss) & jnp.isfinite(sy) & jnp.all(jnp.isfinite(g))
    ok = inp.has_prev & (ss > cfg.min_step_sq) & (sy > 0) & finite
    big = inp.k * batch_size >= dataset_size
    noise = 1.0 - jnp.minimum(inp.r, 1.0 - cfg.eps)
    alpha_tilde = jnp.where(big, 1.0, noise) / jnp.where(ok, nu, 1.0)
    w = jnp.where(big, 1.0, inp.k * batch_size / dataset_size)
    alpha_bb = (1 - w) * alpha + w * jnp.clip(alpha_tilde, alpha_lo, alpha_hi)
    alpha = jnp.where(ok, alpha_bb, alpha).astype(jnp.float32)

    gg = jnp.vdot(g, g)

    def armijo_ok(a):
      return loss_fn(theta - a * g, x, y) <= loss0 - cfg.armijo_c * a * gg

    def cond(c):
      _, nb, good = c
      return (~good) & (nb < cfg.max_bt)

    def body(c):
      a, nb, _ = c
      a = a * cfg.backtrack
      return a, nb + 1, armijo_ok(a)

    alpha, nb, good = jax.lax.while_loop(cond, body, (alpha, jnp.int32(0), armijo_ok(alpha)))
    carry = alpha
    if cfg.alpha_floor_factor is not None:
      carry = jnp.maximum(carry, cfg.alpha_floor_factor * cfg.alpha0)
    return BBOutputs(loss0, g, alpha, carry.astype(jnp.float32), nb, ~good, ok)

  return step
