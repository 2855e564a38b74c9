"""quickstart: one row per mfopt optimizer and baseline, 8 workers, two embedded datasets.

Rows: optax SGD/Adam baselines; seed 000's MF-SGD, MF-Nesterov and MF-Adam; seed 001's QSGD,
CPSGD and ADPSGD; seed 003's K-AVG and M-AVG; seed 004's AdaBound and its linear-scaling
warm-up into LARS; seed 002's adaptive k-sync with the BSP, ASP and SSP parameter servers
(simulated). Not in the table: ``linear_scaling_adabound`` alone (the hybrid's first phase),
and the simulator's EASGD, DropWorker and ``faithful`` k-sync (``async_convergence`` has them).

Command: ``python -m experiments quickstart [--quick] [--workdir DIR] [key=value ...]``

Every algorithm trains the same model from the same initialisation on the same
per-worker data streams for the same number of steps (equal samples processed),
under a cosine-decaying learning rate. The 8 workers of the ``train.fit`` rows run as virtual
workers (``vmap``) on however many local devices there are (one on a plain CPU machine); the
report gives final test accuracy, final train loss, and the all-reduces and bytes each worker
sent as counted by the transforms themselves. The parameter-server rows (``sim_runs``) are
**simulated** by ``mfopt.sim``: their exchanges are the simulator's push and pull messages, and
their times simulated (the report labels them).

Hardware/runtime: the default preset is sized to finish in under 5 minutes on 2
CPU cores (measured: see ``get_config``; ``--quick`` with 36 rows 48 s with a warm compilation
cache); steps are trimmed, never algorithms, and the report says how many steps each run had.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np
import optax

import mfopt
from mfopt import data as data_lib
from mfopt import models as models_lib
from mfopt import parallel, report, runner, train

# names it can build; the runner refuses others before anything runs (the embedded datasets:
# the main job runs on a fresh machine without TFDS data)
CHOICES = {"datasets": ("digits", "mnist1d"), "models": models_lib.classifiers}


@dataclasses.dataclass(frozen=True)
class Context:
  """What an algorithm factory may use to build its transform."""

  axis_name: Any
  num_workers: int
  num_steps: int
  steps_per_epoch: int
  schedule: Callable[[float], optax.Schedule]


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One row of the quickstart table: a transform factory and its peak learning rate."""

  make: Callable[[Context, float], optax.GradientTransformation]
  learning_rate: float
  note: str = ""


def _sync(inner: Callable[[optax.Schedule], optax.GradientTransformation]):
  def make(ctx: Context, lr: float) -> optax.GradientTransformation:
    return optax.chain(mfopt.sync_gradients(ctx.axis_name), inner(ctx.schedule(lr)))
  return make


ALGORITHMS: dict[str, Algorithm] = {
    "sync SGD m=0.9 (optax)": Algorithm(
        _sync(lambda s: optax.sgd(s, momentum=0.9)), 0.1,
        "all-reduce of gradients every step, optax.sgd momentum 0.9 (lr outside the buffer)"),
    "sync SGD m=0.99 (optax)": Algorithm(
        _sync(lambda s: optax.sgd(s, momentum=0.99)), 0.1,
        "same lr as m=0.9, so 10x the effective step lr/(1-m)"),
    "sync Adam (optax)": Algorithm(
        _sync(lambda s: optax.adam(s)), 1e-3, "optax.adam, b1=0.9, b2=0.999"),
    # Seed 000: momentum-like factors (lr inside the momentum buffer).
    "sync MF-SGD mf=0.9 (Alg. 1, lr in buffer)": Algorithm(
        _sync(lambda s: mfopt.mf_sgd(s, mf=0.9)), 0.1,
        "seed 000 Alg. 1: v = mf*v + lr_t*g keeps each step's lr inside the buffer; equals the "
        "optax row at constant lr, but under this decaying schedule old gradients keep their "
        "larger lr (optax rescales the whole buffer by the current lr)"),
    "sync MF-SGD mf=0.99 (Alg. 1, lr in buffer)": Algorithm(
        _sync(lambda s: mfopt.mf_sgd(s, mf=0.99)), 0.1,
        "as above with mf=0.99: the buffer remembers ~100 steps of larger early lrs"),
    "sync MF-Nesterov mf=0.9 (Alg. 1 Nesterov form)": Algorithm(
        _sync(lambda s: mfopt.mf_nesterov(s, mf=0.9)), 0.1,
        "seed 000's momentum-like factor in Nesterov form (lr inside the buffer)"),
    "sync MF-Adam (Alg. 2, phi=adam)": Algorithm(
        _sync(lambda s: mfopt.mf_adam(s, mf1=0.9, mf2=0.999)), 1e-3,
        "seed 000 Alg. 2 with phi=adam: identical to optax.adam (lr outside the moments)"),
    # Seed 001's quantized baseline: int8 levels + bucket norms, one all-gather per step.
    "QSGD 8-bit (SGD m=0.9)": Algorithm(
        lambda ctx, lr: optax.chain(mfopt.qsgd(ctx.axis_name, bits=8),
                                    optax.sgd(ctx.schedule(lr), momentum=0.9)),
        0.1, "seed 001's QSGD-8bit baseline: stochastic int8 gradients + float32 bucket norms, "
             "exchanged with one all-gather per step (about 1/4 of the float32 bytes per "
             "worker; an all-gather's wire bytes grow with the workers, mfopt.costmodel)"),
    # Seeds 001 and 003: periodic averaging and block momentum.
    "CPSGD p=8 (local SGD m=0.9)": Algorithm(
        lambda ctx, lr: mfopt.periodic_averaging(
            optax.sgd(ctx.schedule(lr), momentum=0.9), ctx.axis_name, mfopt.constant_period(8)),
        0.1, "seed 001 Alg. 1: local momentum SGD, parameters averaged every 8 steps"),
    "ADPSGD (local SGD m=0.9)": Algorithm(
        lambda ctx, lr: mfopt.periodic_averaging(
            optax.sgd(ctx.schedule(lr), momentum=0.9), ctx.axis_name, mfopt.adpsgd_period(
                learning_rate=ctx.schedule(lr), sampling_steps=max(ctx.num_steps // 4, 4 + 1),
                p_init=4, warmup_steps=min(ctx.steps_per_epoch, 1))),
        0.1, "seed 001 Alg. 2: period 1 for a 1-step warm-up, p_init=4, K_s=K/4, then adaptive; "
             "one extra scalar all-reduce per sync"),
    "K-AVG K=8 (local SGD m=0.9)": Algorithm(
        lambda ctx, lr: mfopt.block_momentum(
            optax.sgd(ctx.schedule(lr), momentum=0.9), ctx.axis_name, 8, momentum=0.0),
        0.1, "seed 003 Alg. 1 with mu=0 (learner momentum 0.9)"),
    "M-AVG K=8 mu=0.5 (local SGD m=0.9)": Algorithm(
        lambda ctx, lr: mfopt.block_momentum(
            optax.sgd(ctx.schedule(lr), momentum=0.9), ctx.axis_name, 8, momentum=0.5),
        0.1, "seed 003 Alg. 1: block momentum 0.5 on the averaged delta, learner momentum 0.9"),
    # Seed 002: see SIM_RUNS below (a simulated cluster, not train.fit).
    # Seed 004: AdaBound itself, then the linear-scaling warm-up into LARS SGD.
    "sync AdaBound (Luo et al.)": Algorithm(
        _sync(lambda s: mfopt.adabound(s, final_lr=0.1)), 1e-3,
        "AdaBound (reference semantics): Adam steps clipped into bounds converging to "
        "final_lr x lr_t/lr_0 (so the bounds follow the cosine schedule)"),
    # Seed 004: linear-scaling AdaBound warm-up into LARS SGD.
    "sync hybrid AdaBound->LARS SGD (seed 004)": Algorithm(
        lambda ctx, lr: mfopt.chain(  # (keeps the hybrid's host schedule for host gates)
            mfopt.sync_gradients(ctx.axis_name),
            mfopt.hybrid_adabound_lars(
                num_workers=ctx.num_workers, steps_per_epoch=ctx.steps_per_epoch,
                base_lr=lr / ctx.num_workers,
                # (fractional: forced to >= 1 epoch, the switch came at 52% of the quick run)
                warmup_epochs=ctx.num_steps / ctx.steps_per_epoch / 9,
                axis_name=ctx.axis_name)),
        0.8, "linear-scaling AdaBound for the first 1/9 of the steps (rounded up to a whole step; "
             "seed: T=10 of 90 epochs), then "
             "LARS SGD at the peak lr (per-worker lr x workers) decaying 0.9 per epoch; its own "
             "schedule, not the "
             "cosine one"),
}


# Seed 002: the parameter-server algorithms run in mfopt.sim, a
# simulated cluster (virtual clock, real gradients), not through train.fit. They train the same
# model as the other rows (the simulator needs a model without BatchNorm, hence the CNN without
# BN on mnist1d), 8 workers x 16 per worker, for the same number of samples; SGD/α_0 lr 0.1
# x 0.99^epoch, compute 0.01 simulated s per step (speed spread 0.3, jitter 0.2), 10 Gbit/s.
SIM_RUNS: dict[str, Callable[[], Any]] = {
    "KSync[working] adaptive k-sync (seed 002, simulated)":
        lambda: mfopt.sim.ksync_preset("working", alpha0=0.1),
    "BSP parameter server (simulated)": lambda: mfopt.sim.BSP(mfopt.sim.BaseSGD(0.1)),
    "ASP parameter server (simulated)": lambda: mfopt.sim.ASP(mfopt.sim.BaseSGD(0.1)),
    "SSP s=3 parameter server (simulated)": lambda: mfopt.sim.SSP(3, mfopt.sim.BaseSGD(0.1)),
}


def _simulated_rows(c, dataset_name, model_name, model, dataset, metrics_log) -> list[dict[str, Any]]:
  rows = []
  samples = c.num_steps * c.global_batch  # equal samples with the train.fit rows
  for name in c.sim_runs:
    t0 = time.perf_counter()
    res = mfopt.sim.simulate(
        SIM_RUNS[name](), model=model, dataset=dataset, num_workers=c.num_workers,
        per_worker_batch=c.global_batch // c.num_workers, max_samples=samples, seed=c.seed,
        compute=mfopt.sim.ComputeModel(0.01, speed_spread=0.3, jitter_sigma=0.2), network="10gbit",
        eval_every_samples=max(1, samples // 4),
        on_log=lambda r, name=name: metrics_log(
            {"dataset": dataset_name, "model": model_name, "algorithm": name, **r}))
    s = res.summary
    rows.append({"dataset": dataset_name, "model": model_name, "algorithm": name, "peak_lr": 0.1,
                 "test_accuracy": s["test_accuracy"], "final_train_loss": s["final_train_loss"],
                 # pushes (each answered by a pull) and the payload they sent: what the
                 # all-reduce rows count (bytes_per_worker adds the pulled bytes)
                 "all_reduces": s["pushes_per_worker"], "collectives": s["pushes_per_worker"],
                 "payload_bytes": int(round(s["bytes_sent_per_worker"])),
                 # the simulator's own measured time, kept over attempts (timed here, a
                 # finished run's saved result returned on a rerun took 0.3 s to "train")
                 "train_s": res.wall_s if np.isfinite(res.wall_s) else time.perf_counter() - t0,
                 "sim_time_s": s["sim_time_s"],
                 "samples": s["samples"]})
    print(f"{_label(c, dataset_name, model_name):8s} {name:32s} test acc {s['test_accuracy']:.4f}  "
          f"simulated time {s['sim_time_s']:.2f} s")
  return rows


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
  """Quickstart config.

  Command: ``python -m experiments quickstart`` (``--quick`` for the CI preset).
  Hardware: any; sized for 2 CPU cores (budget 5 min). Measured 2026-11-22 on an idle 2-core
  VM, JAX 0.10.2: 90 s for the default preset (28 rows), 28 s for ``--quick`` with a warm
  compilation cache (89 s cold; with 36 rows 48.4 s, a reviewer's run on 2026-11-26 at load
  average 2); re-measured 2026-11-23 (``bash scripts/quickstart.sh``,
  quiet VM, warm cache): 69.5 s, the same accuracies. 2026-11-25, 36 rows (QSGD, MF-Nesterov,
  AdaBound and SSP added), ``python -m experiments quickstart --workdir /tmp/s18/qs_full
  progress=false`` on the 2-core VM at load average 3 (a second job running): 131.3 s, sync
  SGD m=0.9 again 0.9167 / 0.9180.
  Expected (same run): sync SGD m=0.9 reaches test accuracy 0.917 on digits and 0.918 on
  mnist1d; every row's figures are in its report.
  """
  c = ml_collections.ConfigDict()
  c.datasets = ("digits", "mnist1d")
  c.models = ("mlp", "cnn")  # one per dataset, same order
  c.num_workers = 8
  c.global_batch = 128  # 16 per worker
  c.num_steps = 60 if quick else 400
  c.log_every = 10 if quick else 25
  c.seed = 0
  c.algorithms = tuple(ALGORITHMS)
  c.sim_runs = tuple(SIM_RUNS)  # simulated parameter-server rows (mfopt.sim)
  # One model per dataset for every row; BatchNorm off so the simulated rows can train the same
  # model (mfopt.sim needs a model without BatchNorm statistics).
  c.use_bn = False
  c.progress = True
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  runner.require_positive(c, "num_workers", "global_batch", "num_steps", "log_every")
  try:
    train.split_batch(c.global_batch, c.num_workers)
  except ValueError as e:
    raise runner.ConfigError(str(e)) from e
  for field in ("datasets", "models", "algorithms"):
    if not c[field]:
      raise runner.ConfigError(f"config field {field!r} must not be empty, got {c[field]!r}")
  if c.sim_runs and c.use_bn:
    raise runner.ConfigError("config field 'use_bn' must be False when sim_runs are requested "
                             "(the simulator trains models without BatchNorm), got True")
  runner.require_choice(c, "algorithms", tuple(ALGORITHMS))
  runner.require_choice(c, "sim_runs", tuple(SIM_RUNS))
  # classifiers only (lstm_lm is a language model: it takes no num_classes)
  runner.require_choice(c, "models", models_lib.classifiers())
  if len(c.models) != len(c.datasets):
    raise runner.ConfigError(
        f"config field 'models' needs one model per dataset ({len(c.datasets)}), got {c.models!r}")
  if c.sim_runs:
    # Checked here, before anything trains: the ResNets always carry BatchNorm statistics, which
    # the simulator refuses only after every train.fit row of the dataset has run.
    with_bn = [m for m in c.models if m not in SIM_MODELS]
    if with_bn:
      raise runner.ConfigError(
          f"config field 'models' may only name {list(SIM_MODELS)} when sim_runs are requested "
          f"(the simulator trains models without BatchNorm), got {with_bn!r}; set sim_runs=() to "
          "train them")
  pairs = list(zip(c.datasets, c.models))
  if len(set(pairs)) != len(pairs):
    raise runner.ConfigError(
        f"config fields 'datasets' and 'models' name the same (dataset, model) pair twice: "
        f"{pairs!r}")


# models the simulator can train (no BatchNorm statistics; the CNN with use_bn=False)
SIM_MODELS = ("mlp", "cnn")


def _label(c, dataset_name: str, model_name: str) -> str:
  """A run's name in curves and logs: the dataset, plus the model when a dataset appears twice."""
  if list(c.datasets).count(dataset_name) == 1:
    return dataset_name
  return f"{dataset_name}/{model_name}"


def _model_for(name: str, dataset: data_lib.Dataset, use_bn: bool):
  kwargs = {"use_bn": use_bn} if name == "cnn" else {}
  return models_lib.get_model(name, num_classes=dataset.num_classes, **kwargs)


def run(c: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
  runner.require_process_multiple(c, "num_workers")  # (before anything trains)
  mesh = parallel.worker_mesh(c.num_workers)  # (4 workers on 8 devices: the first 4)
  parallel.local_workers(c.num_workers, mesh)
  per_worker_batch = train.split_batch(c.global_batch, c.num_workers)
  metrics_log = report.JsonlWriter(workdir / "metrics.jsonl")
  rows, curves, sizes = [], {}, {}
  datasets = {name: data_lib.load(name) for name in dict.fromkeys(c.datasets)}
  for name, dataset in datasets.items():  # (before anything trains)
    if len(dataset.train) < c.global_batch:
      raise runner.ConfigError(
          f"config field 'global_batch' = {c.global_batch} exceeds dataset {name!r}'s "
          f"{len(dataset.train)} training examples (an epoch would be 0 steps)")
  for dataset_name, model_name in zip(c.datasets, c.models):
    dataset = datasets[dataset_name]
    sizes[dataset_name] = {"train": len(dataset.train), "test": len(dataset.test)}
    model = _model_for(model_name, dataset, c.use_bn)
    steps_per_epoch = len(dataset.train) // c.global_batch

    def schedule(peak: float) -> optax.Schedule:
      return optax.cosine_decay_schedule(peak, decay_steps=c.num_steps)

    ctx = Context(axis_name=parallel.WORKER_AXES, num_workers=c.num_workers,
                  num_steps=c.num_steps, steps_per_epoch=steps_per_epoch, schedule=schedule)
    label = _label(c, dataset_name, model_name)
    curves[label] = {}
    for algo_name in c.algorithms:
      algo = ALGORITHMS[algo_name]
      tx = algo.make(ctx, algo.learning_rate)

      def on_log(row, algo_name=algo_name, dataset_name=dataset_name, model_name=model_name):
        metrics_log({"dataset": dataset_name, "model": model_name, "algorithm": algo_name, **row})

      result = train.fit(
          model=model, tx=tx, dataset=dataset, num_workers=c.num_workers,
          per_worker_batch=per_worker_batch, num_steps=c.num_steps, mesh=mesh, seed=c.seed,
          log_every=c.log_every, learning_rate=schedule(algo.learning_rate),
          progress=c.progress, desc=f"{label}/{algo_name}", on_log=on_log)
      s = result.summary
      rows.append({"dataset": dataset_name, "model": model_name, "algorithm": algo_name,
                   "peak_lr": algo.learning_rate, **s})
      curves[label][algo_name] = ([r["step"] for r in result.history],
                                         [r["train_loss"] for r in result.history])
      print(f"{label:8s} {algo_name:32s} test acc {s['test_accuracy']:.4f}  "
            f"train loss {s['final_train_loss']:.4f}  exchanges {s['collectives']}")
    rows += _simulated_rows(c, dataset_name, model_name, model, dataset, metrics_log)

  report.plot_curves(workdir / "loss_curves.png", curves, xlabel="step",
                     ylabel="train loss (mean over workers, log scale)", logy=True,
                     title=f"quickstart: {c.num_workers} workers, train.fit rows only")
  _write_report(c, workdir, rows, sizes)
  return {"rows": rows, "dataset_sizes": sizes}


def _write_report(c, workdir: pathlib.Path, rows, sizes) -> None:
  env = report.environment()
  lines = [
      "# quickstart: mfopt algorithms on embedded datasets\n",
      report.environment_markdown(env),
      f"- Workers: {c.num_workers} (virtual workers, {env['device_count']} device(s)); "
      f"per-worker batch {c.global_batch // c.num_workers}, global batch {c.global_batch}",
      f"- Steps: {c.num_steps} per run for every algorithm (equal samples processed); "
      "cosine-decayed learning rate from the peak shown; seed "
      f"{c.seed}; one seed (this is a tour, not a paper table).",
      "- Datasets: " + "; ".join(
          f"{k}: {v['train']:,} train / {v['test']:,} test examples" for k, v in sizes.items()),
      "- Models: " + ", ".join(f"{d} -> {m}" for d, m in zip(c.datasets, c.models))
      + f" (BatchNorm {'on' if c.use_bn else 'off'}), the same for every row of a dataset",
      "- Times are measured on this machine (compile excluded). Exchanges (all-reduces; "
      "QSGD's all-gathers) and bytes are "
      "per worker, counted by the transforms (payload in the exchanged dtype).\n",
      report.markdown_table(
          rows,
          ["dataset", "model", "algorithm", "peak_lr", "test_accuracy", "final_train_loss",
           "collectives", "payload_bytes", "train_s", "sim_time_s"],
          ["dataset", "model", "algorithm", "peak lr", "test acc", "final train loss",
           "exchanges/worker", "bytes sent/worker", "train time (s)", "simulated time (s)"]),
      "\n## Notes\n",
  ]
  for name in c.algorithms:
    if ALGORITHMS[name].note:
      lines.append(f"- **{name}**: {ALGORITHMS[name].note}")
  if c.sim_runs:
    lines.append("- **(simulated) rows**: mfopt.sim parameter-server cluster, same model and "
                 "same number of samples as the other rows, lr 0.1 x 0.99^epoch (its own schedule); "
                 "'exchanges/worker' is the pushes per worker there (each answered by a pull), "
                 "'bytes sent/worker' the payload they pushed, 'simulated time' "
                 "is the virtual clock (compute 0.01 s/step, 10 Gbit/s), 'train time' is measured "
                 "with the simulator's compilation included (the other rows exclude theirs).")
  lines.append("\n![loss curves](loss_curves.png)\n")
  lines.append("The plot holds the `train.fit` rows (cosine-decayed lr, except where a note says "
               "otherwise)" + ("; the simulated rows are not plotted (their losses are logged "
                              "per server evaluation, in `metrics.jsonl`)." if c.sim_runs else
                              ".") + "\n")
  (workdir / "report.md").write_text("\n".join(lines) + "\n")
