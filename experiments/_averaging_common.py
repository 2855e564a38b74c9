"""Helpers shared by the seed 001/003 experiments (periodic averaging, block momentum).

Kept thin: schedules, one training run, seed statistics, the paper-claim verdict
rule of SPEC.md, and cost-model projections (always labelled "projected").

A run that diverges (``mfopt.train.fit`` raises :class:`mfopt.train.NonFiniteError`)
is an outcome, not an abort: :func:`run` returns a :class:`RunResult` with
``diverged`` set, ``nan`` metrics and no state, :func:`fmt_ms` leaves it out of
the mean and counts it, and :func:`verdict` says "not reproduced at this scale"
for any claim that involves it (the seed 000 scripts' ``_mf_common.run_cell`` rule).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from mfopt import comm, parallel, report, train
from mfopt import models as models_lib
from mfopt.report import mean_std  # noqa: F401 (re-exported for the seed 001/003 scripts)

NOT_REPRODUCED = "not reproduced at this scale"

@dataclasses.dataclass(frozen=True)
class RunResult:
  """One run's outcome: ``train.FitResult``'s fields, or a divergence.

  Attributes:
    summary: ``train.fit``'s summary plus ``diverged`` (false), ``error`` and
      ``diverged_at_step`` (``None``): the keys a diverged run's has. A diverged run's
      is ``train.diverged_summary``'s: the same keys, ``nan`` for every metric,
      counter and timing, the planned ``steps``/``num_workers``/``per_worker_batch``,
      ``error`` (the first line of the error) and ``diverged_at_step``.
    history: the logged rows; empty for a diverged run (the rows it logged before
      diverging are in ``metrics.jsonl``).
    state: the final ``train.TrainState``; ``None`` for a diverged run.
    error: the first line of the ``NonFiniteError`` message, or ``None``.
  """

  summary: dict[str, Any]
  history: list[dict[str, Any]]
  state: train.TrainState | None
  error: str | None = None

  @property
  def diverged(self) -> bool:
    return self.error is not None


def step_decay(peak: float, num_steps: int) -> optax.Schedule:
  """Seed 001's schedule: x0.1 at 50% and again at 75% of the steps."""
  return optax.piecewise_constant_schedule(
      peak, {int(num_steps * 0.5): 0.1, int(num_steps * 0.75): 0.1})


def adpsgd_warmup_steps(c, steps_per_epoch: int) -> int:
  """ADPSGD's warm-up in steps (``round(c.warmup_epochs x steps_per_epoch)``), refused where it
  covers the whole run: ADPSGD then averages every step throughout, the FULLSGD row, and its
  comparisons were judged anyway (``warmup_epochs=2`` on digits: 44 steps of a 20-step run)."""
  from mfopt import runner  # noqa: PLC0415
  warmup = int(round(c.warmup_epochs * steps_per_epoch))
  if warmup >= c.num_steps:
    raise runner.ConfigError(
        f"config field 'warmup_epochs' = {c.warmup_epochs!r} is {warmup} steps "
        f"({steps_per_epoch} per epoch) of a num_steps={c.num_steps} run: ADPSGD would average "
        f"every step (FULLSGD); use warmup_epochs < "
        f"{(c.num_steps - 0.5) / steps_per_epoch:.4g}")  # (round(T x spe) < num_steps)
  return warmup


def mesh_for(num_workers: int):
  """The largest mesh whose size divides ``num_workers`` (P = 6 on 8 devices: 6; on 2 processes
  x 4 devices: 3 + 3), as :func:`mfopt.parallel.worker_mesh`."""
  return parallel.worker_mesh(num_workers)


def run(*, dataset, model_name: str, tx: optax.GradientTransformation, num_workers: int,
        per_worker_batch: int, num_steps: int, seed: int, log_every: int, progress: bool,
        desc: str, schedule: optax.Schedule | None = None, on_log=None,
        model_kwargs: dict[str, Any] | None = None, eval_every: int | None = None) -> RunResult:
  """One ``train.fit`` run on a model from the registry; a divergence is returned, not raised.

  Returns:
    A :class:`RunResult`. If ``fit`` raised ``NonFiniteError`` (a non-finite loss
    or update), ``result.diverged`` is true, the summary's metrics are ``nan``,
    ``result.error`` holds the error's first line and ``result.state`` is ``None``;
    a line naming the run goes to stderr. Rerunning in the same workdir trains it
    again from its last good checkpoint and diverges again (deterministic), so
    the experiment still finishes and reports it.
  """
  model = models_lib.get_model(model_name, num_classes=dataset.num_classes, **(model_kwargs or {}))
  try:
    res = train.fit(model=model, tx=tx, dataset=dataset, num_workers=num_workers,
                    per_worker_batch=per_worker_batch, num_steps=num_steps,
                    mesh=mesh_for(num_workers), seed=seed, log_every=log_every,
                    learning_rate=schedule, progress=progress, desc=desc, on_log=on_log,
                    eval_every=eval_every)
  except train.NonFiniteError as e:
    summary = train.diverged_summary(e, num_steps=num_steps, num_workers=num_workers,
                                     per_worker_batch=per_worker_batch)
    print(f"{desc}: diverged: {summary['error']}", file=sys.stderr)
    return RunResult(summary=summary, history=[], state=None, error=summary["error"])
  return RunResult(summary={**res.summary, "diverged": False, "error": None,
                            "diverged_at_step": None}, history=res.history, state=res.state)


def fmt_ms(values: Sequence[float], digits: int = 4, *,
           diverged: Sequence[bool] | None = None) -> str:
  """``mean ± std`` over seeds; one seed has no spread: ``value (1 seed)``.

  Seeds flagged in ``diverged`` are left out of the mean and counted:
  ``0.9100 ± 0.0100 (1/3 diverged)``, ``0.9100 (1 seed; 1/2 diverged)``, or
  ``diverged (2/2)`` when every seed diverged (never a number from a diverged run).
  """
  flags = [False] * len(values) if diverged is None else [bool(d) for d in diverged]
  if len(flags) != len(values):
    raise ValueError(f"fmt_ms: {len(values)} values but {len(flags)} diverged flags")
  kept = [float(v) for v, d in zip(values, flags) if not d]
  k, n = sum(flags), len(values)
  if n == 0:
    return "n/a"
  if not kept:
    return f"diverged ({k}/{n})"
  notes = ["1 seed"] if len(kept) == 1 else []
  if k:
    notes.append(f"{k}/{n} diverged")
  if len(kept) == 1:
    text = f"{kept[0]:.{digits}f}"
  else:
    m, s = mean_std(kept)
    text = f"{m:.{digits}f} ± {s:.{digits}f}"
  return text + (f" ({'; '.join(notes)})" if notes else "")


def fmt_diff(mean: float, std: float, seeds: int, scale: float = 1.0, digits: int = 2) -> str:
  """A paired difference ``+m ± s``; one seed: ``+m (1 seed)`` (no spread, not ``± inf``).

  No finite pair (``seeds == 0`` or a ``nan`` mean, e.g. every seed diverged): ``n/a``.
  """
  if seeds == 0 or not math.isfinite(mean):
    return "n/a"
  if seeds == 1:
    return f"{scale * mean:+.{digits}f} (1 seed)"
  return f"{scale * mean:+.{digits}f} ± {scale * std:.{digits}f}"


def verdict(a: Sequence[float], b: Sequence[float], *, expect_greater: bool, what: str,
            diverged: Sequence[bool] | None = None) -> dict[str, Any]:
  """SPEC.md's rule on paired per-seed values: the claim is ``a > b`` (or ``a < b``).

  Reproduced only if the mean paired difference has the claimed sign and exceeds
  two standard deviations of the paired differences (ddof=1). With one seed
  nothing can be reproduced. A seed flagged in ``diverged`` (a run of its pair
  diverged) or whose pair is not finite (``nan``) is left out of the statistics
  and makes the verdict "not reproduced at this scale", whatever the other seeds
  say, with the reason in ``reason`` (e.g. ``1 of 3 seeds had a diverged run``).

  Args:
    a: per-seed values of the side the claim says is larger (if ``expect_greater``).
    b: per-seed values of the other side, paired with ``a`` by position.
    expect_greater: the claim is ``a > b`` (else ``a < b``).
    what: the claim, as the report states it.
    diverged: optional per-seed flags, true where a run of that seed's pair diverged.

  Returns:
    ``{"claim", "mean_diff", "std_diff", "seeds", "excluded", "reason", "verdict"}``:
    mean and std of the differences over the ``seeds`` pairs used (``nan`` if none),
    the number of ``excluded`` seeds and why (``None`` if none).
  """
  a, b = np.asarray(a, float).reshape(-1), np.asarray(b, float).reshape(-1)
  flags = np.zeros(a.shape, bool) if diverged is None else np.asarray(diverged, bool).reshape(-1)
  if not a.shape == b.shape == flags.shape:
    raise ValueError(f"verdict: {a.size} and {b.size} values and {flags.size} diverged flags "
                     "must pair up by seed")
  nonfinite = ~(np.isfinite(a) & np.isfinite(b)) & ~flags
  bad = flags | nonfinite
  d = (a - b)[~bad]
  m = float(d.mean()) if d.size else math.nan
  s = float(d.std(ddof=1)) if d.size > 1 else (math.inf if d.size else math.nan)
  ok = not bad.any() and d.size > 1 and (m > 0) == expect_greater and abs(m) > 2 * s
  reasons = []
  if flags.any():
    reasons.append(f"{int(flags.sum())} of {a.size} seed(s) had a diverged run")
  if nonfinite.any():
    reasons.append(f"{int(nonfinite.sum())} of {a.size} seed(s) had a non-finite value")
  return {"claim": what, "mean_diff": m, "std_diff": s, "seeds": int(d.size),
          "excluded": int(bad.sum()), "reason": "; ".join(reasons) or None,
          "verdict": "reproduced" if ok else NOT_REPRODUCED}


def no_verdict(what: str, reason: str) -> dict[str, Any]:
  """A claim that could not be tested at all (e.g. every candidate run diverged)."""
  return {"claim": what, "mean_diff": math.nan, "std_diff": math.nan, "seeds": 0,
          "excluded": 0, "reason": reason, "verdict": NOT_REPRODUCED}


def verdict_lines(verdicts: Sequence[dict[str, Any]]) -> list[str]:
  """One markdown bullet per verdict: the verdict, its reason if any, the claim, the numbers."""
  def numbers(v):
    if v["seeds"] == 0:
      return "no finite pair"
    other = " other" if v.get("excluded") else ""
    if v["seeds"] == 1:
      spread = f"1{other} seed: no spread, so nothing can be reproduced"
    else:
      spread = f"std {v['std_diff']:.3g}, {v['seeds']}{other} seeds"
    return f"mean paired difference {v['mean_diff']:.4g}, {spread}"

  return [f"- **{v['verdict']}**" + (f" ({v['reason']})" if v.get("reason") else "")
          + f": {v['claim']} ({numbers(v)})" for v in verdicts]


def pick_best(candidates: Mapping[str, Sequence[Mapping[str, Any]]],
              metric: str = "test_accuracy") -> str | None:
  """The candidate (e.g. a learning rate) with the highest mean ``metric`` over its seeds.

  ``candidates`` maps a name to its per-seed rows (each with ``metric`` and
  ``diverged``). Diverged seeds are never a candidate's value: candidates that
  diverged on fewer seeds rank first (one that never diverged beats one that
  sometimes did, whatever their means), then by the mean over the seeds that did
  not diverge. ``None`` when every candidate diverged on every seed.
  """
  scored = []
  for name, rows in candidates.items():
    kept = [float(r[metric]) for r in rows if not r["diverged"]]
    if kept:
      scored.append((len(rows) - len(kept), -float(np.mean(kept)), name))
  return min(scored, key=lambda t: t[:2])[2] if scored else None


def diverged_lines(runs: Sequence[tuple[str, Mapping[str, Any]]],
                   left_out_of: str = "every mean") -> list[str]:
  """A report section listing each diverged run (``label``, its row's ``error``); empty if none.

  ``left_out_of`` names what the report leaves diverged runs out of (its means, best choices).
  """
  return report.diverged_section(
      runs, f"They are left out of {left_out_of}, and every claim involving them is "
      f"{NOT_REPRODUCED}.")


def averaging_comm(opt_state) -> dict[str, int]:
  """Parameter syncs, their payload, and scalar syncs of a periodic_averaging state (worker 0)."""
  from mfopt import averaging
  s = averaging.find_averaging_state(opt_state)
  first = lambda x: int(np.asarray(jax.device_get(x)).reshape(-1)[0])  # noqa: E731
  return {"param_syncs": first(s.param_comm.count), "param_bytes": comm.payload_of(s.param_comm),
          "scalar_syncs": first(s.scalar_comm.count)}

