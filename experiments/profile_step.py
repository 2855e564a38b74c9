"""Where a training step's time goes: a device profile of one-device steps, kernel by kernel (issue 8).

Issue 8 asks for a profile wherever a target is not met: target 4a (the fast path at >= 0.97 x
one replica) and target 4b's stretch (16 x 256 local workers at >= 0.75 x one replica at batch
4096). This bench builds the same steps as ``bench_virtual_workers`` and, per program:

1. times it unprofiled, interleaved with the others (``_bench.time_interleaved``);
2. records ``--steps`` steps under :func:`jax.profiler.trace` (one trace per program);
3. reads the trace's ``perfetto_trace.json.gz`` (Chrome trace-event JSON) and keeps the
   device's kernel events: on a GPU, the events on the ``/device:GPU:N`` process's
   ``Stream`` threads (CUPTI); on the CPU, the XLA:CPU thunk events. Each event carries the
   HLO instruction it ran (``args.hlo_op``);
4. joins every event with that instruction in the compiled HLO
   (``Compiled.as_text()``), which gives it a category (cuDNN convolution, cuBLAS/Triton
   matmul, reduction fusion, elementwise fusion, copy, collective, ...) and the modelled
   bytes it writes and reads (:func:`_bench.hlo_instruction_traffic`);
5. reports per program and step: the wall time while traced, the device span (first kernel
   start to last kernel end), busy time (the union of kernel intervals; span - busy is device
   idle time, e.g. waiting on the host to launch), and per category the time, launches,
   modelled bytes and achieved GB/s; then the top kernels; then each program's difference to
   the first (the reference), category by category.

Inside a CUDA graph (an XLA:GPU command buffer) every kernel reports the graph's name instead
of its instruction, so this bench turns command buffers off (``XLA_FLAGS`` gets
``--xla_gpu_enable_command_buffer=``, explicitly empty, unless it sets that flag already;
``--keep-command-buffers`` leaves it alone). Its untraced times are therefore of the
op-by-op program; ``bench_virtual_workers`` times the default one. Kernels that still report
a command buffer are counted under ``unmatched: command_buffer...`` and named in a note. The trace and the join are tested on the CPU
(``tests/test_profile_step.py``) and on a GPU-format trace built in the test.

Commands::

  python -m experiments.profile_step --programs one,fast --shapes 16x64      # target 4a
  python -m experiments.profile_step --programs one,unroll,map --shapes 16x256  # 4b stretch
  python -m experiments.profile_step --quick                                 # CI

Programs: ``one`` (the plain flax + optax step at the global batch W*B), ``fast``
(``mfopt.fastpath``), ``vmap``, ``map``, ``unroll``, ``gemm`` (``mfopt.train`` local steps
with that lowering, SGD momentum, no communication). Sizes as ``bench_virtual_workers``
(GPU: ResNet-18 width 64, 32x32, bf16; CPU: width 8, 16x16; ``--quick``: the small CNN).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _bench

PROGRAMS = ("one", "fast", "vmap", "map", "unroll", "gemm")
#: Trace lines on a GPU's process that are derived from the kernels (not kernels themselves).
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "Steps", "Framework Ops", "Framework Name Scope",
                  "Source code", "TensorFlow Name Scope", "TensorFlow Ops", "XLA TraceMe"}
_GPU_PROCESS = re.compile(r"/device:GPU:\d+")
#: Turns XLA:GPU command buffers (CUDA graphs) off, so every kernel names its instruction.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
_HLO_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)", re.M)
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                "collective-broadcast")


def categorize(op: str, line: str, fused_ops: set[str] = frozenset()) -> str:
  """A kernel's category from its HLO instruction (``op`` and the whole line) and, for a
  fusion, the ops of its fused computation (a fusion around a ``dot`` is a matmul: XLA:GPU's
  Triton GEMMs, XLA:CPU's library fusions; around a ``convolution``, a convolution)."""
  low = line.lower()
  if op.startswith(_COLLECTIVES) or (op == "async-start" and any(c in low for c in _COLLECTIVES)):
    return "collective"
  if "cudnn" in low or op == "convolution" or "convolution" in fused_ops:
    return "convolution"
  if ("cublas" in low or "triton_gemm" in low or "gemm_fusion" in low or op == "dot"
      or "dot" in fused_ops):
    return "matmul"
  if op == "fusion":
    kind = _FUSION_KIND.search(line)
    return {"kLoop": "elementwise fusion", "kInput": "reduction fusion",
            "kOutput": "output fusion"}.get(kind.group(1) if kind else "", "custom fusion")
  if op == "custom-call":
    target = _TARGET.search(line)
    return f"custom-call {target.group(1) if target else '?'}"
  if op in ("copy", "copy-start", "transpose"):
    return "copy/transpose"
  if op in ("reduce", "reduce-window", "select-and-scatter"):
    return "reduction"
  return op


def hlo_index(text: str) -> tuple[str | None, dict[str, dict[str, Any]]]:
  """``(module name, {instruction name: {"op", "category", "written", "read"}})`` for every
  kernel-launching instruction of a compiled module (all computations: loop bodies too)."""
  comps, _ = _bench.hlo_computations(text)
  ops = {name: {m.group("op") for m in map(_bench.HLO_INSTR.match, lines) if m}
         for name, lines in comps.items()}
  index = {}
  for lines in comps.values():
    for row in _bench.hlo_instruction_traffic(lines, _bench.HLO_NOT_KERNELS, comps):
      called = _CALLS.search(row["line"]) if row["op"] == "fusion" else None
      fused = ops.get(called.group(1), set()) if called else set()
      index[row["name"]] = {"op": row["op"],
                            "category": categorize(row["op"], row["line"], fused),
                            "written": row["written"], "read": row["read"]}
  m = _HLO_MODULE.search(text)
  return (m.group(1) if m else None), index


def load_trace(trace_dir: str) -> list[dict[str, Any]]:
  """The events of the newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under trace_dir={trace_dir!r}")
  with gzip.open(paths[-1], "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _line_names(events: Sequence[dict[str, Any]]
                ) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
  """``({pid: process name}, {(pid, tid): thread name})`` from a trace's metadata events."""
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e.get("pid")] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
  return procs, threads


def trace_lines(events: Sequence[dict[str, Any]], top: int = 16) -> list[dict[str, Any]]:
  """A census of a trace's lines (process, thread), most events first: per line the number of
  complete events, their summed duration (s), the ``args`` keys they carry and one event's
  name. Kept in the JSON so that a trace whose layout :func:`device_events` misreads (e.g. the
  first real CUPTI trace, or a JAX version that renames its lines) can be understood from the
  fetched results alone, without another device call for the raw trace."""
  procs, threads = _line_names(events)
  count: collections.Counter = collections.Counter()
  dur: collections.Counter = collections.Counter()
  keys: dict[tuple[Any, Any], set[str]] = collections.defaultdict(set)
  example: dict[tuple[Any, Any], str] = {}
  for e in events:
    if e.get("ph") != "X":
      continue
    line = (e.get("pid"), e.get("tid"))
    count[line] += 1
    dur[line] += float(e.get("dur", 0.0)) * 1e-6
    keys[line].update(e.get("args", {}))
    example.setdefault(line, str(e.get("name", ""))[:80])
  return [{"process": procs.get(pid, str(pid)), "thread": threads.get((pid, tid), str(tid)),
           "events": n, "s": dur[(pid, tid)], "arg_keys": sorted(keys[(pid, tid)])[:12],
           "example": example[(pid, tid)]}
          for (pid, tid), n in count.most_common(top)]


def device_events(events: Sequence[dict[str, Any]], module: str | None = None
                  ) -> tuple[str, list[dict[str, Any]], int | None]:
  """``(where, kernel events, executions)`` of a trace.

  GPU traces: complete events (``ph == "X"``) of ``/device:GPU:N`` processes on ``Stream``
  threads (the derived "XLA Ops"/"XLA Modules" lines would count each kernel twice);
  ``executions`` is the number of ``module`` events on the "XLA Modules" line. CPU traces
  (no GPU process): the XLA:CPU thunk events, which carry ``args.hlo_op``, without the
  ``end: ...`` markers and without control-flow thunks (a ``while`` thunk's event spans its
  body's); ``executions`` counts distinct ``run_id``. With ``module``, only events whose
  ``args.hlo_module`` is that module (where the trace names it) are kept.
  """
  procs, threads = _line_names(events)
  gpus = {p for p, n in procs.items() if _GPU_PROCESS.search(n)}

  def in_module(e):
    got = e.get("args", {}).get("hlo_module")
    return module is None or got is None or got == module or got.startswith(module + "(")

  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if gpus:
    stream = {k for k, n in threads.items() if k[0] in gpus and n.startswith("Stream")}
    if not stream:  # an unknown thread naming: every line but the derived ones
      stream = {k for k, n in threads.items() if k[0] in gpus and n not in _DERIVED_LINES}
    kernels = [e for e in complete if (e.get("pid"), e.get("tid")) in stream and in_module(e)]
    mods = {k for k, n in threads.items() if k[0] in gpus and n == "XLA Modules"}
    runs = [e for e in complete if (e.get("pid"), e.get("tid")) in mods and in_module(e)
            and (module is None or e.get("name", "").startswith(module))]
    return "gpu", kernels, (len(runs) or None)
  kernels = [e for e in complete if "hlo_op" in e.get("args", {})
             and not e.get("name", "").startswith("end: ") and in_module(e)
             and e["args"]["hlo_op"] not in ("while", "conditional", "call")
             and not re.match(r"(while|conditional|call)(\.\d+)?$", e["args"]["hlo_op"])]
  runs = {e["args"].get("run_id") for e in kernels if e["args"].get("run_id") is not None}
  return "cpu", kernels, (len(runs) or None)


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
  """Total length (in the inputs' unit) covered by ``[start, end)`` intervals."""
  total, end = 0.0, -np.inf
  for s, e in sorted(intervals):
    if e <= end:
      continue
    total += e - max(s, end)
    end = e
  return total


def summarize(kernels: Sequence[dict[str, Any]], index: dict[str, dict[str, Any]], steps: int,
              top: int = 12) -> dict[str, Any]:
  """Per-step figures of a program's kernel events joined with its :func:`hlo_index`.

  Times are in seconds per step (trace timestamps are microseconds); bytes are the traffic
  model's per launch, summed over the launches seen; GB/s = modelled bytes / kernel time.
  A kernel whose ``hlo_op`` is not in the index (a memcpy/memset, or a name the compiler gave
  after ``as_text``) is counted under ``unmatched: <kernel name>``.
  """
  if steps <= 0:
    raise ValueError(f"steps must be positive, got {steps}")
  cats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  op_cat = {}
  for e in kernels:
    args = e.get("args", {})
    hop = str(args.get("hlo_op") or args.get("tf_op") or "").rsplit("/", 1)[-1]
    info = index.get(hop)
    if info is None:
      cat = f"unmatched: {(hop or e.get('name', '?'))[:60]}"
      written = read = 0
    else:
      cat, written, read = info["category"], info["written"], info["read"]
    dur = float(e["dur"]) * 1e-6
    for c in (cats[cat], ops[hop or e.get("name", "?")]):
      c["s"] += dur
      c["launches"] += 1
      c["written"] += written
      c["read"] += read
    op_cat[hop or e.get("name", "?")] = cat
  if kernels:
    starts = [float(e["ts"]) for e in kernels]
    ends = [float(e["ts"]) + float(e["dur"]) for e in kernels]
    span = (max(ends) - min(starts)) * 1e-6
    busy = union_seconds(list(zip(starts, ends))) * 1e-6
  else:
    span = busy = 0.0

  def per_step(c: collections.Counter) -> dict[str, Any]:
    moved = c["written"] + c["read"]
    return {"s_per_step": c["s"] / steps, "launches_per_step": c["launches"] / steps,
            "written_per_step": c["written"] / steps, "read_per_step": c["read"] / steps,
            "GBps": moved / c["s"] / 1e9 if c["s"] > 0 and moved else None}

  ranked = sorted(ops.items(), key=lambda kv: -kv[1]["s"])[:top]
  return {
      "steps": steps, "kernels": len(kernels),
      "span_s_per_step": span / steps, "busy_s_per_step": busy / steps,
      "kernel_s_per_step": sum(c["s"] for c in cats.values()) / steps,
      "categories": {k: per_step(c) for k, c in sorted(cats.items(), key=lambda kv: -kv[1]["s"])},
      "top": [{"hlo_op": k, "category": op_cat[k], **per_step(c)} for k, c in ranked],
  }


def profile_runner(runner: _bench.Runner, steps: int, trace_dir: str) -> dict[str, Any]:
  """Traces ``steps`` calls of a warmed-up runner and summarizes its kernels."""
  text = runner.fn.lower(runner.state, *runner.args).compile().as_text()
  module, index = hlo_index(text)
  runner.call(1)  # warm (the state is donated: the runner threads it); nothing compiles inside
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    t0 = time.perf_counter()
    runner.call(steps)
    wall = (time.perf_counter() - t0) / steps
  events = load_trace(trace_dir)
  where, kernels, runs = device_events(events, module)
  out = summarize(kernels, index, steps)
  out.update(where=where, module=module, traced_wall_s_per_step=wall, executions_seen=runs,
             hlo_kernels=len(index), lines=trace_lines(events))
  return out


def _runners(names: Sequence[str], model, xw: np.ndarray, yw: np.ndarray) -> dict[str, Any]:
  from experiments.bench_train_step import mfopt_runner, plain_runner
  from experiments.bench_virtual_workers import fast_runner
  num_workers = xw.shape[0]
  sgd = optax.sgd(0.1, momentum=0.9)
  out = {}
  for name in names:
    if name == "one":
      out[name] = plain_runner(model, sgd, xw.reshape(-1, *xw.shape[2:]), yw.reshape(-1))
    elif name == "fast":
      out[name] = fast_runner(model, sgd, xw, yw)
    else:
      out[name] = mfopt_runner(model, sgd, xw, yw, num_workers=num_workers, lowering=name)
  return out


def parse_programs(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  bad = [n for n in names if n not in PROGRAMS]
  if not names or bad:
    raise ValueError(f"--programs must be a comma list from {', '.join(PROGRAMS)}, got {text!r}")
  return names


def markdown(result: dict[str, Any]) -> list[str]:
  """A profile run (``main``'s result or its JSON) as Markdown: per shape, one column per
  program and one row per figure (ms per step) and per kernel category (ms, launches)."""
  by_shape: dict[str, dict[str, dict[str, Any]]] = {}
  for f in result.get("figures", []):
    if "profile" in f:
      by_shape.setdefault(f["shape"], {})[f["program"]] = f["profile"]
  lines = []
  for shape, profs in by_shape.items():
    names = list(profs)
    ref = profs[names[0]]
    cats = sorted({c for p in profs.values() for c in p["categories"]},
                  key=lambda c: -ref["categories"].get(c, {}).get("s_per_step", 0.0))
    ms = lambda v: f"{v * 1e3:.3f}"  # noqa: E731
    rows = [("untraced step (median)", [ms(p["untraced"]["median_s"]) for p in profs.values()]),
            ("traced step (wall)", [ms(p["traced_wall_s_per_step"]) for p in profs.values()]),
            ("device span", [ms(p["span_s_per_step"]) for p in profs.values()]),
            ("busy (union of kernels)", [ms(p["busy_s_per_step"]) for p in profs.values()]),
            ("idle (span - busy)", [ms(p["span_s_per_step"] - p["busy_s_per_step"])
                                    for p in profs.values()]),
            ("kernels", [f"{p['kernels'] / p['steps']:.0f}" for p in profs.values()])]
    for c in cats:
      cells = []
      for p in profs.values():
        got = p["categories"].get(c)
        cells.append("-" if got is None else
                     f"{ms(got['s_per_step'])} ({got['launches_per_step']:.0f})")
      rows.append((c, cells))
    lines += ["", f"{shape}, ms per step (a category: ms (launches)); reference {names[0]}:", "",
              "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
  return lines


def _extra_args(parser) -> None:
  from experiments.bench_virtual_workers import parse_shapes
  parser.add_argument("--programs", default="one,fast",
                      help=f"comma list from {', '.join(PROGRAMS)}; the first is the reference "
                           "(default one,fast: target 4a)")
  parser.add_argument("--shapes", default=None, type=parse_shapes,
                      help="comma list of WxB (default: 16x64 on GPU, 4x8 on CPU, 2x2 quick)")
  parser.add_argument("--steps", type=int, default=None,
                      help="traced steps per program (default 5; 2 with --quick)")
  parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
  parser.add_argument("--keep-command-buffers", action="store_true",
                      help="do not add --xla_gpu_enable_command_buffer= to XLA_FLAGS (kernels "
                           "inside CUDA graphs then report the graph, not their instruction)")
  parser.add_argument("--trace-dir", default=None,
                      help="keep the raw traces here (one subfolder per program and shape; "
                           "open them in Perfetto or XProf); default: a deleted temp folder")


def _fmt_cat(c: dict[str, Any]) -> str:
  bw = "" if c["GBps"] is None else f", {c['GBps']:.0f} GB/s"
  return (f"{c['launches_per_step']:.0f} launches, {(c['written_per_step'] + c['read_per_step']) / 1e6:.1f} MB"
          f" modelled{bw}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _bench.parse_args(argv, __doc__.splitlines()[0], _extra_args)
  try:
    names = parse_programs(args.programs)
  except ValueError as err:
    raise SystemExit(str(err)) from None
  steps = args.steps if args.steps is not None else (2 if args.quick else 5)
  if steps <= 0:
    raise SystemExit(f"--steps must be positive, got {steps}")
  flags = os.environ.get("XLA_FLAGS", "")
  if not args.keep_command_buffers and "xla_gpu_enable_command_buffer" not in flags:
    # Read when the backend starts (below, in Report): a process whose backend already runs
    # (a test) keeps its flags; XLA:CPU has no command buffers to turn off.
    os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()
  from experiments.bench_train_step import synthetic
  from experiments.bench_virtual_workers import build_model, configs

  gpu = jax.default_backend() == "gpu"
  report = _bench.Report("profile_step", args)
  model_cfg, _ = configs(args.quick, gpu)
  shapes = args.shapes or [(2, 2) if args.quick else (16, 64) if gpu else (4, 8)]
  dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
  model, model_name = build_model(args.quick, model_cfg, dtype)
  reps = args.reps or (1 if args.quick else 5)
  report.note(f"{model_name}, {model_cfg['image']}x{model_cfg['image']}, {args.dtype}, one "
              f"device; untraced: 1 warm-up, {reps} interleaved reps x 1 step; traced: {steps} "
              f"steps per program under jax.profiler.trace; bytes: the HLO traffic model "
              f"(not measured); programs {', '.join(names)} (first = reference)")
  profiles = {}
  for num_workers, batch in shapes:
    x, y = synthetic(num_workers * batch, model_cfg["image"], 10)
    xw = x.reshape(num_workers, batch, *x.shape[1:])
    yw = y.reshape(num_workers, batch)
    runners = _runners(names, model, xw, yw)
    shape = f"W={num_workers} B={batch}"
    order = list(runners)
    timed = _bench.time_interleaved(
        list(runners.values()), warmup=1, reps=reps, iters=1,
        on_error=lambda i, e: report.left_out(f"{shape} | {order[i]}", e))
    timings = {n: t for n, t in zip(order, timed) if t is not None}
    runners = {n: r for n, r in runners.items() if n in timings}
    with tempfile.TemporaryDirectory() as tmp:
      for name, runner in runners.items():
        where = os.path.join(args.trace_dir or tmp, f"{name}_{num_workers}x{batch}")
        prof = profile_runner(runner, steps, where)
        prof["untraced"] = timings[name].as_dict()
        profiles[(shape, name)] = prof
        report.figure(f"{shape} | {name} | untraced step", timings[name].median * 1e3, "ms",
                      timings[name].spread())
        report.figure(f"{shape} | {name} | traced step (wall)",
                      prof["traced_wall_s_per_step"] * 1e3, "ms",
                      f"{prof['where']} kernels: {prof['kernels'] / steps:.0f} per step, "
                      f"span {prof['span_s_per_step'] * 1e3:.3f} ms, busy "
                      f"{prof['busy_s_per_step'] * 1e3:.3f} ms, executions seen "
                      f"{prof['executions_seen']}", shape=shape, program=name, profile=prof)
        unmatched = sum(c["s_per_step"] for k, c in prof["categories"].items()
                        if k.startswith("unmatched"))
        if not prof["kernels"] or unmatched > 0.5 * prof["kernel_s_per_step"]:
          lines = "; ".join(f"{ln['process']} / {ln['thread']}: {ln['events']} events, "
                            f"args {ln['arg_keys']}" for ln in prof["lines"][:6])
          report.note(f"{shape} | {name}: "
                      + (f"the trace has no kernel events of module {prof['module']} (is "
                         "CUPTI available?)" if not prof["kernels"] else
                         f"{unmatched / prof['kernel_s_per_step']:.0%} of kernel time is not "
                         "matched to an HLO instruction")
                      + f". Its busiest lines (all in the JSON's profile.lines): {lines}")
        graphs = [c for c in prof["categories"] if c.startswith("unmatched: command_buffer")]
        if graphs:
          report.note(f"{shape} | {name}: {len(graphs)} CUDA graph(s) in the trace, their "
                      "kernels unattributed: run without --keep-command-buffers and without "
                      "xla_gpu_enable_command_buffer in XLA_FLAGS")
        for cat, c in prof["categories"].items():
          report.figure(f"{shape} | {name} | {cat}", c["s_per_step"] * 1e3, "ms/step",
                        _fmt_cat(c))
        for row in prof["top"][:8]:
          report.figure(f"{shape} | {name} | top kernel {row['hlo_op']} ({row['category']})",
                        row["s_per_step"] * 1e3, "ms/step", _fmt_cat(row))
    if names[0] not in runners:
      continue  # no reference to compare with (its failure is noted above)
    ref = profiles[(shape, names[0])]
    for name in names[1:]:
      if name not in runners:
        continue
      prof = profiles[(shape, name)]
      gap = prof["busy_s_per_step"] - ref["busy_s_per_step"]
      report.figure(f"{shape} | {name} - {names[0]} | busy time", gap * 1e3, "ms/step",
                    f"untraced {timings[name].median * 1e3:.3f} vs "
                    f"{timings[names[0]].median * 1e3:.3f} ms; idle (span - busy) "
                    f"{(prof['span_s_per_step'] - prof['busy_s_per_step']) * 1e3:.3f} vs "
                    f"{(ref['span_s_per_step'] - ref['busy_s_per_step']) * 1e3:.3f} ms")
      cats = set(prof["categories"]) | set(ref["categories"])
      zero = {"s_per_step": 0.0, "launches_per_step": 0.0}
      deltas = sorted(((prof["categories"].get(c, zero)["s_per_step"]
                        - ref["categories"].get(c, zero)["s_per_step"], c) for c in cats),
                      key=lambda d: -abs(d[0]))
      for delta, cat in deltas[:8]:
        a, b = ref["categories"].get(cat, zero), prof["categories"].get(cat, zero)
        report.figure(f"{shape} | {name} - {names[0]} | {cat}", delta * 1e3, "ms/step",
                      f"{b['s_per_step'] * 1e3:.3f} vs {a['s_per_step'] * 1e3:.3f} ms, "
                      f"{b['launches_per_step']:.0f} vs {a['launches_per_step']:.0f} launches")
  return report.finish()


if __name__ == "__main__":
  main()
