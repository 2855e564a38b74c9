"""mf_batch_workers: seed 000 Tables 2/3 -- validation accuracy over global batch x workers, SGD and Adam.

Command: ``python -m experiments mf_batch_workers [--quick] [--workdir DIR] [key=value ...]``

The paper trains ResNet-50 on CIFAR-10 for 300 epochs on 1..32 GPUs of a parameter
server, global batch 32..2048, lr from the linear scaling rule (0.05 at 128, Table 1)
for both SGD (MF 0.9) and Adam (MF1 0.9, MF2 0.999), BN per GPU. Here, at small scale:
a small CNN with BatchNorm on MNIST-1D (generated locally with enough samples for batch
2048), W virtual workers with per-worker BN statistics (the models' default under the
worker ``vmap``), synchronous all-reduce of gradients then ``mfopt.mf_sgd`` /
``mfopt.mf_adam`` (the parameter server's single update, SPEC.md). Every cell processes
the same number of samples (``epochs``), from the same initialisation and data stream
per seed. ``table.json`` gives, per cell, mean and std over seeds of the test accuracy, the
final model's loss over the whole training set (``train_set_loss``: the same examples for
every batch size; ``runs.json`` also keeps ``fit``'s last-window minibatch loss) and the
training time.

Cells with a per-worker batch below 1 (global batch < workers) or a global batch not
divisible by the workers are skipped and listed in the report (none occur on the
paper's grid). Workers must be a multiple of the mesh's device count: W is run on all
local devices when it is a multiple of their count, else on the first gcd(W, D)
devices (W=1: a one-device mesh); the report says which.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import ml_collections

from experiments import _mf_common as common
from mfopt import data as data_lib
from mfopt import mf as mf_lib
from mfopt import models as models_lib
from mfopt import report, runner

# names it can build; the runner refuses others before anything runs
CHOICES = {"dataset": data_lib.classification_datasets}



def get_config(quick: bool = False) -> ml_collections.ConfigDict:
  """Tables 2/3 config.

  Command: ``python -m experiments mf_batch_workers`` (``--quick``: CI preset, 2x2 cells).
  Hardware: one GPU (workers are virtual); the full grid is 42 cells x 2 optimizers x 3
  seeds = 252 runs of 10 epochs of 20,000 MNIST-1D examples (6,250 steps at batch 32,
  98 at 2048; 74,412 steps per seed and optimizer; each cell processes 199,680-200,704 samples,
  the nearest whole number of steps to 200,000).
  Runtime: projected, not measured in full. A reduced run on this project's 2-core CPU (1 JAX
  device, shared with ~6 other jobs; load average ~20) --
  ``python -m experiments mf_batch_workers "batches=(128,2048)" "workers=(1,32)" epochs=0.5
  "seeds=(0,)"`` -- measured 0.25-1.35 ms per training sample (mean ~0.7) plus 21-31 s of
  compilation per run; the full grid (252 runs x 200,000 samples) extrapolates to ~12 h on
  that CPU. On one GPU it should be far shorter (not measured: no GPU was available).
  Expected (paper): SGD accuracy falls slowly with workers at a fixed batch; Adam falls
  sharply with the batch (its linearly scaled lr reaches 0.8).
  """
  c = ml_collections.ConfigDict()
  c.dataset = "mnist1d"
  c.num_train = 4000 if quick else 20000
  c.num_test = 500 if quick else 2000
  c.features = (8,) if quick else (32, 64)
  c.batches = (64,) if quick else (32, 64, 128, 256, 512, 1024, 2048)
  c.workers = (1, 8) if quick else (1, 2, 4, 8, 16, 32)
  c.optimizers = ("sgd", "adam")
  c.mf = 0.9
  c.mf2 = 0.999
  c.base_lr = 0.05
  c.base_batch = 128
  c.epochs = 0.25 if quick else 10.0
  c.seeds = (0,) if quick else (0, 1, 2)
  c.log_every = 1000 if quick else 100
  c.progress = not quick
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  runner.require_positive(c, "num_train", "num_test", "batches", "workers", "base_lr",
                          "base_batch", "epochs", "log_every")
  runner.require_choice(c, "dataset", tuple(data_lib.registered()))
  runner.require_choice(c, "optimizers", ("sgd", "nag", "adam"))
  if not 0 <= c.mf < 1 or not 0 <= c.mf2 < 1:
    raise runner.ConfigError(f"config fields 'mf'/'mf2' must be in [0, 1), got {c.mf!r}/{c.mf2!r}")
  if not c.seeds:
    raise runner.ConfigError("config field 'seeds' must not be empty, got ()")


def run(c: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
  runner.require_process_multiple(c, "workers")
  dataset = data_lib.load_sized(c.dataset, c.num_train, c.num_test)
  model = models_lib.get_model("cnn", features=tuple(c.features), num_classes=dataset.num_classes)
  rule = mf_lib.linear_scaling_rule(c.base_lr, c.base_batch)
  samples = int(round(c.epochs * len(dataset.train)))
  log = report.JsonlWriter(workdir / "metrics.jsonl")
  rows, skipped, meshes = [], [], {}
  start = time.perf_counter()
  for batch in c.batches:
    for workers in c.workers:
      if batch < workers or batch % workers:
        skipped.append({"global_batch": batch, "workers": workers,
                        "why": "per-worker batch < 1" if batch < workers else
                        "global batch not divisible by workers"})
        continue
      meshes[workers] = common.mesh_for(workers)[1]
      for opt in c.optimizers:
        for seed in c.seeds:
          lr = rule(batch)
          desc = f"{opt}-B{batch}-W{workers}-s{seed}"
          r = common.run_cell(
              model=model, dataset=dataset, optimizer=opt, learning_rate=lr, mf=c.mf,
              mf2=c.mf2, num_workers=workers, per_worker_batch=batch // workers,
              num_steps=common.steps_for(samples, batch), seed=seed, log_every=c.log_every,
              progress=c.progress, desc=desc, train_set_loss=True,
              on_log=lambda row, d=desc: log({"run": d, **row}))
          r.update(global_batch=batch, workers=workers)
          rows.append(r)
          print(f"{desc:28s} lr {lr:<7g} test acc {r['test_accuracy']:.4f}"
                + ("  DIVERGED" if r["diverged"] else ""))
  wall = time.perf_counter() - start
  aggs = common.aggregate(rows, ("optimizer", "global_batch", "workers"),
                          # train_set_loss, not final_train_loss: fit's last logging window
                          # was the last 1 % of the run at batch 32 and all of it at 2048
                          ("test_accuracy", "train_set_loss", "train_s"))
  report.write_json(workdir / "runs.json", rows)
  report.write_json(workdir / "table.json", aggs)
  claims = _claims(c, rows)
  _plot(c, aggs, workdir)
  _write_report(c, workdir, dataset, rows, aggs, rule, skipped, meshes, claims, samples, wall)
  return {"cells": aggs, "skipped": skipped, "claims": claims, "samples_per_run": samples}


# The paper's validation accuracies (seed 000 Tables 2 and 3: ResNet-50 on CIFAR-10), rows by
# global batch, columns by GPU count: they give the sign each claim is tested for.
PAPER_GPUS = (1, 2, 4, 8, 16, 32)
PAPER_TABLES = {
    "sgd": {32: (0.928, 0.923, 0.917, 0.910, 0.917, 0.199),
            64: (0.928, 0.924, 0.916, 0.908, 0.891, 0.839),
            128: (0.923, 0.924, 0.917, 0.906, 0.896, 0.870),
            256: (0.926, 0.914, 0.913, 0.901, 0.891, 0.878),
            512: (0.925, 0.917, 0.907, 0.901, 0.893, 0.880),
            1024: (0.927, 0.916, 0.909, 0.899, 0.893, 0.876),
            2048: (0.923, 0.919, 0.906, 0.901, 0.885, 0.872)},
    "adam": {32: (0.807, 0.839, 0.864, 0.894, 0.898, 0.432),
             64: (0.734, 0.802, 0.845, 0.885, 0.908, 0.901),
             128: (0.665, 0.765, 0.816, 0.869, 0.897, 0.922),
             256: (0.547, 0.665, 0.757, 0.848, 0.886, 0.910),
             512: (0.492, 0.583, 0.562, 0.794, 0.871, 0.902),
             1024: (0.399, 0.329, 0.361, 0.578, 0.847, 0.883),
             2048: (0.173, 0.177, 0.103, 0.353, 0.675, 0.768)},
}


def _paper_sign(opt: str, batch: int, w_a: int, w_b: int) -> tuple[int, str] | None:
  """Sign of the paper's acc(W=w_a) - acc(W=w_b) at ``batch`` (0: the table ties), and the two
  values; None if the cell is not in Table 2 (SGD) or 3 (Adam)."""
  table = PAPER_TABLES.get(opt, {}).get(batch)
  if table is None or w_a not in PAPER_GPUS or w_b not in PAPER_GPUS:
    return None
  a, b = table[PAPER_GPUS.index(w_a)], table[PAPER_GPUS.index(w_b)]
  return (a > b) - (a < b), f"paper {a:.3f} vs {b:.3f}"


def _paper_batch_sign(opt: str, workers: int, b_a: int, b_b: int) -> tuple[int, str] | None:
  """Sign of the paper's acc(batch b_a) - acc(batch b_b) at ``workers`` GPUs (0: a tie), and
  the two values; None if a cell is not in Table 2 / 3."""
  table = PAPER_TABLES.get(opt, {})
  if b_a not in table or b_b not in table or workers not in PAPER_GPUS:
    return None
  i = PAPER_GPUS.index(workers)
  a, b = table[b_a][i], table[b_b][i]
  return (a > b) - (a < b), f"paper {a:.3f} vs {b:.3f}"


def _claims(c, rows) -> dict[str, str]:
  """The paper's qualitative claims, tested with the SPEC.md rule per optimizer.

  "More workers hurt" at a fixed batch is tested with the sign of the paper's own table for
  that cell: the prose says accuracy declines "for each line", true of SGD's Table 2, but
  Adam's Table 3 rises with GPUs in every row except batch 32 at 32 GPUs.
  """
  out = {}
  bmin, bmax = min(c.batches), max(c.batches)

  def ran(batch):  # the worker counts whose cell at this batch ran (the others are skipped)
    return [w for w in c.workers if batch >= w and batch % w == 0]

  def claim(opt, paper, prose, a_sel, b_sel, a, b, where, bigger, smaller):
    """``acc(a) - acc(b) where``, with the sign of the paper's table cells ``paper`` (``(sign,
    text)``; 0: a tie, no direction); for an optimizer without a table (NAG) the prose's
    ``prose``; a cell missing from its optimizer's table: not testable."""
    if paper is None:
      if opt in PAPER_TABLES:
        out[f"{opt}: acc({a}) vs acc({b}) {where}"] = (
            "not testable (a cell outside the paper's table)")
        return
      sign, source = prose
    else:
      sign, source = paper
    if sign == 0:  # the table ties (SGD batch 32: 0.917 at 4 and 16 GPUs): no direction
      out[f"{opt}: acc({a}) vs acc({b}) {where} ({source})"] = (
          "not testable (the paper's table ties: no direction to test)")
      return
    d = common.paired_difference(rows, "test_accuracy", a_sel, b_sel)
    out[f"{opt}: acc({a}) - acc({b}) {where} {'>' if sign > 0 else '<'} 0 "
        f"({bigger if sign > 0 else smaller}; {source})"] = common.claim_verdict(d, sign)

  for opt in c.optimizers:
    for batch in c.batches:
      run_ws = ran(batch)  # (the fewest and most workers that ran: a skipped cell has no runs)
      if len(run_ws) < 2:
        continue
      wmin, wmax = min(run_ws), max(run_ws)
      claim(opt, _paper_sign(opt, batch, wmin, wmax), (1, "prose: accuracy declines with workers"),
            {"optimizer": opt, "global_batch": batch, "workers": wmin},
            {"optimizer": opt, "global_batch": batch, "workers": wmax},
            f"W={wmin}", f"W={wmax}", f"at batch {batch}", "more workers hurt", "more workers help")
    both = sorted(set(ran(bmin)) & set(ran(bmax)))  # the fewest workers that ran both batches
    if bmin != bmax and both:  # its sign from the table too (it was always "larger batch hurts")
      wmin = both[0]
      claim(opt, _paper_batch_sign(opt, wmin, bmin, bmax), (1, "prose: larger batch hurts"),
            {"optimizer": opt, "global_batch": bmin, "workers": wmin},
            {"optimizer": opt, "global_batch": bmax, "workers": wmin},
            f"batch {bmin}", f"batch {bmax}", f"at W={wmin}", "larger batch hurts",
            "larger batch helps")
  return out


def _plot(c, aggs, workdir: pathlib.Path) -> None:
  common.plot_accuracy_vs_workers(
      aggs, c.optimizers, "global_batch", c.batches, lambda b: f"batch {b}",
      workdir / "accuracy_vs_workers.png",
      f"seed 000 Tables 2/3 at small scale (CNN + per-worker BN, {c.dataset})")


def _processed_range(c, samples: int) -> str:
  """The samples the cells actually process (steps x global batch), as text."""
  done = sorted({common.steps_for(samples, b) * b for b in c.batches})
  if len(done) == 1:
    return f"{done[0]:,} samples"
  return f"{done[0]:,} to {done[-1]:,} samples (by batch)"


def _write_report(c, workdir, dataset, rows, aggs, rule, skipped, meshes, claims, samples,
                  wall) -> None:
  env = report.environment()
  lrs = {b: f"{rule(b):g}" for b in c.batches}
  lines = [
      "# mf_batch_workers: seed 000 Tables 2/3 at small scale\n",
      report.environment_markdown(env),
      f"- Dataset: {dataset.name}, {len(dataset.train):,} train / {len(dataset.test):,} test "
      "examples (validation accuracy = accuracy on the test split, worker-averaged model, BN "
      "running averages)",
      f"- Model: CNN features {tuple(c.features)}, BatchNorm per worker (statistics of each "
      "worker's own batch, the models' default under the worker vmap)",
      "- Optimizers: synchronous all-reduce + " + " / ".join(
          {"sgd": f"mfopt.mf_sgd (MF {c.mf})", "nag": f"mfopt.mf_nesterov (MF {c.mf})",
           "adam": f"mfopt.mf_adam (MF1 {c.mf}, MF2 {c.mf2})"}[o] for o in c.optimizers)
      + f"; lr by the linear scaling rule {c.base_lr} @ {c.base_batch} (Table 1)"
      + (", the same rule for Adam as in the paper" if "adam" in c.optimizers else ""),
      f"- Samples per run: {samples:,} ({c.epochs} epochs) nominal; steps = round(samples / "
      "global batch), so a cell processes "
      + _processed_range(c, samples) + "; per-worker batch = global batch / workers",
      f"- Seeds: {tuple(c.seeds)} (same init and data order per seed across cells); cells "
      "show mean ± std over seeds",
      "- Meshes: " + ", ".join(f"W={w}: {m}" for w, m in sorted(meshes.items())),
      f"- Wall time of the grid, this attempt: {wall:.1f} s measured on this machine (compile included; earlier attempts at a resumed workdir: summary.json's wall_time_all_attempts_s)",
  ]
  if skipped:
    lines.append("- Skipped cells: " + "; ".join(
        f"batch {s['global_batch']} x {s['workers']} workers ({s['why']})" for s in skipped))
  else:
    lines.append("- Skipped cells: none")
  for opt in c.optimizers:
    lines += [f"\n## {common.OPTIMIZER_LABELS[opt]}: test accuracy (rows: global batch, "
              "columns: workers)\n",
              common.grid_table([a for a in aggs if a["optimizer"] == opt], "global_batch",
                                "workers", "test_accuracy", c.batches, c.workers, "batch",
                                lambda w: f"{w} worker(s)", extra=lrs)]
  common.write_claims_report(workdir, lines, claims, "accuracy_vs_workers.png",
                             "accuracy vs workers", empty=None, runs=rows)
