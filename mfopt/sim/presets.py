"""Named configurations of the seed's model: ``faithful`` (the spec's defaults) and ``working`` (its remedies).

``faithful`` keeps every [A] default of ``spec/seed-002-async-ksync.md``: γ = 0.9
without dampening, ϑ = 0.9, 95 % t-interval with the literal ``upper_signed``
Test B, k ∈ [2, M], cheap ν (eq. 25), α clamp [1e-6, 10 α_0], no α floor,
Armijo c = 0.1, ρ = 0.5, at most 10 backtracks, additive stale merge, no cutoff.

``working`` applies the spec's cautions (§7): dampened momentum
``u = γu + (1-γ)G`` (caution 1), exact ν (eq. 22, caution 2), k capped at
``k_max = 8`` (§6, "optional cap ≈ 8"), and the α floor ``1e-3 α_0`` (caution 3).
Everything else equals ``faithful``. Reports name the preset they used.
"""

from __future__ import annotations

import dataclasses

from mfopt.sim import bb as bb_lib
from mfopt.sim import ksync as ksync_lib
from mfopt.sim import server as server_lib

PRESETS = ("faithful", "working")


def ksync_config(preset: str = "faithful", *, alpha0: float = 0.01, **overrides) -> server_lib.KSyncConfig:
  """The :class:`KSyncConfig` of a named preset, with ``alpha0`` and field overrides.

  Args:
    preset: ``"faithful"`` or ``"working"``.
    alpha0: the initial per-worker step size α_0 (Table 3 LR).
    **overrides: any :class:`KSyncConfig` field (e.g. ``k_rule=3``, ``bb=None``).
  """
  if preset == "faithful":
    cfg = server_lib.KSyncConfig(bb=bb_lib.BBConfig(alpha0=alpha0))
  elif preset == "working":
    cfg = server_lib.KSyncConfig(
        dampening=True, ktest=ksync_lib.KTestConfig(k_max=8),
        bb=bb_lib.BBConfig(alpha0=alpha0, nu="exact", alpha_floor_factor=1e-3))
  else:
    raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
  return dataclasses.replace(cfg, **overrides)


def ksync_preset(preset: str = "faithful", *, alpha0: float = 0.01, label: str | None = None,
          **overrides) -> server_lib.KSync:
  """A fresh :class:`KSync` strategy for ``preset`` (labelled ``"KSync[<preset>]"``)."""
  return server_lib.KSync(ksync_config(preset, alpha0=alpha0, **overrides),
                          label=label or f"KSync[{preset}]")
