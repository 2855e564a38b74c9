"""Argument validation shared by every public entry point.

One definition of "an integer" for the whole library: a Python ``int`` or a NumPy integer
(config files and ``np.arange`` loops hand out both), never a ``bool`` (``True`` is an ``int`` to
Python, but ``num_workers=True`` is a bug, not one worker). Every message names the argument and
repeats the bad value, so ``ValueError: num_steps must be a positive integer, got 0`` says what to
fix without a traceback dive.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["is_int", "is_real", "positive_int", "nonnegative_int", "positive_number",
           "nonnegative_number", "unit_interval"]


def is_int(value: Any) -> bool:
  """True for ``int`` and NumPy integers, False for ``bool`` and everything else."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
  """True for real numbers (``int``, ``float``, NumPy scalars), False for ``bool``."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _label(name: str, owner: str | None) -> str:
  return name if owner is None else f"{owner}: {name}"


def positive_int(name: str, value: Any, *, owner: str | None = None) -> int:
  """``value`` as an ``int`` if it is an integer >= 1, else ``ValueError`` naming ``name``."""
  if not is_int(value) or value <= 0:
    raise ValueError(f"{_label(name, owner)} must be a positive integer, got {value!r}")
  return int(value)


def nonnegative_int(name: str, value: Any, *, owner: str | None = None) -> int:
  """``value`` as an ``int`` if it is an integer >= 0, else ``ValueError`` naming ``name``."""
  if not is_int(value) or value < 0:
    raise ValueError(f"{_label(name, owner)} must be a non-negative integer, got {value!r}")
  return int(value)


def positive_number(name: str, value: Any) -> float:
  """``value`` if it is a real number > 0 (NaN fails), else ``ValueError`` naming ``name``."""
  if not is_real(value) or not value > 0:
    raise ValueError(f"{name} must be a positive number, got {value!r}")
  return value


def nonnegative_number(name: str, value: Any) -> float:
  """``value`` if it is a real number >= 0 (NaN fails), else ``ValueError`` naming ``name``."""
  if not is_real(value) or not value >= 0:
    raise ValueError(f"{name} must be a non-negative number, got {value!r}")
  return value


def unit_interval(name: str, value: Any) -> float:
  """``value`` if it is a real number in [0, 1), else ``ValueError`` naming ``name``."""
  if not is_real(value) or not 0 <= value < 1:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}")
  return value
