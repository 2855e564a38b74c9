"""BENCHMARKS.md tables from the JSON files the benchmarks write (issue 8).

Command::

  python -m experiments.bench_tables runs/gpu_bench            # every *.json in the folder
  python -m experiments.bench_tables a.json b.json --figures   # also list every figure

Every ``experiments/bench_*.py`` run with ``--json PATH`` (``scripts/gpu_bench.sh`` and
``scripts/gpu_aot.sh`` always pass it) records its figures, targets, device, JAX version, UTC
time, command line and code commit. This prints, per file, a Markdown section with that
header and one table row per target (measured value, threshold, verdict), so the rows that go
into BENCHMARKS.md are copied from data, not retyped from logs. Nothing is measured here.
Quick-mode files (``--quick``: CI sizes) are labelled so. The verdicts shown are the
bench's own, and a bench may still judge targets in quick mode (structural ones, counts
and bytes: all of ``bench_comm``'s): a quick file's PASS/FAIL checks a code path, not a
speed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Sequence
from typing import Any


def _cell(text: Any) -> str:
  """A Markdown table cell: pipes escaped, newlines flattened."""
  return str(text).replace("|", "\\|").replace("\n", " ")


def _verdict(target: dict[str, Any]) -> str:
  if target.get("passed") is None:
    return "not judged"
  return "**PASS**" if target["passed"] else "**FAIL**"


def section(result: dict[str, Any], *, figures: bool = False, source: str = "") -> str:
  """One benchmark run (the dict ``_bench.Report.finish`` returns / writes) as Markdown."""
  env = result.get("env", {})
  device = f"{env.get('backend', '?')} ({env.get('device_kind', '?')} x{env.get('num_devices', '?')})"
  quick = " **[--quick: CI sizes, timings meaningless]**" if result.get("quick") else ""
  if result.get("complete") is False:  # written mid-run, then cut off (a time limit)
    quick += " **[cut off: partial run, no final verdict]**"
  lines = [
      f"#### {result.get('bench', '?')} on {device}, JAX {env.get('jax', '?')}, "
      f"{env.get('date_utc', '?')}{quick}",
      "",
      f"Command: `{result.get('command', 'not recorded')}`; commit "
      f"{env.get('commit') or 'not recorded'}"
      + (f"; data: `{source}`" if source else "") + ".",
      "",
  ]
  notes = [f["note"] for f in result.get("figures", []) if "note" in f]
  lines += [f"* {n}" for n in notes] + ([""] if notes else [])
  targets = result.get("targets", [])
  if targets:
    lines += ["| target | measured | threshold | verdict |", "|---|---|---|---|"]
    lines += [f"| {_cell(t['name'])} | {t['value']:.4f} | {t['op']} {t['threshold']} | "
              f"{_verdict(t)} |" for t in targets]
    judged = [t for t in targets if t.get("passed") is not None]
    lines += ["", f"Result: {sum(t['passed'] for t in judged)}/{len(judged)} targets met."]
  else:
    lines.append("No targets in this run.")
  if result.get("bench") == "profile_step":
    from experiments import profile_step
    lines += profile_step.markdown(result)
  if figures:
    figs = [f for f in result.get("figures", []) if "name" in f]
    if figs:
      lines += ["", "| figure | value | details |", "|---|---|---|"]
      lines += [f"| {_cell(f['name'])} | {f['value']:.4g} {_cell(f.get('unit', ''))} | "
                f"{_cell(f.get('details', ''))} |" for f in figs]
  return "\n".join(lines) + "\n"


def _natural(path: str) -> list[Any]:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def json_files(paths: Sequence[str]) -> list[str]:
  """The JSON files named, or found (``*.json``) in the folders named, in natural order: the
  gpu_plan calls' files start with their number, and ``10_...`` sorts after ``9_...``."""
  out: list[str] = []
  for p in paths:
    if os.path.isdir(p):
      out += sorted(glob.glob(os.path.join(p, "*.json")), key=_natural)
    elif os.path.isfile(p):
      out.append(p)
    else:
      raise SystemExit(f"bench_tables: no such file or folder: {p!r}")
  if not out:
    raise SystemExit(f"bench_tables: no JSON file in {list(paths)!r}")
  return out


def main(argv: Sequence[str] | None = None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("paths", nargs="+", help="JSON files or folders of them")
  parser.add_argument("--figures", action="store_true", help="also list every figure")
  args = parser.parse_args(argv)
  parts = []
  for path in json_files(args.paths):
    with open(path) as f:
      try:
        result = json.load(f)
      except json.JSONDecodeError as e:
        raise SystemExit(f"bench_tables: {path!r} is not JSON: {e}") from None
    if not isinstance(result, dict) or "bench" not in result:
      raise SystemExit(f"bench_tables: {path!r} is not a benchmark result (no 'bench' key)")
    parts.append(section(result, figures=args.figures, source=path))
  text = "\n".join(parts)
  print(text, end="")
  return text


if __name__ == "__main__":
  main()
