"""``train.fit`` throughput against how far the host may dispatch ahead (``MAX_STEPS_IN_FLIGHT``).

Command: ``python -m experiments.bench_fit_dispatch [--quick] [--reps N] [--steps N] [--json PATH]``

``fit`` waits for the step ``train.MAX_STEPS_IN_FLIGHT`` (8) back before it dispatches another,
because on XLA:CPU a queue of more than about 32 steps with an in-process all-reduce deadlocks
(see that constant's docstring). This bench measures what the wait costs: steps/s of ``fit``
(``sync_gradients`` + SGD with momentum, the README's MLP on a ``synthetic`` dataset shaped like
``digits``, 64 features and 10 classes, which needs no scikit-learn on a lent GPU; 8 workers
over the devices, logging only at the end so nothing else syncs) with a limit of 8 against a limit of 1
(a sync every step) and 16 (30 still ran on CPU, 34 deadlocked: 16 keeps a margin), and on an
accelerator also without a limit (``10**9``; there, in-process all-reduces do not go through XLA:CPU's
rendezvous). Reported: the median of ``--reps`` interleaved repetitions of each (after one
untimed warm-up run each), and each one's ratio to limit 8. Figures only, no targets.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from experiments import _bench


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  def extra(p):
    p.add_argument("--steps", type=int, default=None,
                   help="train steps per timed run (default 2000, --quick 60)")

  args = _bench.parse_args(argv, __doc__.splitlines()[0], extra)
  import jax
  try:  # 8 fake CPU devices where the CPU backend has not started (no effect on a GPU's)
    jax.config.update("jax_num_cpu_devices", 8)
  except Exception:  # noqa: BLE001 (a running backend, e.g. pytest's with 8, is kept)
    pass
  report = _bench.Report("bench_fit_dispatch", args)
  import optax

  import mfopt
  from mfopt import data, models, train
  steps = args.steps or (60 if args.quick else 2000)
  if steps <= 0:
    raise SystemExit(f"--steps must be positive, got {steps}")
  reps = args.reps or (1 if args.quick else 5)
  limits = [8, 1, 16] + ([] if jax.default_backend() == "cpu" else [10**9])
  ds = data.load("synthetic", num_train=1437, num_test=360, input_shape=(64,))  # digits' sizes
  model = models.get_model("mlp", num_classes=ds.num_classes)
  workers = 8 if 8 % jax.device_count() == 0 else jax.device_count()  # README: 8 workers

  def run(limit: int) -> float:
    saved = train.MAX_STEPS_IN_FLIGHT
    train.MAX_STEPS_IN_FLIGHT = limit
    try:
      tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.01, momentum=0.9))
      result = train.fit(model=model, tx=tx, dataset=ds, num_workers=workers,
                         per_worker_batch=16, num_steps=steps, log_every=steps, progress=False)
    finally:
      train.MAX_STEPS_IN_FLIGHT = saved
    return steps / result.history[-1]["train_time_s"]

  for limit in limits:  # warm-up: compiles (and fills the compilation cache)
    run(limit)
  rates: dict[int, list[float]] = {limit: [] for limit in limits}
  for _ in range(reps):  # interleaved
    for limit in limits:
      rates[limit].append(run(limit))
  med = {limit: float(np.median(r)) for limit, r in rates.items()}
  where = (f"{jax.default_backend()}, {jax.device_count()} device(s), {workers} workers, "
           f"{steps} steps, median of {reps}")
  for limit in limits:
    name = "no limit" if limit == 10**9 else f"limit {limit}"
    report.figure(f"fit steps/s, {name}", med[limit], "steps/s",
                  f"ratio to limit 8: {med[limit] / med[8]:.3f}; {where}",
                  limit=limit, ratio_to_8=med[limit] / med[8])
  return report.finish()


if __name__ == "__main__":
  main()
