"""Collectives per step of every communicating transform, from the program and the compiled HLO (issue 8, target 6).

Command::

  python -m experiments.bench_comm            # 8 fake CPU devices, W = 8 and 16 workers
  python -m experiments.bench_comm --quick    # CI: W = 16 only
  python -m experiments.bench_comm --platform gpu   # on the GPUs of the machine (>= 2)

For each transform, the worker-stacked train step (``mfopt.train.make_train_step``, an MLP
784-64-10 (50,890 parameters, 203,560 B in f32) on 8 devices) is

* traced: every cross-device collective of the *program* (``psum``/``all_gather``/... over
  the mesh axis ``data`` in the jaxpr), with its dtype and bytes, and whether it sits in a
  ``cond`` branch (a sync branch) or runs every step. Bytes are per *device*: under the
  worker ``vmap`` the operand of a ``psum`` over ``("data", "local")`` holds the device's
  ``W/D`` workers (XLA then sums them locally before the all-reduce, as the compiled bytes
  show). Reductions over the ``vmap`` axis alone are local sums, not collectives;
* compiled: every collective op of the optimised HLO (``all-reduce``, ``all-gather``,
  ``reduce-scatter``, ``all-to-all``, ``collective-permute``, and their async ``-start``
  forms), its result bytes, and whether its computation is reached from ``ENTRY`` only
  through a ``conditional`` branch;
* run for ``N = 8`` steps, and its own ``CommStats`` counters read (``mfopt.comm_totals``).

It prints one line per transform and W with the three views side by side, and checks the
facts the transforms promise (targets): synchronous transforms exchange the parameter bytes
(in ``comm_dtype``) every step and count one all-reduce per step; periodic averaging /
block momentum run no collective outside the sync ``conditional`` and count floor(N/p)
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
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4,
               "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "s4": 1, "u4": 1}
HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-permute")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(HLO_COLLECTIVES) +
                 r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _shape_bytes(shape: str, op: str, start: bool) -> int:
  parts = _SHAPE.findall(shape)
  if start and op == "all-gather" and len(parts) > 1:  # (operand, result): count the result
    parts = parts[-1:]
  total = 0
  for dtype, dims in parts:
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * DTYPE_BYTES.get(dtype, 4)
  return total


def hlo_collectives(text: str) -> list[dict[str, Any]]:
  """Collective ops of an optimised HLO module, each with bytes and ``in_conditional``.

  A computation counts as unconditional when ``ENTRY`` reaches it through ``calls``,
  ``to_apply``, ``body``/``condition`` edges only; reached only through a conditional's
  branch computations, it is conditional.
  """
  comps: dict[str, list[str]] = {}
  entry, cur = None, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is not None and line.strip() == "}":
      cur = None
      continue
    if cur is not None:
      comps[cur].append(line)
  edges: dict[str, list[tuple[str, bool]]] = {c: [] for c in comps}
  for c, lines in comps.items():
    for line in lines:
      for kind, callee in _CALLS.findall(line):
        edges[c].append((callee, kind in ("true_computation", "false_computation")))
      for group in _BRANCHES.findall(line):
        for callee in group.split(","):
          edges[c].append((callee.strip().lstrip("%"), True))
  unconditional, seen = set(), set()

  def visit(c: str, cond: bool) -> None:
    if (c, cond) in seen or c not in comps:
      return
    seen.add((c, cond))
    if not cond:
      unconditional.add(c)
    for callee, branch in edges[c]:
      visit(callee, cond or branch)

  if entry is not None:
    visit(entry, False)
  out = []
  for c, lines in comps.items():
    if all(c != s[0] for s in seen):
      continue
    for line in lines:
      m = _OP.search(line)
      if m:
        out.append({"op": m.group("op"), "bytes": _shape_bytes(m.group("shape"), m.group("op"),
                                                               bool(m.group("start"))),
                    "in_conditional": c not in unconditional,
                    "dtype": ",".join(sorted({d for d, _ in _SHAPE.findall(m.group("shape"))}))})
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
      is_cond = eqn.primitive.name == "cond"
      for value in eqn.params.values():
        subs = value if isinstance(value, (list, tuple)) else [value]
        for sub in subs:
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr, in_cond or is_cond)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub, in_cond or is_cond)

  walk(closed_jaxpr.jaxpr, False)
  return out


def _setup_devices(platform: str) -> None:
  import jax
  if platform == "cpu":
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
      "--platform", choices=("cpu", "gpu"), default="cpu"))
  _setup_devices(args.platform)
  import jax
  import optax

  from mfopt import comm as comm_lib
  from mfopt import fastpath, models, parallel
  from mfopt import train as train_lib

  report = _bench.Report("bench_comm", args)
  mesh = parallel.make_mesh()
  num_devices = mesh.shape[parallel.DATA_AXIS]
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
    lowered = step.lower(state, data[0])
    jaxpr = jax.make_jaxpr(step)(state, data[0])
    prog = program_collectives(jaxpr, parallel.DATA_AXIS)
    hlo = hlo_collectives(lowered.compile().as_text())
    for batch in data:
      state, _ = step(state, batch)
    return prog, hlo, state

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
        "hlo_sync_branch_ops": len(cond), "hlo_sync_branch_bytes": sum(c["bytes"] for c in cond),
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
      step = train_lib.make_train_step(model, tx, mesh=mesh, num_workers=num_workers)
      prog, hlo, state = analyse(step, state, data)
      totals = comm_lib.comm_totals(state.opt_state)
      row = {"transform": name, "kind": kind, "num_workers": num_workers, **summarise(prog, hlo),
             "counter_collectives": totals["collectives"],
             "counter_payload_bytes": totals["payload_bytes"],
             "counter_all_reduces": totals["all_reduces"],
             "counter_all_gathers": totals["all_gathers"]}
      rows.append(row)
    # The fast path: one replica per device, D-way gradient all-reduce.
    inner = optax.sgd(0.1, momentum=0.9)
    state = fastpath.init_train_state(model, inner, example, num_workers=num_workers, mesh=mesh)
    step = fastpath.make_train_step(model, inner, mesh=mesh, num_workers=num_workers)
    prog, hlo, state = analyse(step, state, data)
    totals = fastpath.comm_report(state)
    rows.append({"transform": f"{fastpath.LABEL} (sync SGD)", "kind": "fast",
                 "num_workers": num_workers, **summarise(prog, hlo),
                 "counter_collectives": totals["collectives"],
                 "counter_payload_bytes": totals["payload_bytes"],
                 "counter_all_reduces": totals["all_reduces"],
                 "counter_all_gathers": totals["all_gathers"]})

  for row in rows:
    per = lambda v: v / STEPS  # noqa: E731
    report.figure(
        f"{row['transform']} | W={row['num_workers']}", per(row["counter_payload_bytes"]),
        "B/step (counters)",
        f"counters: {per(row['counter_collectives']):g} exchanges/step "
        f"({row['counter_all_reduces']} all-reduce, {row['counter_all_gathers']} all-gather in "
        f"{STEPS} steps); program: every step {row['program_every_step_bytes']:,} B "
        f"{row['program_every_step_dtypes']}, sync branch {row['program_sync_branch_bytes']:,} B "
        f"{row['program_sync_branch_dtypes']}; compiled HLO: every step "
        f"{row['hlo_every_step_ops']} op(s) {row['hlo_every_step_bytes']:,} B, in conditional "
        f"{row['hlo_sync_branch_ops']} op(s) {row['hlo_sync_branch_bytes']:,} B {row['hlo_ops']}",
        **row)

  # Checks (targets on counts, not timings; they apply in --quick mode too).
  half = param_bytes // 2
  syncs = STEPS // PERIOD
  for row in rows:
    tag = f"{row['transform']} W={row['num_workers']}"
    kind = row["kind"]
    if num_devices < 2:
      continue
    local = 1 if kind == "fast" else row["num_workers"] // num_devices
    if kind in ("sync", "fast"):
      want = half if "bf16" in row["transform"] else param_bytes
      report.target(f"{tag}: program bytes/step == params x comm dtype x {local} local worker(s)",
                    float(row["program_every_step_bytes"] == local * want), ">=", 1.0)
      report.target(f"{tag}: counters payload/step == program bytes",
                    float(row["counter_payload_bytes"] == STEPS * want
                          and row["counter_all_reduces"] == STEPS), ">=", 1.0)
      compiled_want = param_bytes  # bf16 is computed in f32 on XLA:CPU
      report.target(f"{tag}: compiled HLO all-reduce bytes/step == params"
                    f"{' (f32 on CPU)' if want == half else ''}",
                    float(row["hlo_every_step_bytes"] == (
                        compiled_want if args.platform == "cpu" else want)), ">=", 1.0)
    elif kind == "qsgd":
      report.target(f"{tag}: all-gather every step, counted once per step",
                    float(row["hlo_every_step_ops"] >= 1 and row["counter_all_gathers"] == STEPS
                          and row["counter_payload_bytes"] > 0), ">=", 1.0)
    elif kind in ("periodic", "adpsgd"):
      # Every-step collectives, if any, are scalars (no parameter-sized exchange on local steps).
      report.target(f"{tag}: no parameter-sized collective outside the sync conditional",
                    float(row["hlo_every_step_bytes"] < 64
                          and row["program_every_step_bytes"] < 64), ">=", 1.0)
      want = half if "bf16" in row["transform"] else param_bytes
      report.target(f"{tag}: sync branch exchanges the parameters",
                    float(row["program_sync_branch_bytes"] >= local * want
                          and row["hlo_sync_branch_bytes"] >= param_bytes), ">=", 1.0)
      if kind == "periodic":
        report.target(f"{tag}: counters = floor(N/p) = {syncs} parameter exchanges",
                      float(row["counter_all_reduces"] >= syncs
                            and row["counter_payload_bytes"] >= syncs * want), ">=", 1.0)
  return report.finish()


if __name__ == "__main__":
  main()
