"""Shared pieces of the seed-002 experiments: the strategy registry, one run, time-to-target, seeds.

The experiments (``experiments/async_convergence.py``, ``async_scaling.py``,
``ksync_trace.py``, ``bb_lr.py``) stay thin: they build a config with
:func:`base_config`, call :func:`run` per (strategy, network, seed, workers)
and tabulate with :func:`aggregate`.

Timing emulation (a *simulation*, stated in every report): the optimisation
runs on a small model (an MLP on mnist1d), while the simulated compute time and
message size can be set to a paper benchmark's (``compute_s``,
``payload_params``). The default full presets use ResNet101/Cifar100 from the
seed: 44,707,176 float32 parameters (Table 2) and 0.89 s of computation per
local step (Table 4, GPU cluster). ``payload_params = 0`` uses the real model's size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from mfopt import costmodel
from mfopt import data as data_lib
from mfopt import models as models_lib
from mfopt import report
from mfopt.sim import clock, presets, run as run_lib, server

RESNET101_PARAMS = 44_707_176  # seed Table 2
RESNET101_COMPUTE_S = 0.89     # seed Table 4, GPU cluster, seconds of computation per local step


def _base(c) -> server.BaseSGD:
  return server.BaseSGD(c.learning_rate, c.decay_rate, c.momentum if c.momentum > 0 else None)


def ksync_variant(preset: str, *, k: int | str = "adaptive", bb: bool = True, label: str | None = None,
                  **overrides) -> Callable[[Any], server.Strategy]:
  """A factory for the seed's model with a fixed ``k`` and/or the decay schedule instead of BB.

  ``overrides`` are further :class:`KSyncConfig` fields (e.g. ``stale_merge="reaverage"``).
  """
  def make(c):
    over: dict[str, Any] = {"k_rule": k, **overrides}
    if not bb:
      over.update(bb=None, lr_fallback=_base(c))
    return presets.ksync_preset(preset, alpha0=c.learning_rate, label=label, **over)
  return make


#: name -> factory(config) of a fresh strategy. Fixed-k and decay-schedule variants of the seed's
#: model are built by :func:`ksync_variant` too.
STRATEGIES: Mapping[str, Callable[[Any], server.Strategy]] = {
    "ASP": lambda c: server.ASP(_base(c)),
    "BSP": lambda c: server.BSP(_base(c)),
    "SSP": lambda c: server.SSP(c.ssp_staleness, _base(c)),
    "EASGD": lambda c: server.EASGD(c.easgd_interval, _base(c)),
    "DropWorker": lambda c: server.DropWorker(c.drop_rate, _base(c)),
    "all-reduce": lambda c: server.AllReduce(_base(c)),
    "KSync[faithful]": ksync_variant("faithful"),
    "KSync[working]": ksync_variant("working"),
    "KSync[working,reaverage]": ksync_variant("working", stale_merge="reaverage"),
}


#: The names the simulator experiments can build (its MLP on class labels); an experiment's
#: ``CHOICES``, which the runner checks before anything runs.
CHOICES = {"dataset": data_lib.classification_datasets}


def base_config(quick: bool) -> ml_collections.ConfigDict:
  """Fields every simulator experiment shares (the experiment adds its own)."""
  c = ml_collections.ConfigDict()
  c.dataset = "mnist1d"
  c.hidden = (32,) if quick else (128, 128)
  c.num_workers = 4 if quick else 16
  c.per_worker_batch = 16 if quick else 32
  c.epochs = 2.0 if quick else 30.0
  c.eval_every_epochs = 0.5
  c.learning_rate = 0.1    # LR of every baseline and α_0 of the BB step
  c.decay_rate = 0.99      # DR per epoch (Table 3)
  c.momentum = 0.0         # baselines' momentum (0 = plain SGD, spec §5)
  c.ssp_staleness = 3
  c.easgd_interval = 10
  c.drop_rate = 0.5
  c.compute_s = 0.01 if quick else RESNET101_COMPUTE_S
  c.payload_params = 0 if quick else RESNET101_PARAMS
  c.speed_spread = 0.3     # per-worker speed factors exp(0.3 z)
  c.jitter_sigma = 0.2     # lognormal jitter per step
  c.straggler_prob = 0.02
  c.straggler_slowdown = 4.0
  c.duplex = True
  c.seeds = (0,) if quick else (0, 1, 2)
  c.target_accuracy = 0.3 if quick else 0.45
  c.progress = not quick
  return c


def validate_base(c, strategies: Sequence[str] = ()) -> None:
  from mfopt import runner  # pylint: disable=g-import-not-at-top
  runner.require_positive(c, "num_workers", "per_worker_batch", "epochs", "eval_every_epochs",
                          "learning_rate", "compute_s", "target_accuracy")
  runner.require_choice(c, "dataset", tuple(data_lib.registered()))
  if c.eval_every_epochs > c.epochs:  # (accepted: the final evaluation was then the only one,
    # and every time to target was the run's whole simulated time)
    raise runner.ConfigError(f"config field 'eval_every_epochs' must be <= epochs={c.epochs:g}, "
                             f"got {c.eval_every_epochs:g}")
  for name in strategies:
    if name not in STRATEGIES:
      raise runner.ConfigError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
  if not 0 < c.decay_rate <= 1:
    raise runner.ConfigError(f"config field 'decay_rate' must be in (0, 1], got {c.decay_rate!r}")
  if c.payload_params < 0:
    raise runner.ConfigError(f"config field 'payload_params' must be >= 0, got {c.payload_params!r}")


def load(c):
  ds = data_lib.load(c.dataset)
  model = models_lib.get_model("mlp", hidden=tuple(c.hidden), num_classes=ds.num_classes)
  return ds, model


def run(c, strategy: server.Strategy, *, dataset, model, network: str | None, seed: int,
        num_workers: int | None = None, epochs: float | None = None, desc: str | None = None,
        on_log: Callable[[dict[str, Any]], None] | None = None) -> run_lib.SimResult:
  """One simulated run of ``strategy`` for ``epochs`` of data (equal samples across strategies).

  A run that diverged (``summary["diverged"]``: a non-finite test loss stopped it) has ``nan``
  for its final ``test_accuracy``, ``test_loss`` and ``final_train_loss`` (the accuracy of a
  non-finite model is a constant prediction's, not a result); its history keeps what was
  logged. Per-seed rows carry ``diverged`` so :func:`aggregate` and :func:`pm` count it.
  """
  n = len(dataset.train)
  m = num_workers or c.num_workers
  compute = clock.ComputeModel(c.compute_s, speed_spread=c.speed_spread, jitter_sigma=c.jitter_sigma,
                               straggler_prob=c.straggler_prob,
                               straggler_slowdown=c.straggler_slowdown)
  res = run_lib.simulate(
      strategy, model=model, dataset=dataset, num_workers=m, per_worker_batch=c.per_worker_batch,
      max_samples=int((epochs or c.epochs) * n), seed=seed, compute=compute, network=network,
      duplex=c.duplex, payload_bytes=4 * c.payload_params if c.payload_params else None,
      eval_every_samples=max(1, int(c.eval_every_epochs * n)), progress=c.progress, desc=desc,
      on_log=on_log)
  if res.summary["diverged"]:
    res.summary.update(test_accuracy=float("nan"), test_loss=float("nan"),
                       final_train_loss=float("nan"))
  return res


#: What every time in the simulated experiments' results.json is (``time_to_target``,
#: ``time_per_local_step``, the lr/k traces' times ...): written next to them as ``time_unit``
#: so the JSON read on its own does not pass for measured time.
TIME_UNIT = "simulated seconds (mfopt.sim's virtual clock, not measured)"


def to_target(result: run_lib.SimResult, target: float) -> dict[str, float]:
  """Server steps, simulated time, samples and worker steps at the first evaluation reaching ``target``.

  ``worker_steps_to_target`` is the mean training step count of a worker then, samples /
  (M b): the seed's "training steps (counted by the worker)", comparable across algorithms.
  ``steps_to_target`` counts server updates, which are not: ASP's server steps once per
  gradient, k-sync once per k gradients. ``target_at_first_eval``: the first evaluation already
  reached it, so these values are only the grid's first point (an upper bound; see
  :func:`first_eval_lines`).
  """
  row = result.first_reaching(target)
  if row is None:
    return {"steps_to_target": float("nan"), "time_to_target": float("nan"),
            "samples_to_target": float("nan"), "worker_steps_to_target": float("nan"),
            "target_at_first_eval": False}
  s = result.summary
  return {"steps_to_target": float(row["server_step"]), "time_to_target": float(row["sim_time"]),
          "samples_to_target": float(row["samples"]),
          "worker_steps_to_target": float(row["samples"]) / (s["num_workers"]
                                                             * s["per_worker_batch"]),
          "target_at_first_eval": row is result.history[0]}


def per_step_times(result: run_lib.SimResult) -> dict[str, float]:
  """Table 4 analogue: simulated time per local step split into computation ("Cp") and the rest
  ("Cu").

  ``Cp`` is the mean simulated compute time of the local steps actually drawn
  (``summary["compute_s_per_step"]``: speed factors, jitter and stragglers are not mean-one, and
  a BB worker's step includes its Armijo trials and exact-ν gradient); ``Cu`` = time per local
  step - Cp: communication, queueing on the server link, and waiting at barriers.
  """
  s = result.summary
  local = float(np.mean(s["worker_steps"]))
  per_step = s["sim_time_s"] / local if local else float("nan")
  cp = s["compute_s_per_step"]
  return {"time_per_local_step": per_step, "cp_per_local_step": cp,
          "cu_per_local_step": per_step - cp}


def aggregate(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], fields: Sequence[str]
              ) -> list[dict[str, Any]]:
  """Groups ``rows`` by ``keys``; for each field gives ``<f>_mean``, ``<f>_std`` (over finite values)
  and ``<f>_n`` (how many seeds had a finite value); ``diverged`` counts rows whose run
  diverged (their ``diverged`` field, :func:`run`)."""
  groups: dict[tuple, list[Mapping[str, Any]]] = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  out = []
  for key, rs in groups.items():
    row: dict[str, Any] = dict(zip(keys, key))
    row["seeds"] = len(rs)
    row["diverged"] = sum(bool(r.get("diverged")) for r in rs)
    row["target_at_first_eval"] = sum(bool(r.get("target_at_first_eval")) for r in rs)
    for f in fields:
      vals = [float(r[f]) for r in rs if r.get(f) is not None and np.isfinite(float(r[f]))]
      mean, std = report.mean_std(vals) if vals else (float("nan"), float("nan"))
      row[f + "_mean"], row[f + "_std"], row[f + "_n"] = mean, std, len(vals)
    out.append(row)
  return out


def first_eval_lines(table: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
  """A report line naming the :func:`aggregate` groups (by ``keys``) whose runs reached the
  target at their first evaluation, or none. Their to-target values are the evaluation grid's
  first point, an upper bound: every ASP run of ``async_scaling dataset=digits`` reached 0.3 at
  0.5 epoch, so its "speedup in worker steps" was exactly M, and a paired difference of
  exactly one evaluation interval came out "± 0"."""
  hits = [r for r in table if r.get("target_at_first_eval")]
  if not hits:
    return []
  names = "; ".join(" ".join(f"{k}={r[k]}" for k in keys)
                    + f" ({r['target_at_first_eval']}/{r['seeds']} seeds)" for r in hits)
  return [f"- **Reached the target at the first evaluation**: {names}. Their time, samples "
          "and steps to target are the first point of the evaluation grid (an upper bound), so "
          "comparisons among them are resolved only to one evaluation interval; raise "
          "target_accuracy or evaluate more often (eval_every_epochs).\n"]


def pm(row: Mapping[str, Any], field: str, digits: int = 3) -> str:
  """``mean ± std (n/seeds)`` cell; diverged runs (simulation stopped) are counted in it."""
  m, s, n = row[field + "_mean"], row[field + "_std"], row[field + "_n"]
  d = row.get("diverged", 0)
  div = f"; {d} diverged" if d else ""
  if not n:
    return f"diverged ({d}/{row['seeds']})" if d == row["seeds"] else \
        f"not reached (0/{row['seeds']}{div})"
  if n == 1:  # one value has no spread
    return (f"{m:.{digits}g} (1/{row['seeds']} seeds{div})" if row["seeds"] > 1
            else f"{m:.{digits}g} (1 seed)")
  tail = f" ({n}/{row['seeds']}{div})" if n != row["seeds"] else ""
  return f"{m:.{digits}g} ± {s:.2g}{tail}"


def per_seed(rows: Sequence[Mapping[str, Any]], field: str, **match: Any) -> dict[int, float]:
  """``{seed: row[field]}`` over the per-seed ``rows`` whose keys equal ``match``."""
  return {int(r["seed"]): float(r[field]) for r in rows
          if all(r[k] == v for k, v in match.items())}


def paired_claim(ours: Mapping[int, float], baseline: Mapping[int, float],
                 lower_is_better: bool = True, nan_means: str = "missed the target") -> str:
  """The protocol's verdict on "ours beats the baseline", on per-seed pairs (SPEC.md).

  Reproduced only if the mean paired difference (same seed) has the claimed sign and exceeds
  two standard deviations of the differences (ddof=1), as the other experiments' verdicts.
  NaN means "never reached the target": ours must reach it in every seed; a seed where only
  the baseline missed it is not a pair (said in the verdict), and a baseline that never
  reached it while ours always did is reproduced. One seed has no spread: never reproduced.
  ``nan_means="diverged"`` (a metric such as accuracy, NaN only when a run diverged): a
  diverged run on either side makes the claim not reproduced, as in the other experiments
  (a baseline that diverged in every seed was "reproduced: ours reached the target").
  """
  seeds = sorted(set(ours) & set(baseline))
  n = len(seeds)
  if n == 0:
    return "not decidable (no seeds)"
  a = np.array([ours[s] for s in seeds], float)
  b = np.array([baseline[s] for s in seeds], float)
  if nan_means == "diverged":
    bad = int((~np.isfinite(a)).sum() + (~np.isfinite(b)).sum())
    if bad:
      return f"not reproduced at this scale ({bad} of {2 * n} runs diverged)"
  elif nan_means != "missed the target":
    raise ValueError(f"nan_means must be 'missed the target' or 'diverged', got {nan_means!r}")
  if not np.isfinite(a).all():
    return (f"not reproduced at this scale (ours reached the target in "
            f"{int(np.isfinite(a).sum())}/{n} seeds)")
  if n < 2:
    return "not reproduced at this scale (1 seed: no spread)"
  both = np.isfinite(b)
  if not both.any():
    return f"reproduced (ours reached the target in all {n} seeds, the baseline in none)"
  note = "" if both.all() else f"; the baseline reached the target in {int(both.sum())}/{n} seeds"
  if both.sum() < 2:
    return f"not reproduced at this scale (fewer than 2 paired seeds{note})"
  d = (b - a) if lower_is_better else (a - b)
  d = d[both]
  mean, std = float(d.mean()), float(d.std(ddof=1))
  if mean > 0 and mean > 2 * std:
    return f"reproduced{' (' + note[2:] + ')' if note else ''}"
  return f"not reproduced at this scale{' (' + note[2:] + ')' if note else ''}"


def holds_in_every_seed(values: Mapping[int, bool]) -> str:
  """Verdict of a qualitative claim checked per seed: reproduced only if it holds in every one
  of at least two seeds."""
  n, k = len(values), sum(bool(v) for v in values.values())
  if n < 2:
    return f"{'consistent' if k else 'not seen'} in 1 seed (not a test: the protocol needs several)"
  return "reproduced" if k == n else f"not reproduced at this scale (holds in {k}/{n} seeds)"


_PRESET_TEXT = {"faithful": "`faithful` (spec defaults)",
                "working": "`working` (dampened momentum, exact ν, k_max = 8, α floor)"}


def _presets_text(c) -> str:
  """The k-sync presets this run used: its ``presets`` field, or those its ``strategies`` name
  (``KSync[working,reaverage]``); it listed both whatever ran."""
  if "presets" in c:
    names = tuple(c.presets)
  else:
    found = (re.match(r"KSync\[(\w+)", name) for name in c.get("strategies", ()))
    names = tuple(dict.fromkeys(m.group(1) for m in found if m))
  if not names:
    return "no k-sync preset ran."
  return ("presets " if len(names) > 1 else "preset ") + " and ".join(
      _PRESET_TEXT.get(n, f"`{n}`") for n in names) + "."


def setup_lines(c, ds, model_desc: str, networks: Sequence[Any], extra: str = "") -> list[str]:
  """Report header lines every simulator experiment shares."""
  env = report.environment()
  payload = (f"{c.payload_params:,} float32 parameters ({4 * c.payload_params / 1e6:.1f} MB, "
             "ResNet101 of seed Table 2)" if c.payload_params else "the real model's float32 parameters")
  return [
      report.environment_markdown(env),
      "- **All times are simulated time** (mfopt.sim virtual clock), never measured; gradients "
      "are real computations on this machine.",
      f"- Dataset: {c.dataset}, {len(ds.train):,} train / {len(ds.test):,} test examples; "
      f"model: {model_desc}.",
      f"- Workers: {c.num_workers}; per-worker batch {c.per_worker_batch}; budget {c.epochs:g} "
      f"epochs = {int(c.epochs * len(ds.train)):,} samples per run (equal for every algorithm); "
      f"seeds {tuple(c.seeds)}; evaluation every {c.eval_every_epochs:g} epoch.",
      f"- Simulated compute {c.compute_s:g} s per local step (speed factors exp({c.speed_spread:g} z), "
      f"lognormal jitter {c.jitter_sigma:g}, stragglers p={c.straggler_prob:g} x{c.straggler_slowdown:g}; "
      "a BB worker (seed's model) also pays 1/3 of a step per Armijo trial and, with exact ν, one "
      "more gradient; server updates and k-tests take no simulated time); "
      f"message size: {payload}; networks: "
      + "; ".join(costmodel.link(n).describe() if isinstance(n, (str, costmodel.Link)) else str(n)
                  for n in networks) + " (mfopt.costmodel presets; the server link is shared "
      f"and {'full' if c.duplex else 'half'}-duplex).",
      f"- Baselines: SGD lr {c.learning_rate:g} x {c.decay_rate:g}^epoch"
      + (f", momentum {c.momentum:g}" if c.momentum else ", no momentum")
      + f"; SSP s={c.ssp_staleness}; EASGD interval {c.easgd_interval}; DropWorker drop "
      f"{c.drop_rate:g}. Seed's model: α_0 = {c.learning_rate:g}; "
      + _presets_text(c),
      extra,
  ]
