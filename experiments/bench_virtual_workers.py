"""W virtual workers on one device: vmap vs lax.map vs the fast path vs one replica (issue 8, target 4).

Command (same on CPU and GPU; the device is printed in the header line)::

  python -m experiments.bench_virtual_workers           # GPU: ResNet-18 CIFAR bf16; CPU: reduced
  python -m experiments.bench_virtual_workers --quick   # CI: tiny sizes, 1 repetition

Per ``(W, B)`` (W workers x per-worker batch B, global batch W*B), all on ONE device, bf16
compute, fp32 parameters, SGD momentum 0.9, synthetic CIFAR-shaped data:

* ``one replica @ W*B``: the plain flax + optax step of ``bench_train_step`` at the global batch
  (BN over the whole batch) -- the reference throughput;
* ``fast path`` (:mod:`mfopt.fastpath`): synchronous workers as one replica with per-worker BN
  groups -- target 4a: >= 0.97 x one replica;
* ``vmap sync``: ``mfopt.train.make_train_step`` with ``sync_gradients`` (per-worker weights
  under ``vmap``: grouped convolutions);
* ``vmap local``: the same step with the inner optimizer only (no communication: what a
  local-SGD step of periodic averaging runs);
* ``lax.map local``: the workers one after another (``jax.lax.map`` over the worker-stacked
  state and batch), written here.

Target 4b (local algorithms) is reported as ``best(vmap, map) / one replica at W*B``; the
stretch figure 16 x 256 >= 0.75 is judged on GPU only. The automatic choice between the two
lowerings belongs in ``mfopt.train`` (not done in this benchmark; see BENCHMARKS.md).

Sizes. GPU: ResNet-18 width 64, 32x32, (W, B) in (4, 256), (8, 128), (16, 64), (32, 32),
(16, 256). CPU (reduced; ratios only): ResNet-18 width 8, 16x16, (4, 8), (8, 4).
``--quick``: a CNN (4, 8) with BN at 8x8, (2, 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _bench
from experiments.bench_train_step import mfopt_runner, plain_runner, synthetic


def map_runner(model, tx, x: np.ndarray, y: np.ndarray, seed: int = 0) -> _bench.Runner:
  """Workers one after another with ``lax.map`` (local steps, no communication)."""
  from mfopt import models, parallel
  from mfopt import train as train_lib
  num_workers = x.shape[0]
  params, model_state = models.init_model(model, jax.random.PRNGKey(seed), x[0, :1])
  state = parallel.stack_workers((params, model_state, tx.init(params)), num_workers)
  state = jax.tree.map(jnp.array, state)

  def worker(args):
    p, ms, os, xb, yb = args

    def loss_of(q):
      logits, new_ms = models.apply_model(model, q, ms, xb, train=True)
      loss, _ = train_lib.classification_loss(logits, yb)
      return loss, new_ms

    (loss, new_ms), grads = jax.value_and_grad(loss_of, has_aux=True)(p)
    updates, os = tx.update(grads, os, p)
    return optax.apply_updates(p, updates), new_ms, os, loss

  def step(state, xs, ys):
    p, ms, os, loss = jax.lax.map(worker, (*state, xs, ys))
    return (p, ms, os), loss

  return _bench.Runner(jax.jit(step, donate_argnums=0), state,
                       (jnp.asarray(x), jnp.asarray(y)), out_state=lambda out: out[0])


def fast_runner(model, inner, x: np.ndarray, y: np.ndarray, seed: int = 0) -> _bench.Runner:
  from mfopt import fastpath, parallel
  mesh = parallel.make_mesh(jax.devices()[:1])
  num_workers = x.shape[0]
  state = fastpath.init_train_state(model, inner, x[0, :1], num_workers=num_workers, mesh=mesh,
                                    seed=seed)
  step = fastpath.make_train_step(model, inner, mesh=mesh, num_workers=num_workers)
  batch = parallel.shard_workers({"x": x, "y": y}, mesh)
  return _bench.Runner(step, state, (batch,), out_state=lambda out: out[0])


def configs(quick: bool, gpu: bool) -> tuple[dict[str, Any], list[tuple[int, int]]]:
  if quick:
    return dict(width=4, image=8), [(2, 2)]
  if gpu:
    return dict(width=64, image=32), [(4, 256), (8, 128), (16, 64), (32, 32), (16, 256)]
  return dict(width=8, image=16), [(4, 8), (8, 4)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], lambda p: p.add_argument(
      "--dtype", choices=("bf16", "fp32"), default="bf16"))
  import mfopt
  from mfopt import fastpath, models, parallel

  gpu = jax.default_backend() == "gpu"
  report = _bench.Report("bench_virtual_workers", args)
  warmup, reps, iters = (2, 1, 1) if args.quick else (2, args.reps or (10 if gpu else 5),
                                                      5 if gpu else 1)
  model_cfg, shapes = configs(args.quick, gpu)
  dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
  if args.quick:  # CI: a small CNN with BN compiles in a fraction of ResNet-18's time
    model = models.get_model("cnn", features=(4, 8), num_classes=10, dtype=dtype)
  else:
    model = models.get_model("resnet18", num_classes=10, width=model_cfg["width"], dtype=dtype)
  model_name = "CNN (4, 8)" if args.quick else f"ResNet-18 width {model_cfg['width']}"
  report.note(f"{model_name}, {model_cfg['image']}x{model_cfg['image']}, "
              f"{args.dtype}; one device; harness: jit, donated state, {warmup} warm-up, {reps} "
              f"interleaved reps x {iters} steps; "
              f"{'full sizes' if gpu and not args.quick else 'REDUCED sizes (CPU/quick)'}; "
              f"'{fastpath.LABEL}' = mfopt.fastpath (synchronous workers as one replica)")
  targets = []
  for num_workers, batch in shapes:
    x, y = synthetic(num_workers * batch, model_cfg["image"], 10)
    xw = x.reshape(num_workers, batch, *x.shape[1:])
    yw = y.reshape(num_workers, batch)
    sgd = optax.sgd(0.1, momentum=0.9)
    sync = optax.chain(mfopt.sync_gradients(parallel.WORKER_AXES), sgd)
    names = ["one replica @ W*B", fastpath.LABEL, "vmap sync", "vmap local", "lax.map local"]
    runners = [plain_runner(model, sgd, x, y), fast_runner(model, sgd, xw, yw),
               mfopt_runner(model, sync, xw, yw, num_workers=num_workers),
               mfopt_runner(model, sgd, xw, yw, num_workers=num_workers),
               map_runner(model, sgd, xw, yw)]
    timings = _bench.time_interleaved(runners, warmup=warmup, reps=reps, iters=iters)
    images = num_workers * batch
    ref = timings[0].median
    for name, t in zip(names, timings):
      report.figure(f"W={num_workers} B={batch} | {name}", images / t.median, "img/s",
                    f"{ref / t.median:.3f}x one replica; {t.spread()}", num_workers=num_workers,
                    per_worker_batch=batch, variant=name, timing=t.as_dict())
    fast = ref / timings[1].median
    best_local = max(ref / timings[3].median, ref / timings[4].median)
    best_name = "vmap" if timings[3].median <= timings[4].median else "lax.map"
    report.figure(f"W={num_workers} B={batch} | best local lowering ({best_name}) / one replica",
                  best_local, "x")
    targets.append((num_workers, batch, fast, best_local))
  for num_workers, batch, fast, best_local in targets:
    report.target(f"4a: fast path / one replica, W={num_workers} B={batch}", fast, ">=", 0.97,
                  applies=not args.quick, why_not="quick mode")
    if (num_workers, batch) == (16, 256):
      report.target("4b stretch: best local lowering / one replica, 16x256", best_local, ">=",
                    0.75, applies=gpu and not args.quick, why_not="GPU target")
  return report.finish()


if __name__ == "__main__":
  main()
