"""mfopt's synchronized train step vs a plain flax + optax train step (issue 8, targets 2 and 5).

Command (same on CPU and GPU; the device is printed in the header line)::

  python -m experiments.bench_train_step           # GPU: full sizes; CPU: reduced sizes
  python -m experiments.bench_train_step --quick   # CI: tiny sizes, 1 repetition

Compared, on one device, per model and compute dtype (bf16 and fp32; parameters and
optimizer state are fp32 in both):

* **mfopt**: ``mfopt.train.make_train_step`` with
  ``optax.chain(mfopt.sync_gradients(WORKER_AXES), optax.sgd(0.1, momentum=0.9))``, W=1
  worker (the worker-stacked ``shard_map`` step every synchronous run uses; with one worker
  per device its forward/backward is not ``vmap``-ed, only the update is; it also computes
  the per-worker metrics loss, accuracy and ``update_norm``);
* **plain**: the textbook flax step written below (``model.apply`` with
  ``mutable=["batch_stats"]``, ``jax.value_and_grad``, ``optax.sgd(0.1, momentum=0.9)``,
  ``optax.apply_updates``, loss returned), jitted with the state donated.

Sizes. GPU: ResNet-18 (CIFAR stem, width 64, 32x32x3, batch 512) and ResNet-50 (ImageNet
stem, 224x224x3, batch 128). ``--quick``: a CNN (4, 8) with BN at 8x8 batch 4. CPU (reduced, as the issue allows; ratios only): ResNet-18
width 16 at 32x32 batch 32, ResNet-50 width 8 at 64x64 batch 8. Data: synthetic (random
normal images, random labels), fixed across steps (the step time does not depend on values).

Figures: images/s of each, ratio mfopt/plain (target >= 0.97), and bf16/fp32 step time of
mfopt's step (target 5: <= 0.6, judged on GPU only: XLA:CPU has no fast bf16 convolutions;
the plain step's ratio beside it). The bf16 and fp32 steps are timed in two interleaved blocks
(each against its plain step), one after the other, not interleaved with each other.
Target 3: a periodic-averaging local train step vs a step with no communication (<= 1.01),
and a sync step's extra cost (see :func:`periodic_step_cost`).

``--devices N`` (N > 1) runs the same comparisons data-parallel over N devices, one worker per
device with the configuration's batch each (target 6 asks for them on 8 fake CPU devices, in
reduced sizes, as ratios only; on CPU the fake devices are made here unless the backend
already runs): mfopt's step with W = N workers against the textbook data-parallel flax + optax
step (:func:`plain_dp_train_step`: ``shard_map``, parameters and optimizer state replicated,
per-device BatchNorm, ``lax.pmean`` of the gradients), and periodic averaging's local and sync
steps against the no-communication step, where the sync now runs an N-way all-reduce. On fake
CPU devices the N "devices" share the host's cores and the all-reduce is a memory copy, so
these ratios are reported, not judged; on N GPUs they are judged like the one-device ones.

  python -m experiments.bench_train_step --devices 8          # 8 fake CPU devices (target 6)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _bench


def plain_train_step(model, tx: optax.GradientTransformation):
  """The baseline: a plain flax + optax step, ``((params, batch_stats, opt_state), x, y) -> (state, loss)``."""

  def step(state, x, y):
    params, batch_stats, opt_state = state

    def loss_fn(p):
      logits, new_vars = model.apply({"params": p, "batch_stats": batch_stats}, x, train=True,
                                     mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), y).mean()
      return loss, new_vars["batch_stats"]

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_stats, opt_state), loss

  return jax.jit(step, donate_argnums=0)


def plain_runner(model, tx, x: np.ndarray, y: np.ndarray, seed: int = 0) -> _bench.Runner:
  from mfopt import models
  params, model_state = models.init_model(model, jax.random.PRNGKey(seed), x[:1])
  state = (params, model_state["batch_stats"], tx.init(params))
  return _bench.Runner(plain_train_step(model, tx), state, (jnp.asarray(x), jnp.asarray(y)),
                       out_state=lambda out: out[0])


def plain_dp_train_step(model, tx: optax.GradientTransformation, mesh):
  """The textbook data-parallel flax + optax step over ``mesh``'s one axis (what ``pmap`` with
  ``lax.pmean`` gives): parameters and optimizer state replicated, the batch and the BatchNorm
  statistics split over the devices (per-device BN, as mfopt's workers have), the gradients
  averaged with ``lax.pmean``. ``((params, batch_stats, opt_state), x, y) -> (state, loss)``
  with ``batch_stats`` stacked over devices and ``x``, ``y`` the global batch."""
  from jax.sharding import PartitionSpec as P
  axis = mesh.axis_names[0]

  def step(state, x, y):
    params, batch_stats, opt_state = state

    def loss_fn(p):
      logits, new_vars = model.apply(
          {"params": p, "batch_stats": jax.tree.map(lambda a: a[0], batch_stats)}, x,
          train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), y).mean()
      return loss, new_vars["batch_stats"]

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grads = jax.lax.pmean(grads, axis)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_stats = jax.tree.map(lambda a: a[None], new_stats)
    return (optax.apply_updates(params, updates), new_stats, opt_state), jax.lax.pmean(loss, axis)

  spec = (P(), P(axis), P())
  # check_vma=False: pmap's semantics, where the replicated parameters are each device's own
  # value and their gradient is the device's (then pmean-ed). With JAX's replication typing
  # (check_vma=True) the gradient of a replicated input comes out already summed over the
  # devices, and the pmean above would leave N times the mean gradient
  # (tests/test_bench_quick.py compares this step with mfopt's).
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P(axis), P(axis)),
                               out_specs=(spec, P()), check_vma=False), donate_argnums=0)


def plain_dp_runner(model, tx, x: np.ndarray, y: np.ndarray, devices: int,
                    seed: int = 0) -> _bench.Runner:
  """:func:`plain_dp_train_step` over the first ``devices`` devices; ``x`` is the global batch."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from mfopt import models, parallel
  mesh = parallel.make_mesh(jax.devices()[:devices])
  params, model_state = models.init_model(model, jax.random.PRNGKey(seed), x[:1])
  stats = jax.tree.map(lambda a: np.broadcast_to(a, (devices, *a.shape)),
                       model_state["batch_stats"])
  rep_, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(parallel.DATA_AXIS))
  params = jax.device_put(params, rep_)
  state = (params, jax.device_put(stats, split), jax.device_put(tx.init(params), rep_))
  return _bench.Runner(plain_dp_train_step(model, tx, mesh), state,
                       (jax.device_put(x, split), jax.device_put(y, split)),
                       out_state=lambda out: out[0])


def judged(quick: bool, gpu: bool, devices: int) -> tuple[bool, str]:
  """``(applies, why_not)`` for this run's time targets: not in quick mode, and not on fake CPU
  devices (``devices > 1`` on CPU: they share the host's cores and copy memory for an
  all-reduce, so their ratios are reported only)."""
  if quick:
    return False, "quick mode"
  if devices > 1 and not gpu:
    return False, f"{devices} fake CPU devices: ratios reported only"
  return True, ""


def setup_devices(devices: int) -> None:
  """``devices`` fake CPU devices where the CPU backend has not started (a bench run as a
  script); a running backend (pytest's, with 8) is kept. Checked against what is there."""
  if devices > 1:
    try:
      if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", devices)
    except Exception:  # noqa: BLE001 (the backend already runs: keep its devices)
      pass
  if len(jax.devices()) < devices:
    raise SystemExit(f"--devices {devices}: only {len(jax.devices())} "
                     f"{jax.default_backend()} device(s) here")


def mfopt_runner(model, tx, x: np.ndarray, y: np.ndarray, num_workers: int = 1,
                 seed: int = 0, lowering: str = "vmap",
                 host_gates: bool | None = None, devices: int = 1) -> _bench.Runner:
  """The library's worker-stacked step on the first ``devices`` devices; ``x`` is
  ``(W, B, ...)``."""
  from mfopt import parallel
  from mfopt import train as train_lib
  mesh = parallel.make_mesh(jax.devices()[:devices])
  state = train_lib.init_train_state(model, tx, x[0, :1], num_workers=num_workers, mesh=mesh,
                                     seed=seed)
  step = train_lib.make_train_step(model, tx, mesh=mesh, num_workers=num_workers,
                                   lowering=lowering, host_gates=host_gates)
  batch = parallel.shard_workers({"x": x, "y": y}, mesh)
  return _bench.Runner(step, state, (batch,), out_state=lambda out: out[0])


def synthetic(batch: int, image: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(batch, image, image, 3)).astype(np.float32),
          rng.integers(0, classes, size=(batch,)).astype(np.int32))


def configs(quick: bool, gpu: bool) -> list[dict[str, Any]]:
  if quick:  # CI: a small CNN with BN compiles in a fraction of ResNet-18's time
    return [dict(name="cnn", width=0, image=8, batch=4, classes=10)]
  if gpu:
    return [dict(name="resnet18", width=64, image=32, batch=512, classes=10),
            dict(name="resnet50", width=64, image=224, batch=128, classes=1000)]
  return [dict(name="resnet18", width=16, image=32, batch=32, classes=10),
          dict(name="resnet50", width=8, image=64, batch=8, classes=1000)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  def extra(p):
    p.add_argument("--periodic-only", action="store_true",
                   help="only target 3 (periodic averaging's local and sync steps vs no "
                        "communication)")
    p.add_argument("--bn-variants", action="store_true",
                   help="also time the library's step with the models' bn_impl='mfopt' "
                        "(GroupBatchNorm with one group: a hand-written BN backward pass)")
    p.add_argument("--devices", type=int, default=1,
                   help="data-parallel over this many devices, one worker each (> 1: fake "
                        "CPU devices on CPU, target 6; default 1)")

  args = _bench.parse_args(argv, __doc__.splitlines()[0], extra)
  if args.devices < 1:
    raise SystemExit(f"--devices must be positive, got {args.devices}")
  if args.devices > 1 and args.bn_variants:
    raise SystemExit("--bn-variants is a one-device comparison; drop it with --devices "
                     f"{args.devices}")
  setup_devices(args.devices)
  import mfopt
  from mfopt import models, parallel

  gpu = jax.default_backend() == "gpu"
  n = args.devices
  report = _bench.Report("bench_train_step", args)
  warmup, reps, iters = (2, 1, 1) if args.quick else (2, args.reps or (10 if gpu else 5),
                                                      5 if gpu else 1)
  report.note(f"harness: jit, state donated, {warmup} warm-up, {reps} interleaved reps x "
              f"{iters} steps, block_until_ready per rep; sizes "
              f"{'full (GPU)' if gpu and not args.quick else 'REDUCED (CPU/quick): ratios only'}")
  results = []
  for cfg in ([] if args.periodic_only else configs(args.quick, gpu)):
    x, y = synthetic(cfg["batch"], cfg["image"], cfg["classes"])
    step_time = {}
    for dtype_name, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
      size = {"features": (4, 8)} if cfg["name"] == "cnn" else {"width": cfg["width"]}
      model = models.get_model(cfg["name"], num_classes=cfg["classes"], dtype=dtype, **size)
      sgd = optax.sgd(0.1, momentum=0.9)
      sync = optax.chain(mfopt.sync_gradients(parallel.WORKER_AXES), sgd)
      if n == 1:
        runners = [mfopt_runner(model, sync, x[None], y[None]), plain_runner(model, sgd, x, y)]
      else:  # one worker per device, each with the configuration's batch
        xg, yg = synthetic(n * cfg["batch"], cfg["image"], cfg["classes"])
        runners = [mfopt_runner(model, sync, xg.reshape(n, *x.shape), yg.reshape(n, -1),
                                num_workers=n, devices=n),
                   plain_dp_runner(model, sgd, xg, yg, n)]
      if args.bn_variants:
        runners.append(mfopt_runner(model.clone(bn_impl="mfopt"), sync, x[None], y[None]))
      t_mf, t_plain, *t_bn = _bench.time_interleaved(runners, warmup=warmup, reps=reps,
                                                     iters=iters)
      ratio = t_plain.median / t_mf.median  # images/s ratio mfopt / plain
      label = (f"{cfg['name']} width {cfg['width']} {cfg['image']}x{cfg['image']} "
               f"batch {cfg['batch']}{f' x {n} devices' if n > 1 else ''} {dtype_name}")
      plain_name = "plain flax+optax" if n == 1 else "plain data-parallel flax+optax (pmean)"
      images = n * cfg["batch"]
      report.figure(f"{label} | mfopt sync step / {plain_name} (images/s)", ratio, "x",
                    f"mfopt {images / t_mf.median:,.1f} img/s ({t_mf.spread()}); plain "
                    f"{images / t_plain.median:,.1f} img/s ({t_plain.spread()})",
                    config=cfg, dtype=dtype_name, mfopt=t_mf.as_dict(),
                    plain=t_plain.as_dict(), ratio=ratio)
      results.append((label, ratio))
      if t_bn:  # reported, not judged: the library's default BN is flax's
        report.figure(f"{label} | mfopt sync step with bn_impl='mfopt' / plain flax+optax "
                      "(images/s)", t_plain.median / t_bn[0].median, "x",
                      f"{cfg['batch'] / t_bn[0].median:,.1f} img/s ({t_bn[0].spread()}); "
                      f"against the library's default step: "
                      f"{t_mf.median / t_bn[0].median:.3f}x", config=cfg, dtype=dtype_name,
                      bn_impl="mfopt", timing=t_bn[0].as_dict())
      step_time[dtype_name] = (t_mf.median, t_plain.median)
    # target 5 is mfopt's mixed precision: its own step's ratio (the plain step's was judged)
    mp = step_time["bf16"][0] / step_time["fp32"][0]
    report.figure(f"{cfg['name']} width {cfg['width']} batch {cfg['batch']} | bf16 / fp32 step "
                  f"time (mfopt step)", mp, "x time",
                  f"plain step: {step_time['bf16'][1] / step_time['fp32'][1]:.3f}x")
    results.append((f"target 5: {cfg['name']} bf16/fp32", mp))
  local_ratio = periodic_step_cost(report, args, gpu, warmup=warmup, reps=reps, iters=iters,
                                   devices=n)
  applies, why_not = judged(args.quick, gpu, n)
  for label, value in results:
    if label.startswith("target 5"):
      report.target(label, value, "<=", 0.6, applies=gpu and applies,
                    why_not="GPU target; CPU has no fast bf16" if not gpu else why_not)
    else:
      report.target(f"target 2: {label} images/s mfopt/plain", value, ">=", 0.97,
                    applies=applies, why_not=why_not)
  if local_ratio is not None:
    report.target(f"target 3: periodic_averaging local train step / no-communication step"
                  f"{f', {n} devices' if n > 1 else ''}", local_ratio, "<=", 1.01,
                  applies=applies, why_not=why_not)
  return report.finish()


def periodic_step_cost(report: _bench.Report, args, gpu: bool, *, warmup: int, reps: int,
                       iters: int, devices: int = 1) -> float | None:
  """Target 3: a local step of periodic averaging vs a step with no communication at all.

  Three worker-stacked steps (``mfopt.train.make_train_step``, one worker per device on
  ``devices`` devices) of the first model of :func:`configs`, interleaved: inner
  ``optax.sgd(momentum=0.9)`` alone (no communication), ``periodic_averaging`` with a period
  never due (local steps), and with period 1 (a sync step every step: its extra cost; with
  one device the all-reduce spans one worker, so this is the sync branch's compute, not
  network time; with several it is a ``devices``-way all-reduce of the parameters).
  """
  import mfopt
  from mfopt import models, parallel
  averaging = getattr(mfopt, "periodic_averaging", None)
  if averaging is None:
    report.note("periodic_averaging: not on main yet (skipped)")
    return None
  cfg = configs(args.quick, gpu)[0]
  x, y = synthetic(devices * cfg["batch"], cfg["image"], cfg["classes"])
  x, y = x.reshape(devices, cfg["batch"], *x.shape[1:]), y.reshape(devices, cfg["batch"])
  size = {"features": (4, 8)} if cfg["name"] == "cnn" else {"width": cfg["width"]}
  dtype_name, dtype = ("bf16", jnp.bfloat16) if gpu else ("fp32", jnp.float32)
  model = models.get_model(cfg["name"], num_classes=cfg["classes"], dtype=dtype, **size)
  sgd = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
  never = lambda: averaging(sgd(), parallel.WORKER_AXES, 10**9)  # noqa: E731
  # The library's step (host-decided gates off CPU: make_train_step's default), and the same
  # local step with the device-side gate (host_gates=False: the loop the host waits on).
  on = dict(num_workers=devices, devices=devices)
  runners = [mfopt_runner(model, sgd(), x, y, **on),
             mfopt_runner(model, never(), x, y, **on),
             mfopt_runner(model, averaging(sgd(), parallel.WORKER_AXES, 1), x, y, **on),
             mfopt_runner(model, never(), x, y, host_gates=False, **on)]
  t_none, t_local, t_sync, t_device = _bench.time_interleaved(runners, warmup=warmup, reps=reps,
                                                              iters=iters)
  label = (f"{cfg['name']} batch {cfg['batch']}{f' x {devices} devices' if devices > 1 else ''}"
           f" {dtype_name}")
  ratio = t_local.median / t_none.median
  gates = "host-decided gates" if jax.default_backend() != "cpu" else "device-side gate (CPU default)"
  report.figure(f"{label} | periodic_averaging local step / no-communication step", ratio,
                "x time", f"library default ({gates}); local {t_local.spread()}; no "
                f"communication {t_none.spread()}")
  report.figure(f"{label} | periodic_averaging local step, device-side gate (host_gates=False) "
                f"/ no-communication step", t_device.median / t_none.median, "x time",
                f"local {t_device.spread()}")
  report.figure(f"{label} | periodic_averaging sync step / no-communication step",
                t_sync.median / t_none.median, "x time",
                f"sync {t_sync.spread()} " + ("(W=1 on one device: sync-branch compute only)"
                                              if devices == 1 else
                                              f"(a {devices}-way all-reduce of the parameters)"))
  return ratio


if __name__ == "__main__":
  main()
