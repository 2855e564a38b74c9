"""Writing results as data (JSONL/JSON), markdown tables and PNG plots.

Experiments call these; every report states the device, the software versions
and the date it was produced on, so figures can be traced to a run.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import math
import os
import pathlib
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def environment() -> dict[str, Any]:
  """Device, process and version facts for a report header."""
  import flax
  import jax
  import optax

  devices = jax.devices()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "process_count": jax.process_count(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
  }


def environment_markdown(env: Mapping[str, Any] | None = None) -> str:
  env = environment() if env is None else env
  return (f"- Date: {env['date']}\n"
          f"- Device: {env['device_count']} x {env['device_kind']} ({env['backend']}), "
          f"{env['process_count']} process(es), {env['cpu_count']} host CPU cores\n"
          f"- Software: Python {env['python']}, JAX {env['jax']}, Flax {env['flax']}, "
          f"Optax {env['optax']}\n")


def _jsonable(x: Any) -> Any:
  """Plain JSON types; a non-finite float becomes the string ``"nan"``/``"inf"``/``"-inf"``
  (strict JSON has no NaN), whether it is a Python float, a NumPy scalar or in an array."""
  if isinstance(x, Mapping):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    return _jsonable(x.item())  # (np.float64 is a float: it used to pass through as NaN)
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  return x


def write_json(path: pathlib.Path, obj: Any) -> None:
  """Writes ``obj`` as indented JSON atomically (temporary file, then rename)."""
  path = pathlib.Path(path)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")
  os.replace(tmp, path)


MEASURED_FIELDS = ("train_time_s",)  # wall-clock fields of a metrics row; all others are data
#: Where a row says how far its run got: ``mfopt.train.fit``'s ``step``, ``mfopt.sim``'s
#: ``server_step``. The experiments log ``{labels..., **row}``, so a row's fields up to and
#: including the first of these, with its ``samples``, name the data point; the rest is data.
POSITION_FIELDS = ("step", "server_step")


_RECOMPUTED_ROWS_REPLACE = contextvars.ContextVar("mfopt_recomputed_rows_replace",
                                                   default=False)


_RUN_START: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "mfopt_run_start", default=None)


def note_run_start(position: float, samples: float | None = None) -> None:
  """Says where the (sub-)run about to log starts: the position (``step``, or the simulator's
  ``server_step`` and ``samples``) its state was restored at, 0 when it starts afresh.
  :func:`mfopt.train.fit` and :func:`mfopt.checkpoint.run_resumable` call it; under
  :func:`recomputed_rows_replace` a :class:`JsonlWriter` then drops the run's older rows past
  that point."""
  _RUN_START.set((position, samples))


@contextlib.contextmanager
def recomputed_rows_replace():
  """Within it, a resumed run's rows replace what an earlier attempt logged past the point the
  run restarted from (:func:`note_run_start`): at the first row a run logs, its older rows
  (same labels) past that point are dropped. The runner uses it under an allowed config change
  (``--allow-config-change``): the recomputation follows the new config, and the killed
  attempt's rows past the checkpoint belong to a trajectory that no longer exists (its curve
  mixed the two, also at steps the new config does not log or no longer reaches)."""
  token, start = _RECOMPUTED_ROWS_REPLACE.set(True), _RUN_START.set(None)
  try:
    yield
  finally:
    _RECOMPUTED_ROWS_REPLACE.reset(token)
    _RUN_START.reset(start)


def _past(position: tuple[Any, Any], start: tuple[Any, Any]) -> bool:
  """Whether a row at ``position`` = ``(step, samples)`` lies past a run's ``start`` =
  ``(step, samples or None)``: a later step, or (the simulator: several evaluations per server
  step) the same step with more samples. ``fit`` says no samples: its rows at the restored step
  itself (which carry samples) are the checkpoint's, kept."""
  if position[0] != start[0]:
    return position[0] > start[0]
  return start[1] is not None and position[1] > start[1]


class JsonlWriter:
  """Appends one JSON object per line to ``path`` (``metrics.jsonl``), each data point once.

  A resumed run recomputes what it did after its last checkpoint (and any un-checkpointed
  part, e.g. simulator runs) and logs those rows again. A row names its data point by its
  fields up to and including its first :data:`POSITION_FIELDS` field (the labels the
  experiment put first, then the step) and its ``samples`` (several simulator evaluations can
  share a server version); a row whose data point is already in the file is not
  written again, so the file of a resumed run holds the rows of an uninterrupted one (their
  first values and measured times). Keying on the position, not the whole content, matters
  when the recomputation is not bit-identical: resumed on another device count (the
  reductions split differently), a row differed in its last bit and was written twice, and
  readers averaging rows per step counted it as an extra seed. Such differences are reported
  once on stderr. A row without a position field is identified by its content less the
  wall-clock :data:`MEASURED_FIELDS`.
  """

  def __init__(self, path: pathlib.Path, measured_fields: Sequence[str] = MEASURED_FIELDS):
    self.path = pathlib.Path(path)
    self.measured_fields = frozenset(measured_fields)
    self._seen: dict[str, str] | None = None
    self._warned = False
    self._cut: set[str] = set()  # label groups whose stale rows were dropped (replace mode)

  def _content(self, row: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in self.measured_fields},
                      sort_keys=True)

  def _group_position(self, row: Mapping[str, Any]) -> tuple[str | None, tuple[Any, Any]]:
    """The row's run (its fields before the position field, and that field's name) and
    ``(position, samples)``; ``(None, ())`` for a row without a position field."""
    labels = []
    for k, v in row.items():
      if k in POSITION_FIELDS:
        samples = row.get("samples")
        return json.dumps(labels + [k]), (v, -1 if samples is None else samples)
      labels.append((k, v))
    return None, ()

  def _identity(self, row: Mapping[str, Any]) -> str:
    group, position = self._group_position(row)
    return self._content(row) if group is None else json.dumps([group, list(position)])

  def __call__(self, row: Mapping[str, Any]) -> None:
    if self._seen is None:
      _drop_torn_tail(self.path)  # a write cut short by a kill: resume after the last whole row
      # (rows written before non-finite numbers became strings hold bare NaN: read back as
      # floats, _jsonable makes them the strings a recomputed row has)
      self._seen = {}
      for r in read_jsonl(self.path):
        r = _jsonable(r)
        self._seen.setdefault(self._identity(r), self._content(r))
    row = _jsonable(row)
    if _RECOMPUTED_ROWS_REPLACE.get():
      group, position = self._group_position(row)
      if group is not None and group not in self._cut:
        self._cut.add(group)
        start = _RUN_START.get()
        self._drop_group(group, (lambda p: _past(p, start)) if start is not None
                         else (lambda p: p >= position))
    key = self._identity(row)
    if key in self._seen:
      if self._seen[key] != self._content(row) and not self._warned:
        self._warned = True
        print(f"{self.path}: a row differs from one already logged with the same labels and "
              f"position (a resumed run's recomputation on another device count, a "
              f"non-deterministic op, or labels that do not tell two runs apart); keeping the "
              f"first: {key}", file=sys.stderr)
      return
    self._seen[key] = self._content(row)
    with self.path.open("a") as f:
      f.write(json.dumps(row, allow_nan=False) + "\n")

  def _drop_group(self, group: str, stale) -> None:
    """Rewrites the file without the rows of ``group`` whose position is ``stale``."""
    rows = [_jsonable(r) for r in read_jsonl(self.path)]
    kept = [r for r in rows if not (self._group_position(r)[0] == group
                                    and stale(self._group_position(r)[1]))]
    if len(kept) == len(rows):
      return
    tmp = self.path.with_suffix(self.path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    os.replace(tmp, self.path)
    self._seen = {}
    for r in kept:
      self._seen.setdefault(self._identity(r), self._content(r))


def _torn_tail(raw: bytes) -> int | None:
  """The byte offset where an unfinished last line (no newline and not JSON) of a JSON-lines
  file starts; ``None`` if there is none. Bytes, not text: ``truncate`` takes a byte offset
  (text-mode reading folds ``\r\n`` into ``\n``, so a character offset cut short)."""
  if not raw or raw.endswith(b"\n"):
    return None
  start = raw.rfind(b"\n") + 1
  try:
    json.loads(raw[start:])
  except ValueError:
    return start
  return None


def _drop_torn_tail(path: pathlib.Path) -> None:
  """Truncates a JSON-lines file after its last complete line, saying so on stderr."""
  if not path.exists():
    return
  raw = path.read_bytes()
  start = _torn_tail(raw)
  if start is not None:
    print(f"warning: {path}: dropping an unfinished last line ({len(raw) - start} bytes, a write "
          f"cut short); the rows before it are kept", file=sys.stderr)
    with path.open("r+b") as f:
      f.truncate(start)
  elif raw and not raw.endswith(b"\n"):  # a whole last row without its newline
    with path.open("ab") as f:
      f.write(b"\n")


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """The rows of a JSON-lines file; an unfinished last line (a write cut short) is skipped
  with a warning, while a bad line before it raises (that is not an interrupted append)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  raw = path.read_bytes()
  start = _torn_tail(raw)
  if start is not None:
    print(f"warning: {path}: skipping an unfinished last line", file=sys.stderr)
    raw = raw[:start]
  return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def fmt(x: Any, digits: int = 4) -> str:
  """Formats a table cell: floats to ``digits`` significant digits, ints with separators."""
  if x is None:
    return "–"
  if isinstance(x, (bool, np.bool_)):
    return str(bool(x))
  if isinstance(x, (int, np.integer)):
    return f"{int(x):,}"
  if isinstance(x, (float, np.floating)):
    if not math.isfinite(x):
      return str(x)
    return f"{x:.{digits}g}"
  return str(x)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                   headers: Sequence[str] | None = None, digits: int = 4) -> str:
  """A GitHub markdown table of ``rows`` restricted to ``columns``."""
  headers = list(columns if headers is None else headers)
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c), digits) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def diverged_section(runs: Sequence[tuple[str, Mapping[str, Any]]],
                     consequence: str) -> list[str]:
  """A report's "Diverged runs" section, as lines; empty if no run diverged.

  Args:
    runs: ``(label, run)`` for every run the report covers; a ``run`` with a true
      ``diverged`` is listed with its ``error`` (e.g. from
      ``mfopt.train.diverged_summary``).
    consequence: what the report does with them, one or more sentences.

  >>> from mfopt.report import diverged_section
  >>> lines = diverged_section([("lr=1", {"diverged": False}),
  ...                           ("lr=9", {"diverged": True, "error": "nan loss at step 3"})],
  ...                          "They are left out of every mean.")
  >>> print("\\n".join(lines))  # doctest: +NORMALIZE_WHITESPACE
  ## Diverged runs
  1 of 2 runs stopped on a non-finite loss or update (`mfopt.train.NonFiniteError`).
  They are left out of every mean.
  - lr=9: nan loss at step 3
  """
  bad = [(label, r) for label, r in runs if r.get("diverged")]
  if not bad:
    return []
  return ["\n## Diverged runs\n",
          f"{len(bad)} of {len(runs)} runs stopped on a non-finite loss or update "
          f"(`mfopt.train.NonFiniteError`). {consequence}\n",
          *[f"- {label}: {r['error']}" for label, r in bad]]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for a single value)."""
  a = np.asarray(values, dtype=np.float64)
  return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def plot_curves(path: pathlib.Path, panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                *, xlabel: str | Sequence[str], ylabel: str, title: str | None = None,
                logy: bool = False) -> None:
  """One subplot per panel, one line per series ``name -> (x, y)``, saved as PNG.

  ``xlabel``: one label for every panel, or one per panel. Series of a panel with exactly the
  same points are drawn once, labelled with all their names joined by " = " (a later one was
  drawn over the earlier and looked missing from the plot: BSP under all-reduce).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  xlabels = [xlabel] * len(panels) if isinstance(xlabel, str) else list(xlabel)
  if len(xlabels) != len(panels):
    raise ValueError(f"xlabel must be one label or one per panel ({len(panels)}), got {xlabel!r}")
  panels = {panel: merge_identical_series(series) for panel, series in panels.items()}
  n = max(len(panels), 1)
  most = max((len(series) for series in panels.values()), default=0)
  # More than 6 series: the legend goes below the panels (inside, 11 entries covered the
  # curves), one for the figure when every panel has the same series (same colours), else one
  # column under each panel
  below = most > 6
  shared = below and len({tuple(series) for series in panels.values()}) == 1
  fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
  colors = plt.get_cmap("tab20").colors
  styles = ("-", "--", ":", "-.")
  for ax, label, (panel, series) in zip(axes[0], xlabels, panels.items()):
    for i, (name, (x, y)) in enumerate(series.items()):
      # 20 colours x 4 line styles: no two of up to 80 series look alike.
      # a one-point series (a --quick run logged once) is a marker: a line of one point is
      # not drawn, and the plot looked empty
      ax.plot(x, y, label=name, color=colors[i % 20], linestyle=styles[(i // 20) % 4]
              if len(series) > 20 else styles[i % 2], marker="o" if len(x) == 1 else None)
    ax.set_title(panel)
    ax.set_xlabel(label)
    ax.set_ylabel(ylabel)
    if logy:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if below and not shared:
      ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    elif not below:
      ax.legend(fontsize=7)
  if shared:
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(3, n + 1))
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def merge_identical_series(series: Mapping[str, tuple[Sequence[float], Sequence[float]]]
                           ) -> dict[str, tuple[Sequence[float], Sequence[float]]]:
  """``series`` with those of exactly the same points merged into one, named ``"a = b"``
  (first-seen order)."""
  groups: dict[tuple, list[str]] = {}
  points: dict[tuple, tuple[Sequence[float], Sequence[float]]] = {}
  for name, (x, y) in series.items():
    key = (tuple(map(float, x)), tuple(map(float, y)))
    groups.setdefault(key, []).append(name)
    points.setdefault(key, (x, y))
  return {" = ".join(names): points[key] for key, names in groups.items()}
