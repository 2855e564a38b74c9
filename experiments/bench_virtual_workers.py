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
* ``lax.map local``: the same step with ``lowering="map"`` (the workers' forward/backward one
  after another with ``lax.map``; the update still ``vmap``-ed);
* ``mixed local``: ``lowering="map:K"``, K workers ``vmap``-ed at a time and the W/K groups one
  after another (K the largest power of two <= sqrt(W); absent where that is 1);
* ``unroll local``: ``lowering="unroll"``: the workers one after another as copies of one
  worker's program in a straight line (no ``lax.map`` loop; up to ``UNROLL_MAX_WORKERS``);
* ``gemm local``: ``lowering="gemm"``: ``vmap`` with the model's convolutions computed as
  patches times a matrix (``conv_impl="gemm"``), so per-worker weights give a batched GEMM
  instead of a grouped convolution;
* ``auto local``: ``lowering="auto"``: the step times vmap, map, the mixed lowering, unroll and gemm on
  its first call (a warm-up call here) and keeps the fastest.

``--bn-variants`` adds ``unroll local`` and ``lax.map local`` with the model's
``bn_impl="mfopt"`` (:class:`mfopt.models.GroupBatchNorm` with one group: compiled for an H100
at 16 x 256, ``unroll`` launches 3,881 kernels per step instead of 4,589 and writes 28,199 MB
instead of 29,670; traffic model, ``bench_gpu_hlo``); they count for the best local figure
(the stretch) but not for ``auto``'s target, which chooses among lowerings of one model.

``--compiler-option NAME=VALUE`` (repeatable) adds ``one replica @ W*B``, ``unroll local`` and
``lax.map local`` compiled with those XLA options (per compile, not through ``XLA_FLAGS``), timed
interleaved with the default compiles. They are reported beside the targets, not judged.

``--stretch-only`` times only what the stretch figure needs: ``one replica`` at W*B and at B,
``lax.map local``, ``unroll local`` and their variants (no fast path, vmap, gemm, mixed or auto,
so no 4a or auto target), to fit one GPU call.

``one replica @ B`` (the plain step at the per-worker batch) gives the *sequential reference*
``t(one replica @ W*B) / (W x t(one replica @ B))``: what running the replicas one after another
reaches if each ran as fast as a lone replica at batch B. The lowerings' gap to it is their own
overhead; its gap to 1 is the cost of B-sized steps on the device.

Target 4b (local algorithms): ``auto local >= 0.97 x the best of vmap, lax.map, gemm, unroll and
mixed local`` at every (W, B) (0.97: the timing noise the choice is made under), and
``best local lowering / one replica at W*B`` reported; the stretch figure 16 x 256 >= 0.75 is
judged on GPU only.

Sizes. GPU: ResNet-18 width 64, 32x32, (W, B) in (4, 256), (8, 128), (16, 64), (32, 32),
(16, 256). CPU (reduced; ratios only): ResNet-18 width 8, 16x16, (4, 8), (8, 4), (16, 2),
(32, 1) (W in {4, 8, 16, 32} as in target 4b).
``--quick``: a CNN (4, 8) with BN at 8x8, (2, 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _bench
from experiments.bench_train_step import mfopt_runner, plain_runner, synthetic


def fast_runner(model, inner, x: np.ndarray, y: np.ndarray, seed: int = 0,
                update_in_place: bool = True, group_bn: bool | None = None) -> _bench.Runner:
  from mfopt import fastpath, parallel
  mesh = parallel.make_mesh(jax.devices()[:1])
  num_workers = x.shape[0]
  state = fastpath.init_train_state(model, inner, x[0, :1], num_workers=num_workers, mesh=mesh,
                                    seed=seed)
  step = fastpath.make_train_step(model, inner, mesh=mesh, num_workers=num_workers,
                                  update_in_place=update_in_place, group_bn=group_bn)
  batch = parallel.shard_workers({"x": x, "y": y}, mesh)
  return _bench.Runner(step, state, (batch,), out_state=lambda out: out[0])


def configs(quick: bool, gpu: bool) -> tuple[dict[str, Any], list[tuple[int, int]]]:
  if quick:
    return dict(width=4, image=8), [(2, 2)]
  if gpu:
    return dict(width=64, image=32), [(4, 256), (8, 128), (16, 64), (32, 32), (16, 256)]
  return dict(width=8, image=16), [(4, 8), (8, 4), (16, 2), (32, 1)]


def build_model(quick: bool, model_cfg: dict[str, Any], dtype) -> tuple[Any, str]:
  """The benchmarked model and its name: ResNet-18 at ``model_cfg["width"]``, or with
  ``quick`` a small CNN with BN (compiles in a fraction of ResNet-18's time: CI)."""
  from mfopt import models
  if quick:
    return models.get_model("cnn", features=(4, 8), num_classes=10, dtype=dtype), "CNN (4, 8)"
  return (models.get_model("resnet18", num_classes=10, width=model_cfg["width"], dtype=dtype),
          f"ResNet-18 width {model_cfg['width']}")


def parse_shapes(text: str) -> list[tuple[int, int]]:
  """``"16x64,16x256"`` -> ``[(16, 64), (16, 256)]`` (W x per-worker batch)."""
  shapes = []
  for item in text.split(","):
    w, _, b = item.strip().partition("x")
    if not (w.isdigit() and b.isdigit() and int(w) > 0 and int(b) > 0):
      raise argparse.ArgumentTypeError(
          f"must be a comma list of WxB with positive ints, got {text!r}")
    shapes.append((int(w), int(b)))
  return shapes


# --stretch-only: the runners the 4b stretch figure needs (one device call's time limit).
STRETCH_RUNNERS = ("one replica @ W*B", "one replica @ B", "lax.map local", "unroll local")


def parse_option(text: str) -> tuple[str, Any]:
  """``"xla_gpu_command_buffer_scheduling_mode=CONCURRENT"`` -> ``(name, value)``."""
  name, eq, value = text.partition("=")
  if not (eq and name.strip() and value.strip()):
    raise argparse.ArgumentTypeError(f"must be NAME=VALUE (an XLA DebugOptions field), got {text!r}")
  value = value.strip()
  if value.lower() in ("true", "false"):  # XLA takes bools and ints typed, enums as names
    return name.strip(), value.lower() == "true"
  return name.strip(), int(value) if value.lstrip("-").isdigit() else value


def _extra_args(parser) -> None:
  parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
  parser.add_argument("--shapes", default=None, type=parse_shapes,
                      help="comma list of WxB to run instead of the defaults, e.g. 16x64,16x256 "
                           "(to fit one device call's time limit)")
  parser.add_argument("--fastpath-variants", action="store_true",
                      help="also time the fast path with update_in_place=False (XLA copies the "
                           "updated state) and with group_bn=False (the model vmapped over BN "
                           "groups: the design before GroupBatchNorm), each against the default")
  parser.add_argument("--compiler-option", action="append", type=parse_option, default=[],
                      metavar="NAME=VALUE",
                      help="also time one replica @ W*B and the one-after-another local lowerings "
                           "compiled with this XLA option (repeatable; e.g. "
                           "xla_gpu_command_buffer_scheduling_mode=CONCURRENT: the CUDA graph's "
                           "commands ordered by their buffers, not by the schedule (XLA's default "
                           "LHS), so that independent replicas may overlap)")
  parser.add_argument("--stretch-only", action="store_true",
                      help="time only one replica (at W*B and at B), lax.map and unroll (and "
                           "their --bn-variants / --compiler-option variants): the 4b stretch "
                           "figure, without the fast path, vmap, gemm, mixed and auto")
  parser.add_argument("--bn-variants", action="store_true",
                      help="also time the one-after-another local lowerings (unroll where auto "
                           "has it, and lax.map) with the model's bn_impl='mfopt' "
                           "(models.GroupBatchNorm with one group: fewer kernels per replica), "
                           "each against the same lowering with flax's BatchNorm")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], _extra_args)
  import mfopt
  from mfopt import fastpath, parallel
  from mfopt import train as train_lib

  gpu = jax.default_backend() == "gpu"
  report = _bench.Report("bench_virtual_workers", args)
  warmup, reps, iters = (2, 1, 1) if args.quick else (2, args.reps or (10 if gpu else 5),
                                                      5 if gpu else 1)
  model_cfg, shapes = configs(args.quick, gpu)
  if args.shapes is not None:
    shapes = args.shapes
  dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
  model, model_name = build_model(args.quick, model_cfg, dtype)
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
    candidates = train_lib._auto_candidates(num_workers)
    mixed = next((c for c in candidates if c.startswith("map:")), None)
    # Named runners, timed interleaved in this order; figures and ratios look them up by name.
    # Builders, so that what --stretch-only drops is never initialised, and a --compiler-option
    # variant is a fresh copy of the same runner.
    def local_step(lowering, m=model):
      return lambda: mfopt_runner(m, sgd, xw, yw, num_workers=num_workers, lowering=lowering)

    builders = {
        "one replica @ W*B": lambda: plain_runner(model, sgd, x, y),
        "one replica @ B": lambda: plain_runner(model, sgd, x[:batch], y[:batch]),
        fastpath.LABEL: lambda: fast_runner(model, sgd, xw, yw),
        "vmap sync": lambda: mfopt_runner(model, sync, xw, yw, num_workers=num_workers),
        "vmap local": local_step("vmap"),
        "lax.map local": local_step("map"),
        "auto local": local_step("auto"),
        "gemm local": local_step("gemm"),
    }
    if "unroll" in candidates:  # auto times it up to train.UNROLL_MAX_WORKERS workers
      builders["unroll local"] = local_step("unroll")
    if mixed:
      builders[f"mixed local ({mixed})"] = local_step(mixed)
    if args.stretch_only:
      builders = {k: b for k, b in builders.items() if k in STRETCH_RUNNERS}
    copying = f"{fastpath.LABEL} (copying update)"
    vmapped = f"{fastpath.LABEL} (vmap over BN groups)"
    if args.fastpath_variants and not args.stretch_only:
      builders[copying] = lambda: fast_runner(model, sgd, xw, yw, update_in_place=False)
      builders[vmapped] = lambda: fast_runner(model, sgd, xw, yw, group_bn=False)
    bn_pairs = {}  # flax-BN runner name -> the same lowering with bn_impl="mfopt"
    if args.bn_variants:
      group_model = model.clone(bn_impl="mfopt")
      for name, lw in (("unroll local", "unroll"), ("lax.map local", "map")):
        if name in builders:
          bn_pairs[name] = f"{name} (bn_impl='mfopt')"
          builders[bn_pairs[name]] = local_step(lw, group_model)
    shape = f"W={num_workers} B={batch}"
    runners = {}  # one program failing must not cost a device call the others' timings
    for name, build in builders.items():
      try:
        runners[name] = build()
      except Exception as e:  # noqa: BLE001 (XLA raises its own error types)
        report.left_out(f"{shape} | {name}", e)
    options = dict(args.compiler_option)
    tag = " [" + ", ".join(f"{k}={v}" for k, v in options.items()) + "]"
    flagged = {}  # default-compiled runner name -> the same program compiled with `options`
    if options:
      try:  # an option this JAX/XLA does not know must not cost the rest of a device call
        compiled = {name: _bench.with_compiler_options(builders[name](), options)
                    for name in ("one replica @ W*B", "unroll local", "lax.map local")
                    if name in builders}
      except Exception as e:  # noqa: BLE001 (XLA raises its own error types)
        report.note(f"{shape}: --compiler-option{tag} not compiled, its "
                    f"variants skipped: {type(e).__name__}: {str(e)[:300]}")
        compiled = {}
      for name, runner in compiled.items():
        flagged[name] = name + tag
        runners[flagged[name]] = runner
    names = list(runners)
    timed = _bench.time_interleaved(
        list(runners.values()), warmup=warmup, reps=reps, iters=iters,
        on_warm=lambda i, sec: report.note(f"{shape} | {names[i]}: compiled and warmed up in "
                                           f"{sec:.1f} s"),
        on_error=lambda i, e: report.left_out(f"{shape} | {names[i]}", e))
    timings = {name: t for name, t in zip(names, timed) if t is not None}
    images = num_workers * batch
    if "one replica @ W*B" not in timings:
      report.note(f"{shape}: no reference (one replica @ W*B failed): no figures for this shape")
      continue
    ref = timings["one replica @ W*B"].median
    for name, t in timings.items():
      report.figure(f"{shape} | {name}", images / t.median, "img/s",
                    f"{ref / t.median:.3f}x one replica; {t.spread()}", num_workers=num_workers,
                    per_worker_batch=batch, variant=name.split(" (")[0], timing=t.as_dict())
    fast = ref / timings[fastpath.LABEL].median if fastpath.LABEL in timings else None
    if {copying, vmapped, fastpath.LABEL} <= set(timings):
      report.figure(f"{shape} | fast path in place / copying update",
                    timings[copying].median / timings[fastpath.LABEL].median, "x",
                    "> 1: the in-place update (the default) is faster")
      report.figure(f"{shape} | fast path GroupBatchNorm / vmap over BN groups",
                    timings[vmapped].median / timings[fastpath.LABEL].median, "x",
                    "> 1: GroupBatchNorm on the flat batch (the default) is faster; "
                    f"vmap over groups: {ref / timings[vmapped].median:.3f}x one replica")
    for name, other in bn_pairs.items():
      if not {name, other} <= set(timings):
        continue
      report.figure(f"{shape} | {name}: bn_impl='mfopt' / flax BatchNorm",
                    timings[name].median / timings[other].median, "x",
                    "> 1: GroupBatchNorm (one group per replica) is faster; with it "
                    f"{ref / timings[other].median:.3f}x one replica", num_workers=num_workers,
                    per_worker_batch=batch, variant="bn_impl speed-up")
    flagged = {k: v for k, v in flagged.items() if {k, v} <= set(timings)}
    if "one replica @ W*B" not in flagged:  # nothing to compare the flagged compiles with
      flagged = {}
    for name, other in flagged.items():
      ref_flag = timings[flagged["one replica @ W*B"]].median
      report.figure(f"{shape} | {name}:{tag} / default compile",
                    timings[name].median / timings[other].median, "x",
                    f"> 1: the option makes it faster; with it {ref / timings[other].median:.3f}x "
                    f"one replica (default compile), {ref_flag / timings[other].median:.3f}x one "
                    f"replica compiled with it too", num_workers=num_workers,
                    per_worker_batch=batch, variant="compiler option speed-up")
    costs = [_bench.compiled_cost(r.fn, r.state, *r.args)
             for r in (runners["one replica @ W*B"],
                       runners[fastpath.LABEL] if fastpath.LABEL in timings else None) if r]
    # the fast path's extra work over one replica: per-group BN only
    if len(costs) == 2 and None not in costs:
      report.figure(f"{shape} | fast path / one replica, XLA cost estimate",
                    costs[1]["bytes accessed"] / costs[0]["bytes accessed"], "x bytes",
                    f"{costs[1]['flops'] / costs[0]['flops']:.4f}x flops; "
                    f"{costs[1]['bytes accessed'] / 1e6:.1f} vs "
                    f"{costs[0]['bytes accessed'] / 1e6:.1f} MB accessed per step",
                    num_workers=num_workers, per_worker_batch=batch,
                    variant="fast path cost", cost=costs)
    # The plain lowerings, keyed by the names lowering="auto" uses for its candidates.
    local = {"vmap": "vmap local", "map": "lax.map local", "gemm": "gemm local",
             "unroll": "unroll local", **({mixed: f"mixed local ({mixed})"} if mixed else {})}
    local = {k: v for k, v in local.items() if v in timings}
    # auto is judged against the lowerings it chooses among (same model); the best local
    # figure (the stretch) also counts the bn_impl='mfopt' variants (--bn-variants): the same
    # lowerings with another BatchNorm, a model choice the user makes.
    variants = {**local, **{f"{kind} bn_impl='mfopt'": bn_pairs[name]
                            for kind, name in local.items()
                            if name in bn_pairs and bn_pairs[name] in timings}}
    if not local:
      report.note(f"{shape}: every local lowering failed: no local figures for this shape")
      targets.append((num_workers, batch, fast, None, None))
      continue
    plain_t = min(timings[local[n]].median for n in local)
    best_name = min(variants, key=lambda n: timings[variants[n]].median)
    best_t = timings[variants[best_name]].median
    best_local = ref / best_t
    report.figure(f"{shape} | best local lowering ({best_name}) / one replica",
                  best_local, "x")
    # What running the W replicas one after another can reach at best: W lone steps at batch B
    # (each with its own update) against one step at W*B. A reference, not a strict bound (the
    # lowerings update all W replicas in one vmapped update), but it separates the cost of a
    # small batch per step from the cost of the lowering.
    seq = (timings["one replica @ B"].median * num_workers if "one replica @ B" in timings
           else None)
    if seq is not None:
      report.figure(f"{shape} | sequential reference: one replica @ W*B / "
                    f"(W x one replica @ B)", ref / seq, "x",
                    f"W x one replica @ B = {seq * 1e3:.2f} ms vs {ref * 1e3:.2f} ms at W*B; "
                    f"the best local lowering reaches {seq / best_t:.3f}x of it",
                    num_workers=num_workers, per_worker_batch=batch,
                    variant="sequential reference")
    auto = None
    if "auto local" in timings:
      auto_step = runners["auto local"].fn
      auto = plain_t / timings["auto local"].median
      chosen = auto_step.choice
      report.figure(f"{shape} | auto local (chose "
                    f"{chosen}) / best of {', '.join(local)}", auto, "x",
                    "choice timings " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                                  for k, v in auto_step.timings.items()))
      if chosen in local:  # auto runs the very program of its chosen lowering: a noise gauge
        report.figure(f"{shape} | noise gauge: auto local / {chosen} local "
                      "(the same compiled program timed twice)",
                      timings[local[chosen]].median / timings["auto local"].median, "x")
    targets.append((num_workers, batch, fast, best_local, auto))
  for num_workers, batch, fast, best_local, auto in targets:
    if auto is not None:
      report.target(f"4b: auto local / best local lowering, W={num_workers} B={batch}", auto,
                    ">=", 0.97, applies=not args.quick, why_not="quick mode")
    if fast is not None:
      report.target(f"4a: fast path / one replica, W={num_workers} B={batch}", fast, ">=", 0.97,
                    applies=not args.quick, why_not="quick mode")
    if (num_workers, batch) == (16, 256) and best_local is not None:
      report.target("4b stretch: best local lowering / one replica, 16x256", best_local, ">=",
                    0.75, applies=gpu and not args.quick, why_not="GPU target")
  return report.finish()


if __name__ == "__main__":
  main()
