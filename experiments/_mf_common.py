"""Shared pieces of the seed 000 (MF) experiments: optimizers, meshes, one training cell, tables.

Not an experiment itself (the leading underscore keeps the runner from listing it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

import mfopt
from mfopt import parallel, report, train

OPTIMIZERS = ("sgd", "nag", "adam")
OPTIMIZER_LABELS = {"sgd": "SGD (mf_sgd, Alg. 1)", "nag": "NAG (mf_nesterov)",
                    "adam": "Adam (mf_adam, Alg. 2, phi=adam)"}


def make_optimizer(name: str, learning_rate: float, mf: float, mf2: float = 0.999,
                   axis_name: Any = parallel.WORKER_AXES) -> optax.GradientTransformation:
  """Synchronous data-parallel MF optimizer: all-reduce of gradients, then Alg. 1 / NAG / Alg. 2.

  The parameter-server of the seed (Algorithms 3/4) applies one update per step
  from the gradients of all workers; with synchronous all-reduce every worker
  applies that same update (SPEC.md: same mathematics, no server).

  The hyperparameters are injected as state (``optax.inject_hyperparams``), so runs
  that differ only in lr or MF compile to the same program and share the compilation
  cache; the update is the same function of them. The plain constructor is called
  once first, so a bad lr or MF raises ``ValueError`` here, before anything compiles
  (inside ``inject_hyperparams`` the values are traced and cannot be checked).
  """
  factories = {"sgd": lambda: mfopt.mf_sgd(learning_rate, mf=mf),
               "nag": lambda: mfopt.mf_nesterov(learning_rate, mf=mf),
               "adam": lambda: mfopt.mf_adam(learning_rate, mf1=mf, mf2=mf2)}
  if name in factories:
    factories[name]()  # validation only
  if name == "sgd":
    inner = optax.inject_hyperparams(mfopt.mf_sgd)(learning_rate=learning_rate, mf=mf)
  elif name == "nag":
    inner = optax.inject_hyperparams(mfopt.mf_nesterov)(learning_rate=learning_rate, mf=mf)
  elif name == "adam":
    inner = optax.inject_hyperparams(mfopt.mf_adam)(learning_rate=learning_rate, mf1=mf, mf2=mf2)
  else:
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
  return optax.chain(mfopt.sync_gradients(axis_name), inner)


def mesh_for(num_workers: int) -> tuple[Any, str]:
  """A mesh whose device count divides ``num_workers``, and a note saying which was used.

  :func:`mfopt.parallel.worker_mesh`: all devices when ``num_workers`` is a multiple of
  their count; otherwise the largest mesh ``num_workers`` split over evenly, with as many
  devices from each process (e.g. 1 worker on a 1-device mesh). Raises ``ValueError`` in a
  job of several processes when ``num_workers`` is not a multiple of their count
  (:func:`mfopt.runner.require_process_multiple` says so before anything trains).
  """
  mesh = parallel.worker_mesh(num_workers)
  g, d = mesh.devices.size, jax.device_count()
  if g == d:
    return mesh, f"{d} device(s)"
  procs = jax.process_count()
  per = f", {g // procs} per process" if procs > 1 else ""
  return mesh, f"{g} of {d} device(s) (W not a multiple of {d}{per})"


def run_cell(*, model, dataset, optimizer: str, learning_rate: float, mf: float, num_workers: int,
             per_worker_batch: int, num_steps: int, seed: int, log_every: int,
             progress: bool, desc: str, on_log: Callable[[dict], None] | None = None,
             mf2: float = 0.999, train_set_loss: bool = False) -> dict[str, Any]:
  """Trains one configuration; returns its summary, with ``diverged=True`` on a non-finite loss.

  ``final_train_loss`` is ``fit``'s: the mean minibatch loss of the last logging window, whose
  length in samples depends on the batch and on where the run's steps fall against
  ``log_every``. ``train_set_loss=True`` adds ``train_set_loss``: the final (worker-averaged)
  model's loss over the whole training set in inference mode, the same examples for every
  cell, so comparable across batch sizes (``nan`` for a diverged run).

  A diverged run (``mfopt.train.fit`` raises ``NonFiniteError``) is recorded with
  ``mfopt.train.diverged_summary`` (``nan`` metrics, its error and first non-finite
  step) instead of stopping the whole grid, as the paper's tables also report runs
  that did not converge; a line naming it goes to stderr.
  """
  mesh, mesh_note = mesh_for(num_workers)
  tx = make_optimizer(optimizer, learning_rate, mf, mf2)
  try:
    result = train.fit(
        model=model, tx=tx, dataset=dataset, num_workers=num_workers,
        per_worker_batch=per_worker_batch, num_steps=num_steps, mesh=mesh, seed=seed,
        log_every=min(log_every, num_steps), progress=progress, desc=desc, on_log=on_log,
        run_info={"optimizer": optimizer, "learning_rate": learning_rate, "mf": mf, "mf2": mf2})
    out = {**result.summary, "diverged": False, "error": None, "diverged_at_step": None}
    if train_set_loss:
      params, model_state = train.averaged_model(result.state)
      out["train_set_loss"] = train.evaluate(train.make_eval_fn(model), params, model_state,
                                             dataset.train)["test_loss"]
  except train.NonFiniteError as e:
    out = train.diverged_summary(e, num_steps=num_steps, num_workers=num_workers,
                                 per_worker_batch=per_worker_batch)
    if train_set_loss:
      out["train_set_loss"] = math.nan
    print(f"{desc}: diverged: {out['error']}", file=sys.stderr)
  out.update(optimizer=optimizer, learning_rate=learning_rate, mf=mf, seed=seed, mesh=mesh_note)
  return out


def aggregate(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
              metrics: Sequence[str]) -> list[dict[str, Any]]:
  """Groups ``rows`` by ``keys`` and gives mean/std over seeds of each metric (diverged = nan).

  Each output row has ``<metric>_mean``, ``<metric>_std``, ``<metric>_values``,
  ``seeds`` and ``diverged`` (the count of diverged seeds, excluded from the mean).
  """
  groups: dict[tuple, list[Mapping[str, Any]]] = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  out = []
  for key, members in groups.items():
    agg: dict[str, Any] = dict(zip(keys, key))
    agg["seeds"] = len(members)
    agg["diverged"] = sum(bool(m.get("diverged")) for m in members)
    for metric in metrics:
      vals = [float(m[metric]) for m in members if m.get(metric) is not None]
      finite = [v for v in vals if math.isfinite(v)]
      agg[f"{metric}_values"] = vals
      if finite:
        agg[f"{metric}_mean"], agg[f"{metric}_std"] = report.mean_std(finite)
      else:
        agg[f"{metric}_mean"] = agg[f"{metric}_std"] = math.nan
    out.append(agg)
  return out


def cell_text(agg: Mapping[str, Any] | None, metric: str, digits: int = 3) -> str:
  """``mean ± std`` for a table cell (``n/a`` when skipped, ``diverged`` counts shown)."""
  if agg is None:
    return "skipped"
  mean, std = agg[f"{metric}_mean"], agg[f"{metric}_std"]
  if not math.isfinite(mean):
    return f"diverged ({agg['diverged']}/{agg['seeds']})"
  text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if agg["seeds"] > 1 else "")
  if agg["diverged"]:
    text += f" ({agg['diverged']}/{agg['seeds']} diverged)"
  return text


def grid_table(aggs: Sequence[Mapping[str, Any]], row_key: str, col_key: str, metric: str,
               row_values: Sequence[Any], col_values: Sequence[Any], row_label: str,
               col_fmt: Callable[[Any], str], extra: Mapping[Any, str] | None = None) -> str:
  """A markdown table in the layout of the paper's tables: rows x columns of ``mean ± std``."""
  index = {(a[row_key], a[col_key]): a for a in aggs}
  headers = [row_label] + [col_fmt(c) for c in col_values] + (["lr"] if extra else [])
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  for r in row_values:
    cells = [str(r)] + [cell_text(index.get((r, c)), metric) for c in col_values]
    if extra:
      cells.append(extra.get(r, ""))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def paired_difference(rows: Sequence[Mapping[str, Any]], metric: str,
                      a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
  """``metric(a) - metric(b)`` paired by seed: mean, std over seeds, and whether |mean| > 2 std.

  ``a`` and ``b`` select rows by equality on their keys. Seeds where either run
  diverged are left out (and counted).
  """
  def pick(sel):
    return {r["seed"]: r for r in rows if all(r.get(k) == v for k, v in sel.items())}
  ra, rb = pick(a), pick(b)
  diffs = []
  seeds = sorted(set(ra) & set(rb))
  for s in seeds:
    va, vb = float(ra[s][metric]), float(rb[s][metric])
    if math.isfinite(va) and math.isfinite(vb):
      diffs.append(va - vb)
  excluded = len(seeds) - len(diffs)
  if not diffs:
    return {"mean": math.nan, "std": math.nan, "n": 0, "excluded": excluded,
            "significant": False}
  mean, std = report.mean_std(diffs)
  return {"mean": mean, "std": std, "n": len(diffs), "excluded": excluded,
          "significant": len(diffs) > 1 and abs(mean) > 2 * std}


def claim_verdict(diff: Mapping[str, Any], expected_sign: int) -> str:
  """SPEC.md rule: reproduced only if the paper's sign and |difference| > 2 std (>= 2 seeds)."""
  if diff["n"] == 0 or not math.isfinite(diff["mean"]):
    return "not testable (no finite pair)"
  numbers = (f"{diff['mean']:+.4f} ± {diff['std']:.4f} over {diff['n']} seeds" if diff["n"] > 1
             else f"{diff['mean']:+.4f} (1 seed: no spread)")
  if diff.get("excluded"):  # as the seed 001/003/004 scripts: a diverged run voids the claim
    return f"not reproduced at this scale ({diff['excluded']} seed(s) diverged): {numbers}"
  if diff["n"] < 2:
    return f"not reproduced at this scale (one seed, no std): {numbers}"
  if np.sign(diff["mean"]) == expected_sign and diff["significant"]:
    return f"reproduced: {numbers}"
  return f"not reproduced at this scale: {numbers}"


def steps_for(samples: int, global_batch: int) -> int:
  """Steps that process ``samples`` examples at ``global_batch`` (at least 1; equal samples)."""
  return max(1, int(round(samples / global_batch)))


def sweep_mf(*, model, dataset, mfs: Sequence[float], seeds: Sequence[int], learning_rate: float,
             num_workers: int, global_batch: int, num_steps: int, log_every: int, progress: bool,
             workdir, optimizer: str = "sgd") -> list[dict[str, Any]]:
  """Runs ``optimizer`` for every MF and seed at one (workers, batch) setting; summaries as rows."""
  log = report.JsonlWriter(workdir / "metrics.jsonl")
  rows = []
  for mf in mfs:
    for seed in seeds:
      desc = f"{optimizer}-mf{mf}-s{seed}"
      r = run_cell(model=model, dataset=dataset, optimizer=optimizer, learning_rate=learning_rate,
                   mf=mf, num_workers=num_workers, per_worker_batch=global_batch // num_workers,
                   num_steps=num_steps, seed=seed, log_every=log_every, progress=progress,
                   desc=desc, on_log=lambda row, d=desc, m=mf, s=seed: log(
                       {"run": d, "mf": m, "seed": s, **row}))
      rows.append(r)
      print(f"{desc:24s} test loss {r['test_loss']:.4f} test acc {r['test_accuracy']:.4f}"
            + ("  DIVERGED" if r["diverged"] else ""))
  return rows


def curves_by_mf(workdir, key: str = "train_loss") -> dict[str, tuple[list, list]]:
  """``MF -> (steps, mean over seeds of key)`` from ``metrics.jsonl`` written by :func:`sweep_mf`."""
  rows = report.read_jsonl(workdir / "metrics.jsonl")
  by: dict[float, dict[int, list[float]]] = {}
  for r in rows:
    if key in r:
      by.setdefault(r["mf"], {}).setdefault(r["step"], []).append(float(r[key]))
  out = {}
  for mf, steps in sorted(by.items()):
    xs = sorted(steps)
    out[f"MF {mf}"] = (xs, [float(np.mean(steps[x])) for x in xs])
  return out


def write_claims_report(workdir, lines: list[str], claims: dict[str, str], image: str,
                        caption: str, empty: str | None, *,
                        runs: Sequence[Mapping[str, Any]]) -> None:
  """Appends the diverged runs (if any, with their errors), the paper-claims section (the
  SPEC.md rule) and one plot to ``lines``; writes ``report.md``. ``runs``: every
  :func:`run_cell` row of the report. ``empty``: the line written when no claim could be tested,
  naming the settings the claims need (a generic "needs two MF values" stood under a run of
  three MFs, none of them on the paper's grid), or None for no line."""
  lines = list(lines) + report.diverged_section(
      [(f"{r['optimizer']} MF {r['mf']:g}, {r['num_workers']} worker(s) x batch "
        f"{r['per_worker_batch']}, seed {r['seed']}", r) for r in runs],
      "They are left out of every mean (a cell reads `diverged (k/n)`, or `(k/n diverged)` "
      "beside the mean of the others) and of the paired differences the claims use.")
  lines += ["\n## Paper claims (reproduced only with the paper's sign and |diff| > 2 std)\n"]
  lines += [f"- {k}: **{v}**" for k, v in claims.items()] or ([empty] if empty else [])
  lines.append(f"\n![{caption}]({image})\n")
  (workdir / "report.md").write_text("\n".join(lines) + "\n")


def plot_accuracy_vs_workers(aggs, optimizers, key: str, values, label, path, title: str) -> None:
  """Test accuracy (mean over seeds) against workers: one panel per optimizer, one series per
  value of ``key`` (``label(value)`` names it); cells with no run are left out."""
  panels = {}
  for opt in optimizers:
    series = {}
    for v in values:
      pts = sorted((a["workers"], a["test_accuracy_mean"]) for a in aggs
                   if a["optimizer"] == opt and a[key] == v)
      if pts:
        series[label(v)] = ([p[0] for p in pts], [p[1] for p in pts])
    panels[OPTIMIZER_LABELS[opt]] = series
  report.plot_curves(path, panels, xlabel="workers", ylabel="test accuracy (mean over seeds)",
                     title=title)
