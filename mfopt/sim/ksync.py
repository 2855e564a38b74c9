"""The adaptive k-synchronisation test of seed 002 (spec §2.2-2.3): Welford statistics, Test A, Test B.

The server receives fresh worker gradients ``g_1, g_2, ...`` (all computed at
the current version) one at a time, in arrival order. After each arrival with
``n >= k_min`` it evaluates, with ``ḡ = mean``, ``s² = M2/(n-1)`` (coordinate-wise),
``V̂ = Σ_j s²_j`` and ``Ê = V̂ / n``:

* Test A (seed eq. 13):  ``Ê <= ϑ² ‖ḡ‖²``
* Test B (seed eqs. 14-16): ``Ê <= ϑ² ‖μ̂‖²`` with ``μ̂`` an end of the coordinate-wise
  Student-t interval ``ḡ ± t_{1-a/2, n-1} s/√n`` chosen by ``ci_mode``:
  ``"upper_signed"`` (literal, default) ``μ̂ = ḡ + t* s/√n``; ``"upper_abs"``
  ``|ḡ| + t* s/√n``; ``"lower_abs"`` ``max(|ḡ| - t* s/√n, 0)``; ``"off"`` (Test B skipped).

and the server updates as soon as ``A ∧ B`` passes or ``n = k_max`` (spec §2.3,
assumption 5). Optional ``variance_ucb`` (not in the seed, spec §2.2) replaces
``V̂`` by the chi-square upper confidence bound ``(n-1) V̂ / χ²_{a/2, n-1}`` in
Test A only.

Statistics are kept in float64 on the host with Welford's update
``δ = g - m; m += δ/n; M2 += δ ⊙ (g - m)`` (exact elementwise form).

Reference: ``seeds/002_7eb60581c949cce6.txt`` Sec. 3.3 (equations lost),
reconstructed in ``spec/seed-002-async-ksync.md`` §2.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from mfopt import _checks

CI_MODES = ("upper_signed", "upper_abs", "lower_abs", "off")


@functools.lru_cache(maxsize=None)
def t_quantile(q: float, df: int) -> float:
  """Student-t quantile ``t_{q, df}`` (scipy)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.t.ppf(q, df))


@functools.lru_cache(maxsize=None)
def chi2_quantile(q: float, df: int) -> float:
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.chi2.ppf(q, df))


class Welford:
  """Running mean and coordinate-wise sum of squared deviations of vectors (float64).

  >>> import numpy as np
  >>> from mfopt.sim import Welford
  >>> w = Welford(3); w.add(np.ones(3)); w.add(3 * np.ones(3)); w.mean, w.variance
  (array([2., 2., 2.]), array([2., 2., 2.]))
  """

  def __init__(self, dim: int):
    self.n = 0
    self.mean = np.zeros(dim, np.float64)
    self.m2 = np.zeros(dim, np.float64)

  def add(self, g: np.ndarray) -> None:
    g = np.asarray(g, np.float64)
    self.n += 1
    delta = g - self.mean
    self.mean += delta / self.n
    self.m2 += delta * (g - self.mean)

  def reset(self) -> None:
    self.n = 0
    self.mean[:] = 0.0
    self.m2[:] = 0.0

  @property
  def variance(self) -> np.ndarray:
    """Unbiased coordinate-wise sample variance ``s² = M2/(n-1)`` (needs n >= 2)."""
    return self.m2 / (self.n - 1)

  def state_dict(self) -> dict[str, Any]:
    return {"n": self.n, "mean": self.mean.copy(), "m2": self.m2.copy()}

  def load_state_dict(self, d: dict[str, Any]) -> None:
    self.n = int(d["n"])
    self.mean = np.array(d["mean"], np.float64)
    self.m2 = np.array(d["m2"], np.float64)


@dataclasses.dataclass(frozen=True)
class KTestConfig:
  """Options of the k-test (spec §2.2-2.3; every default is the spec's).

  Args:
    theta: the test constant ϑ (spec renames the seed's θ), default 0.9 [A].
    confidence: 1 - a of the t-interval, default 0.95 [A].
    ci_mode: Test B variant, see the module docstring; default ``"upper_signed"`` (literal) [A].
    k_min: smallest k tested, default 2 [A].
    k_max: largest k; ``None`` means M (the BSP limit) [A]; the ``working`` preset caps it at 8.
    variance_ucb: use the chi-square upper bound of V̂ in Test A only (not in the seed) [A].
  """

  theta: float = 0.9
  confidence: float = 0.95
  ci_mode: str = "upper_signed"
  k_min: int = 2
  k_max: int | None = None
  variance_ucb: bool = False

  def __post_init__(self):
    _checks.python_scalars(self)
    _checks.flag("variance_ucb", self.variance_ucb)
    _checks.number_where("theta", self.theta, lambda v: v > 0, "> 0")
    _checks.number_where("confidence", self.confidence, lambda v: 0 < v < 1, "in (0, 1)")
    if self.ci_mode not in CI_MODES:
      raise ValueError(f"ci_mode must be one of {CI_MODES}, got {self.ci_mode!r}")
    _checks.positive_int("k_min", self.k_min)
    if self.k_min < 2:  # (1 was accepted and ran as 2: the test needs a sample variance)
      raise ValueError(f"k_min must be >= 2 (the k-test needs two gradients), got {self.k_min}")
    if self.k_max is not None and (not _checks.is_int(self.k_max) or self.k_max < self.k_min):
      raise ValueError(f"k_max must be an integer >= k_min={self.k_min}, got {self.k_max!r}")

  def resolved_k_max(self, num_workers: int) -> int:
    return num_workers if self.k_max is None else min(self.k_max, num_workers)


@dataclasses.dataclass(frozen=True)
class KTestResult:
  passed: bool
  test_a: bool
  test_b: bool
  e_hat: float       # Ê = V̂ / n
  v_hat: float       # V̂ = Σ s²
  grad_sq_norm: float  # ‖ḡ‖²


def k_test(w: Welford, cfg: KTestConfig) -> KTestResult:
  """Tests A and B on the statistics of ``w`` (``w.n >= 2``)."""
  n = w.n
  if n < 2:
    raise ValueError(f"the k-test needs at least 2 gradients, got n={n}")
  s2 = w.variance
  v_hat = float(s2.sum())
  e_hat = v_hat / n
  # Test A's variance: V̂, or its chi-square upper bound "in place of V̂ in Test A" (spec §2.2);
  # Test B, the result's Ê and V̂ (the broadcast r and V̂) keep the plain estimate.
  e_a = e_hat
  if cfg.variance_ucb:
    a = 1 - cfg.confidence
    e_a = (n - 1) * v_hat / chi2_quantile(a / 2, n - 1) / n
  gbar = w.mean
  g2 = float(gbar @ gbar)
  th2 = cfg.theta ** 2
  test_a = e_a <= th2 * g2
  if cfg.ci_mode == "off":
    test_b = True
  else:
    half = t_quantile(1 - (1 - cfg.confidence) / 2, n - 1) * np.sqrt(s2 / n)
    mu = _ci_end(cfg.ci_mode, gbar, half)
    test_b = e_hat <= th2 * float(mu @ mu)
  return KTestResult(bool(test_a and test_b), bool(test_a), bool(test_b), e_hat, v_hat, g2)


def _upper_signed(g, h):
  return g + h


def _upper_abs(g, h):
  return np.abs(g) + h


def _lower_abs(g, h):
  return np.maximum(np.abs(g) - h, 0.0)


_CI_ENDS = {"upper_signed": _upper_signed, "upper_abs": _upper_abs, "lower_abs": _lower_abs}


def _ci_end(mode: str, gbar: np.ndarray, half: np.ndarray) -> np.ndarray:
  return _CI_ENDS[mode](gbar, half)


def choose_k(grads: Iterable[np.ndarray], cfg: KTestConfig, num_workers: int) -> tuple[int, KTestResult | None]:
  """The online rule of spec §2.3 on gradients in arrival order: the smallest passing n, capped at k_max.

  Returns ``(k, result of the last test evaluated)`` (``None`` if none was).
  """
  k_max = cfg.resolved_k_max(num_workers)
  w, last = None, None
  for g in grads:
    if w is None:
      w = Welford(np.asarray(g).size)
    w.add(np.ravel(g))
    if w.n >= max(cfg.k_min, 2):
      last = k_test(w, cfg)
      if last.passed:
        return w.n, last
    if w.n >= k_max:
      return w.n, last
  raise ValueError(f"ran out of gradients after {0 if w is None else w.n} without reaching k_max={k_max}")
