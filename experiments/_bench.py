"""Shared timing harness of the ``experiments/bench_*.py`` benchmarks (issue 8).

Harness (the issue asks every report to state it):

* every timed function is jitted, with its state argument **donated** when the
  benchmark says so, and compiled before timing;
* ``warmup`` untimed calls, then ``reps`` repetitions of ``iters`` back-to-back calls,
  each repetition ended by ``jax.block_until_ready`` on the whole output (no host sync
  inside a repetition); the figure is the **median** seconds per call over the
  repetitions, the spread is reported as min and max (and the IQR);
* two variants compared for a ratio are timed **interleaved** (A, B, A, B, ...) in one
  process, so slow drift of a shared machine affects both alike.

Output: one line per figure, ``FIG <bench> | <name> | <value> <unit> | <details>``, and
at the end one ``TARGET`` line per target and ``RESULT: PASS`` or ``RESULT: FAIL``. With
``--json PATH`` the same figures are written as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

#: Peak memory bandwidth (bytes/s) by device kind (vendor datasheets); unknown kinds print "n/a".
PEAK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12,   # H100 SXM5
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
}


def parse_args(argv: Sequence[str] | None, description: str,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, 1 repetition: checks that the bench runs (CI)")
  parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
  parser.add_argument("--json", default=None, help="write the figures to this JSON file")
  if extra is not None:
    extra(parser)
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)  # for the report's command line
  if args.reps is not None and args.reps <= 0:
    parser.error(f"--reps must be positive, got {args.reps}")
  return args


def source_commit() -> str | None:
  """The git commit of the code that runs (``+dirty`` with uncommitted changes), or
  ``$MFOPT_COMMIT`` where there is no repository (a copied working tree, e.g. a lent GPU
  machine: ``MFOPT_COMMIT=$(git rev-parse --short HEAD)`` is set where the call is made)."""
  if os.environ.get("MFOPT_COMMIT"):
    return os.environ["MFOPT_COMMIT"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10)
    if head.returncode != 0:
      return None
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
  dev = jax.devices()[0]
  return {
      "commit": source_commit(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "device_kind": dev.device_kind,
      "num_devices": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def peak_bandwidth() -> float | None:
  return PEAK_BANDWIDTH.get(jax.devices()[0].device_kind)


def block(tree: Any) -> Any:
  return jax.block_until_ready(tree)


def minor_faults() -> int | None:
  """This process's minor page faults so far (``getrusage``), ``None`` where unavailable."""
  try:
    import resource
  except ImportError:  # not on Unix
    return None
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def compiled_cost(fn: Any, *args: Any) -> dict[str, float] | None:
  """XLA's own cost estimate of ``fn`` (a ``jax.jit`` function) compiled for ``args``.

  ``{"flops": ..., "bytes accessed": ...}`` from ``Compiled.cost_analysis()`` (per
  execution; a ``while`` body counted once, so compare programs without loops), or ``None``
  where the backend gives none. Deterministic: a structural figure beside noisy timings.
  """
  try:
    cost = fn.lower(*args).compile().cost_analysis()
  except Exception:  # noqa: BLE001  (a backend without cost analysis: report nothing)
    return None
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per partition
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost or "bytes accessed" not in cost:
    return None
  return {"flops": float(cost["flops"]), "bytes accessed": float(cost["bytes accessed"])}


_HLO_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def hlo_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  """The computations of an HLO module's text: ``({name: instruction lines}, entry name)``."""
  comps: dict[str, list[str]] = {}
  entry, cur = None, None
  for line in text.splitlines():
    m = _HLO_HEADER.match(line)
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
  return comps, entry


#: Bytes per element of HLO element types (``shape_bytes`` counts unknown types as 4).
HLO_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "f32": 4, "s32": 4, "u32": 4,
                   "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1,
                   "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_HLO_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_HLO_LOOP = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_HLO_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_HLO_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_HLO_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\swhile\(")
_HLO_OPNAME = re.compile(r'op_name="([^"]*)"')
_HLO_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
#: ``mfopt.comm.GATE_SCOPE``, repeated to keep this module free of mfopt imports
#: (``tests/test_averaging_hlo.py`` checks that the two agree).
GATE_SCOPE = "mfopt_gate"
_HLO_CALL = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_HLO_BRANCH = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_HLO_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def hlo_arrays(shape: str) -> list[tuple[str, int]]:
  """``(element type, element count)`` of each array in an HLO shape string (tuples too)."""
  return [(dtype, int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1)
          for dtype, dims in _HLO_ARRAY.findall(shape)]


def hlo_arrays_bytes(arrays: Sequence[tuple[str, int]]) -> int:
  """Bytes of ``(element type, count)`` pairs from :func:`hlo_arrays`."""
  return sum(n * HLO_DTYPE_BYTES.get(dtype, 4) for dtype, n in arrays)


def hlo_shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple counts all its elements)."""
  return hlo_arrays_bytes(hlo_arrays(shape))


#: One instruction line of an HLO computation: ``name = shape op(``, tuple shapes included.
HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
                       r"(?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+)\s+(?P<op>[\w\-]+)\(")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")


#: HLO ops that launch no kernel of their own on XLA:GPU (views, tuples, control flow, the
#: "done" halves of async pairs): left out of the traffic model and the profile join.
HLO_NOT_KERNELS = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "conditional", "while",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "all-reduce-done",
    "all-gather-done", "collective-permute-done", "copy-done", "async-done", "async-update"})


_HLO_PARAM_NO = re.compile(r"\bparameter\((\d+)\)")
_SLICES = ("slice", "dynamic-slice")


def _sliced_operand_bytes(fused: Sequence[str]) -> dict[int, int]:
  """``{parameter number: bytes}`` for the parameters of a fused computation that are only
  read through ``slice``/``dynamic-slice``: the bytes of those slices, which is what the
  kernel reads of that operand (``jax.flatten_util``'s unravel is one slice per leaf of a
  flat vector; counting the whole vector per slice would overcount it by the leaf count)."""
  params, shapes, users = {}, {}, {}
  for line in fused:
    m = HLO_INSTR.match(line)
    if not m:
      continue
    name, op = m.group("name"), m.group("op")
    shapes[name] = hlo_shape_bytes(m.group("shape"))
    if op == "parameter":
      number = _HLO_PARAM_NO.search(line)
      if number:
        params[name] = int(number.group(1))
      continue
    for operand in set(_HLO_OPERAND.findall(line[m.end():].split(")", 1)[0])):
      users.setdefault(operand, []).append((name, op))
  out = {}
  for name, number in params.items():
    use = users.get(name, [])
    if use and all(op in _SLICES for _, op in use):
      out[number] = min(shapes[name], sum(shapes[u] for u, _ in use))
  return out


def hlo_instruction_traffic(lines: Sequence[str], free: set[str] | frozenset[str],
                            comps: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
  """Per kernel of one HLO computation, ``{"name", "op", "line", "written", "read"}``: every
  instruction whose op is not in ``free``, with its result's bytes (written) and the bytes of
  its operands defined in ``lines`` (read; parameters included). A model of memory traffic,
  the way XLA's cost analysis counts it: it does not know what a kernel reads twice or skips,
  or what stays in cache. Two exceptions where the operand is known to be read only in part:
  a ``slice`` reads its result's bytes, and with ``comps`` (the module's computations) a
  fusion reads of an operand that it only slices the slices' bytes."""
  size: dict[str, int] = {}
  out = []
  for line in lines:
    m = HLO_INSTR.match(line)
    if not m:
      continue
    size[m.group("name")] = hlo_shape_bytes(m.group("shape"))
    if m.group("op") in free:
      continue
    operands = _HLO_OPERAND.findall(line[m.end():].split(")", 1)[0])
    read = [size.get(a, 0) for a in operands]
    if m.group("op") in _SLICES and read:
      read[0] = min(read[0], size[m.group("name")])
    elif m.group("op") == "fusion" and comps:
      called = _HLO_CALL.search(line)
      for number, sliced in _sliced_operand_bytes(comps.get(called.group(1), []) if called
                                                   else []).items():
        if number < len(read):
          read[number] = min(read[number], sliced)
    out.append({"name": m.group("name"), "op": m.group("op"), "line": line,
                "written": size[m.group("name")], "read": sum(read)})
  return out


def hlo_kernel_traffic(lines: Sequence[str], free: set[str] | frozenset[str],
                       comps: dict[str, list[str]] | None = None) -> tuple[int, int]:
  """Bytes written and read by the kernels of one HLO computation: the sums of
  :func:`hlo_instruction_traffic`."""
  rows = hlo_instruction_traffic(lines, free, comps)
  return sum(r["written"] for r in rows), sum(r["read"] for r in rows)


def hlo_branches(line: str) -> list[str]:
  """The branch computations a ``conditional`` instruction line names (none for others)."""
  return _HLO_BRANCH.findall(line) + [b.strip().lstrip("%") for group in
                                      _HLO_BRANCHES.findall(line) for b in group.split(",")]


def hlo_is_gated_loop(line: str) -> bool:
  """Whether an instruction line is a :func:`mfopt.comm.gated` loop.

  That ``while`` runs its body 0 times or once (periodic averaging's sync: a local step / a sync
  step; the hybrid's LARS norms: the AdaBound / the LARS phase): its ``op_name`` metadata
  carries :data:`mfopt.comm.GATE_SCOPE`. Its body is counted like a ``conditional`` branch,
  its condition as every-step work.
  """
  if not _HLO_WHILE.match(line):
    return False
  m = _HLO_OPNAME.search(line)
  return bool(m) and in_gate_scope(m.group(1))


def in_gate_scope(name: str) -> bool:
  """Whether an HLO ``op_name`` or a jaxpr equation's name stack lies in the gate scope
  (``"jit(step)/vmap(mfopt_gate)/while"`` under ``vmap``, ``"mfopt_gate"`` bare)."""
  return re.search(rf"(?:^|[/(]){GATE_SCOPE}(?:[/)]|$)", name) is not None


def hlo_loop_bodies(line: str) -> list[str]:
  """The computations a ``while`` line runs on every step: body and condition, or only the
  condition for a gated loop (:func:`hlo_gated_bodies`)."""
  if hlo_is_gated_loop(line):
    return _HLO_COND.findall(line)
  return _HLO_LOOP.findall(line)


def hlo_trip_count(line: str) -> int | None:
  """XLA's ``known_trip_count`` of a ``while`` line (``backend_config``), else ``None``."""
  m = _HLO_TRIPS.search(line)
  return int(m.group(1)) if m else None


def hlo_gated_bodies(line: str) -> list[str]:
  """The body of the gated loop an instruction line names (none for other lines)."""
  return _HLO_BODY.findall(line) if hlo_is_gated_loop(line) else []


def hlo_reachable(comps: dict[str, list[str]], entry: str | None, *,
                  through_calls: bool = True) -> dict[str, bool]:
  """Computations reached from ``entry`` -> True if reached *only* through conditional branches
  (or the body of a gated loop, :func:`hlo_is_gated_loop`: e.g. the sync steps' work).

  Follows ``while`` bodies/conditions and conditional branches, and with ``through_calls``
  also ``calls=``/``to_apply=`` (fusion bodies, reducers, async wrappers); without it the
  result is the top-level computations, whose instructions each launch on their own.
  """
  where: dict[str, bool] = {}

  def visit(c: str, in_cond: bool) -> None:
    if c not in comps or (c in where and (where[c] is False or in_cond)):
      return
    where[c] = in_cond
    for line in comps[c]:
      for callee in hlo_loop_bodies(line) + (_HLO_CALL.findall(line) if through_calls else []):
        visit(callee, in_cond)
      for callee in hlo_branches(line) + hlo_gated_bodies(line):
        visit(callee, True)

  if entry is not None:
    visit(entry, False)
  return where


class Timing:
  """Seconds per call over repetitions: median, min, max, IQR; page faults per call.

  ``faults`` (minor page faults of the whole process per call, median over repetitions) is a
  host-side profile: on XLA:CPU a temporary parameter-sized buffer allocated afresh at every
  execution costs one fault per 4 KiB page (BENCHMARKS.md, target 1).
  """

  def __init__(self, samples: Sequence[float], faults: Sequence[float] | None = None):
    self.samples = [float(s) for s in samples]
    self.fault_samples = None if faults is None else [float(f) for f in faults]

  @property
  def faults(self) -> float | None:
    return None if self.fault_samples is None else statistics.median(self.fault_samples)

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  def spread(self) -> str:
    s = np.asarray(self.samples)
    q1, q3 = np.percentile(s, [25, 75])
    return (f"median {fmt_s(self.median)} [min {fmt_s(s.min())}, max {fmt_s(s.max())}, "
            f"IQR {fmt_s(q3 - q1)}, n={len(s)}]")

  def as_dict(self) -> dict[str, Any]:
    return {"median_s": self.median, "samples_s": self.samples,
            "page_faults_per_call": self.faults}


def fmt_s(seconds: float) -> str:
  if seconds >= 1:
    return f"{seconds:.3f} s"
  if seconds >= 1e-3:
    return f"{seconds * 1e3:.3f} ms"
  return f"{seconds * 1e6:.1f} us"


class Runner:
  """A stateful timed call: ``state = fn(state, *args)``, state threaded (and donated)."""

  def __init__(self, fn: Callable[..., Any], state: Any, args: tuple = (),
               out_state: Callable[[Any], Any] = lambda out: out):
    self.fn, self.state, self.args, self.out_state = fn, state, args, out_state
    self.last_faults: float | None = None

  def call(self, iters: int) -> float:
    f0 = minor_faults()
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = self.fn(self.state, *self.args)
      self.state = self.out_state(out)
    block(out)
    seconds = (time.perf_counter() - t0) / iters
    f1 = minor_faults()
    self.last_faults = None if f0 is None else (f1 - f0) / iters
    return seconds


def with_compiler_options(runner: Runner, options: dict[str, Any]) -> Runner:
  """``runner`` with its jitted function compiled under XLA ``options`` (``DebugOptions`` fields
  passed as ``jax.stages.Lowered.compile(compiler_options=...)``), so that a flag XLA_FLAGS would
  set for the whole process is compared side by side in one run. The runner's state moves to
  the new runner (build a fresh runner for it)."""
  lower = getattr(runner.fn, "lower", None)
  if lower is None:
    raise ValueError(f"with_compiler_options needs a jitted function (with .lower), got "
                     f"runner.fn={runner.fn!r}")
  compiled = lower(runner.state, *runner.args).compile(compiler_options=dict(options))
  return Runner(compiled, runner.state, runner.args, runner.out_state)


def time_interleaved(runners: Sequence[Runner], *, warmup: int, reps: int, iters: int,
                     on_warm: Callable[[int, float], None] | None = None,
                     on_error: Callable[[int, Exception], None] | None = None
                     ) -> list[Timing | None]:
  """Warm up every runner, then time them round-robin ``reps`` times, the order reversed
  every other round (A B, B A, ...): a fixed order gave the first runner every round's cold
  start (caches, clocks) and the last every round's warm one. (GPU tables measured before
  session 17 used the fixed order.)

  ``on_warm(i, seconds)`` is called after runner ``i``'s warm-up (its compile and ``warmup``
  calls). A bench reports its figures only after all the timing, so these calls are what a
  run stopped by a time limit still tells (e.g. which compile took the time).

  ``on_error(i, exception)``, when given, is called instead of raising when runner ``i``'s
  compile or warm-up fails (an XLA compile error, device memory exhausted): that runner is
  dropped and its entry in the result is ``None``, so one failing program does not cost a GPU
  call the timings of all the others. Without it, the error propagates.
  """
  alive = []
  for i, r in enumerate(runners):
    t0 = time.perf_counter()
    try:
      for _ in range(warmup):
        r.call(1)
    except Exception as e:  # noqa: BLE001 (XLA raises its own error types)
      if on_error is None:
        raise
      on_error(i, e)
      continue
    alive.append(i)
    if on_warm is not None:
      on_warm(i, time.perf_counter() - t0)
  samples: dict[int, list[float]] = {i: [] for i in alive}
  faults: dict[int, list[int | None]] = {i: [] for i in alive}
  for rep_ in range(reps):
    for i in (alive if rep_ % 2 == 0 else alive[::-1]):
      samples[i].append(runners[i].call(iters))
      faults[i].append(runners[i].last_faults)
  return [Timing(samples[i], None if None in faults[i] else faults[i]) if i in samples
          else None for i in range(len(runners))]


class Report:
  """Collects figures and targets, prints them as they come, and the final verdict."""

  def __init__(self, bench: str, args: argparse.Namespace):
    self.bench, self.args = bench, args
    self.figures: list[dict[str, Any]] = []
    self.targets: list[dict[str, Any]] = []
    if not jax.config.jax_compilation_cache_dir:  # re-runs skip compiling (pytest sets its own)
      from mfopt import runner
      runner.enable_compilation_cache()
    self.env = environment()
    flags = os.environ.get("XLA_FLAGS", "")
    self.command = " ".join([f"XLA_FLAGS={shlex.quote(flags)}"] * bool(flags)
                            + ["python", "-m", f"experiments.{bench}",
                               *map(shlex.quote, getattr(args, "argv", []))])
    print(f"# {bench} on {self.env['backend']} ({self.env['device_kind']} x"
          f"{self.env['num_devices']}), JAX {self.env['jax']}, {self.env['date_utc']}"
          f"{' [--quick: sizes for CI, timings meaningless]' if args.quick else ''}", flush=True)

  def figure(self, name: str, value: float, unit: str, details: str = "", **data: Any) -> None:
    print(f"FIG {self.bench} | {name} | {value:.4g} {unit} | {details}", flush=True)
    self.figures.append({"name": name, "value": value, "unit": unit, "details": details, **data})
    self._write(complete=False)

  def note(self, text: str) -> None:
    print(f"NOTE {self.bench} | {text}", flush=True)
    self.figures.append({"note": text})
    self._write(complete=False)

  def left_out(self, label: str, error: Exception) -> None:
    """Notes a program that failed to build, compile or run (``time_interleaved``'s
    ``on_error``) and is left out of the run: its label, the error's type and first line."""
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    self.note(f"{label}: failed, left out: {type(error).__name__}: {first}")

  def target(self, name: str, value: float, op: str, threshold: float,
             applies: bool = True, why_not: str = "") -> None:
    """Records ``value op threshold``; targets that do not apply here are listed, not judged."""
    ok = value <= threshold if op == "<=" else value >= threshold
    status = ("PASS" if ok else "FAIL") if applies else f"n/a ({why_not})"
    print(f"TARGET {self.bench} | {name} | {value:.4f} {op} {threshold} | {status}", flush=True)
    self.targets.append({"name": name, "value": value, "op": op, "threshold": threshold,
                         "applies": applies, "passed": bool(ok) if applies else None})
    self._write(complete=False)

  def _write(self, complete: bool, passed: bool | None = None) -> dict[str, Any]:
    """The report as data; written to ``--json`` after every figure (``complete: false``) so
    a run cut off by a time limit (a device call's 10 minutes) still leaves what it measured."""
    out = {"bench": self.bench, "env": self.env, "command": self.command,
           "quick": self.args.quick, "complete": complete,
           "figures": self.figures, "targets": self.targets, "passed": passed}
    if self.args.json:
      tmp = f"{self.args.json}.tmp"
      with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
      os.replace(tmp, self.args.json)
    return out

  def finish(self) -> dict[str, Any]:
    judged = [t for t in self.targets if t["applies"]]
    passed = all(t["passed"] for t in judged)
    verdict = "PASS" if passed else "FAIL"
    quick = ", quick mode: timings not meaningful" if self.args.quick else ""
    if not self.targets:  # a profile: figures only
      print(f"RESULT {self.bench}: DONE (figures only, no targets{quick})", flush=True)
    else:
      print(f"RESULT {self.bench}: {verdict} ({sum(t['passed'] for t in judged)}/{len(judged)} "
            f"targets met{quick})", flush=True)
    return self._write(complete=True, passed=passed)
