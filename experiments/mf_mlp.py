"""mf_mlp: seed 000 Fig. 8 -- 3-layer MLP, global batch 64, lr 0.05, 8 workers, MF sweep.

Command: ``python -m experiments mf_mlp [--quick] [--workdir DIR] [key=value ...]``

The paper (§4.4.2) trains a 3-layer MLP (two ReLU hidden layers and a softmax layer) on
MNIST for 30 epochs on 8 GPUs with SGD, batch 64, lr 0.05 and momentum (MF) in
{0.9, 0.95, 0.975, 0.99}; test accuracy rises up to MF 0.975 and drops at 0.99. Here the
same recipe on MNIST-1D (generated locally; ``dataset=mnist`` uses TFDS MNIST when it
has been prepared): ``mfopt.models.MLP`` with hidden (256, 256), 8 virtual workers of 8
examples each, synchronous all-reduce + ``mfopt.mf_sgd`` at constant lr (where
Algorithm 1 equals optax's momentum). Every MF processes the same samples from the same
initialisation and data order per seed.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import ml_collections

from experiments import _mf_common as common
from mfopt import data as data_lib
from mfopt import models as models_lib
from mfopt import report, runner

# names it can build; the runner refuses others before anything runs
CHOICES = {"dataset": data_lib.classification_datasets}



def get_config(quick: bool = False) -> ml_collections.ConfigDict:
  """Fig. 8 config.

  Command: ``python -m experiments mf_mlp`` (``--quick``: CI preset).
  Hardware: any; the full preset runs on a 2-core CPU. Full: 4 MF x 3 seeds x 30 epochs of
  10,000 MNIST-1D examples = 12 runs of 4,688 steps.
  Runtime: measured (2026-11-22), full preset: 2,298 s (38 min) on this project's 2-core CPU shared with
  other jobs (load average ~20), 1 JAX device, ``python -m experiments mf_mlp``.
  Expected (paper, MNIST): test accuracy increases with MF up to 0.975, lower at 0.99.
  """
  c = ml_collections.ConfigDict()
  c.dataset = "mnist1d"
  c.num_train = 4000 if quick else 10000
  c.num_test = 500 if quick else 2000
  c.hidden = (32, 32) if quick else (256, 256)
  c.num_workers = 8
  c.global_batch = 64
  c.learning_rate = 0.05
  c.mfs = (0.9, 0.975) if quick else (0.9, 0.95, 0.975, 0.99)
  c.epochs = 0.5 if quick else 30.0
  c.seeds = (0,) if quick else (0, 1, 2)
  c.log_every = 1000 if quick else 200
  c.progress = not quick
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  runner.require_positive(c, "num_train", "num_test", "hidden", "num_workers", "global_batch",
                          "learning_rate", "epochs", "log_every")
  # (the dataset: CHOICES, any classification dataset; a narrower list here refused a
  # registered or TFDS one the MLP trains on as on these)
  for m in c.mfs:
    if not 0 <= m < 1:
      raise runner.ConfigError(f"config field 'mfs' must hold values in [0, 1), got {m!r}")
  if c.global_batch % c.num_workers:
    raise runner.ConfigError(f"global_batch must be divisible by num_workers={c.num_workers}, "
                             f"got {c.global_batch}")
  if not c.seeds:
    raise runner.ConfigError("config field 'seeds' must not be empty, got ()")


def run(c: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
  runner.require_process_multiple(c, "num_workers")
  dataset = data_lib.load_sized(c.dataset, c.num_train, c.num_test)
  model = models_lib.get_model("mlp", hidden=tuple(c.hidden), num_classes=dataset.num_classes)
  samples = int(round(c.epochs * len(dataset.train)))
  steps = common.steps_for(samples, c.global_batch)
  start = time.perf_counter()
  rows = common.sweep_mf(model=model, dataset=dataset, mfs=c.mfs, seeds=c.seeds,
                         learning_rate=c.learning_rate, num_workers=c.num_workers,
                         global_batch=c.global_batch, num_steps=steps,
                         log_every=min(c.log_every, steps), progress=c.progress, workdir=workdir)
  wall = time.perf_counter() - start
  aggs = common.aggregate(rows, ("mf",), ("test_accuracy", "test_loss", "final_train_loss"))
  report.write_json(workdir / "runs.json", rows)
  report.write_json(workdir / "table.json", aggs)
  claims = _claims(c, rows)
  report.plot_curves(workdir / "train_loss.png", {"train loss": common.curves_by_mf(workdir)},
                     xlabel="step", ylabel="train loss (mean over workers and seeds)", logy=True,
                     title=f"seed 000 Fig. 8 at small scale: MLP, {c.num_workers} workers")
  env = report.environment()
  table = [{"mf": a["mf"], "acc": common.cell_text(a, "test_accuracy", 4),
            "loss": common.cell_text(a, "test_loss", 4),
            "train": common.cell_text(a, "final_train_loss", 4),
            "eff": c.learning_rate / (1 - a["mf"])} for a in aggs]
  lines = [
      "# mf_mlp: seed 000 Fig. 8 (MLP, MF sweep) at small scale\n",
      report.environment_markdown(env),
      f"- Dataset: {dataset.name}, {len(dataset.train):,} train / {len(dataset.test):,} test",
      f"- Model: MLP hidden {tuple(c.hidden)} ({len(c.hidden) + 1} dense layers, ReLU), no "
      "BatchNorm",
      f"- Workers: {c.num_workers} (virtual); global batch {c.global_batch}, per-worker "
      f"{c.global_batch // c.num_workers}; synchronous all-reduce + mfopt.mf_sgd, constant lr "
      f"{c.learning_rate}",
      f"- Steps: {steps} per run x global batch {c.global_batch} = {steps * c.global_batch:,} "
      f"samples processed ({c.epochs} epochs = {samples:,}, to whole steps) for every MF",
      f"- Seeds: {tuple(c.seeds)}; mean ± std over seeds",
      f"- Training time of this attempt: {wall:.1f} s measured on this machine (the runs' "
      "loops, compile included; data loading, report and the attempt's whole time: "
      "summary.json's wall_time_s, earlier attempts: wall_time_all_attempts_s)\n",
      report.markdown_table(table, ["mf", "acc", "loss", "train", "eff"],
                            ["MF", "test accuracy", "test loss", "final train loss",
                             "effective lr/(1-MF)"]),
  ]
  common.write_claims_report(
      workdir, lines, claims, "train_loss.png", "train loss", runs=rows,
      empty=f"- no claim testable: Fig. 8's claims compare MF 0.975 with a lower MF, and MF 0.99 "
            f"with 0.975 or 0.95; this run has mfs={tuple(sorted(c.mfs))}")
  return {"cells": aggs, "claims": claims, "steps": steps}


def _claims(c, rows) -> dict[str, str]:
  """The paper's Fig. 8 statements, each only where its MF values were run: accuracy rises
  with MF up to 0.975 (the best), and at 0.99 drops below 0.975 and 0.95."""
  out = {}
  mfs = sorted(c.mfs)

  def test(a, b, sign, text):
    if a in mfs and b in mfs:
      d = common.paired_difference(rows, "test_accuracy", {"mf": a}, {"mf": b})
      out[text] = common.claim_verdict(d, sign)

  if mfs and mfs[0] < 0.975:
    test(0.975, mfs[0], +1, f"acc(MF 0.975) - acc(MF {mfs[0]}) > 0 (accuracy rises with MF)")
  test(0.99, 0.975, -1, "acc(MF 0.99) - acc(MF 0.975) < 0 (drops past the peak)")
  test(0.99, 0.95, -1, "acc(MF 0.99) - acc(MF 0.95) < 0 (drops below 0.95)")
  return out
