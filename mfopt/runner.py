"""The experiment runner behind ``python -m experiments <name> [--quick] [--workdir DIR] [key=value ...]``.

An experiment is a module ``experiments/<name>.py`` that defines

* ``get_config(quick: bool = False) -> ml_collections.ConfigDict`` — whose
  docstring gives the command, hardware, runtime and expected metric;
* ``run(config, workdir: pathlib.Path) -> dict`` — trains, writes its plots and
  ``report.md`` into ``workdir`` and returns the summary;
* optionally ``validate(config) -> None`` — raises ``ValueError`` naming a bad field.

Experiments are discovered by module name (no registry to edit). The runner owns
the command line, config overrides with type checking, the workdir, the
persistent compilation cache, ``config.json`` and ``summary.json``. Every error
about the input is raised before anything is compiled.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import json
import math
import os
import pathlib
import pkgutil
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import ml_collections

from mfopt import _checks, checkpoint, distributed, report
from mfopt import data as data_lib

EXPERIMENTS_PACKAGE = "experiments"


class ConfigError(ValueError):
  """A bad experiment name, config key or config value."""


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str:
  """Turns on JAX's persistent compilation cache (``$MFOPT_JAX_CACHE`` or ``~/.cache/mfopt/jax``).

  Every program is cached, however fast it compiled: with JAX's usual 0.2 s threshold most of
  this project's programs (tiny models, optimizer inits, the fast path's helpers) compiled
  again in every process. ``pytest tests/test_fastpath.py tests/test_parallel.py`` twice
  (cold, then warm cache) on the 2-core VM under load, 2026-11-25: warm 9.7 s with 4.3 s
  compiling at 0.2 s (21 of 153 compilations hit), 6.0 s with 0.8 s at 0 (153 hits); cold
  31.9 s and 33.8 s.
  """
  import jax

  path = os.fspath(path or os.environ.get("MFOPT_JAX_CACHE")
                   or pathlib.Path.home() / ".cache" / "mfopt" / "jax")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def list_experiments() -> list[str]:
  """Names of all experiment modules (those defining ``get_config`` and ``run``)."""
  pkg = importlib.import_module(EXPERIMENTS_PACKAGE)
  names = []
  for info in pkgutil.iter_modules(pkg.__path__):
    if info.name.startswith("_") or info.name.startswith("bench_"):
      continue
    # tools with their own CLI (profile_step: `python -m experiments.profile_step`) are not
    # experiments; read the source rather than importing every module to list them
    path = pathlib.Path(info.module_finder.path) / f"{info.name}.py"
    if path.exists() and "\ndef get_config(" not in path.read_text():
      continue
    names.append(info.name)
  return sorted(names)


def load_experiment(name: str) -> ModuleType:
  """The experiment module ``name``: one of :func:`list_experiments`, or a dotted module path
  of your own (``mypkg.my_experiment``, importable from ``sys.path``) with the same
  ``get_config`` / ``run`` (and optional ``validate``, ``CHOICES``) as this package's."""
  if "." in name:
    try:
      module = importlib.import_module(name)
    except ModuleNotFoundError as e:
      raise ConfigError(f"experiment module {name!r} cannot be imported ({e}); a dotted name is "
                        "a module of your own on sys.path (PYTHONPATH)") from None
    for attr in ("get_config", "run"):
      if not callable(getattr(module, attr, None)):
        raise ConfigError(f"experiment module {name!r} does not define {attr}()")
    return module
  known = list_experiments()
  if name not in known:
    pkg = importlib.import_module(EXPERIMENTS_PACKAGE)
    if (pathlib.Path(pkg.__path__[0]) / f"{name}.py").exists() and not name.startswith("_"):
      raise ConfigError(f"{name!r} is a tool with its own command line, not an experiment: "
                        f"python -m {EXPERIMENTS_PACKAGE}.{name} --help")
    raise ConfigError(f"unknown experiment {name!r}; known experiments: {', '.join(known)}")
  module = importlib.import_module(f"{EXPERIMENTS_PACKAGE}.{name}")
  for attr in ("get_config", "run"):
    if not callable(getattr(module, attr, None)):
      raise ConfigError(f"experiment module {name!r} does not define {attr}()")
  return module


def _parse_value(key: str, text: str, current: Any) -> Any:
  """Parses ``text`` into the type of the field's current value, or raises ConfigError.

  An int field takes integers only and a float field any number; the items of a tuple of
  floats must be numbers (a bool or a quoted string is refused). A field that takes fractions
  (``warmup_epochs``, ``warmup_values``) has a float default for that reason."""
  expected = type(current)
  try:
    if isinstance(current, bool):
      low = text.lower()
      if low not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError
      return low in ("true", "1", "yes")
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
    if isinstance(current, str) or current is None:
      if current is None:
        try:
          return ast.literal_eval(text)
        except (ValueError, SyntaxError):
          return text
      return text
    if isinstance(current, (tuple, list)):
      try:
        value = ast.literal_eval(text)
      except (ValueError, SyntaxError):
        if current and not isinstance(current[0], str):
          raise
        inner = text.strip()
        if inner[:1] + inner[-1:] in ("()", "[]"):  # (fp32,bf16): strings without quotes
          inner = inner[1:-1]
        value = tuple(v.strip() for v in inner.split(",") if v.strip())  # digits,mnist1d
      if isinstance(value, (int, float, str)):
        value = (value,)
      if not isinstance(value, (tuple, list)):
        raise ValueError
      if current and value:
        item_type = type(current[0])
        if item_type is float:
          if not all(_checks.is_real(v) for v in value):  # (True and '0.1' became 1.0 and 0.1)
            raise ValueError
          value = [float(v) for v in value]
        elif not all(isinstance(v, item_type) and not (item_type is int and isinstance(v, bool))
                     for v in value):
          raise ValueError
      return expected(value)
  except (ValueError, SyntaxError, TypeError):
    pass
  else:
    raise ConfigError(f"config field {key!r} has unsupported type {expected.__name__}")
  what = expected.__name__
  if isinstance(current, (tuple, list)) and current:
    item = type(current[0])
    what = ("a tuple of numbers" if item is float else "a tuple of integers" if item is int
            else "a tuple of strings" if item is str else f"a tuple of {item.__name__}")
  elif isinstance(current, float):
    what = "a number"
  raise ConfigError(
      f"config field {key!r} expects {what} (current value {current!r}), got {text!r}")


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> ml_collections.ConfigDict:
  """Applies ``key=value`` strings (dotted keys for nested fields) with type checking, in
  order (a later one for the same key wins: a caller may append to a base list; the command
  line refuses a key given twice, see :func:`refuse_repeated_keys`)."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"config override must look like key=value, got {item!r}")
    key, text = item.split("=", 1)
    node = config
    parts = key.split(".")
    for part in parts[:-1]:
      if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(flat_keys(config))}")
      node = node[part]
    if parts[-1] not in node:
      raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(flat_keys(config))}")
    value = _parse_value(key, text, node[parts[-1]])
    with node.unlocked():
      node[parts[-1]] = value
  return config


def refuse_repeated_keys(overrides: Iterable[str]) -> None:
  """ConfigError for a key given twice on the command line (it was last-wins, silently:
  ``base_lr=0.1 ... base_lr=0.2`` ran with 0.2 and said nothing)."""
  seen: dict[str, str] = {}
  for item in overrides:
    key = item.split("=", 1)[0]
    if "=" in item and key in seen:
      raise ConfigError(f"config field {key!r} is given twice: {seen[key]!r} and {item!r}")
    seen[key] = item


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for k, v in config.items():
    if isinstance(v, ml_collections.ConfigDict):
      keys += flat_keys(v, f"{prefix}{k}.")
    else:
      keys.append(prefix + k)
  return keys


def require_positive(config: ml_collections.ConfigDict, *fields: str) -> None:
  """Raises ConfigError unless every named (dotted) field is a positive number (or all items are)."""
  for field in fields:
    value = config
    for part in field.split("."):
      value = value[part]
    items = value if isinstance(value, (tuple, list)) else (value,)
    for v in items:
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ConfigError(f"config field {field!r} must be positive, got {value!r}")


def require_process_multiple(config: ml_collections.ConfigDict, *fields: str) -> None:
  """Raises ConfigError unless every worker count in the named fields is a multiple of the
  process count (one worker cannot span processes; :func:`mfopt.parallel.worker_mesh`).

  Experiments call it at the start of ``run`` (the process count is known only once the
  backend is up, after :func:`validate_config`), so that a multi-process grid fails before
  its first cell rather than at its first ``W = 1`` cell hours later. The message names the
  field, the counts that do not divide and the value that would run.
  """
  import jax  # noqa: PLC0415  (the backend is up by the time an experiment runs)

  procs = jax.process_count()
  for field in fields:
    value = config
    for part in field.split("."):
      value = value[part]
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    bad = [w for w in items if w % procs]
    if bad:
      keep = tuple(w for w in items if not w % procs)
      fix = (f"pass {field}={keep!r}" if keep and isinstance(value, (tuple, list))
             else f"use multiples of {procs}")
      raise ConfigError(
          f"config field {field!r}: worker counts {bad} are not multiples of the {procs} "
          f"processes of this job (one worker cannot span processes); run as one process, or "
          f"{fix}")


def require_choice(config: ml_collections.ConfigDict, field: str, choices: Sequence[Any]) -> None:
  value = config
  for part in field.split("."):
    value = value[part]
  items = value if isinstance(value, (tuple, list)) else (value,)
  for v in items:
    if v not in choices:
      raise ConfigError(f"config field {field!r} must be one of {list(choices)}, got {value!r}")


def _rule(holds: Callable[[Any], bool], what: str) -> tuple[Callable[[Any], bool], str]:
  def check(v):
    return not isinstance(v, bool) and isinstance(v, (int, float)) and holds(v)
  return check, what


_UNIT = _rule(lambda v: 0 <= v < 1, "in [0, 1)")
_PROB = _rule(lambda v: 0 <= v <= 1, "in [0, 1]")
_DECAY = _rule(lambda v: 0 < v <= 1, "in (0, 1]")
_POS = _rule(lambda v: 0 < v < math.inf, "a positive number")
_NONNEG = _rule(lambda v: 0 <= v < math.inf, "a non-negative number")
_NONNEG_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
               "a non-negative integer")
_POS_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "a positive integer")

# Field names that mean the same thing in every experiment's config, and what they must hold
# (each item of a tuple field). prepare() checks them after the overrides, before anything is
# built, so that a nonsense value (momentum=-1, seeds=(-1,), epochs=nan) stops the run with one
# error naming it instead of running, or failing late with a traceback.
CONVENTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(("momentum", "momenta", "mf", "mf2", "mfs", "drop_rate"), _UNIT),
    **dict.fromkeys(("straggler_prob", "target_accuracy", "sampling_fraction"), _PROB),
    **dict.fromkeys(("decay", "decay_rate"), _DECAY),
    **dict.fromkeys(("learning_rate", "base_lr", "alpha", "fullsgd_lrs", "small_batch_lrs",
                     "trust_coefficient", "compute_s", "epochs", "warmup_epochs", "warmup_values",
                     "eval_every_epochs"), _POS),
    **dict.fromkeys(("weight_decay", "adam_lr", "jitter_sigma", "speed_spread", "payload_params"),
                    _NONNEG),
    **dict.fromkeys(("seed", "seeds", "ssp_staleness"), _NONNEG_INT),
    **dict.fromkeys(("hidden", "mlp_hidden", "features", "workers", "fig6_workers", "batches",
                     "batch_sizes", "decreasing_periods", "easgd_interval"), _POS_INT),
    "straggler_slowdown": _rule(lambda v: 1 <= v < math.inf, "a number >= 1"),
}


# Tuple fields whose empty value means "none of these" (an MLP without hidden layers, no
# simulated rows, no fixed-k or Fig. 6 extras). Every other tuple is a sweep or a list of
# rows, and an empty one ran nothing and reported "done".
EMPTY_ALLOWED = frozenset({"sim_runs", "hidden", "mlp_hidden", "features", "fixed_k",
                           "fig6_workers"})

# Tuple fields where an item may repeat: one thing's layout (layer widths, a schedule of
# periods) and quickstart's datasets/models, read in pairs (zip; it refuses a repeated pair
# itself). In every other tuple (a sweep axis, seeds, a list of rows) a repeat ran the same cell
# again: seeds=(0, 0) showed "0.29 +- 0.00" over "2 seeds" beside a claim line that said one seed.
REPEATS_ALLOWED = frozenset({"hidden", "mlp_hidden", "features", "decreasing_periods",
                             "datasets", "models"})


def _choices() -> dict[str, tuple[str, ...]]:
  from mfopt import costmodel, data, models  # pylint: disable=g-import-not-at-top
  nets, names = tuple(costmodel.PRESETS), tuple(data.registered())
  return {"net": nets, "network": nets, "networks": nets, "dataset": names, "datasets": names,
          "model": tuple(models.MODELS), "models": tuple(models.MODELS)}


def check_conventions(config: ml_collections.ConfigDict,
                      narrower: Mapping[str, Sequence[str] | Callable[[], Sequence[str]]]
                      | None = None) -> None:
  """Raises ConfigError for a field whose name has a library-wide meaning (:data:`CONVENTIONS`,
  link/dataset/model names) and whose value breaks it, for any non-finite float, for an
  empty tuple outside :data:`EMPTY_ALLOWED` and for a repeated item outside
  :data:`REPEATS_ALLOWED`. ``narrower``: an experiment's ``CHOICES``, the
  names it can build (an MLP-only script given ``model=cnn`` passed this check and crashed
  inside its run with a traceback). A value may be a function returning the names, called
  here: ``data.classification_datasets`` then includes datasets a user registers after the
  experiment was imported."""
  choices = {**_choices(),
             **{k: tuple(v() if callable(v) else v) for k, v in (narrower or {}).items()}}
  for key in flat_keys(config):
    value = config
    for part in key.split("."):
      value = value[part]
    name = key.rsplit(".", 1)[-1]
    items = value if isinstance(value, (tuple, list)) else (value,)
    if isinstance(value, (tuple, list)) and not value and name not in EMPTY_ALLOWED:
      raise ConfigError(f"config field {key!r} must not be empty (the run would do nothing), "
                        f"got {value!r}")
    if isinstance(value, (tuple, list)) and name not in REPEATS_ALLOWED:
      repeated = [v for i, v in enumerate(value) if v in value[:i]]
      if repeated:
        raise ConfigError(f"config field {key!r} repeats {repeated[0]!r} (a repeated item runs "
                          f"the same cell twice and counts it twice), got {value!r}")
    if name in CONVENTIONS:
      check, what = CONVENTIONS[name]
      bad = [v for v in items if not check(v)]
      if bad:
        raise ConfigError(f"config field {key!r} must be {what}"
                          + (" (each item)" if isinstance(value, (tuple, list)) else "")
                          + f", got {value!r}")
    elif name in choices and not all(v in choices[name] for v in items):
      raise ConfigError(f"config field {key!r} must be one of {list(choices[name])}, got {value!r}")
    bad_floats = [v for v in items if isinstance(v, float) and not math.isfinite(v)]
    if bad_floats:
      raise ConfigError(f"config field {key!r} must be finite, got {value!r}")


def _refuse_ignored_sizes(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """Refuses an explicit ``num_train`` or ``num_test`` for a dataset with fixed splits. The
  experiments load such a dataset whole (``data.load_sized``), so ``dataset=digits
  num_train=500`` trained on all 1,437 digits and said nothing."""
  from mfopt import data  # pylint: disable=g-import-not-at-top
  sized = [k for k in (item.split("=", 1)[0] for item in overrides)
           if k in ("num_train", "num_test")]
  name = config.get("dataset")
  if sized and isinstance(name, str) and name in data.registered() and not data.takes_sizes(name):
    generated = [n for n in data.registered() if data.takes_sizes(n)]
    raise ConfigError(
        f"config field {sized[0]!r} sets the size of a generated dataset ({', '.join(generated)}); "
        f"dataset={name!r} has fixed splits and is loaded whole, so it would be ignored")


def _refuse_unused_overrides(module: ModuleType, config: ml_collections.ConfigDict,
                             overrides: Sequence[str]) -> None:
  """Refuses an override of a field this config does not use. An experiment may define
  ``unused_fields(config) -> {field: why}`` (fields its other settings make irrelevant:
  ``features`` of ``model=mlp``); a field set on the command line that it lists ran as if it
  were not given while the report printed it (``model=mlp features=(64,)`` trained the MLP's
  default widths under a "features (64,)" line)."""
  unused = getattr(module, "unused_fields", None)
  if unused is None:
    return
  why = unused(config)
  for key in (item.split("=", 1)[0].strip() for item in overrides):
    if key in why:
      value = config
      for part in key.split("."):
        value = value[part]
      raise ConfigError(f"config field {key!r} is not used here: {why[key]}; drop it "
                        f"(got {key}={value!r})")


def prepare(name: str, *, quick: bool = False, overrides: Sequence[str] = ()) -> tuple[ModuleType, ml_collections.ConfigDict]:
  """Loads an experiment and its validated config (nothing compiled yet)."""
  module = load_experiment(name)
  config = module.get_config(quick)
  if not isinstance(config, ml_collections.ConfigDict):  # (a user experiment's: a traceback)
    raise ConfigError(f"experiment {name!r}: get_config must return an "
                      f"ml_collections.ConfigDict, got {type(config).__name__}")
  config = apply_overrides(config, overrides)
  choices = getattr(module, "CHOICES", None)
  check_conventions(config, choices() if callable(choices) else choices)
  _refuse_ignored_sizes(config, overrides)
  _refuse_unused_overrides(module, config, overrides)
  validate = getattr(module, "validate", None)
  if validate is not None:
    try:
      validate(config)
    except ConfigError:
      raise
    except ValueError as e:
      raise ConfigError(str(e)) from e
  return module, config


CHECKPOINTS = "checkpoints"
CHECKPOINT_INTERVAL_S = 60.0  # default: periodic saves at most this often (the final one always)


# Config fields that change what is shown, not what is computed: they may differ on resume.
DISPLAY_FIELDS = ("config.progress",)
# Fields no --allow-config-change may change: bb_lr written into ksync_trace's workdir mixed
# the two experiments' metrics rows and left ksync_trace's plots beside bb_lr's report.
FIXED_FIELDS = ("experiment", "quick")
ALLOWED_CHANGES = "allowed_changes"  # config.json's record of --allow-config-change runs


def _config_changes(saved: Mapping[str, Any], record: Mapping[str, Any]) -> list[str]:
  """:func:`mfopt.checkpoint.config_diff` of two config.json records, display fields and the
  record of allowed changes left out."""
  saved = {k: v for k, v in saved.items() if k != ALLOWED_CHANGES}
  record = {k: v for k, v in record.items() if k != ALLOWED_CHANGES}
  return [d for d in checkpoint.config_diff(saved, record)
          if d.split(":", 1)[0] not in DISPLAY_FIELDS]


def _has_results(workdir: pathlib.Path) -> bool:
  """Whether a run in ``workdir`` (any process) logged a metrics row or finished."""
  return any((d / name).exists() for d in [workdir, *workdir.glob("process-*")]
             for name in ("metrics.jsonl", "summary.json"))


def check_resumable(workdir: pathlib.Path, record: dict[str, Any], *,
                    allow_config_change: bool = False) -> bool:
  """True if ``workdir`` holds checkpoints of this same experiment and config (resume).

  Raises ConfigError naming every differing field when the workdir's ``config.json`` (written
  when a run starts) is another experiment's or config's, unless ``allow_config_change``:
  with or without checkpoints, since an interrupted run's ``metrics.jsonl`` rows (and a
  simulator run's, which has no checkpoints) would otherwise mix with this config's.
  """
  ckpt_root = workdir / CHECKPOINTS
  has_ckpts = ckpt_root.is_dir() and any(ckpt_root.iterdir())
  saved_path = workdir / "config.json"
  if not saved_path.exists():
    if has_ckpts:
      raise ConfigError(f"{ckpt_root} holds checkpoints but {saved_path} is missing; cannot "
                        "tell which experiment wrote them (use another --workdir or --restart)")
    return False
  saved = json.loads(saved_path.read_text())
  diff = _config_changes(saved, record)
  what = "checkpoints" if has_ckpts else "results"
  if diff and not has_ckpts and not _has_results(workdir):
    # An attempt that failed before it logged anything (a dataset not prepared, a bad value
    # only its run could find) left config.json and attempts.json: nothing to protect, so the
    # corrected command may use the workdir (it was refused as "holds results").
    import jax  # noqa: PLC0415
    print(f"note: {workdir} holds no results of its earlier config ({'; '.join(diff)}); "
          "starting afresh", file=sys.stderr)
    if jax.process_index() == 0:  # (its other files, if any, are the user's: kept)
      for name in RUN_DATA:
        (workdir / name).unlink(missing_ok=True)
    return False
  fixed = [d for d in diff if d.split(":", 1)[0] in FIXED_FIELDS]
  if fixed:  # another experiment's files (or the other preset's) would mix with this one's
    raise ConfigError(
        f"{workdir} holds {what} of {'; '.join(fixed)} (saved -> now); a workdir holds one "
        "experiment and preset, even with --allow-config-change. Use another --workdir, or "
        "--restart to discard them")
  if diff and not allow_config_change:
    raise ConfigError(
        f"{workdir} holds {what} of a different experiment or config; differing fields "
        f"({what[:-1] if has_ckpts else 'saved'} -> now): {'; '.join(diff)}. Use another "
        "--workdir, --restart to discard them, or --allow-config-change to "
        + ("resume anyway" if has_ckpts else "add to them anyway"))
  if diff:
    print(f"warning: {'resuming' if has_ckpts else 'writing into'} {workdir} despite config "
          f"changes: {'; '.join(diff)}", file=sys.stderr)
  return has_ckpts


ATTEMPTS = "attempts.json"  # every attempt at a workdir's run: start, wall time, interrupted?
# What --restart discards, with the checkpoints: the data log of every process (process-<i>/
# too), and the outputs the discarded run wrote (OUTPUT_SUFFIXES).
RUN_DATA = ("config.json", "summary.json", "metrics.jsonl", ATTEMPTS)


# Outputs of a run other than RUN_DATA (reports, plots, per-seed traces): --restart removes
# those the discarded run wrote (see discard_run_data).
OUTPUT_SUFFIXES = (".json", ".jsonl", ".md", ".png", ".pdf", ".svg", ".csv")


def _run_began(d: pathlib.Path) -> float | None:
  """When the run in ``d`` began (its first attempt in attempts.json, else the time
  config.json, written at the start, was last changed); ``None`` if neither says."""
  try:
    starts = [float(a["started"]) for a in json.loads((d / ATTEMPTS).read_text())]
    if starts:
      return min(starts)
  except (OSError, ValueError, TypeError, KeyError):
    pass
  try:
    return (d / "config.json").stat().st_mtime
  except OSError:
    return None


def discard_run_data(workdir: pathlib.Path) -> list[pathlib.Path]:
  """``--restart``: removes ``workdir``'s checkpoints, data log (:data:`RUN_DATA`) and the
  outputs the discarded run wrote (files with an :data:`OUTPUT_SUFFIXES` suffix, directly in
  the workdir or a ``process-*`` folder, last written while that run went on: from its start
  to its last write of the data log or a checkpoint), so the new run's folder holds its own
  results only. A per-seed trace of a seed the new run does not have used to stay beside its
  report. A user's files written before the run began or after it ended are kept (those
  written after it ended went too). Returns every path removed, checkpoint folder and data
  log included (the CLI prints them; it printed the outputs only)."""
  removed = []
  ended = {d: _last_write([d / n for n in RUN_DATA]
                          + ([workdir / CHECKPOINTS] if d == workdir else []))
           for d in [workdir, *sorted(workdir.glob("process-*"))]}
  if (workdir / CHECKPOINTS).exists():
    shutil.rmtree(workdir / CHECKPOINTS)
    removed.append(workdir / CHECKPOINTS)
  for d, last in ended.items():
    began = _run_began(d)
    for name in RUN_DATA:
      if (d / name).exists():
        (d / name).unlink()
        removed.append(d / name)
    if began is None:
      continue
    last = math.inf if last is None else last
    for f in d.iterdir():
      try:
        # (1 s of slack either side: file systems' coarse mtimes)
        if (f.is_file() and f.suffix in OUTPUT_SUFFIXES
            and began - 1.0 <= f.stat().st_mtime <= last + 1.0):
          f.unlink()
          removed.append(f)
      except OSError:
        pass
  return removed


def _last_write(paths: Iterable[pathlib.Path]) -> float | None:
  """The newest modification time (epoch s) of the files at or under ``paths``; None if none."""
  times = []
  for path in paths:
    files = [path] if path.is_file() else path.rglob("*") if path.is_dir() else []
    for f in files:
      try:
        if f.is_file():
          times.append(f.stat().st_mtime)
      except OSError:  # removed meanwhile (another process's old or temporary checkpoint)
        pass
  return max(times, default=None)


def begin_attempt(workdir: pathlib.Path, files_dir: pathlib.Path, *,
                  resumed: bool) -> list[dict[str, Any]]:
  """Records the start of this attempt in ``files_dir/attempts.json`` and returns the list.

  The earlier attempts at this workdir are kept, including one killed before its first
  checkpoint (the next run starts over, but that time was spent: ``--restart`` discards
  the list with the rest of the run's data). An attempt
  that raised is recorded with its time by :func:`fail_attempt`; one that was killed is
  closed here, its time counted up to its last sign of life: the newest write to the
  workdir's checkpoints or to this process's ``metrics.jsonl``. So ``wall_time_at_least_s``
  is a lower bound (the attempt ran on for as long as it wrote nothing).
  :func:`end_attempt` adds them up.
  """
  path = files_dir / ATTEMPTS
  attempts: list[dict[str, Any]] = []
  if path.exists():
    try:
      attempts = list(json.loads(path.read_text()))
    except ValueError:  # (written atomically; a hand-edited file is not fatal)
      print(f"warning: {path} is not valid JSON; earlier attempts are not counted",
            file=sys.stderr)
  for a in attempts:
    if a.get("wall_time_s") is None and not a.get("interrupted"):
      last = _last_write([workdir / CHECKPOINTS, files_dir / "metrics.jsonl"])
      a["interrupted"] = True
      a["wall_time_at_least_s"] = max(0.0, (last or a["started"]) - a["started"])
  now = time.time()
  attempts.append({"started": now,
                   "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now)),
                   "resumed": resumed, "wall_time_s": None})
  report.write_json(path, attempts)
  return attempts


def fail_attempt(files_dir: pathlib.Path, attempts: list[dict[str, Any]], wall_time_s: float,
                 error: BaseException) -> None:
  """Records that this attempt ended with ``error`` after ``wall_time_s`` (counted in the total)."""
  attempts[-1].update(wall_time_s=wall_time_s, failed=f"{type(error).__name__}: {error}"[:500])
  report.write_json(files_dir / ATTEMPTS, attempts)


def end_attempt(files_dir: pathlib.Path, attempts: list[dict[str, Any]],
                wall_time_s: float) -> dict[str, Any]:
  """Closes this (the last) attempt; returns the summary fields for all attempts together:
  ``attempts`` (their count), ``wall_time_all_attempts_s`` and whether it is a lower bound
  (an interrupted attempt's time counts only to its last write)."""
  attempts[-1]["wall_time_s"] = wall_time_s
  report.write_json(files_dir / ATTEMPTS, attempts)
  total = sum(a["wall_time_s"] if a.get("wall_time_s") is not None
              else a.get("wall_time_at_least_s", 0.0) for a in attempts)
  return {"attempts": len(attempts), "wall_time_all_attempts_s": total,
          "wall_time_all_attempts_is_lower_bound": any(a.get("interrupted") for a in attempts)}


def run_experiment(name: str, *, quick: bool = False, workdir: str | os.PathLike | None = None,
                   overrides: Sequence[str] = (), checkpoint_every: int | None = None,
                   keep_checkpoints: int = 2, allow_config_change: bool = False,
                   restart: bool = False) -> dict[str, Any]:
  """Runs one experiment into ``workdir`` and returns its summary.

  Every ``mfopt.train.fit`` call of the experiment checkpoints into
  ``workdir/checkpoints/<index>-<desc>/`` (every ``checkpoint_every`` steps;
  by default at a logging step once :data:`CHECKPOINT_INTERVAL_S` passed since
  the last save; always at the end of a run; ``keep_checkpoints`` kept). Running again with the
  same workdir resumes: finished runs return their saved results, the
  interrupted one continues from its last good checkpoint, bit for bit. A
  workdir whose checkpoints were written for another experiment or config is
  refused (ConfigError naming the fields) unless ``allow_config_change``, and so is one whose
  ``config.json`` says another config wrote its results (no checkpoints: a run interrupted
  before its first save, or a simulator experiment); ``restart`` deletes the checkpoints and
  the data log (:func:`discard_run_data`) first.

  In a multi-process job (``mfopt.distributed``) all processes share
  ``workdir/checkpoints``; process 0 writes ``config.json``/``summary.json`` and
  the experiment's files into ``workdir``, process ``i > 0`` into
  ``workdir/process-<i>/``.
  """
  module, config = prepare(name, quick=quick, overrides=overrides)
  return _run_prepared(name, module, config, quick=quick, workdir=workdir,
                       checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                       allow_config_change=allow_config_change, restart=restart)


def require_same_settings_on_every_process(settings: Mapping[str, Any]) -> None:
  """Raises :class:`ConfigError` on every process of the job unless all were given the same
  ``settings`` (JSON data) as process 0; the processes that differ name the fields.

  Nothing compared them: with ``seed=1`` on one host and ``seed=0`` on the other the job ran
  and reported seed 0 over a mixture, and with different step counts it hung in a collective.
  """
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415
  mine = json.dumps(report._jsonable(settings), sort_keys=True).encode()
  lengths = multihost_utils.process_allgather(np.asarray([len(mine)], np.int64))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:len(mine)] = np.frombuffer(mine, np.uint8)
  first = np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)
  theirs = json.loads(first[:int(np.asarray(lengths).reshape(-1)[0])].tobytes().decode())
  diff = checkpoint.config_diff(theirs, json.loads(mine.decode()))
  differs = np.asarray(multihost_utils.process_allgather(np.asarray([bool(diff)]))).reshape(-1)
  if differs.any():
    others = [int(i) for i in np.flatnonzero(differs)]
    if diff:
      raise ConfigError(f"process {jax.process_index()} was given other settings than process 0 "
                        f"(process 0 -> here): {'; '.join(diff)}; every process must run the "
                        "same command")
    raise ConfigError(f"process(es) {others} were given other settings than process 0 (their "
                      "errors name the fields); every process must run the same command")


def _run_prepared(name: str, module: ModuleType, config: ml_collections.ConfigDict, *, quick: bool,
                  workdir: str | os.PathLike | None, checkpoint_every: int | None,
                  keep_checkpoints: int, allow_config_change: bool,
                  restart: bool) -> dict[str, Any]:
  """:func:`run_experiment` after :func:`prepare` (``main`` validates before joining a job)."""
  workdir = pathlib.Path(workdir or pathlib.Path("runs") / (name + ("-quick" if quick else "")))
  try:  # before anything runs: the first checkpoint would be written and never read back
    checkpoint.check_directory(workdir / CHECKPOINTS)
  except ValueError as e:
    raise ConfigError(f"workdir {str(workdir)!r}: {e}") from None
  import jax  # noqa: PLC0415  (after prepare: config errors never start a backend)

  primary = jax.process_index() == 0
  single_only = getattr(module, "SINGLE_PROCESS_ONLY", None)
  if single_only and jax.process_count() > 1:
    raise ConfigError(f"experiment {name!r} does not run as several processes yet "
                      f"({single_only}); run it as one process (with any number of devices)")
  record = {"experiment": name, "quick": quick, "config": config.to_dict()}
  if jax.process_count() > 1:
    require_same_settings_on_every_process({
        **record, "checkpoint_every": checkpoint_every, "keep_checkpoints": keep_checkpoints,
        "allow_config_change": allow_config_change, "restart": restart})
  if restart and primary:
    removed = discard_run_data(workdir)
    if removed:
      print(f"--restart removed the discarded run's checkpoints, data log and outputs: "
            f"{', '.join(str(f.relative_to(workdir)) for f in removed)}", file=sys.stderr)
  if restart and jax.process_count() > 1:  # the others check the workdir after it is cleared
    from jax.experimental import multihost_utils  # noqa: PLC0415
    multihost_utils.sync_global_devices("mfopt_restart")
  resumed = check_resumable(workdir, record, allow_config_change=allow_config_change)
  workdir.mkdir(parents=True, exist_ok=True)
  enable_compilation_cache()
  if primary and not (resumed and not allow_config_change):  # others may be reading it
    if (workdir / "config.json").exists():
      # The workdir keeps what it was written with: each allowed change is recorded (and kept
      # by later runs), since finished sub-runs keep their results (computed with the old values).
      saved = json.loads((workdir / "config.json").read_text())
      changes = _config_changes(saved, record) if allow_config_change else []
      history = list(saved.get(ALLOWED_CHANGES, []))
      if changes:
        history.append({"utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                        "changes": changes})
      if history:
        record = {**record, ALLOWED_CHANGES: history}
    report.write_json(workdir / "config.json", record)
  files_dir = workdir if primary else workdir / f"process-{jax.process_index()}"
  files_dir.mkdir(parents=True, exist_ok=True)
  attempts = begin_attempt(workdir, files_dir, resumed=resumed)
  start = time.perf_counter()
  with checkpoint.auto_checkpoint(
      workdir / CHECKPOINTS, every=checkpoint_every, keep=keep_checkpoints,
      allow_mismatch=allow_config_change,
      min_interval_s=CHECKPOINT_INTERVAL_S if checkpoint_every is None else None):
    try:
      # (whenever a change is allowed: a rerun that found no checkpoint recomputes everything
      # with the new config, and dropped every recomputed row as already logged)
      with (report.recomputed_rows_replace() if allow_config_change
            else contextlib.nullcontext()):
        summary = module.run(config, files_dir)
    except BaseException as e:  # (KeyboardInterrupt too) the attempt's time and why it ended
      fail_attempt(files_dir, attempts, time.perf_counter() - start, e)
      raise
  summary = dict(summary or {})
  summary.setdefault("experiment", name)
  summary["quick"] = quick
  summary["resumed"] = resumed
  summary["wall_time_s"] = time.perf_counter() - start  # this attempt's
  summary.update(end_attempt(files_dir, attempts, summary["wall_time_s"]))
  summary["environment"] = report.environment()
  summary["files_dir"] = str(files_dir)
  history = _allowed_changes(workdir)
  if history:
    summary[ALLOWED_CHANGES] = history
    _note_allowed_changes(files_dir / "report.md", history)
  report.write_json(files_dir / "summary.json", summary)
  return summary


def _allowed_changes(workdir: pathlib.Path) -> list[dict[str, Any]]:
  try:
    return list(json.loads((workdir / "config.json").read_text()).get(ALLOWED_CHANGES, []))
  except (OSError, ValueError, AttributeError):
    return []


def _note_allowed_changes(path: pathlib.Path, history: list[dict[str, Any]]) -> None:
  """Appends to an experiment's report that its workdir's config changed during its runs:
  the report shows the new config, but runs finished before a change kept results computed
  with the old values (an lr 0.5 report over lr 0.05 accuracies, unlabelled, before)."""
  if not path.exists():
    return
  lines = ["", "**Config changed while this workdir's runs were under way** "
           "(`--allow-config-change`; runs finished before a change kept the results of the "
           "values they ran with, so this report's config is not every run's):", ""]
  lines += [f"- {h.get('utc', '?')} UTC: {'; '.join(h.get('changes', []))}" for h in history]
  with path.open("a") as f:
    f.write("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m experiments``; returns the exit code. A failing process of a multi-process
  job ends at once (:func:`mfopt.distributed.exit_now`): returned, its exit went through
  ``jax.distributed.shutdown``'s barrier and hung the job for 5 minutes."""
  code = _main(argv)
  distributed.exit_now(code)
  return code


def _main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m experiments",
      description="Run an mfopt experiment; writes metrics.jsonl, summary.json, plots and "
                  "report.md.",
      add_help=False)
  parser.add_argument("-h", "--help", action="store_true",
                      help="show this help; with an experiment name, also what it runs and its "
                      "config (with --quick: the quick preset's)")
  parser.add_argument("name", nargs="?", help="experiment name (omit with --list), or a "
                      "dotted module path of your own experiment (get_config/run)")
  parser.add_argument("overrides", nargs="*", help="config overrides key=value (dotted keys)")
  parser.add_argument("--quick", action="store_true", help="the small preset used in CI")
  parser.add_argument("--workdir", default=None, help="output directory (default runs/<name>[-quick])")
  parser.add_argument("--list", action="store_true", help="list experiments and exit")
  parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (repeatable): a module of your own that "
                      "registers datasets (mfopt.data.register) or models "
                      "(mfopt.models.register) for the config to name")
  parser.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
  parser.add_argument("--checkpoint-every", type=int, default=None,
                      help="steps between checkpoints, rounded up to a multiple of each run's "
                      "logging interval; simulator events for mfopt.sim runs (default: at a "
                      "logging step, or every 2000 events, once 60 s passed since the last save; "
                      "always at the end)")
  parser.add_argument("--keep-checkpoints", type=int, default=2,
                      help="checkpoints kept per run (>= 2 allows falling back past a corrupt one)")
  parser.add_argument("--allow-config-change", action="store_true",
                      help="resume from (or add to) a workdir whose checkpoints or results were "
                      "written with another config (finished sub-runs keep their results; the "
                      "change is recorded in config.json's allowed_changes)")
  parser.add_argument("--restart", action="store_true",
                      help="delete the workdir's checkpoints, data log (config.json, "
                      "summary.json, metrics.jsonl, attempts.json) and the reports, plots and "
                      "data files written while the discarded run went on (by modification "
                      "time; it prints them), and start from scratch")
  dist = parser.add_argument_group("multi-process (see mfopt.distributed; default: environment)")
  dist.add_argument("--coordinator", default=None, help="host:port of process 0")
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
  dist.add_argument("--distributed", action="store_true",
                    help="join a job found by JAX's cluster detection (SLURM, Open MPI, ...)")
  args = parser.parse_intermixed_args(argv)
  if args.help and args.name is None:
    parser.print_help()
    return 0
  if args.list or args.name is None:
    print("\n".join(list_experiments()))
    if args.list:
      return 0
    print("error: name an experiment (one of the above), or pass --list or --help",
          file=sys.stderr)
    return 2
  try:
    for module_name in args.imports:
      try:
        importlib.import_module(module_name)
      except ModuleNotFoundError as e:
        raise ConfigError(f"--import {module_name}: {e} (a module on sys.path, PYTHONPATH)") \
            from None
    refuse_repeated_keys(args.overrides)
    module, config = prepare(args.name, quick=args.quick, overrides=args.overrides)  # fail before joining a job
    if args.help:  # (the same help for every name told nothing about the experiment)
      parser.print_help()
      print(f"\n{inspect.getdoc(module) or ''}\n\n{inspect.getdoc(module.get_config) or ''}"
            f"\n\nconfig{' (--quick)' if args.quick else ''} (override with key=value):\n"
            f"{config}")
      return 0
    if args.show_config:
      print(config)
      return 0
    for flag, value in (("--checkpoint-every", args.checkpoint_every),
                        ("--keep-checkpoints", args.keep_checkpoints)):
      if value is not None and value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if args.distributed:
      os.environ[distributed.ENV_AUTO] = "1"
    try:
      distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    summary = _run_prepared(args.name, module, config, quick=args.quick, workdir=args.workdir,
                            checkpoint_every=args.checkpoint_every,
                            keep_checkpoints=args.keep_checkpoints,
                            allow_config_change=args.allow_config_change, restart=args.restart)
  except (ConfigError, checkpoint.ConfigMismatchError, data_lib.DatasetNotPreparedError,
          data_lib.BatchTooLargeError) as e:
    # (a TFDS dataset not prepared in the data dir: the user's setup, not a bug; its message
    # names the dataset, the directory searched and the command that prepares it. A global
    # batch larger than the dataset: a config whose fields disagree, found when the data is
    # loaded, which is after the run's directory was made; a corrected rerun is accepted.)
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # (a traceback from orbax/asyncio told nothing about resuming)
    print(f"\n{args.name}: interrupted; run the same command again to resume from its last "
          "checkpoint", file=sys.stderr)
    return 130
  earlier = ""
  if summary["attempts"] > 1:
    earlier = (f" ({summary['attempts']} attempts, "
               + ("at least " if summary["wall_time_all_attempts_is_lower_bound"] else "")
               + f"{summary['wall_time_all_attempts_s']:.1f} s in all)")
  report_md = os.path.join(summary["files_dir"], "report.md")
  where = (f"; report: {report_md}" if os.path.exists(report_md)  # (a user experiment may write
           else f"; outputs in {summary['files_dir']}")          # none: it was named anyway)
  print(f"{args.name}: done in {summary['wall_time_s']:.1f} s{earlier}{where}")
  return 0
