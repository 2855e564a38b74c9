"""Argument validation shared by every public entry point.

One definition of "an integer" for the whole library: a Python ``int`` or a NumPy integer
(config files and ``np.arange`` loops hand out both), never a ``bool`` (``True`` is an ``int`` to
Python, but ``num_workers=True`` is a bug, not one worker). Every message names the argument and
repeats the bad value, so ``ValueError: num_steps must be a positive integer, got 0`` says what to
fix without a traceback dive.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_int", "is_real", "is_traced", "is_array", "real_scalar", "number_where", "positive_int", "nonnegative_int",
           "positive_number", "nonnegative_number", "finite_positive_number", "unit_interval",
           "transformation", "flag", "python_scalars"]


def is_int(value: Any) -> bool:
  """True for ``int`` and NumPy integers, False for ``bool`` and everything else."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
  """True for real numbers (``int``, ``float``, NumPy scalars), False for ``bool``."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_traced(value: Any) -> bool:
  """True for a JAX tracer (a hyperparameter under ``jit``, e.g. from ``optax.inject_hyperparams``)."""
  return isinstance(value, jax.core.Tracer)


def is_array(value: Any) -> bool:
  """True for a JAX array or tracer: a hyperparameter from ``optax.inject_hyperparams``
  (concrete at ``init``, traced under ``jit``), where a plain transform sees a Python number."""
  return isinstance(value, jax.Array)  # (a Tracer is a jax.Array too)


def real_scalar(value: Any) -> tuple[bool, Any]:
  """``(ok, comparable)``: Python and NumPy reals as they are, 0-d NumPy/JAX arrays of a real
  dtype as their value (``optax.inject_hyperparams`` hands hyperparameters over as
  ``jnp`` scalars). A tracer is accepted unchecked (``comparable`` None): its value is known
  only at run time, and it was checked as a concrete value when the transform was built."""
  if is_real(value):
    return True, value
  # jnp.issubdtype: bfloat16 (what inject_hyperparams hands out for bf16 params) is a float
  # to JAX but not to NumPy.
  if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and (
      jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
    if is_traced(value):
      return True, None
    return True, (float(value) if jnp.issubdtype(value.dtype, jnp.floating) else int(value))
  return False, None


def python_scalars(config: Any) -> None:
  """Replaces, in the frozen dataclass ``config``, every field holding a NumPy scalar or a
  concrete 0-d NumPy/JAX array by its Python value.

  The simulator's configs are hashed (``functools.lru_cache`` keys of jitted steps) and
  fingerprinted for resumption (:func:`mfopt.sim.server.plain_settings`): a ``jnp.asarray(0.9)``
  momentum passed validation and then raised ``unhashable type`` mid-run, and a JAX learning
  rate was fingerprinted as ``'ArrayImpl'``, so runs at two learning rates looked the same.
  """
  import dataclasses  # (only the simulator's configs need it)
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    if isinstance(v, np.generic) or (isinstance(v, (np.ndarray, jax.Array)) and v.ndim == 0
                                     and not is_traced(v)):
      object.__setattr__(config, f.name, np.asarray(v).item())


def _label(name: str, owner: str | None) -> str:
  return name if owner is None else f"{owner}: {name}"


def _array_hint(value: Any) -> str:
  if isinstance(value, jax.Array):
    return (" (a JAX array; a structural integer must be a Python int: with "
            "optax.inject_hyperparams, list it in static_args)")
  return ""


def positive_int(name: str, value: Any, *, owner: str | None = None) -> int:
  """``value`` as an ``int`` if it is an integer >= 1, else ``ValueError`` naming ``name``."""
  if not is_int(value) or value <= 0:
    raise ValueError(f"{_label(name, owner)} must be a positive integer, got {value!r}"
                     + _array_hint(value))
  return int(value)


def nonnegative_int(name: str, value: Any, *, owner: str | None = None) -> int:
  """``value`` as an ``int`` if it is an integer >= 0, else ``ValueError`` naming ``name``."""
  if not is_int(value) or value < 0:
    raise ValueError(f"{_label(name, owner)} must be a non-negative integer, got {value!r}"
                     + _array_hint(value))
  return int(value)


def number_where(name: str, value: Any, holds, what: str) -> Any:
  """``value`` if it is a finite real scalar for which ``holds(value)``, else ``ValueError``
  saying it must be ``what``; a tracer passes unchecked (see :func:`real_scalar`). No
  hyperparameter of the library is meaningful at ``inf`` or NaN (``inf`` passed ``v > 0`` and
  then made parameters NaN, or froze them), so neither passes."""
  ok, v = real_scalar(value)
  if not ok or (v is not None and not (_finite(v) and holds(v))):
    finite = " (it must be finite)" if ok and v is not None and not _finite(v) and v == v else ""
    raise ValueError(f"{name} must be {what}, got {value!r}{finite}"
                     f"{_low_precision_hint(value)}")
  return value


def _finite(v: Any) -> bool:
  """``math.isfinite`` for any real, huge Python ints included (``np.isfinite`` raises on them)."""
  try:
    return math.isfinite(v)
  except OverflowError:  # an int too large for a float
    return False


def _low_precision_hint(value: Any) -> str:
  """For a 16-bit float hyperparameter (``optax.inject_hyperparams`` with bf16/fp16 params):
  rounding may be what broke it (0.999 is 1.0 in bfloat16)."""
  dtype = getattr(value, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits <= 16:
    return (f" ({jnp.dtype(dtype).name} rounds hyperparameters, e.g. 0.999 to 1.0: pass "
            "hyperparam_dtype=jnp.float32 to optax.inject_hyperparams)")
  return ""


def positive_number(name: str, value: Any) -> Any:
  """``value`` if it is a finite real scalar > 0, else ``ValueError`` naming ``name``.

  Real scalars: Python and NumPy numbers and 0-d NumPy/JAX arrays; a tracer passes unchecked.
  """
  return number_where(name, value, lambda v: v > 0, "a positive number")


def nonnegative_number(name: str, value: Any) -> Any:
  """``value`` if it is a finite real scalar >= 0, else ``ValueError`` naming ``name``."""
  return number_where(name, value, lambda v: v >= 0, "a non-negative number")


def finite_positive_number(name: str, value: Any) -> Any:
  """``value`` if it is a finite real scalar > 0, else ``ValueError`` naming ``name``."""
  return number_where(name, value, lambda v: 0 < v < float("inf"), "a finite positive number")


def transformation(name: str, value: Any, *, owner: str | None = None,
                   allow_none: bool = False) -> Any:
  """``value`` if it is an optax transformation (has ``init`` and ``update``), or ``None``
  when ``allow_none``; else ``ValueError`` naming ``name`` (``optax.sgd`` itself, uncalled,
  is the usual slip)."""
  if (value is None and allow_none) or (hasattr(value, "init") and hasattr(value, "update")):
    return value
  raise ValueError(f"{_label(name, owner)} must be {'None or ' if allow_none else ''}an "
                   f"optax.GradientTransformation (e.g. optax.sgd(0.1), not optax.sgd), "
                   f"got {value!r}")


def flag(name: str, value: Any, *, allow_none: bool = False) -> bool | None:
  """``value`` as a Python ``bool`` if it is a ``bool`` or NumPy bool (or ``None`` when
  ``allow_none``), else ``ValueError`` naming ``name`` (a truthy string such as ``'no'`` would
  otherwise switch a feature on, and ``0``/``1`` are not flags)."""
  if value is None and allow_none:
    return None
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(f"{name} must be {'True, False or None' if allow_none else 'True or False'}, "
                   f"got {value!r}")


def unit_interval(name: str, value: Any) -> Any:
  """``value`` if it is a real scalar in [0, 1), else ``ValueError`` naming ``name``."""
  return number_where(name, value, lambda v: 0 <= v < 1, "in [0, 1)")
