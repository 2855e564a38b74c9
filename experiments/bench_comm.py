"""Collectives per step of every communicating transform, from the program and the compiled HLO (issue 8, target 6).

Command::

  python -m experiments.bench_comm            # 8 fake CPU devices, W = 8 and 16 workers
  python -m experiments.bench_comm --quick    # CI: W = 16 only
  python -m experiments.bench_comm --platform gpu   # on the GPUs of the machine (>= 2)
  JAX_PLATFORMS=cpu python -m experiments.bench_comm --platform gpu-aot  # XLA:GPU, no GPU needed

``--platform gpu-aot`` compiles the same steps with XLA:GPU for 8 compile-only H100s
(deviceless compilation, ``experiments/_gpu_aot.py``; needs the JAX CUDA plugin:
``bash scripts/gpu_aot.sh``). Nothing runs there, so the counters are not read; the program
and the compiled *GPU* HLO are, and the bf16 rows must show bf16 all-reduce operands of half
the parameter bytes.

For each transform, the worker-stacked train step (``mfopt.train.make_train_step``, an MLP
784-64-10 (50,890 parameters, 203,560 B in f32) on 8 devices) is

* traced: every cross-device collective of the *program* (``psum``/``all_gather``/... over
  the mesh axis ``data`` in the jaxpr), with its dtype and bytes, and whether it sits in a
  ``cond`` branch or the body of periodic averaging's sync loop (a sync branch) or runs
  every step. Bytes are per *device*: under the
  worker ``vmap`` the operand of a ``psum`` over ``("data", "local")`` holds the device's
  ``W/D`` workers (XLA then sums them locally before the all-reduce, as the compiled bytes
  show). Reductions over the ``vmap`` axis alone are local sums, not collectives;
* compiled: every collective op of the optimised HLO (``all-reduce``, ``all-gather``,
  ``reduce-scatter``, ``all-to-all``, ``collective-permute``, and their async ``-start``
  forms), its result bytes, and whether its computation is reached from ``ENTRY`` only
  through a ``conditional`` branch or the sync loop's body;
* run for ``N = 8`` steps, and its own ``CommStats`` counters read (``mfopt.comm_totals``).

It prints one line per transform and W with the three views side by side, and checks the
facts the transforms promise (targets): synchronous transforms exchange the parameter bytes
(in ``comm_dtype``) every step and count one all-reduce per step; periodic averaging /
block momentum run no collective outside the sync loop and count floor(N/p)
exchanges; the fast path (``mfopt.fastpath``) runs one ``D``-way all-reduce per step and
counts it. Bytes are *payload* bytes (SPEC.md), one worker's contribution; on XLA:CPU a
bf16 all-reduce is computed in f32 after compilation, so the compiled bytes of a bf16
exchange are those of f32 on CPU (the program's dtype is bf16; checked on GPU).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import _bench

STEPS = 8
PERIOD = 4
HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(HLO_COLLECTIVES) +
                 r")(?P<start>-start)?\(")


def _top_level(shape: str) -> list[str]:
  """The elements of an HLO tuple shape ``(a, (b, c), d)``; ``[shape]`` if it is no tuple."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, begin = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        parts.append(shape[begin:i])
        break
    elif ch == "," and depth == 1:
      parts.append(shape[begin:i])
      begin = i + 1
  return [p.strip() for p in parts if p.strip()]


def _collective_bytes(shape: str, op: str, start: bool) -> int:
  """Bytes of a collective's result. An async ``*-start`` may print (operands, result): XLA:GPU
  under JAX 0.11 writes ``((f32[N]), f32[N]) all-reduce-start``, where 0.10 wrote ``f32[N]``
  (an operand tuple first: count the last element, the result; counting both doubled every
  all-reduce), and an all-gather-start is ``(operand, result)`` in both."""
  parts = _top_level(shape)
  if start and len(parts) > 1 and (parts[0].startswith("(") or op == "all-gather"):
    shape = parts[-1]
  return _bench.hlo_arrays_bytes(_bench.hlo_arrays(shape))


def hlo_collectives(text: str) -> list[dict[str, Any]]:
  """Collective ops of an optimised HLO module, each with bytes and ``in_conditional``.

  A computation counts as unconditional when ``ENTRY`` reaches it through ``calls``,
  ``to_apply``, ``body``/``condition`` edges only; reached only through a conditional's
  branch computations or the body of the sync loop (``_bench.hlo_is_gated_loop``), it is
  conditional (runs on sync steps only).
  """
  comps, entry = _bench.hlo_computations(text)
  out = []
  for c, in_conditional in _bench.hlo_reachable(comps, entry).items():
    for line in comps[c]:
      m = _OP.search(line)
      if m:
        out.append({"op": m.group("op"),
                    "bytes": _collective_bytes(m.group("shape"), m.group("op"),
                                               bool(m.group("start"))),
                    "in_conditional": in_conditional,
                    "dtype": ",".join(sorted({d for d, _ in _bench.hlo_arrays(m.group("shape"))}))})
  return out


def program_collectives(closed_jaxpr, cross_axis: str) -> list[dict[str, Any]]:
  """Collectives over ``cross_axis`` in a jaxpr (recursively), with dtype, bytes and in_cond."""
  import jax

  names = {"psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all", "reduce_scatter",
           "psum_scatter", "psum_invariant", "pbroadcast"}
  out = []

  def axes_of(params):
    for key in ("axes", "axis_name"):
      if key in params:
        a = params[key]
        return a if isinstance(a, tuple) else (a,)
    return ()

  def walk(jaxpr, in_cond):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in names and cross_axis in axes_of(eqn.params):
        for v in eqn.invars:
          aval = v.aval
          out.append({"prim": eqn.primitive.name, "dtype": str(aval.dtype),
                      "bytes": int(np.prod(aval.shape)) * aval.dtype.itemsize,
                      "in_cond": in_cond})
      is_cond = eqn.primitive.name == "cond" or (  # or periodic averaging's sync loop
          eqn.primitive.name == "while" and _bench.in_gate_scope(str(eqn.source_info.name_stack)))
      # (open Jaxprs on JAX 0.10 and 0.11; 0.11 merged ClosedJaxpr into Jaxpr and keeps the
      # old name and .jaxpr only as aliases it means to remove)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub, in_cond or is_cond)

  walk(closed_jaxpr, False)  # (.eqns: a ClosedJaxpr's on 0.10, the Jaxpr's own on 0.11)
  return out


def _setup_devices(platform: str) -> None:
  import jax
  if platform in ("cpu", "gpu-aot"):  # gpu-aot: host arrays on CPU, programs for the GPU mesh
    try:
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", 8)
    except Exception:  # backend already initialised (e.g. under pytest's conftest): keep it
      pass


def transforms() -> list[tuple[str, Any, str]]:
  """``(name, factory(axis) -> tx or None, kind)``; kind in {sync, periodic, fast}."""
  import jax.numpy as jnp
  import optax

  import mfopt

  inner = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731

  def get(name):
    return getattr(mfopt, name, None)

  def guarded(name, build):
    return lambda axes: None if get(name) is None else build(axes)

  return [
      ("sync_gradients f32", lambda ax: optax.chain(mfopt.sync_gradients(ax), inner()), "sync"),
      ("sync_gradients bf16",
       lambda ax: optax.chain(mfopt.sync_gradients(ax, jnp.bfloat16), inner()), "sync"),
      ("qsgd 8-bit", guarded("qsgd", lambda ax: optax.chain(get("qsgd")(ax), inner())), "qsgd"),
      (f"periodic_averaging p={PERIOD}",
       guarded("periodic_averaging", lambda ax: get("periodic_averaging")(
           inner(), ax, get("constant_period")(PERIOD))), "periodic"),
      (f"periodic_averaging p={PERIOD} bf16",
       guarded("periodic_averaging", lambda ax: get("periodic_averaging")(
           inner(), ax, get("constant_period")(PERIOD), comm_dtype=jnp.bfloat16)), "periodic"),
      ("adpsgd (p_init=4, sampling 4)",
       guarded("adpsgd_period", lambda ax: get("periodic_averaging")(
           inner(), ax, get("adpsgd_period")(learning_rate=0.1, sampling_steps=4))), "adpsgd"),
      (f"block_momentum p={PERIOD}",
       guarded("block_momentum", lambda ax: get("block_momentum")(inner(), ax, PERIOD)),
       "periodic"),
  ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], lambda p: p.add_argument(
      "--platform", choices=("cpu", "gpu", "gpu-aot"), default="cpu"))
  aot = args.platform == "gpu-aot"
  if aot:
    from experiments import _gpu_aot
    reason = _gpu_aot.unavailable_reason()
    if reason is not None:
      raise SystemExit(f"--platform gpu-aot: {reason}")
  _setup_devices(args.platform)
  import jax
  if aot:  # compile-only executables cannot be stored in (or loaded from) the persistent cache
    jax.config.update("jax_enable_compilation_cache", False)
  import optax

  from mfopt import comm as comm_lib
  from mfopt import fastpath, models, parallel
  from mfopt import train as train_lib

  if args.platform == "gpu" and (jax.default_backend() != "gpu" or jax.device_count() < 2):
    # (it ran on one CPU device and said DONE: a device call wasted on nothing measured)
    raise SystemExit(f"bench_comm --platform gpu needs >= 2 GPUs, this machine has "
                     f"{jax.device_count()} {jax.default_backend()} device(s)")
  report = _bench.Report("bench_comm", args)
  mesh = parallel.make_mesh()
  num_devices = mesh.shape[parallel.DATA_AXIS]
  # The mesh the steps are compiled for: the same devices, or (gpu-aot) as many compile-only
  # H100s, with the host-built states and batches passed as shapes + shardings.
  step_mesh = mesh
  if aot:
    step_mesh = parallel.make_mesh(_gpu_aot.topology_devices(num_devices, "h100"))
    report.note(f"SIMULATED TARGET: deviceless XLA:GPU compilation for {num_devices} x H100 "
                "(compile-only devices); nothing executes, counters are not read")
  if num_devices < 2:
    report.note(f"only {num_devices} device(s): no cross-device collectives to count")
  model = models.get_model("mlp", hidden=(64,), num_classes=10)
  per_worker_batch = 4
  example = np.zeros((per_worker_batch, 784), np.float32)
  params, _ = models.init_model(model, jax.random.PRNGKey(0), example)
  param_bytes = comm_lib.tree_payload_bytes(params)
  report.note(f"model MLP 784-64-10: {param_bytes // 4:,} params = {param_bytes:,} B in f32; "
              f"{num_devices} devices; {STEPS} steps; per-worker batch {per_worker_batch}")
  rng = np.random.default_rng(0)
  worker_counts = [2 * num_devices] if args.quick else [num_devices, 2 * num_devices]

  def batches(num_workers):
    return [parallel.shard_workers({
        "x": rng.normal(size=(num_workers, per_worker_batch, 784)).astype(np.float32),
        "y": rng.integers(0, 10, size=(num_workers, per_worker_batch)).astype(np.int32)}, mesh)
        for _ in range(STEPS)]

  def analyse(step, state, data):
    args = (state, data[0])
    if aot:
      args = _gpu_aot.abstract_on(args, step_mesh)
    lowered = step.lower(*args)
    jaxpr = jax.make_jaxpr(step)(*args)
    prog = program_collectives(jaxpr, parallel.DATA_AXIS)
    hlo = hlo_collectives(lowered.compile().as_text())
    if not aot:
      for batch in data:
        state, _ = step(state, batch)
    return prog, hlo, state

  def counters(totals):
    if aot:  # nothing ran
      return {"counter_collectives": 0, "counter_payload_bytes": 0, "counter_all_reduces": 0,
              "counter_all_gathers": 0}
    return {"counter_collectives": totals["collectives"],
            "counter_payload_bytes": totals["payload_bytes"],
            "counter_all_reduces": totals["all_reduces"],
            "counter_all_gathers": totals["all_gathers"]}

  def summarise(prog, hlo):
    every = [c for c in hlo if not c["in_conditional"]]
    cond = [c for c in hlo if c["in_conditional"]]
    p_every = [c for c in prog if not c["in_cond"]]
    p_cond = [c for c in prog if c["in_cond"]]
    return {
        "program_every_step_bytes": sum(c["bytes"] for c in p_every),
        "program_every_step_dtypes": sorted({c["dtype"] for c in p_every}),
        "program_sync_branch_bytes": sum(c["bytes"] for c in p_cond),
        "program_sync_branch_dtypes": sorted({c["dtype"] for c in p_cond}),
        "hlo_every_step_ops": len(every), "hlo_every_step_bytes": sum(c["bytes"] for c in every),
        "hlo_every_step_dtypes": sorted({c["dtype"] for c in every}),
        "hlo_sync_branch_ops": len(cond), "hlo_sync_branch_bytes": sum(c["bytes"] for c in cond),
        "hlo_sync_branch_dtypes": sorted({c["dtype"] for c in cond}),
        "hlo_ops": sorted({c["op"] for c in hlo}),
    }

  rows = []
  for num_workers in worker_counts:
    data = batches(num_workers)
    for name, factory, kind in transforms():
      tx = factory(parallel.WORKER_AXES)
      if tx is None:
        report.note(f"{name}: not on main yet (skipped)")
        continue
      state = train_lib.init_train_state(model, tx, example, num_workers=num_workers, mesh=mesh)
      step = train_lib.make_train_step(model, tx, mesh=step_mesh, num_workers=num_workers)
      prog, hlo, state = analyse(step, state, data)
      rows.append({"transform": name, "kind": kind, "num_workers": num_workers,
                   **summarise(prog, hlo), **counters(comm_lib.comm_totals(state.opt_state))})
    # The fast path: one replica per device, D-way gradient all-reduce.
    inner = optax.sgd(0.1, momentum=0.9)
    state = fastpath.init_train_state(model, inner, example, num_workers=num_workers, mesh=mesh)
    step = fastpath.make_train_step(model, inner, mesh=step_mesh, num_workers=num_workers)
    prog, hlo, state = analyse(step, state, data)
    rows.append({"transform": f"{fastpath.LABEL} (sync SGD)", "kind": "fast",
                 "num_workers": num_workers, **summarise(prog, hlo),
                 **counters(fastpath.comm_report(state))})

  ran = "counters n/a (gpu-aot: nothing runs)"
  for row in rows:
    per = lambda v: v / STEPS  # noqa: E731
    counted = ran if aot else (
        f"counters: {per(row['counter_collectives']):g} exchanges/step "
        f"({row['counter_all_reduces']} all-reduce, {row['counter_all_gathers']} all-gather in "
        f"{STEPS} steps)")
    value, unit = ((row["hlo_every_step_bytes"] + row["hlo_sync_branch_bytes"],
                    "B (compiled GPU HLO, every step + sync branch)") if aot else
                   (per(row["counter_payload_bytes"]), "B/step (counters)"))
    report.figure(
        f"{row['transform']} | W={row['num_workers']}", value, unit,
        f"{counted}; program: every step {row['program_every_step_bytes']:,} B "
        f"{row['program_every_step_dtypes']}, sync branch {row['program_sync_branch_bytes']:,} B "
        f"{row['program_sync_branch_dtypes']}; compiled HLO: every step "
        f"{row['hlo_every_step_ops']} op(s) {row['hlo_every_step_bytes']:,} B "
        f"{row['hlo_every_step_dtypes']}, on sync steps only {row['hlo_sync_branch_ops']} op(s) "
        f"{row['hlo_sync_branch_bytes']:,} B {row['hlo_sync_branch_dtypes']} {row['hlo_ops']}",
        **row)

  # Checks (targets on counts, not timings; they apply in --quick mode too).
  half = param_bytes // 2
  syncs = STEPS // PERIOD
  # XLA:CPU computes a bf16 all-reduce in f32 after compilation; XLA:GPU keeps bf16.
  cpu = args.platform == "cpu"

  def compiled(want):
    return param_bytes if cpu else want

  def counted(tag, name, ok):
    report.target(f"{tag}: {name}", float(ok), ">=", 1.0, applies=not aot,
                  why_not="gpu-aot: nothing runs")

  for row in rows:
    tag = f"{row['transform']} W={row['num_workers']}"
    kind = row["kind"]
    if num_devices < 2:
      continue
    local = 1 if kind == "fast" else row["num_workers"] // num_devices
    bf16 = "bf16" in row["transform"]
    want = half if bf16 else param_bytes
    if kind in ("sync", "fast"):
      report.target(f"{tag}: program bytes/step == params x comm dtype x {local} local worker(s)",
                    float(row["program_every_step_bytes"] == local * want), ">=", 1.0)
      counted(tag, "counters payload/step == program bytes",
              row["counter_payload_bytes"] == STEPS * want and row["counter_all_reduces"] == STEPS)
      report.target(f"{tag}: compiled HLO all-reduce bytes/step == params x comm dtype"
                    f"{' (f32 on CPU)' if bf16 and cpu else ''}",
                    float(row["hlo_every_step_bytes"] == compiled(want)), ">=", 1.0)
    elif kind == "qsgd":
      report.target(f"{tag}: compiled: one all-gather per step (levels and norms in one buffer)",
                    float(row["hlo_every_step_ops"] == 1 and "all-gather" in row["hlo_ops"]),
                    ">=", 1.0)
      counted(tag, "all-gather counted once per step",
              row["counter_all_gathers"] == STEPS and row["counter_payload_bytes"] > 0)
    elif kind in ("periodic", "adpsgd"):
      # Every-step collectives, if any, are scalars (no parameter-sized exchange on local steps).
      report.target(f"{tag}: no parameter-sized collective outside the sync loop",
                    float(row["hlo_every_step_bytes"] < 64
                          and row["program_every_step_bytes"] < 64), ">=", 1.0)
      report.target(f"{tag}: sync branch exchanges the parameters",
                    float(row["program_sync_branch_bytes"] >= local * want
                          and row["hlo_sync_branch_bytes"] >= compiled(want)), ">=", 1.0)
      if kind == "periodic":  # exactly (with >=, averaging every step passed as p=4)
        counted(tag, f"counters = floor(N/p) = {syncs} parameter exchanges",
                row["counter_all_reduces"] == syncs
                and row["counter_payload_bytes"] == syncs * want)
      else:  # ADPSGD: each sync exchanges the parameters and S_k (one f32 scalar), nothing else
        n = row["counter_all_reduces"]
        counted(tag, "counters = parameters + S_k per sync",
                n >= 2 and n % 2 == 0 and row["counter_payload_bytes"] == n // 2 * (want + 4))
    if bf16 and not cpu:  # issue 8: bf16 all-reduce operands in the compiled GPU HLO
      dtypes = row["hlo_every_step_dtypes"] if kind in ("sync", "fast") else \
          row["hlo_sync_branch_dtypes"]
      report.target(f"{tag}: compiled GPU all-reduce operand dtype is bf16 (got {dtypes})",
                    float(dtypes == ["bf16"]), ">=", 1.0)
  return report.finish()


if __name__ == "__main__":
  main()
