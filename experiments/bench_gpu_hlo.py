"""The compiled XLA:GPU programs of issue 8's train steps, without a GPU (structure, not time).

Command::

  JAX_PLATFORMS=cpu .venv-gpu-aot/bin/python -m experiments.bench_gpu_hlo   # bash scripts/gpu_aot.sh
  JAX_PLATFORMS=cpu .venv-gpu-aot/bin/python -m experiments.bench_gpu_hlo --quick
  JAX_PLATFORMS=cpu .venv-gpu-aot/bin/python -m experiments.bench_gpu_hlo --resnet50   # target 2, model 2
  JAX_PLATFORMS=cpu .venv-gpu-aot/bin/python -m experiments.bench_gpu_hlo --workers 4 --batch 256 \
      --compiler-option xla_gpu_experimental_enable_conv_fusion=true \
      --compiler-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT   # unroll under options

SIMULATED TARGET: every program is compiled by XLA:GPU for one compile-only H100
(``experiments/_gpu_aot.py``: deviceless compilation, no autotuning) and never run. The figures
are what the compiler emitted: cuDNN convolution calls (with their batch and feature-group
count), GEMM calls, kernel launches (non-trivial instructions of the top-level computations,
split into every-step and inside a ``conditional``), ``copy`` bytes, and the temporary buffer
XLA assigned. They explain or predict timings; they are not timings, and the time targets of
issue 8 still need a GPU run (``scripts/gpu_bench.sh``).

Programs (ResNet-18, CIFAR-shaped 32x32 inputs, width 64, bf16 compute unless noted; the
same steps ``bench_virtual_workers`` and ``bench_train_step`` time):

* target 2: the library's train step (``W=1``) vs the plain flax + optax step at the same
  batch: the same convolutions, and how many more kernels (the ``update_norm`` metric is
  one fused reduction on GPU, ``mfopt.train.tree_norm``);
* target 4a: one replica at ``W*B`` (a plain flax + optax step) vs the fast path
  (``mfopt.fastpath``) with ``W`` BN groups of ``B``; the fast path must send cuDNN the same
  convolutions as the one replica (same count, same batch, no feature groups);
* the fast path's in-place update (default) vs ``update_in_place=False``;
* target 4b: the local (divergent-replica) lowerings ``vmap`` (grouped convolutions),
  ``gemm`` (batched matrix products, no convolution), ``map`` (a loop of ``W`` replicas) and
  ``unroll`` (the ``W`` replicas in a straight line), the last two also with
  ``bn_impl="mfopt"``;
* target 3: a periodic-averaging (and block-momentum) local step vs a step with no
  communication: the same work outside the gated sync loop; and the host-gated step's shut
  program (what a GPU runs by default, ``mfopt.train.HostGatedStep``): the no-communication
  step's bytes, plus the scalar counter kernels;
* target 4b with the local algorithms: the averaging transforms' local step with W workers on
  the device vs plain local SGD (``vmap``);
* target 5: bf16 vs fp32 compute of the one-replica step: the convolutions run in bf16.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from typing import Any

from experiments import _bench, _gpu_aot, bench_virtual_workers

# Instructions that launch nothing (views, tuples, parameters) or are control flow whose
# bodies are counted where they are.
_FREE = _bench.HLO_NOT_KERNELS
_INSTR = _bench.HLO_INSTR
_CONV = re.compile(r"=\s*\(?(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\].*custom_call_target="
                   r"\"__cudnn\$conv(?P<kind>\w+)\"")
_GROUPS = re.compile(r"feature_group_count=(\d+)")
_GEMM = re.compile(r"custom_call_target=\"__cublas\$(?:lt\$matmul|gemm)[^\"]*\"|"
                   r"calls=%?gemm_fusion|\"kind\":\"__triton_gemm\"")


def entry_traffic(lines: Sequence[str], comps: dict[str, list[str]] | None = None
                  ) -> tuple[int, int]:
  """Bytes written and read by the kernels of one computation's lines
  (:func:`_bench.hlo_kernel_traffic`; loop bodies and branches are separate computations;
  ``comps``, the module's computations, lets a fusion that slices an operand read its slices)."""
  return _bench.hlo_kernel_traffic(lines, _FREE, comps)


def run_traffic(comps: dict[str, list[str]], entry: str | None) -> tuple[int, int]:
  """:func:`entry_traffic` of ``ENTRY`` plus each ``while`` body's, times its trip count
  (XLA's ``known_trip_count``; once where unknown), recursively: what a local step's kernels
  write and read (conditional branches and the gated sync loop are not run)."""

  def visit(c: str, seen: frozenset) -> tuple[int, int]:
    written, read = entry_traffic(comps.get(c, []), comps)
    for line in comps.get(c, []):
      trips = _bench.hlo_trip_count(line) or 1
      for body in _bench.hlo_loop_bodies(line):
        if body not in seen:
          w, r = visit(body, seen | {body})
          written, read = written + trips * w, read + trips * r
    return written, read

  return visit(entry, frozenset({entry})) if entry else (0, 0)


def program_structure(text: str) -> dict[str, Any]:
  """What an optimised HLO module launches, per top-level computation class.

  Top-level computations are ``ENTRY`` and the bodies of its control flow (``while``
  bodies/conditions, ``conditional`` branches), recursively; fusion bodies and reducers are
  not (their instructions run inside one kernel). ``launches_*`` counts the non-trivial
  instructions there (fusions, custom calls, copies, collectives, ...); a loop body counts
  once, and so do ``copies`` / ``copy_bytes`` (the ``copy`` / ``copy-start`` instructions
  there: a copy inside a fusion body is part of that kernel, not a copy);
  ``copy_bytes_every_step`` leaves out those inside conditionals and the sync loop's body, and
  copies of scalars.
  ``launches_cheapest`` / ``launches_dearest`` follow one path: at every ``conditional`` the
  branch with the fewest / most launches, and the sync loop of periodic averaging
  (``_bench.hlo_is_gated_loop``) skipped / run once: a local step / a sync step. The sync loop's
  body counts as ``launches_in_conditional``. ``launches_run`` is the cheapest path with every
  ``while`` body counted as often as it runs (XLA's ``known_trip_count``; once where unknown,
  e.g. ``lax.map``'s loop over W workers counts W times): the kernels one step launches. Convolutions are cuDNN custom calls (``kind`` Forward /
  BackwardInput / BackwardFilter) with their output batch (first dimension) and
  feature-group count.
  """
  comps, entry = _bench.hlo_computations(text)
  where = _bench.hlo_reachable(comps, entry, through_calls=False)  # -> inside a branch
  ops = {False: collections.Counter(), True: collections.Counter()}
  convs, gemms, copies, copy_bytes, copy_bytes_every_step = [], 0, 0, 0, 0
  for c, in_cond in where.items():
    for line in comps[c]:
      m = _INSTR.match(line)
      if not m or m.group("op") in _FREE:
        continue
      ops[in_cond][m.group("op")] += 1
      if m.group("op") in ("copy", "copy-start"):
        arrays = _bench.hlo_arrays(m.group("shape"))
        if m.group("op") == "copy-start":  # (destination, source, context): count one
          arrays = arrays[:1]
        copies += 1
        copy_bytes += _bench.hlo_arrays_bytes(arrays)
        if not in_cond:  # arrays, not scalars (a loop counter's copy is 4 B)
          copy_bytes_every_step += _bench.hlo_arrays_bytes([a for a in arrays if a[1] > 1])
      conv = _CONV.search(line)
      if conv:
        dims = [int(d) for d in conv.group("dims").split(",") if d]
        groups = _GROUPS.search(line)
        convs.append({"kind": conv.group("kind"), "dtype": conv.group("dtype"),
                      "batch": dims[0] if dims else 1,
                      "groups": int(groups.group(1)) if groups else 1})
      elif _GEMM.search(line):
        gemms += 1

  def path(c: str, pick, seen: frozenset = frozenset(), trips: bool = False) -> int:
    if c not in comps or c in seen:
      return 0
    seen = seen | {c}
    total = 0
    for line in comps[c]:
      m = _INSTR.match(line)
      if m and m.group("op") not in _FREE:
        total += 1
      n = (_bench.hlo_trip_count(line) or 1) if trips else 1
      total += n * sum(path(b, pick, seen, trips) for b in _bench.hlo_loop_bodies(line))
      branches = _bench.hlo_branches(line)
      if branches:
        total += pick(path(b, pick, seen, trips) for b in branches)
      for body in _bench.hlo_gated_bodies(line):  # 0 trips (local step) or 1 (sync step)
        total += pick((0, path(body, pick, seen, trips)))
    return total

  written, read = entry_traffic(comps.get(entry, []) if entry else [], comps)
  run_written, run_read = run_traffic(comps, entry)
  return {"launches_every_step": sum(ops[False].values()),
          "entry_bytes_written": written, "entry_bytes_read": read,
          "bytes_written_run": run_written, "bytes_read_run": run_read,
          "launches_cheapest": path(entry, min) if entry else 0,
          "launches_dearest": path(entry, max) if entry else 0,
          "launches_run": path(entry, min, trips=True) if entry else 0,
          "launches_in_conditional": sum(ops[True].values()),
          "ops_every_step": dict(ops[False]), "ops_in_conditional": dict(ops[True]),
          "convs": convs, "gemms": gemms, "copies": copies, "copy_bytes": copy_bytes,
          "copy_bytes_every_step": copy_bytes_every_step}


def conv_summary(convs: Sequence[dict[str, Any]]) -> str:
  """``"59 convs (20 Forward, ...), batch {1024}, groups {1}, bf16"``."""
  if not convs:
    return "0 convs"
  kinds = collections.Counter(c["kind"] for c in convs)
  return (f"{len(convs)} convs ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))}), "
          f"batch {sorted({c['batch'] for c in convs})}, groups "
          f"{sorted({c['groups'] for c in convs})}, {sorted({c['dtype'] for c in convs})}")


def _extra_args(parser) -> None:
  parser.add_argument("--workers", type=int, default=16, help="W (default 16)")
  parser.add_argument("--batch", type=int, default=64, help="per-worker batch B (default 64)")
  parser.add_argument("--resnet50", action="store_true",
                      help="only target 2's second model: ResNet-50 224x224, batch 128, bf16 "
                           "and fp32, the library's step vs the plain one")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                      type=bench_virtual_workers.parse_option,
                      help="only the unroll local step (W x B), compiled with XLA's default "
                           "options and then with the first, the first two, ... of these options "
                           "(repeatable): what each adds to cuDNN convolutions, CUDA graphs "
                           "(command buffers, from XLA's thunk dump) and launches. E.g. "
                           "xla_gpu_experimental_enable_conv_fusion=true")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], _extra_args)
  reason = _gpu_aot.unavailable_reason()
  if reason is not None:
    raise SystemExit(f"bench_gpu_hlo: {reason}")
  import jax
  jax.config.update("jax_platforms", "cpu")
  # Compile-only executables cannot be stored in (or loaded from) the persistent cache.
  jax.config.update("jax_enable_compilation_cache", False)
  import jax.numpy as jnp
  import numpy as np
  import optax

  import mfopt
  from experiments import bench_train_step
  from mfopt import fastpath, models, parallel
  from mfopt import train as train_lib

  report = _bench.Report("bench_gpu_hlo", args)
  gpu_mesh = parallel.make_mesh(_gpu_aot.topology_devices(1, "h100"))
  host_mesh = parallel.make_mesh(jax.devices()[:1])
  if args.quick:  # a small CNN with BN: seconds to compile
    num_workers, batch, image = 2, 4, 8
    make = lambda dtype: models.get_model("cnn", features=(4, 8), num_classes=10,  # noqa: E731
                                          dtype=dtype)
    label = "CNN (4, 8) 8x8"
  elif args.resnet50:
    num_workers, batch, image = 1, 128, 224
    make = lambda dtype: models.get_model("resnet50", num_classes=1000,  # noqa: E731
                                          dtype=dtype)
    label = "ResNet-50, 224x224"
  else:
    num_workers, batch, image = args.workers, args.batch, 32
    make = lambda dtype: models.get_model("resnet18", num_classes=10, width=64,  # noqa: E731
                                          dtype=dtype)
    label = "ResNet-18 width 64, 32x32"
  for name, value in (("--workers", num_workers), ("--batch", batch)):
    if value < 1:
      raise SystemExit(f"bench_gpu_hlo: {name} must be positive, got {value}")
  report.note(f"SIMULATED TARGET: XLA:GPU deviceless compilation for one H100 (compile-only "
              f"device, no autotuning); nothing runs. {label}, W={num_workers} B={batch}")
  sgd = optax.sgd(0.1, momentum=0.9)
  images = num_workers * batch
  x1 = np.zeros((1, image, image, 3), np.float32)

  def record(name: str, compiled) -> dict[str, Any]:
    text = compiled.as_text()
    row = {"program": name, **program_structure(text), **(_gpu_aot.memory(compiled) or {})}
    report.figure(f"{name} | kernel launches", row["launches_cheapest"], "launches",
                  f"cheapest path (run with loop trip counts: {row['launches_run']}; "
                  f"every step {row['launches_every_step']}, "
                  f"+{row['launches_in_conditional']} in conditionals, dearest path "
                  f"{row['launches_dearest']}); {conv_summary(row['convs'])};"
                  f" {row['gemms']} gemm; {row['copies']} copies {row['copy_bytes'] / 1e6:.1f} MB;"
                  f" traffic model with loop trips: written {row['bytes_written_run'] / 1e6:,.0f}"
                  f" MB, read {row['bytes_read_run'] / 1e6:,.0f} MB;"
                  f" temp {row.get('temp_bytes', 0) / 1e6:.1f} MB", **row)
    return row

  def plain(dtype, n):
    model = make(dtype)
    params, model_state = models.init_model(model, jax.random.PRNGKey(0), x1)
    state = (params, model_state["batch_stats"], sgd.init(params))
    args_ = _gpu_aot.abstract_on((state, np.zeros((n, image, image, 3), np.float32),
                                  np.zeros((n,), np.int32)), gpu_mesh)
    return bench_train_step.plain_train_step(model, sgd).lower(*args_).compile()

  def worker_batch(w, b):
    return {"x": jax.ShapeDtypeStruct((w, b, image, image, 3), jnp.float32,
                                      sharding=parallel.worker_sharding(host_mesh)),
            "y": jax.ShapeDtypeStruct((w, b), jnp.int32,
                                      sharding=parallel.worker_sharding(host_mesh))}

  def fast(update_in_place, group_bn=None):
    model = make(jnp.bfloat16)
    state = fastpath.init_train_state(model, sgd, x1, num_workers=num_workers, mesh=host_mesh)
    step = fastpath.make_train_step(model, sgd, mesh=gpu_mesh, num_workers=num_workers,
                                    update_in_place=update_in_place, group_bn=group_bn)
    return step.lower(*_gpu_aot.abstract_on((state, worker_batch(num_workers, batch)),
                                            gpu_mesh)).compile()

  def stacked(tx, w, b, lowering="vmap", dtype=jnp.bfloat16, bn_impl="flax", host_gates=False):
    # host_gates=False: the device-side gate (this process's backend is the CPU, so that is
    # make_train_step's default here); True: the shut program of the host-gated step, which is
    # what a real GPU runs for a local step (train.host_schedule's default off CPU).
    model = make(dtype).clone(bn_impl=bn_impl)
    state = train_lib.init_train_state(model, tx, x1, num_workers=w, mesh=host_mesh)
    step = train_lib.make_train_step(model, tx, mesh=gpu_mesh, num_workers=w, lowering=lowering,
                                     host_gates=host_gates)
    if host_gates:
      step = step.steps[False]
    return step.lower(*_gpu_aot.abstract_on((state, worker_batch(w, b)), gpu_mesh)).compile()

  def key(convs):
    return sorted((c["kind"], c["batch"], c["groups"]) for c in convs)

  if args.compiler_option:  # the unroll local step under cumulative XLA options
    model = make(jnp.bfloat16)
    state = train_lib.init_train_state(model, sgd, x1, num_workers=num_workers, mesh=host_mesh)
    lowered = train_lib.make_train_step(model, sgd, mesh=gpu_mesh, num_workers=num_workers,
                                        lowering="unroll").lower(
        *_gpu_aot.abstract_on((state, worker_batch(num_workers, batch)), gpu_mesh))
    base = None
    for n in range(len(args.compiler_option) + 1):
      options = dict(args.compiler_option[:n])
      compiled, thunks = _gpu_aot.compile_with_thunks(lowered, options)
      label = ", ".join(f"{k}={v}" for k, v in options.items()) or "default options"
      row = record(f"unroll local W={num_workers} B={batch} [{label}]", compiled)
      row["options"], row["thunks"] = {k: str(v) for k, v in options.items()}, thunks
      if thunks is not None:
        report.figure(f"unroll local [{label}] | CUDA graphs (command buffers)",
                      thunks["command_buffers"], "graphs",
                      f"{thunks['commands_in_buffers']} commands inside them, "
                      f"{thunks['thunks_outside']} thunks outside "
                      f"({thunks['outside_by_kind']}); cuDNN convolutions "
                      f"{len(row['convs'])}", **thunks)
      if base is None:
        base = row
      else:
        report.figure(f"unroll local [{label}] / default options, bytes written",
                      row["bytes_written_run"] / base["bytes_written_run"], "x",
                      f"{row['bytes_written_run'] / 1e6:,.1f} vs "
                      f"{base['bytes_written_run'] / 1e6:,.1f} MB (traffic model); launches "
                      f"{row['launches_run']} vs {base['launches_run']}")
    return report.finish()

  if args.resnet50:  # target 2, second model: the library's step as bench_train_step runs it
    sync = optax.chain(mfopt.sync_gradients(parallel.WORKER_AXES), sgd)
    for dname, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
      base = record(f"plain flax + optax @ {batch} {dname}", plain(dtype, batch))
      lib = record(f"mfopt step (sync_gradients, W=1) @ {batch} {dname}",
                   stacked(sync, 1, batch, dtype=dtype))
      report.figure(f"2: ResNet-50 {dname}, mfopt / plain step, kernel launches",
                    lib["launches_cheapest"] / base["launches_cheapest"], "x",
                    f"{lib['launches_cheapest']} vs {base['launches_cheapest']}; temp "
                    f"{lib.get('temp_bytes', 0) / 1e6:.1f} vs {base.get('temp_bytes', 0) / 1e6:.1f} MB")
      report.target(f"2: ResNet-50 {dname}: the library's step sends cuDNN the plain step's "
                    "convolutions", float(key(lib["convs"]) == key(base["convs"])
                                          and bool(base["convs"])), ">=", 1.0)
    return report.finish()

  one = record(f"one replica @ {images} bf16", plain(jnp.bfloat16, images))
  fp = record(f"{fastpath.LABEL} W={num_workers} B={batch}", fast(True))
  fc = record(f"{fastpath.LABEL} W={num_workers} B={batch} (copying update)", fast(False))
  fv = record(f"{fastpath.LABEL} W={num_workers} B={batch} (vmap over BN groups: before "
              "GroupBatchNorm)", fast(True, group_bn=False))
  loc = {lw: record(f"{lw} local W={num_workers} B={batch}",
                    stacked(sgd, num_workers, batch, lowering=lw))
         for lw in ("vmap", "gemm", "map", "unroll")}
  unroll_bn = record(f"unroll local W={num_workers} B={batch}, bn_impl='mfopt'",
                     stacked(sgd, num_workers, batch, lowering="unroll", bn_impl="mfopt"))
  map_bn = record(f"map local W={num_workers} B={batch}, bn_impl='mfopt'",
                  stacked(sgd, num_workers, batch, lowering="map", bn_impl="mfopt"))
  # Target 4b's local algorithms: the averaging transforms with W workers on one device.
  local_avg = {
      name: record(f"{name} local (vmap) W={num_workers} B={batch}",
                   stacked(make(sgd, parallel.WORKER_AXES, 10**9), num_workers, batch))
      for name, make in (("periodic_averaging", mfopt.periodic_averaging),
                         ("block_momentum", mfopt.block_momentum))}
  half = images // 2
  none = record(f"no communication W=1 @ {half}", stacked(sgd, 1, half))
  none_bn = record(f"no communication W=1 @ {half}, bn_impl='mfopt'",
                   stacked(sgd, 1, half, bn_impl="mfopt"))
  averagers = (("periodic_averaging", mfopt.periodic_averaging),
               ("block_momentum", mfopt.block_momentum))
  local_steps = {
      tname: record(f"{tname} local W=1 @ {half}",
                    stacked(avg(sgd, parallel.WORKER_AXES, 10**9), 1, half))
      for tname, avg in averagers}
  # What a GPU runs by default (host-decided gates): the shut program, with no loop at all.
  host_local = {
      tname: record(f"{tname} local W=1 @ {half}, host-decided gate (shut program)",
                    stacked(avg(sgd, parallel.WORKER_AXES, 10**9), 1, half, host_gates=True))
      for tname, avg in averagers}
  fp32 = record(f"one replica @ {half} fp32", plain(jnp.float32, half))
  bf16 = record(f"one replica @ {half} bf16", plain(jnp.bfloat16, half))

  report.figure("2: mfopt train step (W=1) / plain flax + optax step, kernel launches",
                none["launches_cheapest"] / bf16["launches_cheapest"], "x",
                f"{none['launches_cheapest']} vs {bf16['launches_cheapest']} at batch {half}; "
                f"temp {none.get('temp_bytes', 0) / 1e6:.1f} vs {bf16.get('temp_bytes', 0) / 1e6:.1f} MB")
  report.figure("2: mfopt train step with bn_impl='mfopt' / plain flax + optax step, bytes "
                "written", none_bn["bytes_written_run"] / bf16["bytes_written_run"], "x",
                f"written {none_bn['bytes_written_run'] / 1e6:,.0f} vs "
                f"{bf16['bytes_written_run'] / 1e6:,.0f} MB, read "
                f"{none_bn['bytes_read_run'] / 1e6:,.0f} vs {bf16['bytes_read_run'] / 1e6:,.0f} MB;"
                f" launches {none_bn['launches_run']} vs {bf16['launches_run']} "
                "(GroupBatchNorm with one group; not the default)")
  report.target("2: mfopt train step sends cuDNN the plain step's convolutions",
                float(key(none["convs"]) == key(bf16["convs"])), ">=", 1.0)
  report.figure("4a: fast path / one replica, kernel launches",
                fp["launches_cheapest"] / one["launches_cheapest"], "x",
                f"{fp['launches_cheapest']} vs {one['launches_cheapest']}; fusions "
                f"{fp['ops_every_step'].get('fusion', 0)} vs "
                f"{one['ops_every_step'].get('fusion', 0)}")
  report.figure("4a: fast path / one replica, bytes written by ENTRY's kernels",
                fp["entry_bytes_written"] / one["entry_bytes_written"], "x",
                f"written {fp['entry_bytes_written'] / 1e6:,.1f} vs "
                f"{one['entry_bytes_written'] / 1e6:,.1f} MB, read "
                f"{fp['entry_bytes_read'] / 1e6:,.1f} vs {one['entry_bytes_read'] / 1e6:,.1f} MB "
                f"per step (result and operand shapes: a traffic model, not a measurement)")
  report.figure("4a: fast path (vmap over BN groups, the earlier design) / one replica, bytes "
                "written", fv["bytes_written_run"] / one["bytes_written_run"], "x",
                f"written {fv['bytes_written_run'] / 1e6:,.0f} vs "
                f"{one['bytes_written_run'] / 1e6:,.0f} MB, read "
                f"{fv['bytes_read_run'] / 1e6:,.0f} vs {one['bytes_read_run'] / 1e6:,.0f} MB; "
                f"launches {fv['launches_run']} vs {one['launches_run']}")
  report.target("4a: the fast path writes no more than one replica (+1%; traffic model)",
                fp["bytes_written_run"] / one["bytes_written_run"], "<=", 1.01,
                applies=not args.quick,
                why_not="quick: the tiny CNN's per-group statistics weigh on its tiny activations")
  if "temp_bytes" in fp and "temp_bytes" in one:
    report.figure("4a: fast path / one replica, temp buffer", fp["temp_bytes"] / one["temp_bytes"],
                  "x", f"{fp['temp_bytes'] / 1e6:.1f} vs {one['temp_bytes'] / 1e6:.1f} MB")
  report.target("4a: fast path sends cuDNN the one replica's convolutions (kind, batch W*B, "
                "no feature groups)", float(key(fp["convs"]) == key(one["convs"])
                                            and bool(one["convs"]) and not fp["gemms"] > one["gemms"]),
                ">=", 1.0)
  report.figure("fast path: in-place / copying update, copy bytes",
                fp["copy_bytes"] / max(fc["copy_bytes"], 1), "x",
                f"{fp['copies']} copies {fp['copy_bytes'] / 1e6:.2f} MB vs {fc['copies']} copies "
                f"{fc['copy_bytes'] / 1e6:.2f} MB; launches {fp['launches_every_step']} vs "
                f"{fc['launches_every_step']}")
  vm = loc["vmap"]
  report.target(f"4b: vmap of per-worker weights lowers to grouped convolutions "
                f"(feature groups = W = {num_workers})",
                float(any(c["groups"] == num_workers for c in vm["convs"])), ">=", 1.0)
  report.target("4b: the gemm lowering runs no convolution", float(not loc["gemm"]["convs"]
                                                                   and loc["gemm"]["gemms"] > 0),
                ">=", 1.0)
  for lw, with_bn in (("unroll", unroll_bn), ("map", map_bn)):
    report.figure(f"4b: {lw} local with bn_impl='mfopt' / with flax BatchNorm, bytes written",
                  with_bn["bytes_written_run"] / loc[lw]["bytes_written_run"], "x",
                  f"written {with_bn['bytes_written_run'] / 1e6:,.0f} vs "
                  f"{loc[lw]['bytes_written_run'] / 1e6:,.0f} MB, read "
                  f"{with_bn['bytes_read_run'] / 1e6:,.0f} vs "
                  f"{loc[lw]['bytes_read_run'] / 1e6:,.0f} MB; launches "
                  f"{with_bn['launches_run']} vs {loc[lw]['launches_run']} (one replica "
                  f"@ W*B: written {one['bytes_written_run'] / 1e6:,.0f} MB, launches "
                  f"{one['launches_run']})")
  report.figure("4b: map local, convolutions (one replica per loop iteration)",
                len(loc["map"]["convs"]), "convs", conv_summary(loc["map"]["convs"]))
  # A local step skips the sync loop's body (W=1 on one device: XLA reduces the all-reduce of
  # one worker away, so the body is the sync step's compute only).
  for tname, avg in local_steps.items():
    report.figure(f"3: {tname} local step / no-communication step, kernel launches",
                  avg["launches_cheapest"] / none["launches_cheapest"], "x",
                  f"{avg['launches_cheapest']} vs {none['launches_cheapest']}; every step "
                  f"{avg['ops_every_step']} vs {none['ops_every_step']}; sync step "
                  f"{avg['launches_dearest']} launches, its body {avg['ops_in_conditional']}")
    report.figure(f"3: {tname} local step / no-communication step, copy bytes",
                  avg["copy_bytes_every_step"] / max(none["copy_bytes_every_step"], 1), "x",
                  f"{avg['copy_bytes_every_step'] / 1e6:.2f} vs "
                  f"{none['copy_bytes_every_step'] / 1e6:.2f} MB every step (non-scalar); the sync step's "
                  f"body {(avg['copy_bytes'] - avg['copy_bytes_every_step']) / 1e6:.2f} MB more")
    report.target(f"3: {tname} local step copies no array the no-communication step does not",
                  avg["copy_bytes_every_step"] / max(none["copy_bytes_every_step"], 1), "<=",
                  1.0)
    report.target(f"3: {tname} runs the no-communication step's convolutions every step",
                  float(key(avg["convs"]) == key(none["convs"])), ">=", 1.0)
  for tname, avg in host_local.items():
    extra = avg["launches_run"] - none["launches_run"]
    report.figure(f"3: {tname} local step, host-decided gate / no-communication step, bytes "
                  "moved", (avg["bytes_written_run"] + avg["bytes_read_run"])
                  / (none["bytes_written_run"] + none["bytes_read_run"]), "x",
                  f"written {avg['bytes_written_run'] / 1e6:,.1f} vs "
                  f"{none['bytes_written_run'] / 1e6:,.1f} MB, read "
                  f"{avg['bytes_read_run'] / 1e6:,.1f} vs {none['bytes_read_run'] / 1e6:,.1f} MB; "
                  f"launches {avg['launches_run']} vs {none['launches_run']} ({extra:+d}: "
                  f"every step {avg['ops_every_step']} vs {none['ops_every_step']})",
                  extra_launches=extra)
    report.target(f"3: {tname} local step, host-decided gate: the no-communication step's bytes "
                  "(traffic model, +0.1%)", (avg["bytes_written_run"] + avg["bytes_read_run"])
                  / (none["bytes_written_run"] + none["bytes_read_run"]), "<=", 1.001)
  for tname, row in local_avg.items():
    report.figure(f"4b: {tname} local step / vmap local SGD step (W={num_workers}), kernels run",
                  row["launches_run"] / loc["vmap"]["launches_run"], "x",
                  f"{row['launches_run']} vs {loc['vmap']['launches_run']}; every-step copies "
                  f"{row['copy_bytes_every_step'] / 1e6:.2f} vs "
                  f"{loc['vmap']['copy_bytes_every_step'] / 1e6:.2f} MB; temp "
                  f"{row.get('temp_bytes', 0) / 1e6:.1f} vs "
                  f"{loc['vmap'].get('temp_bytes', 0) / 1e6:.1f} MB")
    report.target(f"4b: {tname} local step (W={num_workers}) copies no array the local SGD step "
                  "does not", row["copy_bytes_every_step"]
                  / max(loc["vmap"]["copy_bytes_every_step"], 1), "<=", 1.0)
  report.target("5: bf16 compute runs bf16 convolutions, fp32 runs f32 ones",
                float({c["dtype"] for c in bf16["convs"]} == {"bf16"}
                      and {c["dtype"] for c in fp32["convs"]} == {"f32"}), ">=", 1.0)
  if "temp_bytes" in bf16 and "temp_bytes" in fp32:
    report.figure("5: bf16 / fp32 temp buffer", bf16["temp_bytes"] / fp32["temp_bytes"], "x",
                  f"{bf16['temp_bytes'] / 1e6:.1f} vs {fp32['temp_bytes'] / 1e6:.1f} MB")
  return report.finish()


if __name__ == "__main__":
  main()
