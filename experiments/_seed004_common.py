"""Helpers shared by the seed 004 experiments (hybrid AdaBound warmup, precision, BN strategies).

Algorithms (all synchronous: ``sync_gradients`` over the worker axes, then the optimizer),
with the seed's hyperparameter rules (§3.1): per-worker lr ``base_lr`` scaled by ``N``:

* ``hybrid``: ``mfopt.hybrid_adabound_lars`` (T epochs of linear-scaling AdaBound, then LARS SGD
  with momentum, weight decay and ``lr N decay^(epoch-T)``);
* ``adabound``: ``mfopt.adabound(alpha, final_lr=base_lr*N)`` for the whole run (the AdaBound
  baseline of Fig. 3.1; its final lr linearly scaled like the others -- a choice; no weight
  decay, as in the hybrid's AdaBound phase, while the two SGD phases take ``weight_decay``);
* ``warmup_sgd``: gradual warmup + linear-scaling SGD (Goyal et al.): lr rises linearly from
  ``base_lr`` to ``base_lr*N`` over the same T epochs, then the same exponential decay as the
  hybrid; momentum 0.9, weight decay 1e-4, no LARS.

A run that diverges (``mfopt.train.fit`` raises :class:`mfopt.train.NonFiniteError`) is an
outcome, not an abort (the seed 000 scripts' ``_mf_common.run_cell`` rule): :func:`run_one`
returns it marked ``diverged`` with ``nan`` metrics and no history; :func:`add_efficiency`
gives it no efficiency and no epochs to target; :func:`fmt_runs` / :func:`fmt_ms` leave it out
of every mean and count it (``diverged (k/n)``); :func:`auto_target` ignores it;
:func:`censored_epochs` gives it ``nan`` and :func:`verdict` calls any claim involving it "not
reproduced at this scale (k of n runs diverged)". In the helpers' per-seed value lists a
``nan`` therefore means "this run diverged".
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import mfopt
from experiments import _bench
from experiments._averaging_common import mesh_for  # noqa: F401 (also used by seed-004 scripts)
from mfopt import batchnorm, costmodel, data as data_lib, metrics, parallel, precision, runner
from mfopt import hybrid_switch_step, train
from mfopt import models as models_lib

ALGORITHMS = ("hybrid", "adabound", "warmup_sgd")
LABELS = {"hybrid": "AdaBound warmup + LARS SGD (hybrid)", "adabound": "AdaBound",
          "warmup_sgd": "gradual warmup + linear-scaling SGD"}
NOT_REPRODUCED = "not reproduced at this scale"

#: The names the seed-004 experiments can build (an MLP, CNN or ResNet on class labels); their
#: ``CHOICES``, which the runner checks before anything runs.
CHOICES = {"model": models_lib.classifiers, "dataset": data_lib.classification_datasets}


def base_config(quick: bool) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.dataset = "mnist1d"
  c.num_train = 1024 if quick else 4000
  c.num_test = 256 if quick else 1000
  c.model = "cnn"
  c.features = (8,) if quick else (32, 64)
  c.num_workers = 8
  c.per_worker_batch = 16
  c.epochs = 2 if quick else 30
  c.warmup_epochs = 1.0 if quick else 3.0  # (a float: T may be fractional)
  c.base_lr = 0.1
  c.alpha = 1e-3
  c.decay = 0.9
  c.momentum = 0.9
  c.weight_decay = 1e-4
  c.trust_coefficient = 1e-3
  c.bn = "last_batch"
  c.comm_dtype = "none"  # "none" | "bfloat16" | "float16": gradient all-reduce dtype
  c.seeds = (0,) if quick else (0, 1, 2)
  c.target_accuracy = 0.0  # 0: 95% of the best mean final test accuracy in the run
  c.net = "100gbit"
  c.progress = not quick
  return c


def validate_common(c) -> None:
  runner.require_positive(c, "num_train", "num_test", "num_workers", "per_worker_batch",
                          "epochs", "base_lr", "alpha", "trust_coefficient")
  # (the dataset: CHOICES, any classification dataset; a second list here refused every TFDS
  # one, cifar10 included, which these experiments run on as they do on the embedded two)
  runner.require_choice(c, "bn", batchnorm.STRATEGIES)
  runner.require_choice(c, "comm_dtype", ("none", "bfloat16", "float16"))
  if not 0 < c.decay <= 1:
    raise runner.ConfigError(f"config field 'decay' must be in (0, 1], got {c.decay!r}")
  if not c.seeds:
    raise runner.ConfigError("config field 'seeds' must not be empty")
  # (hybrid_warmup_T has warmup_values instead, checked the same way)
  if c.model not in models_lib.CLASSIFIERS:  # a registered model: the policies set its dtype
    built = models_lib.get_model(c.model, num_classes=2)
    if not hasattr(built, "dtype"):
      raise runner.ConfigError(
          f"config field 'model': {c.model!r} (registered) has no 'dtype' field, which these "
          f"experiments set to the run's compute dtype (mfopt.precision.apply_policy); give "
          f"the module a field `dtype: Any = jnp.float32` used by its layers")
  if "warmup_epochs" in c and not 0 < c.warmup_epochs < c.epochs:
    # as long as the run (or longer), the hybrid never left its AdaBound warm-up and was
    # judged as the hybrid anyway
    raise runner.ConfigError(f"config field 'warmup_epochs' must be in (0, epochs={c.epochs}) "
                             f"(the hybrid must reach its SGD phase), got {c.warmup_epochs!r}")


def steps_per_epoch(c, dataset, per_worker_batch: int | None = None) -> int:
  """A run's steps per epoch at ``per_worker_batch`` (default ``c.per_worker_batch``): whole
  global batches, at least one (its schedule's epoch; each pass drops the remainder)."""
  b = per_worker_batch or c.per_worker_batch
  return max(len(dataset.train) // (c.num_workers * b), 1)


def require_hybrid_reaches_sgd(c, dataset, *, warmups: Sequence[float] | None = None,
                               batches: Sequence[int] | None = None,
                               fewest_steps: Callable[[int], int] | None = None) -> None:
  """Before anything trains: every hybrid the run builds (each warm-up ``T`` in ``warmups``
  at each per-worker batch in ``batches``) reaches its SGD phase. ``T < epochs`` (the config
  check) can still round up to the run's last step (``hybrid_switch_step``: T = 0.95 of one
  8-step epoch switches at step 8). ``fewest_steps(steps)``: the fewest steps a run of nominal
  ``steps`` takes over the seeds (bn_strategies' row 1 draws its batches)."""
  for t in warmups or (c.warmup_epochs,):
    for b in batches or (c.per_worker_batch,):
      spe = steps_per_epoch(c, dataset, b)
      steps = c.epochs * spe
      fewest = min(steps, fewest_steps(steps)) if fewest_steps else steps
      switch = hybrid_switch_step(t, spe)
      if switch >= fewest:
        note = "" if fewest == steps else " (the fewest a seed's row takes)"
        raise runner.ConfigError(
            f"the hybrid's warm-up T = {t:g} epochs is {switch} steps ({spe} per epoch at "
            f"per-worker batch {b}) of a run of {fewest} steps{note}: it would never reach its "
            "SGD phase; use a smaller T or more epochs")


def load_dataset(c) -> data_lib.Dataset:
  return data_lib.load_sized(c.dataset, c.num_train, c.num_test)


def _warmup_text(c) -> str:
  """The warmup T of a config: ``warmup_epochs``, or the values hybrid_warmup_T sweeps."""
  if "warmup_values" in c:
    return ", ".join(f"{t:g}" for t in c.warmup_values)
  return f"{c.warmup_epochs:g}"


def warmup_sgd_schedule(*, base_lr, num_workers, steps_per_epoch, warmup_epochs, decay):
  # the same number of warm-up updates as the hybrid's (ceil(T x steps/epoch)); round() gave
  # one fewer where T x steps/epoch ends in .5 (T = 0.25 at 10 steps/epoch: 2 against 3)
  warm = hybrid_switch_step(warmup_epochs, steps_per_epoch)
  peak = base_lr * num_workers

  def schedule(count):
    rise = base_lr + (peak - base_lr) * jnp.minimum(count, warm) / warm
    after = peak * decay ** jnp.maximum((count - warm) // steps_per_epoch, 0)
    return jnp.where(count < warm, rise, after)

  return schedule


def make_tx(algo: str, c, *, num_workers: int, steps_per_epoch: int,
            warmup_epochs: float | None = None) -> optax.GradientTransformation:
  t = c.warmup_epochs if warmup_epochs is None else warmup_epochs
  comm = None if c.comm_dtype == "none" else jnp.dtype(c.comm_dtype)
  sync = mfopt.sync_gradients(parallel.WORKER_AXES, comm_dtype=comm)
  if algo == "hybrid":
    opt = mfopt.hybrid_adabound_lars(
        num_workers=num_workers, steps_per_epoch=steps_per_epoch, base_lr=c.base_lr,
        alpha=c.alpha, warmup_epochs=t, decay=c.decay, momentum=c.momentum,
        weight_decay=c.weight_decay, trust_coefficient=c.trust_coefficient,
        axis_name=parallel.WORKER_AXES)
  elif algo == "adabound":
    opt = mfopt.adabound(c.alpha, final_lr=c.base_lr * num_workers)
  elif algo == "warmup_sgd":
    sched = warmup_sgd_schedule(base_lr=c.base_lr, num_workers=num_workers,
                                steps_per_epoch=steps_per_epoch, warmup_epochs=t, decay=c.decay)
    opt = optax.chain(optax.add_decayed_weights(c.weight_decay),
                      optax.sgd(sched, momentum=c.momentum))
  else:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algo!r}")
  return mfopt.chain(sync, opt)  # (keeps the hybrid's host schedule; optax.chain dropped it)


#: The models built with a BN strategy's arguments (a registered model gets num_classes only).
BN_MODELS = ("cnn", "resnet18", "resnet50")


def unused_fields(c) -> dict[str, str]:
  """Fields the config's model does not take (``runner.prepare`` refuses them when given):
  ``features`` outside the CNN, ``bn`` outside the BN models (the MLP, a registered one)."""
  out = {}
  if c.model != "cnn":
    out["features"] = f"model={c.model!r} takes no channel widths (only 'cnn' does)"
  if c.model not in BN_MODELS:
    out["bn"] = f"model={c.model!r} is not built with a BN strategy (only {BN_MODELS} are)"
  return out


def model_text(c, bn: str | None = None) -> str:
  """The model and BN strategy as built (the MLP's own widths, no BN; a ResNet's fixed
  widths): "model mlp (features (8,)), BN strategy last_batch" was printed for an MLP."""
  if c.model == "cnn":
    return f"model cnn (features {tuple(c.features)}), {bn or f'BN strategy {c.bn}'}"
  if c.model == "mlp":
    return "model mlp (hidden widths (256, 256), its default), no BatchNorm"
  if c.model not in BN_MODELS:
    return f"model {c.model} (registered: built with num_classes only)"
  return f"model {c.model} (its standard widths), {bn or f'BN strategy {c.bn}'}"


def build_model(c, dataset, *, policy: str = "fp32", bn: str | None = None):
  """The model of a run: ``c.model`` with the BN strategy's arguments, under ``policy``."""
  strategy = batchnorm.get_strategy(bn or c.bn)
  model = models_lib.get_model(c.model, num_classes=dataset.num_classes,
                               **({"features": tuple(c.features)} if c.model == "cnn" else {}),
                               **(strategy.model_kwargs() if c.model in BN_MODELS else {}))
  return precision.apply_policy(model, policy)


def run_one(c, dataset, algo: str, seed: int, *, policy: str = "fp32",
            per_worker_batch: int | None = None, warmup_epochs: float | None = None,
            bn: str | None = None, desc: str = "", on_log=None) -> dict[str, Any]:
  """One training run; a divergence is returned, not raised.

  Returns:
    ``{"history", "summary", "steps_per_epoch", "num_devices", "per_worker_batch", "seed",
    "diverged", "error", "diverged_at_step"}``. A finished run has ``diverged`` false and
    ``error`` / ``diverged_at_step`` ``None`` (in its summary too). If ``mfopt.train.fit`` raised
    ``NonFiniteError`` (a non-finite loss or update), the run is the one
    :func:`diverged_run` builds: ``diverged`` true, the error's first line, the first
    non-finite step, an empty history and ``nan`` summary metrics; a line naming it goes to
    stderr. Rerunning in the same workdir retrains it from its last good checkpoint and it
    diverges again (deterministic), so the experiment still finishes and reports it.
  """
  b = per_worker_batch or c.per_worker_batch
  spe = steps_per_epoch(c, dataset, b)
  num_steps = c.epochs * spe
  model = build_model(c, dataset, policy=policy, bn=bn)
  tx = precision.with_policy(
      make_tx(algo, c, num_workers=c.num_workers, steps_per_epoch=spe,
              warmup_epochs=warmup_epochs), policy)
  mesh = mesh_for(c.num_workers)
  num_devices = mesh.shape[parallel.DATA_AXIS]
  try:
    result = train.fit(model=model, tx=tx, dataset=dataset, num_workers=c.num_workers,
                       per_worker_batch=b, num_steps=num_steps, mesh=mesh, seed=seed,
                       log_every=spe, eval_every=spe, progress=c.progress, desc=desc,
                       on_log=on_log)
  except train.NonFiniteError as e:
    return diverged_run(e, seed=seed, desc=desc, num_workers=c.num_workers, per_worker_batch=b,
                        num_steps=num_steps, steps_per_epoch=spe, num_devices=num_devices)
  summary = {**result.summary, "diverged": False, "error": None, "diverged_at_step": None}
  return {"history": result.history, "summary": summary,
          "steps_per_epoch": spe, "num_devices": num_devices, "per_worker_batch": b,
          "seed": seed, "diverged": False, "error": None, "diverged_at_step": None,
          "build": {"algo": algo, "policy": policy, "bn": bn, "warmup_epochs": warmup_epochs}}


def one_worker_step_s(c, dataset, *, algo: str, per_worker_batch: int, policy: str = "fp32",
                      bn: str | None = None, warmup_epochs: float | None = None, steps: int = 8,
                      repeats: int = 3) -> float:
  """Seconds of one worker's train step alone on one device: the compute time of the seed-004
  projections (``mfopt.metrics.efficiency_report(one_worker_step_s=...)``).

  A run's ``train_s x devices / workers`` is not it: the run's virtual workers go through one
  ``vmap``-batched step, which made one worker look 2.05x faster than it is alone (2 CPU
  cores, W = 8; a review's measurement), so the projected efficiency came out too low and the
  single-GPU time too short. Here: the run's model, precision policy, BN strategy, optimizer
  and per-worker batch, one worker on this process's first device, one fixed batch; compiled
  and warmed up, then the fastest of ``repeats`` timings of ``steps`` steps (other load only
  slows a repeat down). The steps timed are the optimizer's first (the hybrid's AdaBound
  warm-up); the update is a small part of a step.
  """
  if not 0 < steps <= 16:
    raise ValueError(f"steps must be in [1, 16] (queued without a wait), got {steps!r}")
  b = per_worker_batch
  spe = steps_per_epoch(c, dataset, b)  # the run's schedule
  model = build_model(c, dataset, policy=policy, bn=bn)
  tx = precision.with_policy(make_tx(algo, c, num_workers=c.num_workers, steps_per_epoch=spe,
                                     warmup_epochs=warmup_epochs), policy)
  mesh = parallel.make_mesh(jax.local_devices()[:1])  # (each process times its own)
  batcher = data_lib.WorkerBatcher(dataset.train, num_workers=1, per_worker_batch=b, seed=0)
  batch = parallel.shard_workers(batcher.batch(0), mesh)
  state = train.init_train_state(model, tx, batcher.batch(0)["x"][0], num_workers=1, mesh=mesh)
  step = train.make_train_step(model, tx, mesh=mesh, num_workers=1)
  # the benchmarks' harness: one warm-up call (the compile), then `repeats` timings of `steps`
  # steps (few: XLA:CPU's deadlock needed ~32 queued); the fastest, in seconds per step
  runner = _bench.Runner(step, state, (batch,), out_state=lambda out: out[0])
  timing, = _bench.time_interleaved([runner], warmup=1, reps=repeats, iters=steps)
  return min(timing.samples)


def diverged_run(error: train.NonFiniteError, *, seed: int, desc: str, num_workers: int,
                 per_worker_batch: int, num_steps: int, steps_per_epoch: int,
                 num_devices: int) -> dict[str, Any]:
  """The run record of a run stopped by ``error`` (the shape :func:`run_one` returns).

  ``diverged`` is true, ``error`` the message's first line, ``diverged_at_step`` its first
  non-finite step; ``history`` is empty (the rows logged before the divergence are in
  ``metrics.jsonl``); the summary is ``mfopt.train.diverged_summary``'s (the planned
  ``steps`` / ``num_workers`` / ``per_worker_batch`` / ``global_batch``, ``nan`` for every
  metric, timing and communication counter, the same ``diverged`` / ``error`` /
  ``diverged_at_step``).
  """
  summary = train.diverged_summary(error, num_steps=num_steps, num_workers=num_workers,
                                   per_worker_batch=per_worker_batch)
  text = summary["error"]
  print(f"{desc or f'seed {seed}'}: diverged: {text}", file=sys.stderr)
  return {"history": [], "summary": summary, "steps_per_epoch": steps_per_epoch,
          "num_devices": num_devices, "per_worker_batch": per_worker_batch, "seed": seed,
          "diverged": True, "error": text, "diverged_at_step": error.step}


def is_diverged(run: Mapping[str, Any]) -> bool:
  """Whether a run record (from :func:`run_one` or :func:`diverged_run`) diverged."""
  return bool(run.get("diverged"))


def first_ok(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """The first run that did not diverge (``None`` if every one did)."""
  return next((r for r in runs if not is_diverged(r)), None)


def add_efficiency(runs: Sequence[dict[str, Any]], target: float, c, dataset) -> None:
  """Adds ``run["efficiency"]`` (``mfopt.metrics.efficiency_report``) to every run.

  A diverged run gets the same keys with no values: ``nan`` speeds, times and efficiency
  (``efficiency_source`` "n/a (run diverged)"), ``epochs_to_target`` ``None`` (never reached)
  and ``convergence_rate`` 0.
  """
  device = jax.devices()[0].device_kind if jax.devices()[0].platform != "cpu" else "CPU"
  timed: dict[tuple[Any, ...], float] = {}  # one timing per build, shared by its seeds
  for r in runs:
    if is_diverged(r):
      r["efficiency"] = {
          "single_device_speed": math.nan, "speed_device": device,
          "speed_source": "n/a (run diverged)", "compute_s": math.nan,
          "comm_s": math.nan, "scaling_efficiency": math.nan,
          "efficiency_source": "n/a (run diverged)", "target_accuracy": target,
          "epochs_to_target": None, "convergence_rate": 0.0,
          "actual_single_gpu_time_s": math.nan, "actual_training_time_s": math.nan}
      continue
    build = {**r.get("build", {"algo": "hybrid"}), "per_worker_batch": r["per_worker_batch"]}
    key = tuple(sorted(build.items()))
    if key not in timed:
      timed[key] = one_worker_step_s(c, dataset, **build)
    r["efficiency"] = metrics.efficiency_report(
        summary=r["summary"], history=r["history"], target=target,
        samples_per_epoch=len(dataset.train), num_devices=r["num_devices"], net=c.net,
        device=device, one_worker_step_s=timed[key])


def auto_target(c, finals: Mapping[Any, Sequence[float]]) -> float:
  """``c.target_accuracy`` if given, else 95 % of the best mean final test accuracy.

  Means are over the finite values (a diverged run's ``nan`` is left out); ``nan`` if every
  run diverged (then no run reaches it).
  """
  if c.target_accuracy > 0:
    return float(c.target_accuracy)
  means = [float(np.mean(f)) for f in
           ([x for x in v if x is not None and np.isfinite(x)] for v in finals.values()) if f]
  if not means:
    return math.nan
  return float(math.floor(0.95 * max(means) * 1000) / 1000)


def fmt_target(target: float) -> str:
  """The target accuracy for report text: ``n/a`` when :func:`auto_target` found none."""
  return f"{target:g}" if np.isfinite(target) else "n/a (every run diverged)"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
  if v.size == 0:
    return float("nan"), float("nan")
  return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt_ms(values: Sequence[float | None], digits: int = 4, *,
           diverged: Sequence[bool] | None = None) -> str:
  """``mean ± std`` over seeds for a table cell.

  Seeds flagged in ``diverged`` are left out and counted: ``0.91 ± 0.01 (1/3 diverged)``,
  ``diverged (3/3)`` when every seed diverged (never a number from a diverged run). Among the
  others a ``None`` / non-finite value (a target never reached) is left out of the mean and
  counted as ``never``: ``3 ± 0.5 (1 of 3 never)``. A mean of one value out of several seeds
  has no spread to show: ``0.91 (1 seed; 2/3 diverged)``.
  """
  vals = list(values)
  flags = [False] * len(vals) if diverged is None else [bool(d) for d in diverged]
  if len(flags) != len(vals):
    raise ValueError(f"fmt_ms: {len(vals)} values but {len(flags)} diverged flags")
  n, k = len(vals), sum(flags)
  if n and k == n:
    return f"diverged ({k}/{n})"
  kept = [x for x, d in zip(vals, flags) if not d]
  m, s = mean_std(kept)
  missing = sum(1 for x in kept if x is None or not np.isfinite(x))
  one = len(kept) - missing == 1  # one value (one seed, or the others left out): no spread
  text = "n/a" if not np.isfinite(m) else f"{m:.{digits}g}" + ("" if one else f" ± {s:.2g}")
  notes = (["1 seed"] if one else []) + ([f"{missing} of {n} never"] if missing else []) + (
      [f"{k}/{n} diverged"] if k else [])
  return text + (f" ({'; '.join(notes)})" if notes else "")


def fmt_runs(runs: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None],
             digits: int = 4) -> str:
  """:func:`fmt_ms` of ``value(run)`` over the runs that did not diverge, diverged counted.

  ``value`` is never called on a diverged run (its history is empty, its metrics ``nan``).
  """
  return fmt_ms([None if is_diverged(r) else value(r) for r in runs], digits,
                diverged=[is_diverged(r) for r in runs])


def fmt_shared(runs: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None],
               digits: int = 4) -> str:
  """A value computed from one timing shared by a build's seeds (:func:`add_efficiency`): one
  number, said to be one timing, where the runs agree (to rounding); else :func:`fmt_runs`.
  Through ``fmt_runs`` it read as a spread measured over seeds: ``7.532e+04 ± 0``."""
  values = [value(r) for r in runs if not is_diverged(r)]
  if len(values) > 1 and all(v is not None and math.isfinite(v) for v in values) and (
      max(values) - min(values) <= 1e-9 * max(abs(v) for v in values)):
    k = len(runs) - len(values)
    diverged = f"; {k}/{len(runs)} diverged" if k else ""
    return f"{values[0]:.{digits}g} (one timing, shared by {len(values)} seeds{diverged})"
  return fmt_runs(runs, value, digits)


def censored_epochs(runs: Sequence[dict[str, Any]], epochs: int) -> list[float]:
  """Epochs to target per run; a run that never reached it counts as ``epochs + 1``.

  That is a lower bound on its true value, so a claim "x converges in fewer epochs than y"
  judged with a censored y is judged conservatively (the true difference is larger). A
  diverged run has no such bound: ``nan``, which :func:`verdict` reports as a divergence.
  """
  return [math.nan if is_diverged(r) else r["efficiency"]["epochs_to_target"] or float(epochs + 1)
          for r in runs]


def verdict(a: Sequence[float], b: Sequence[float], *, expect_greater: bool, what: str
            ) -> dict[str, Any]:
  """SPEC.md rule on per-seed paired values: claimed sign and |mean diff| > 2 std of the diffs.

  A non-finite value marks a run that diverged (every helper here gives it ``nan``). A claim
  involving a diverged run is "not reproduced at this scale (k of n runs diverged)"; the mean
  and std are then over the seeds where neither run diverged (``nan`` if none), for
  information. ``seeds`` counts the seeds the difference is over, ``diverged`` the diverged
  runs among the ``runs`` compared.
  """
  a, b = np.asarray(a, float), np.asarray(b, float)
  if a.shape != b.shape:
    raise ValueError(f"verdict: {a.size} values against {b.size} (pair them by seed)")
  ok = np.isfinite(a) & np.isfinite(b)
  k = int((~np.isfinite(a)).sum() + (~np.isfinite(b)).sum())
  d = a[ok] - b[ok]
  m = float(d.mean()) if d.size else float("nan")
  s = float(d.std(ddof=1)) if d.size > 1 else float("inf") if d.size else float("nan")
  out = {"claim": what, "mean_diff": m, "std_diff": s, "seeds": int(d.size), "diverged": k,
         "runs": int(a.size + b.size)}
  if k:
    out["verdict"] = f"{NOT_REPRODUCED} ({k} of {a.size + b.size} runs diverged)"
  else:
    good = d.size > 1 and (m > 0) == expect_greater and abs(m) > 2 * s
    out["verdict"] = "reproduced" if good else NOT_REPRODUCED
  return out


def verdict_lines(verdicts) -> list[str]:
  lines = []
  for v in verdicts:
    spread = ("no spread (1 seed)" if v["seeds"] == 1 else f"std {v['std_diff']:.3g}")
    if not v.get("diverged"):
      stats = f"{spread}, {v['seeds']} seed(s)"
    elif v["seeds"]:
      stats = f"{spread}, over the {v['seeds']} seed(s) where neither run diverged"
    else:
      lines.append(f"- **{v['verdict']}**: {v['claim']} (no seed where neither run diverged)")
      continue
    lines.append(f"- **{v['verdict']}**: {v['claim']} (mean paired difference "
                 f"{v['mean_diff']:.4g}, {stats})")
  return lines


def run_record(run: Mapping[str, Any]) -> dict[str, Any]:
  """A run as ``runs.json`` holds it.

  ``seed``, ``diverged`` (and for a diverged run ``error`` and ``diverged_at_step``),
  ``history``, ``summary``, ``efficiency``.
  """
  rec: dict[str, Any] = {"seed": run.get("seed"), "diverged": is_diverged(run)}
  if is_diverged(run):
    rec.update(error=run["error"], diverged_at_step=run["diverged_at_step"])
  rec.update(history=run["history"], summary=run["summary"], efficiency=run["efficiency"])
  return rec


def curve(run: Mapping[str, Any], key: str) -> tuple[list[float], list[float]]:
  """``(epochs, values of key)`` from a run's history; empty for a diverged run."""
  rows = [h for h in run["history"] if key in h]
  return [h["epoch"] for h in rows], [h[key] for h in rows]


def curve_label(label: str, run: Mapping[str, Any]) -> str:
  """A plot legend entry; a diverged run (no line) says so."""
  return f"{label} (diverged at step {run['diverged_at_step']})" if is_diverged(run) else label


def diverged_lines(runs: Mapping[Any, Sequence[dict[str, Any]]],
                   name: Callable[[Any], str] = str) -> list[str]:
  """A report section listing every diverged run and its error (empty if none diverged)."""
  from mfopt import report
  return report.diverged_section(
      [(f"{name(key)}, seed {r['seed']}", r) for key, rs in runs.items() for r in rs],
      "They are left out of every mean and counted in the tables (`diverged (k/n)`, or "
      "`(k/n diverged)` beside the mean of the others), never reach the target, have no "
      f"efficiency, and make any claim involving them \"{NOT_REPRODUCED}\". Rows they logged "
      "before diverging are in `metrics.jsonl`.")


def setup_lines(c, dataset, *, extra: str = "", batches: Sequence[int] | None = None,
                bn: str | None = None) -> list[str]:
  """The report's setup section. ``batches``: the per-worker batches the rows run at (default
  ``c.per_worker_batch``); with several, each one's steps and samples (an epoch is
  ``floor(N / global batch)`` steps, so the samples differ by each batch's dropped remainder).
  ``bn``: the BN text, where the rows do not all use ``c.bn``."""
  from mfopt import report
  env = report.environment()
  batches = tuple(batches or (c.per_worker_batch,))
  devices = f"{c.num_workers} (virtual, on {min(env['device_count'], c.num_workers)} device(s))"
  per_batch = []
  for b in batches:
    spe = steps_per_epoch(c, dataset, b)
    per_batch.append((b, spe, c.epochs * spe, c.epochs * spe * c.num_workers * b))
  if len(per_batch) == 1:
    b, spe, steps, _ = per_batch[0]
    workers = (f"- Workers: {devices}, per-worker batch {b}, global batch {c.num_workers * b}; "
               f"{c.epochs} epochs = {steps} steps ({spe} steps/epoch) for every algorithm "
               "(equal samples)")
  else:
    workers = (f"- Workers: {devices}; {c.epochs} epochs of floor(N / global batch) steps at "
               "each per-worker batch: " + "; ".join(
                   f"{b}: global batch {c.num_workers * b}, {steps} steps, {samples:,} samples"
                   for b, _, steps, samples in per_batch)
               + ". Rows compared in a claim share a batch (equal samples); across batches the "
               "samples differ by each batch's dropped remainder")
  return [
      report.environment_markdown(env),
      f"- Dataset: {dataset.name}, {len(dataset.train):,} train / {len(dataset.test):,} test "
      f"examples; {model_text(c, bn)}",
      workers,
      f"- Seeds: {tuple(c.seeds)}; base lr {c.base_lr} per worker (x{c.num_workers} linear "
      f"scaling), alpha {c.alpha}, T = {_warmup_text(c)} epochs, decay {c.decay}, momentum "
      f"{c.momentum}, weight decay {c.weight_decay}, LARS trust coefficient {c.trust_coefficient}",
      "- Times: train time measured on this machine (compile excluded); speeds are samples/s "
      "of one worker on one device of this machine, timed alone (W = 1, the run's model, "
      "optimizer and per-worker batch); scaling efficiency and the actual "
      "average single-GPU time are **projected** (cost model, "
      f"{costmodel.link(c.net).describe()}) from the measured "
      "compute time and the all-reduces the transforms counted." + extra,
  ]
