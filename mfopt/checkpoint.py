"""Resumable runs: atomic orbax checkpoints of the complete run state, verified on restore.

A checkpoint holds two orbax items per step, in ``<directory>/<step>/``:

* ``state``: the worker-stacked :class:`mfopt.train.TrainState` (parameters,
  BatchNorm statistics, optimizer state -- which includes every transform's
  counters, period controllers, loss scales and PRNG keys), saved with
  ``orbax.checkpoint.args.StandardSave`` from every process (orbax writes each
  process's shards; arrays are restored onto the current mesh, so a run may
  resume on a different process count);
* ``meta``: JSON with the step (the data position: batches are stateless in the
  step, :class:`mfopt.data.WorkerBatcher`), the metrics history so far, the
  run's fingerprint, timings, the final summary of a finished run, and a
  checksum of every array in ``state``.

Guarantees:

* **Atomic writes.** orbax writes a step into a temporary directory and renames
  it when complete; the oldest step beyond ``keep`` is deleted only after the
  new one is committed. A save interrupted at any point (SIGKILL included)
  leaves the last good checkpoint untouched; the unfinished temporary directory
  is ignored on restore.
* **Verified restore with fallback.** :meth:`RunCheckpointer.restore_latest`
  tries the newest step first. If it cannot be read (truncated file, missing
  item) or its arrays do not match the recorded checksum (bit rot, a flipped
  byte), it says so on stderr, moves the step aside to ``corrupt-<step>-<n>``
  (kept for inspection, out of orbax's way) and falls back to the previous good
  one. In a multi-process job the processes agree on the verdict first (each
  reads only its own shards), and process 0 alone moves the step. A failure that
  says nothing about the checkpoint (out of memory, too many open files, no
  permission, a newer mfopt's format) is raised, and the checkpoint stays where
  it is for the next attempt.
* **No silent mix-ups.** A checkpoint written by a different run (different
  fingerprint: data, workers, batch, steps, seed, state structure, or the
  caller's own fields) is refused with :class:`ConfigMismatchError` naming every
  differing field, unless ``allow_mismatch=True``.

Deviation from plain orbax: the checksum. orbax verifies that a checkpoint was
committed, not that its bytes are still what was written; a flipped byte inside
a compressed chunk may decode to different numbers without an error, so the
state's arrays are fingerprinted on device (a position-weighted sum of their
bits, exact for any single changed element) and compared after restore.

The runner turns checkpointing on for every :func:`mfopt.train.fit` call of an
experiment through :func:`auto_checkpoint`; each ``fit`` call then gets its own
sub-directory ``<root>/<index>-<desc>``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from mfopt import _checks, report

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
  """No usable checkpoint although some exist (all corrupt), or a save failed."""


class ConfigMismatchError(ValueError):
  """A checkpoint belongs to a different run; the message names the differing fields."""


class _NewerFormatError(CheckpointError):
  """A checkpoint written by a newer mfopt (its format version is higher): not corruption."""


# errno values of failures that come from the machine, not from the checkpoint's bytes
_ENVIRONMENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC,
                                 errno.EACCES, errno.EPERM, errno.EROFS})


def _is_corruption(error: BaseException) -> bool:
  """Whether a restore failure means the checkpoint itself is unusable.

  Unreadable or inconsistent files (decode errors, missing items, checksum
  mismatch) are; out-of-memory, file-handle and permission failures and a newer
  format are not: moving a good checkpoint aside for those would make the next
  run start over. Any other exception counts as corruption (orbax and
  tensorstore report damaged files with many types).
  """
  if isinstance(error, (MemoryError, PermissionError, _NewerFormatError)):
    return False
  if isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS:
    return False
  text = str(error)
  return not any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                     "Too many open files"))


def _all_processes(code: int) -> list[int]:
  """Every process's ``code`` (this one's alone in a single-process run); a collective."""
  if jax.process_count() == 1:
    return [code]
  from jax.experimental import multihost_utils  # noqa: PLC0415
  return [int(c) for c in np.asarray(multihost_utils.process_allgather(np.int32(code))).ravel()]


# ---------------------------------------------------------------------------------------------
# Fingerprints and checksums


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; sequences become lists (JSON's view of them)."""
  flat: dict[str, Any] = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(flatten_dict(value, name + "."))
    else:
      flat[name] = _jsonable(value)
  return flat


def _jsonable(value: Any) -> Any:
  return json.loads(json.dumps(value, default=repr))


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """Human-readable differing fields of two (nested) configs: ``"num_steps: 60 -> 100"``."""
  a, b = flatten_dict(saved), flatten_dict(current)
  out = []
  for key in sorted(set(a) | set(b)):
    if key not in a:
      out.append(f"{key}: (absent) -> {b[key]!r}")
    elif key not in b:
      out.append(f"{key}: {a[key]!r} -> (absent)")
    elif not _same(a[key], b[key]):
      out.append(f"{key}: {a[key]!r} -> {b[key]!r}")
  return out


def _same(a: Any, b: Any) -> bool:
  """Equal but for NaN, which never equals itself: a fingerprint holding one (``run_info``,
  also inside a list) refused every resume."""
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (math.isnan(a) and math.isnan(b))
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return a == b


#: State classes renamed without a change of fields, as their old names: the hash names every
#: namedtuple, and a checkpoint written before the rename was refused as "a state of a
#: different structure" (skip_nonfinite's state was optax's ApplyIfFiniteState until
#: 2026-11-25; orbax restores by field name into the new class).
_SAME_STRUCTURE_AS = {"namedtuple[SkipNonfiniteState]": "namedtuple[ApplyIfFiniteState]"}


#: ``(old_layout, to_new)`` pairs registered by :func:`register_migration`.
_MIGRATIONS: list[tuple[Any, Any]] = []


def register_migration(old_layout, to_new) -> None:
  """Lets :class:`RunCheckpointer` read a state saved in an earlier version's layout.

  ``old_layout(state)``: ``state`` (a restore target of this version) as the earlier version
  laid it out, or ``None`` where the change does not apply; it must keep the arrays and their
  order (e.g. drop a field that holds no arrays). ``to_new(old)``: the restored old-layout
  state in this version's layout. A checkpoint whose structure hash is ``old_layout``'s is
  restored through it; nothing else of another structure is (see
  ``mfopt.averaging``'s ``trace_variance``)."""
  _MIGRATIONS.append((old_layout, to_new))


#: Fingerprint fields added after checkpoints without them were written (see check_fingerprint).
FINGERPRINT_FIELDS_ADDED = frozenset({"model_settings"})


def plain_settings(v: Any) -> Any:
  """``v`` as JSON data for a fingerprint: dataclasses field by field, numbers (a non-finite
  one as a string: NaN never equals itself), strings, sequences; classes and functions by
  name (never a ``repr`` with a memory address, which would differ between runs)."""
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    return {f.name: plain_settings(getattr(v, f.name)) for f in dataclasses.fields(v)
            if f.name not in ("parent", "name")}  # (flax modules: their place in a tree)
  if isinstance(v, (np.ndarray, jax.Array)):  # (ComputeModel.speeds: values, not the type)
    return plain_settings(np.asarray(v).tolist())
  if isinstance(v, np.generic):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  if v is None or isinstance(v, (bool, int, float, str)):
    return v
  if isinstance(v, (tuple, list)):
    return [plain_settings(x) for x in v]
  if isinstance(v, Mapping):
    return {str(k): plain_settings(x) for k, x in v.items()}
  if isinstance(v, functools.partial):  # (a changed activation's keywords were invisible)
    return {"partial": plain_settings(v.func), "args": plain_settings(list(v.args)),
            "keywords": plain_settings(dict(v.keywords))}
  if isinstance(v, type) or callable(v):
    return getattr(v, "__qualname__", type(v).__name__)
  return type(v).__name__


def changed_settings(obj: Any) -> Any:
  """:func:`plain_settings` of a dataclass's fields whose values differ from their defaults
  (all of them for a field without one). ``train.fit``'s fingerprint of the model: a field a
  later version adds with a default then leaves earlier checkpoints resumable (the built-in
  models gained ``bn_impl``, ``conv_impl`` and ``bn_groups`` that way)."""
  if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
    return plain_settings(obj)
  out = {}
  for f in dataclasses.fields(obj):
    if f.name in ("parent", "name"):
      continue
    value = getattr(obj, f.name)
    default = (f.default if f.default is not dataclasses.MISSING
               else f.default_factory() if f.default_factory is not dataclasses.MISSING
               else dataclasses.MISSING)
    try:
      same = default is not dataclasses.MISSING and bool(value == default)
    except Exception:  # noqa: BLE001  (an array: compared by value it is ambiguous)
      same = False
    if not same:
      out[f.name] = plain_settings(value)
  return out


def _path_name(path: Sequence[Any]) -> str:
  """``"opt.0.mu.w"``: a key path as orbax's metadata and the state both spell it (a
  NamedTuple's fields are saved as dict keys)."""
  return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _leaf_table(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
  """``(path, shape, dtype)`` of each leaf in flattening order (a NumPy leaf keeps its own
  dtype: float64 stays float64 without x64, as it is saved)."""
  return [(_path_name(p), tuple(np.shape(x)),
           str(x.dtype if isinstance(x, np.ndarray) else jnp.result_type(x)))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def structure_hash(tree: Any) -> str:
  """Hash of a pytree's structure, leaf shapes and dtypes (not values)."""
  leaves, treedef = jax.tree.flatten(tree)
  structure = str(treedef)
  for new, old in _SAME_STRUCTURE_AS.items():
    structure = structure.replace(new, old)
  text = structure + "|" + ";".join(f"{tuple(np.shape(x))}:{jnp.result_type(x)}" for x in leaves)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _leaf_words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (any dtype)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = jnp.ravel(x)
  size = jnp.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  if size == 8:
    return jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.uint32))
  raise TypeError(f"cannot checksum dtype {x.dtype}")


def _checksum_fn(tree):
  def one(x):
    words = _leaf_words(x)
    weights = jnp.arange(words.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words * weights, dtype=jnp.uint32),
                      jnp.sum(words ^ (weights * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32)])
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((0, 2), jnp.uint32)
  return jnp.stack([one(x) for x in leaves])


def _host_checksum(x: np.ndarray) -> list[int]:
  """:func:`tree_checksum` of one NumPy array, on the host (float64/int64 kept exact)."""
  a = np.ascontiguousarray(x).ravel()
  if a.dtype == np.bool_:
    words = a.astype(np.uint64)
  elif a.dtype.itemsize in (1, 2):
    words = a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16).astype(np.uint64)
  else:
    words = a.view(np.uint32).astype(np.uint64)
  weights = (2 * np.arange(words.size, dtype=np.uint64) + 1) % 2**32
  first = int((words * weights % 2**32).sum() % 2**32)
  second = int((words ^ (weights * 0x9E3779B1 % 2**32)).sum() % 2**32)
  return [first, second]


def tree_checksum(tree: Any) -> list[list[int]]:
  """Per-leaf ``[weighted sum, xor-weighted sum]`` of the bits of every array.

  Position-weighted with odd weights modulo 2**32, so changing any single
  element changes the first number. JAX arrays are summed on device (works on
  multi-process global arrays; the result is replicated to every process);
  NumPy arrays on the host.
  """
  leaves = jax.tree.leaves(tree)
  host = [isinstance(x, np.ndarray) for x in leaves]
  if all(host):
    return [_host_checksum(x) for x in leaves]
  # NumPy leaves on the host, bit for bit (on the device a float64 one would be summed as
  # float32 without x64, and a change in its low bits went unseen); the others on device
  device = [x for x, h in zip(leaves, host) if not h]
  mesh = next((x.sharding.mesh for x in device
               if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
  out_shardings = NamedSharding(mesh, P()) if mesh is not None else None
  sums = iter(np.asarray(jax.device_get(jax.jit(_checksum_fn, out_shardings=out_shardings)(
      device))).astype(np.int64).tolist())
  return [_host_checksum(x) if h else next(sums) for x, h in zip(leaves, host)]


# ---------------------------------------------------------------------------------------------
# The checkpointer


@dataclasses.dataclass
class Restored:
  """A restored checkpoint: its step, state (same structure as the target), JSON meta and path."""

  step: int
  state: Any
  meta: dict[str, Any]
  path: pathlib.Path


def _say(message: str) -> None:
  if jax.process_index() == 0:
    print(f"[mfopt.checkpoint] {message}", file=sys.stderr, flush=True)


def check_directory(directory: str | os.PathLike) -> pathlib.Path:
  """``directory`` as an absolute path, or ValueError if orbax could not read it back.

  Orbax merges each process's OCDBT data with ``directory.glob("ocdbt.process_*")``, which
  treats a ``[...]`` in the path as a character class: under ``runs/KSync[working]`` the merge
  matched nothing and was skipped with a log warning, the save returned normally, and the next
  start found every checkpoint unreadable and set them all aside as corrupt. (``*``, ``?`` and
  an unpaired bracket match themselves there; tested.)
  """
  path = pathlib.Path(directory).absolute()
  bracket = re.search(r"\[[^/]*\]", str(path))
  if bracket:
    raise ValueError(
        f"checkpoint directory {str(path)!r} contains {bracket.group(0)!r}: orbax globs the "
        "path when it merges a save, so a [...] there is a character class and such a "
        "checkpoint cannot be read back; choose a path without one")
  return path


class RunCheckpointer:
  """Saves and restores one run's state in ``directory`` with orbax (atomic, verified, keep-N).

  Args:
    directory: this run's checkpoint directory (created on first save).
    keep: number of committed checkpoints kept (>= 1; fallback past a corrupt
      newest one needs >= 2).
    fingerprint: JSON-serialisable description of the run; a checkpoint whose
      recorded fingerprint differs is refused (see ``allow_mismatch``).
    allow_mismatch: resume from a checkpoint with a different fingerprint
      anyway (the differing fields are printed).

  Example:
    >>> from mfopt.checkpoint import RunCheckpointer
    >>> ckpt = RunCheckpointer("/tmp/run/ckpt", keep=2, fingerprint={"seed": 0})  # doctest: +SKIP
    >>> ckpt.save(100, state, {"history": history})                              # doctest: +SKIP
    >>> restored = ckpt.restore_latest(abstract_state)   # None if nothing saved  # doctest: +SKIP
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2,
               fingerprint: Mapping[str, Any] | None = None, allow_mismatch: bool = False):
    self.keep = _checks.positive_int("keep", keep)
    self.directory = check_directory(directory)
    self.fingerprint = _jsonable(dict(fingerprint or {}))
    self.allow_mismatch = allow_mismatch
    self.last_good: tuple[int, pathlib.Path] | None = None
    self._manager: ocp.CheckpointManager | None = None

  # -- orbax plumbing
  @property
  def manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self.keep, create=True, enable_async_checkpointing=False,
          cleanup_tmp_directories=True)
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    return self._manager

  def close(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()
      self._manager = None

  def steps(self) -> list[int]:
    """Committed steps on disk, oldest first."""
    if not self.directory.exists():
      return []
    return sorted(self.manager.all_steps())

  def step_path(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def describe_last_good(self) -> str:
    """``"step 40 at /path/40"``, or a sentence saying none was written."""
    if self.last_good is None:
      return f"none (no checkpoint written in {self.directory})"
    step, path = self.last_good
    return f"step {step} at {path}"

  # -- save
  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> pathlib.Path:
    """Writes ``state`` and ``meta`` (JSON) as ``step``, atomically; all processes call this."""
    meta = dict(_jsonable(dict(meta)))
    meta.update(format=FORMAT_VERSION, step=int(step), fingerprint=self.fingerprint,
                checksum=tree_checksum(state), structure=structure_hash(state))
    manager = self.manager
    if step in manager.all_steps():  # e.g. re-saving after resuming from an older step
      raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}")
    manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    self.last_good = (int(step), self.step_path(step))
    return self.step_path(step)

  # -- restore
  def _restore_item(self, step: int, args: Any) -> Any:
    """``manager.restore``, meeting orbax's end-of-restore barrier even when the read raises.

    orbax's ``Checkpointer.restore`` ends with a barrier (``Checkpointer:restore``) that a
    process whose own shards fail to read never reaches; the others would wait there while
    it entered the next collective (:func:`_all_processes`), and the two paired up wrongly
    (a hang, measured with one process's read failing). Deviation from plain orbax: the
    failing process joins that barrier before raising.
    """
    try:
      return self.manager.restore(int(step), args=args)
    except Exception:
      if jax.process_count() > 1:
        options = getattr(self.manager, "_multiprocessing_options", None)
        prefix = getattr(options, "barrier_sync_key_prefix", None)
        ocp.multihost.sync_global_processes(
            ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=prefix))
      raise

  def read_meta(self, step: int) -> dict[str, Any]:
    restored = self._restore_item(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = restored.meta
    version = meta.get("format") if isinstance(meta, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION and meta.get("step") == step:
      raise _NewerFormatError(
          f"checkpoint step {step} in {self.directory} has format {version}, newer than this "
          f"mfopt's {FORMAT_VERSION}: update mfopt, or use another workdir")
    if not isinstance(meta, dict) or version != FORMAT_VERSION or meta.get("step") != step:
      raise CheckpointError(f"unexpected metadata {str(meta)[:200]!r}")
    return meta

  def check_fingerprint(self, meta: Mapping[str, Any], step: int) -> None:
    saved = dict(meta.get("fingerprint", {}))
    # run_resumable's chunk size (how often it saves, not what it computes) was fingerprinted
    # until 2026-11-25: a rerun with another --checkpoint-every was refused. Older checkpoints
    # still hold it.
    saved.pop("chunk_events", None)
    # Fields added to a fingerprint later: not compared against a checkpoint written before
    # them (train.fit's model_settings, 2026-11-26).
    now = {k: v for k, v in self.fingerprint.items()
           if k in saved or k not in FINGERPRINT_FIELDS_ADDED}
    diff = config_diff(saved, now)
    if not diff:
      return
    message = (f"checkpoint step {step} in {self.directory} was written by a different run; "
               f"differing fields (checkpoint -> now): {'; '.join(diff)}")
    if not self.allow_mismatch:
      raise ConfigMismatchError(
          message + ". Use another workdir, delete the checkpoint, or pass allow_mismatch=True "
          "(runner: --allow-config-change) to resume anyway.")
    _say(message + "; resuming anyway (allow_mismatch=True)")

  def _read_step(self, step: int, abstract_state: Any) -> tuple[dict[str, Any], Any]:
    """Reads ``step``'s meta and this process's shards of its state (no collective)."""
    meta = self.read_meta(step)
    self.check_fingerprint(meta, step)  # a different run is an error, not corruption
    if callable(abstract_state):  # the target depends on the step (plain-data state)
      abstract_state = abstract_state(meta)
    target = jax.tree.map(
        lambda x: x if isinstance(x, np.ndarray) else ocp.utils.to_shape_dtype_struct(x),
        abstract_state)  # NumPy leaves restore as NumPy (float64 stays float64)
    to_new = None
    if meta.get("structure") != structure_hash(abstract_state):
      # A layout an earlier version saved, where a registered migration says how to read it
      # (the same arrays in the same order: the recorded checksums still apply). Only those:
      # matching leaf names alone accepted adam's checkpoint for adamw (no arrays added).
      for old_layout, to_new in _MIGRATIONS:
        old = old_layout(abstract_state)
        if old is not None and structure_hash(old) == meta.get("structure"):
          target = jax.tree.unflatten(jax.tree.structure(old), jax.tree.leaves(target))
          break
      else:
        raise ConfigMismatchError(
            f"checkpoint step {step} in {self.directory} holds a state of a different "
            f"structure (shapes/dtypes/tree); it cannot be restored into this run's state"
            + self._structure_difference(step, abstract_state))
    leaves = jax.tree.leaves(target)
    restored = self._restore_item(
        step, ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    if len(jax.tree.leaves(restored.state)) != len(leaves):
      raise CheckpointError("restored state has a different number of arrays")
    state = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored.state))
    return meta, state if to_new is None else to_new(state)

  def _saved_leaves(self, step: int) -> list[tuple[str, tuple[int, ...], str]] | None:
    """The saved state's leaves as :func:`_leaf_table` lists them, from orbax's metadata of
    the saved arrays; ``None`` where it cannot be read."""
    try:
      saved = ocp.StandardCheckpointHandler().metadata(self.step_path(step) / "state")
      return [(_path_name(p), tuple(m.shape), str(np.dtype(m.dtype)))
              for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]]
    except Exception:  # noqa: BLE001  (an older orbax, no metadata)
      return None

  def _structure_difference(self, step: int, abstract_state: Any, shown: int = 3) -> str:
    """``": <leaf>: checkpoint <shape dtype> -> now <shape dtype>; ..."`` from orbax's own
    metadata of the saved arrays, or ``""`` where that cannot be read. (The bare "different
    structure" named no leaf: resuming an 8-worker run with 16 workers said nothing of the
    worker axis.)"""
    saved = self._saved_leaves(step)
    if saved is None:  # (the message stays generic)
      return ""
    was = {k: (shape, dtype) for k, shape, dtype in saved}
    now = {k: (shape, dtype) for k, shape, dtype in _leaf_table(abstract_state)}
    fmt = lambda sd: "missing" if sd is None else f"{sd[0]} {sd[1]}"  # noqa: E731
    diff = [(k, was.get(k), now.get(k)) for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]
    if not diff:  # (adam's checkpoint for adamw: same leaves, another state tree)
      return (": the same arrays under another state tree (a different optimizer or transform "
              "chain?)")
    text = "; ".join(f"{k}: checkpoint {fmt(a)} -> now {fmt(b)}" for k, a, b in diff[:shown])
    more = f" (and {len(diff) - shown} more)" if len(diff) > shown else ""
    leading = {(a[0][0], b[0][0]) for _, a, b in diff
               if a and b and a[0][1:] == b[0][1:] and a[1] == b[1] and a[0] and b[0]}
    only_leading = all(a and b and a[0] and b[0] and a[0][1:] == b[0][1:] and a[1] == b[1]
                       for _, a, b in diff)  # (a width 4 -> 5 changes a bias's only axis)
    hint = ""
    if len(leading) == 1 and only_leading:
      (x, y), = leading
      hint = (f". Only the leading axis differs ({x} -> {y}): in train.fit's state that is the "
              f"worker axis, and a run cannot resume with another number of workers")
    return f": {text}{more}{hint}"

  @staticmethod
  def _verify(meta: Mapping[str, Any], state: Any) -> None:
    """Compares the state's checksum with the recorded one; the checksum of global arrays is
    a collective whose result every process gets, so every process reaches the same verdict."""
    got = tree_checksum(state)
    if got != meta.get("checksum"):
      bad = [i for i, (a, b) in enumerate(zip(got, meta.get("checksum", []))) if a != b]
      raise CheckpointError(f"checksum mismatch in array(s) {bad[:8]} (data changed on disk)")

  def restore_latest(self, abstract_state: Any) -> Restored | None:
    """Restores the newest good checkpoint onto ``abstract_state``'s shardings, or returns None.

    ``abstract_state`` is a state of the right structure (arrays or
    ``jax.ShapeDtypeStruct`` with shardings), e.g. a freshly initialised one,
    or a function of the checkpoint's meta returning one.
    A newest checkpoint that is unreadable or fails its checksum is reported,
    moved aside, and the previous one is tried. All processes call this; in a
    multi-process job they agree on each step's verdict (a collective).

    Raises:
      ConfigMismatchError: the checkpoint belongs to a different run.
      CheckpointError: checkpoints exist but none is readable; or a checkpoint has
        a newer format; or another process failed for a reason that is not corruption.
      Exception: this process's own failure that is not corruption (e.g.
        ``MemoryError``), with a note that the checkpoint was left in place.
    """
    steps = self.steps()
    if not steps:
      aside = sorted(p.name for p in self.directory.glob("corrupt-*")) if (
          self.directory.exists()) else []
      if aside:
        _say(f"no checkpoint to resume in {self.directory}; {len(aside)} set aside earlier as "
             f"corrupt ({', '.join(aside[:4])}{', ...' if len(aside) > 4 else ''}): starting "
             "from the beginning")
    failures = []
    for step in reversed(steps):
      error: Exception | None = None
      try:  # this process's reads, then (only if every process read its part) the checksum
        meta, state = self._read_step(step, abstract_state)
      except ConfigMismatchError:  # from the shared meta: every process raises it
        raise
      except Exception as e:  # noqa: BLE001 -- sorted by _is_corruption below
        error = e
      code = 0 if error is None else 1 if _is_corruption(error) else 2
      codes = _all_processes(code)
      if max(codes) == 0:
        try:
          self._verify(meta, state)
        except CheckpointError as e:  # the same verdict on every process
          error, codes = e, [1] * len(codes)
      if max(codes) == 2:  # not the checkpoint's fault: leave it in place, raise
        if code == 2:
          error.add_note(f"(while restoring checkpoint step {step} in {self.directory}; not "
                         "a sign of corruption, so the checkpoint was left in place)")
          raise error
        others = [i for i, c in enumerate(codes) if c == 2]
        raise CheckpointError(
            f"restoring checkpoint step {step} in {self.directory} failed on process(es) "
            f"{others} for a reason other than corruption (see their errors); the checkpoint "
            "was left in place")
      if max(codes) == 1:
        if error is not None:
          reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        else:
          reason = f"unreadable on process(es) {[i for i, c in enumerate(codes) if c]}"
        failures.append(f"step {step}: {reason}")
        moved = self._move_aside(step)
        _say(f"checkpoint step {step} in {self.directory} is corrupt or truncated ({reason}); "
             f"moved it to {moved.name}; falling back to the previous checkpoint")
        continue
      restored = Restored(step=int(step), state=state, meta=meta, path=self.step_path(step))
      if failures:
        _say(f"resumed from the previous good checkpoint, step {step} "
             f"(skipped {len(failures)} corrupt newer one(s))")
      self.last_good = (restored.step, restored.path)
      return restored
    if failures:
      raise CheckpointError(f"no readable checkpoint in {self.directory}: " + "; ".join(failures))
    return None

  def _move_aside(self, step: int) -> pathlib.Path:
    """Renames ``step`` to the first free ``corrupt-<step>-<n>``: process 0 picks the name and
    renames; the others wait at one barrier named by the step alone (each process choosing a
    name itself raced: a slower one saw process 0's rename and waited at another barrier)."""
    source = self.step_path(step)
    if jax.process_index() == 0 and source.exists():
      n = 0
      while (self.directory / f"corrupt-{step}-{n}").exists():
        n += 1
      source.rename(self.directory / f"corrupt-{step}-{n}")
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes(f"mfopt_move_aside_{step}")
    aside = [p for p in self.directory.glob(f"corrupt-{step}-*")
             if p.name.rsplit("-", 1)[1].isdigit()]
    self.manager.reload()
    return max(aside, key=lambda p: int(p.name.rsplit("-", 1)[1]), default=source)


# ---------------------------------------------------------------------------------------------
# Plain-data state (NumPy arrays inside dicts, lists, tuples and numbers): the simulator's


def encode_plain(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
  """JSON-able skeleton of plain data; non-empty NumPy arrays go into ``arrays`` (saved by orbax).

  Exact round trip with :func:`decode_plain`: tuples, non-string dict keys, NumPy
  scalars and empty arrays are tagged so they come back with their types.
  """
  if isinstance(obj, np.ndarray):
    if obj.dtype == object:
      raise TypeError("object arrays cannot be checkpointed")
    if obj.size == 0:  # orbax does not store zero-size arrays
      return {"__empty__": obj.dtype.str, "shape": list(obj.shape)}
    key = f"a{len(arrays)}"
    arrays[key] = obj
    return {"__nd__": key}
  if isinstance(obj, np.generic):
    return {"__np__": obj.dtype.str, "v": obj.item()}
  if isinstance(obj, tuple):
    return {"__tuple__": [encode_plain(v, arrays) for v in obj]}
  if isinstance(obj, list):
    return [encode_plain(v, arrays) for v in obj]
  if isinstance(obj, dict):
    if all(isinstance(k, str) and not k.startswith("__") for k in obj):
      return {k: encode_plain(v, arrays) for k, v in obj.items()}
    return {"__dict__": [[encode_plain(k, arrays), encode_plain(v, arrays)] for k, v in obj.items()]}
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  raise TypeError(f"cannot checkpoint a {type(obj).__name__} as plain data")


def decode_plain(obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
  """Inverse of :func:`encode_plain`."""
  if isinstance(obj, list):
    return [decode_plain(v, arrays) for v in obj]
  if isinstance(obj, dict):
    if "__nd__" in obj:
      return np.asarray(arrays[obj["__nd__"]])
    if "__empty__" in obj:
      return np.zeros(obj["shape"], np.dtype(obj["__empty__"]))
    if "__np__" in obj:
      return np.dtype(obj["__np__"]).type(obj["v"])
    if "__tuple__" in obj:
      return tuple(decode_plain(v, arrays) for v in obj["__tuple__"])
    if "__dict__" in obj:
      return {_hashable(decode_plain(k, arrays)): decode_plain(v, arrays) for k, v in obj["__dict__"]}
    return {k: decode_plain(v, arrays) for k, v in obj.items()}
  return obj


def _hashable(key: Any) -> Any:
  return tuple(key) if isinstance(key, list) else key


def _plain_target(meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
  return {k: np.zeros(shape, np.dtype(dtype)) for k, (shape, dtype) in meta["arrays"].items()}


def interval_elapsed(last_save: float, interval_s: float | None,
                     clock=time.perf_counter) -> bool:
  """Whether ``interval_s`` seconds passed since ``last_save`` (always, for ``None``), decided
  by process 0 for every process of a multi-process job.

  A save is collective (every process writes its shards and waits at orbax's barriers). Each
  process deciding on its own clock hung the job when the interval ran out between two
  processes' readings: one entered the save, the other the next train step, each waiting for
  the other (the runner's default 60 s interval exposed every long multi-process run).
  """
  if interval_s is None:
    return True
  elapsed = clock() - last_save >= interval_s
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    elapsed = bool(multihost_utils.broadcast_one_to_all(np.asarray(elapsed)))
  return elapsed


ENGINE_LIMITS = ("max_samples", "max_server_steps", "max_time")  # (max_events: the chunking)


def run_resumable(engine: Any, directory: str | os.PathLike, *, chunk_events: int,
                  keep: int = 2, fingerprint: Mapping[str, Any] | None = None,
                  allow_mismatch: bool = False, on_checkpoint=None,
                  min_interval_s: float | None = None, **run_kwargs) -> Any:
  """Runs an event-driven engine (``mfopt.sim.Simulator``) with checkpoints every ``chunk_events``.

  ``engine`` must offer ``run(max_events=..., **run_kwargs)`` (running until a
  limit in ``run_kwargs`` or ``max_events`` events), ``state_dict()`` (plain
  data) and ``load_state_dict(d)``. The state after each chunk is saved with
  orbax (arrays) plus JSON (the rest) into ``directory``; a call that finds a
  checkpoint resumes from it, and one that finds the final checkpoint only
  restores the finished state. Chunked running equals one uninterrupted
  ``run`` (the engine's limits are checked before every event), so a resumed
  simulation is bit-for-bit the uninterrupted one.

  Args:
    fingerprint: what a checkpoint must match to be resumed (with the limits in
      ``run_kwargs``); ``None``: ``engine.fingerprint()`` if the engine has one (the
      simulator's: every setting that changes its results), else the limits alone.
    allow_mismatch: resume a checkpoint whose fingerprint differs (a warning); a finished
      run whose limits were raised is then continued up to the new limits, and one whose
      limits did not change is returned as saved, whatever else changed.
    chunk_events: events between checkpoints (not in the fingerprint: a resumed run may save
      at another interval; the chunks do not change the numbers).
    on_checkpoint: optional ``chunk -> None`` called after each save.
    min_interval_s: save a chunk's state only if this many seconds passed since the last
      save (the final state is always saved); ``None``: after every chunk.
    **run_kwargs: the engine's limits, e.g. ``max_samples=20_000`` (part of the
      fingerprint), and its display arguments (``progress``, ``desc``, ``on_log``; not).

  Returns:
    ``engine``, in its final state (``engine.result()`` for the simulator).
  """
  _checks.positive_int("chunk_events", chunk_events)
  if "max_events" in run_kwargs:  # (it reached engine.run twice: a TypeError)
    raise ValueError(f"run_resumable runs chunks of chunk_events events; max_events="
                     f"{run_kwargs['max_events']!r} is not a limit it supports: stop the engine "
                     f"with max_samples, max_server_steps or max_time")
  limits = {k: v for k, v in run_kwargs.items() if k in ENGINE_LIMITS}
  if all(v is None for v in limits.values()):  # (chunks of max_events satisfied the engine's
    # own check, so a run without a limit spun for ever)
    raise ValueError(f"run_resumable needs at least one of {', '.join(ENGINE_LIMITS)}, got "
                     f"{limits or 'none'}")
  if fingerprint is None and callable(getattr(engine, "fingerprint", None)):
    fingerprint = engine.fingerprint()  # (the limits alone let other settings resume)
  ckpt = RunCheckpointer(directory, keep=keep, allow_mismatch=allow_mismatch,
                         fingerprint={"run_kwargs": limits, **dict(fingerprint or {})})
  chunk = 0
  last_save = time.monotonic()
  try:
    restored = ckpt.restore_latest(_plain_target)
    if restored is not None:
      engine.load_state_dict(decode_plain(restored.meta["plain"], restored.state))
      chunk = restored.step
      saved_limits = restored.meta.get("fingerprint", {}).get("run_kwargs")
      if restored.meta.get("finished") and (saved_limits == limits
                                            or _limits_reached(engine, limits)):
        return engine  # (a finished run allowed new limits it has not reached goes on)
    # (for a metrics log under an allowed config change: the simulator's rows are positioned by
    # server step and samples)
    report.note_run_start(getattr(engine, "version", 0), getattr(engine, "samples", None))

    def progress_mark():  # changes whenever an event ran (the queue's sequence number grows)
      queue = engine.state_dict().get("queue")
      return (getattr(engine, "now", None), getattr(engine, "samples", None),
              getattr(engine, "version", None), queue.get("seq") if isinstance(queue, dict) else None)

    while True:
      before = progress_mark()
      engine.run(max_events=chunk_events, **run_kwargs)
      finished = progress_mark() == before or _limits_reached(engine, limits)
      chunk += 1
      if not finished and not interval_elapsed(last_save, min_interval_s, time.monotonic):
        continue
      last_save = time.monotonic()
      arrays: dict[str, np.ndarray] = {}
      skeleton = encode_plain(engine.state_dict(), arrays)
      if not arrays:
        arrays["a_none"] = np.zeros(1, np.int32)
      ckpt.save(chunk, arrays, {"plain": skeleton, "finished": finished,
                                "arrays": {k: [list(v.shape), v.dtype.str] for k, v in arrays.items()}})
      if on_checkpoint is not None:
        on_checkpoint(chunk)
      if finished:
        return engine
  finally:
    ckpt.close()


def _limits_reached(engine: Any, limits: Mapping[str, Any]) -> bool:
  checks = {"max_samples": "samples", "max_server_steps": "version", "max_time": "now"}
  return any(limits.get(k) is not None and getattr(engine, attr) >= limits[k]
             for k, attr in checks.items())


# ---------------------------------------------------------------------------------------------
# Automatic checkpointing of every fit() call inside an experiment


@dataclasses.dataclass
class CheckpointPolicy:
  """Where and how often :func:`mfopt.train.fit` checkpoints when not told explicitly.

  Attributes:
    root: directory holding one sub-directory per ``fit`` call.
    every: steps between checkpoints, rounded up to a multiple of each run's
      ``log_every`` (sub-runs of one experiment may log at different intervals);
      ``None``: at every logging step.
    keep: checkpoints kept per run.
    allow_mismatch: resume from checkpoints with a different fingerprint.
    min_interval_s: skip a periodic checkpoint unless this many seconds passed
      since the previous save (the final one is always written); ``None``: never skip.
  """

  root: pathlib.Path
  every: int | None = None
  keep: int = 2
  allow_mismatch: bool = False
  min_interval_s: float | None = None
  runs: int = 0

  def next_run_dir(self, desc: str | None) -> pathlib.Path:
    """``<root>/<index>-<desc slug>``: stable across a resumed experiment (same call order)."""
    index = self.runs
    self.runs += 1
    return self.named_run_dir(f"{index:03d}", desc)

  def named_run_dir(self, prefix: str, desc: str | None) -> pathlib.Path:
    """``<root>/<prefix>-<desc slug>``, outside the numbering of :meth:`next_run_dir` (for a
    run with its own training loop, which must not shift the numbered runs after it)."""
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", desc or "run").strip("_")[:80] or "run"
    return self.root / f"{prefix}-{slug}"


_POLICY: contextvars.ContextVar[CheckpointPolicy | None] = contextvars.ContextVar(
    "mfopt_checkpoint_policy", default=None)


@contextlib.contextmanager
def auto_checkpoint(root: str | os.PathLike, *, every: int | None = None, keep: int = 2,
                    allow_mismatch: bool = False,
                    min_interval_s: float | None = None) -> Iterator[CheckpointPolicy]:
  """Within the block, every :func:`mfopt.train.fit` without ``checkpoint_dir`` (and every
  :func:`mfopt.sim.simulate`) checkpoints under ``root``.

  Each call gets its own sub-directory (numbered in call order), resumes from
  it if it holds a checkpoint, and returns a finished run's saved result
  without training again.
  """
  if every is not None and (not _checks.is_int(every) or every <= 0):
    raise ValueError(f"every must be a positive integer or None, got {every!r}")
  _checks.positive_int("keep", keep)
  if min_interval_s is not None and not min_interval_s >= 0:
    raise ValueError(f"min_interval_s must be >= 0 or None, got {min_interval_s!r}")
  policy = CheckpointPolicy(pathlib.Path(root), every=every, keep=keep,
                            allow_mismatch=allow_mismatch, min_interval_s=min_interval_s)
  token = _POLICY.set(policy)
  try:
    yield policy
  finally:
    _POLICY.reset(token)


def active_policy() -> CheckpointPolicy | None:
  """The policy of the innermost :func:`auto_checkpoint` block, if any."""
  return _POLICY.get()
