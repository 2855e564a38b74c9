"""Helpers shared by the seed 001/003 experiments (periodic averaging, block momentum).

Kept thin: schedules, one training run, seed statistics, the paper-claim verdict
rule of SPEC.md, and cost-model projections (always labelled "projected").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from mfopt import parallel, train
from mfopt import models as models_lib
from mfopt.report import mean_std  # noqa: F401 (re-exported for the seed 001/003 scripts)


def step_decay(peak: float, num_steps: int) -> optax.Schedule:
  """Seed 001's schedule: x0.1 at 50% and again at 75% of the steps."""
  return optax.piecewise_constant_schedule(
      peak, {int(num_steps * 0.5): 0.1, int(num_steps * 0.75): 0.1})


def mesh_for(num_workers: int):
  """The largest mesh over local devices whose size divides ``num_workers`` (P = 6 on 8 devices: 6)."""
  devices = jax.devices()
  d = max(k for k in range(1, len(devices) + 1) if num_workers % k == 0)
  return parallel.make_mesh(devices[:d])


def run(*, dataset, model_name: str, tx: optax.GradientTransformation, num_workers: int,
        per_worker_batch: int, num_steps: int, seed: int, log_every: int, progress: bool,
        desc: str, schedule: optax.Schedule | None = None, on_log=None,
        model_kwargs: dict[str, Any] | None = None) -> train.FitResult:
  """One ``train.fit`` run on a model from the registry."""
  model = models_lib.get_model(model_name, num_classes=dataset.num_classes, **(model_kwargs or {}))
  return train.fit(model=model, tx=tx, dataset=dataset, num_workers=num_workers,
                   per_worker_batch=per_worker_batch, num_steps=num_steps,
                   mesh=mesh_for(num_workers), seed=seed, log_every=log_every,
                   learning_rate=schedule, progress=progress, desc=desc, on_log=on_log)


def fmt_ms(values: Sequence[float], digits: int = 4) -> str:
  """``mean ± std`` over seeds; one seed has no spread: ``value (1 seed)``."""
  if len(values) == 1:
    return f"{float(values[0]):.{digits}f} (1 seed)"
  m, s = mean_std(values)
  return f"{m:.{digits}f} ± {s:.{digits}f}"


def fmt_diff(mean: float, std: float, seeds: int, scale: float = 1.0, digits: int = 2) -> str:
  """A paired difference ``+m ± s``; one seed: ``+m (1 seed)`` (no spread, not ``± inf``)."""
  if seeds == 1:
    return f"{scale * mean:+.{digits}f} (1 seed)"
  return f"{scale * mean:+.{digits}f} ± {scale * std:.{digits}f}"


def verdict(a: Sequence[float], b: Sequence[float], *, expect_greater: bool,
            what: str) -> dict[str, Any]:
  """SPEC.md's rule on paired per-seed values: the claim is ``a > b`` (or ``a < b``).

  Reproduced only if the mean paired difference has the claimed sign and exceeds
  two standard deviations of the paired differences (ddof=1). With one seed
  nothing can be reproduced.
  """
  d = np.asarray(a, float) - np.asarray(b, float)
  m = float(d.mean())
  s = float(d.std(ddof=1)) if len(d) > 1 else float("inf")
  ok = (m > 0) == expect_greater and abs(m) > 2 * s and len(d) > 1
  return {"claim": what, "mean_diff": m, "std_diff": s, "seeds": len(d),
          "verdict": "reproduced" if ok else "not reproduced at this scale"}


def verdict_lines(verdicts: Sequence[dict[str, Any]]) -> list[str]:
  def spread(v):
    if v["seeds"] == 1:
      return "1 seed: no spread, so nothing can be reproduced"
    return f"std {v['std_diff']:.3g}, {v['seeds']} seeds"

  return [f"- **{v['verdict']}**: {v['claim']} (mean paired difference {v['mean_diff']:.4g}, "
          f"{spread(v)})" for v in verdicts]


def averaging_comm(opt_state) -> dict[str, int]:
  """Parameter syncs, their payload, and scalar syncs of a periodic_averaging state (worker 0)."""
  from mfopt import averaging
  s = averaging.find_averaging_state(opt_state)
  first = lambda x: int(np.asarray(jax.device_get(x)).reshape(-1)[0])  # noqa: E731
  return {"param_syncs": first(s.param_comm.count), "param_bytes": first(s.param_comm.payload_bytes),
          "scalar_syncs": first(s.scalar_comm.count)}

