r"""The multi-GPU BatchNorm variance analysis of seed 000 §2.3/§3.1 (eqs. 4-8), with its erratum.

Seed: ``seeds/000_6d1af7101f82a674.txt`` §2.3 eqs. (4)-(6) and §3.1 eqs. (7)-(8).
SPEC.md records the erratum this module makes measurable.

The setting. A global batch of ``M`` scalar samples (one BN feature) is split
over ``P`` workers, ``K = M/P`` each. Worker ``j`` has mean ``mu_j`` and biased
variance ``delta_j^2`` (1/K, eq. 4 per worker); ``mu_hat`` is the grand mean.

.. math::
   S_e = K \sum_j \delta_j^2 \;(\text{within}), \quad
   S_a = K \sum_j (\mu_j - \hat\mu)^2 \;(\text{between}), \quad
   S_t = S_e + S_a \quad (7)

What the paper prints, next to what holds for i.i.d. samples of variance
``sigma^2``:

===========================  ============================  =========================
quantity                     printed                       correct
===========================  ============================  =========================
E[delta_B^2] (eq. 4, 1/M)    eq. 6: (M-1) sigma^2          (M-1)/M sigma^2
E[S_t] (eq. 7)               eq. 8: (M-1 + M(P-1)/P) s^2   (M-1) sigma^2, every P
E[S_e]                       --                            (M-P) sigma^2
E[S_a]                       --                            (P-1) sigma^2
===========================  ============================  =========================

``S_t`` is the total sum of squares about the grand mean (the ANOVA identity), so
it does not depend on how the batch is split: eq. 8 cannot hold for ``P > 1``.
Eq. 6 is the expectation of the *sum* of squares ``M delta_B^2``, not of eq. 4's
``delta_B^2``. For Gaussian samples ``S_t / sigma^2 ~ chi^2_{M-1}`` (variance
``2(M-1)``), ``S_e/sigma^2 ~ chi^2_{M-P}``, ``S_a/sigma^2 ~ chi^2_{P-1}``.

What per-worker BN does change is the *noise* of the statistics each worker
normalises with: for i.i.d. samples

.. math::
   E[(\mu_j - \mu)^2] = \sigma^2 / K, \qquad
   E[(\delta_j^2 - \sigma^2)^2] = \left(\tfrac{K-1}{K}\right)^2
     \sigma^4\left(\tfrac{\kappa}{K} - \tfrac{K-3}{K(K-1)}\right) + \tfrac{\sigma^4}{K^2}

(``kappa`` = kurtosis ``E(x-mu)^4/sigma^4``; 3 for a Gaussian, where the second
becomes ``(2K-1) sigma^4 / K^2``; at ``K = 1``, ``delta_j^2 = 0`` and the error is
``sigma^4``). At a fixed global batch both grow roughly linearly in ``P``.

Measurements here use NumPy float64 on arrays ``(trials, M, F)`` (``F``
independent or not features, each with its own population ``sigma^2``); worker
``j`` gets samples ``j*K .. (j+1)*K-1`` of each batch, as a worker-stacked split
does. ``experiments/bn_variance.py`` applies them to CNN activations on mnist1d.

Example:
  >>> import numpy as np
  >>> from mfopt.bn_analysis import correct_total_ss, measure_split_statistics, printed_e2
  >>> x = np.random.default_rng(0).normal(size=(4000, 64, 1))
  >>> m = measure_split_statistics(x, num_workers=8, sigma2=np.ones(1))
  >>> round(m["S_t"], 0), correct_total_ss(64, 1.0), printed_e2(64, 8, 1.0)
  (63.0, 63.0, 119.0)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mfopt import _checks

__all__ = [
    "printed_e1", "printed_e2", "correct_batch_variance", "correct_total_ss",
    "correct_within_ss", "correct_between_ss", "total_ss_std", "split_statistics",
    "measure_split_statistics", "predicted_mean_noise", "predicted_variance_noise",
    "kurtosis", "expectation_table", "measure_bn_channel_noise",
]


def _check(M: int, P: int = 1, *, names: tuple[str, str] = ("M", "P")) -> tuple[int, int]:
  """``(M, P)`` as ints; errors name the caller's arguments (``names``: K, global_batch,
  num_workers; predicted_mean_noise(0) said "M")."""
  m, p = names
  M, P = _checks.positive_int(m, M), _checks.positive_int(p, P)
  if M % P:
    raise ValueError(f"{m} must be divisible by {p}={P} (K = M/P samples per worker), got {M}")
  return int(M), int(P)


def printed_e1(M: int, sigma2: float = 1.0) -> float:
  """Eq. (6) as printed: ``E1 = E(delta_B^2) = (M-1) sigma^2`` (really E of the sum of squares)."""
  M, _ = _check(M)
  return (M - 1) * sigma2


def printed_e2(M: int, P: int, sigma2: float = 1.0) -> float:
  """Eq. (8) as printed: ``E2 = E(S_t) = (M-1) sigma^2 + M(P-1)/P sigma^2`` (does not hold)."""
  M, P = _check(M, P)
  return (M - 1) * sigma2 + M * (P - 1) / P * sigma2


def correct_batch_variance(M: int, sigma2: float = 1.0) -> float:
  """``E[delta_B^2]`` of eq. (4) (biased, 1/M): ``(M-1)/M sigma^2``."""
  M, _ = _check(M)
  return (M - 1) / M * sigma2


def correct_total_ss(M: int, sigma2: float = 1.0, P: int = 1) -> float:
  """``E[S_t] = (M-1) sigma^2`` for every ``P`` (total sum of squares about the grand mean)."""
  M, P = _check(M, P)
  return (M - 1) * sigma2


def correct_within_ss(M: int, P: int, sigma2: float = 1.0) -> float:
  """``E[S_e] = P (K-1) sigma^2 = (M-P) sigma^2``."""
  M, P = _check(M, P)
  return (M - P) * sigma2


def correct_between_ss(M: int, P: int, sigma2: float = 1.0) -> float:
  """``E[S_a] = (P-1) sigma^2``."""
  M, P = _check(M, P)
  return (P - 1) * sigma2


def total_ss_std(M: int, sigma2: float = 1.0) -> float:
  """Standard deviation of ``S_t`` for Gaussian samples: ``sqrt(2(M-1)) sigma^2`` (chi-square)."""
  M, _ = _check(M)
  return math.sqrt(2 * (M - 1)) * sigma2


def predicted_mean_noise(K: int, sigma2: float = 1.0) -> float:
  """``E[(mu_j - mu)^2] = sigma^2 / K`` for i.i.d. samples (any distribution)."""
  K, _ = _check(K, names=("K", "P"))
  return sigma2 / K


def predicted_variance_noise(K: int, sigma2: float = 1.0, kurt: float = 3.0) -> float:
  """``E[(delta_j^2 - sigma^2)^2]`` for i.i.d. samples of kurtosis ``kurt`` (3 = Gaussian).

  Variance of the unbiased estimator, ``sigma^4 (kurt/K - (K-3)/(K(K-1)))``, scaled
  by ``((K-1)/K)^2`` for the biased one BN uses, plus its squared bias
  ``(sigma^2/K)^2``. ``K = 1`` gives ``sigma^4`` (the worker variance is 0).
  """
  K, _ = _check(K, names=("K", "P"))
  # a kurtosis is E[d^4] / E[d^2]^2 >= 1 (kurt = -5 gave a negative mean square)
  _checks.number_where("kurt", kurt, lambda v: v >= 1, "a kurtosis, >= 1")
  if K == 1:
    return sigma2**2
  var_unbiased = sigma2**2 * (kurt / K - (K - 3) / (K * (K - 1)))
  return ((K - 1) / K) ** 2 * var_unbiased + (sigma2 / K) ** 2


def kurtosis(x: np.ndarray, axis: int = 0) -> np.ndarray:
  """Population kurtosis ``E(x-mu)^4 / sigma^4`` along ``axis`` (3 for a Gaussian); NaN where
  ``x`` is constant (0/0: undefined).

  Computed as ``E z^4`` of the standardised ``z = (x-mu)/sigma``: ``sigma^4`` itself
  underflowed to 0 for ``sigma < 1e-81`` or so, and the old ``max(var, 1e-300)**2`` guard
  underflowed too, so a constant column gave 0/0 with a RuntimeWarning.
  """
  x = np.asarray(x, dtype=np.float64)
  d = x - x.mean(axis=axis, keepdims=True)
  var = (d**2).mean(axis=axis, keepdims=True)
  z = d / np.sqrt(np.where(var > 0, var, 1.0))
  return np.where(np.squeeze(var > 0, axis=axis), (z**4).mean(axis=axis), np.nan)


def split_statistics(x: np.ndarray, num_workers: int) -> dict[str, np.ndarray]:
  """Eqs. (4) and (7) on batches ``x`` of shape ``(..., M, F)`` split over ``num_workers``.

  Returns float64 arrays: ``mu_j``, ``delta2_j`` (``(..., P, F)``), ``delta2_B``
  (eq. 4 on the whole batch, ``(..., F)``), ``S_e``, ``S_a``, ``S_t`` (``(..., F)``).
  """
  x = np.asarray(x, dtype=np.float64)
  M, P = _check(x.shape[-2], num_workers)
  K = M // P
  xw = x.reshape(x.shape[:-2] + (P, K, x.shape[-1]))
  mu_j = xw.mean(axis=-2)
  delta2_j = ((xw - mu_j[..., None, :]) ** 2).mean(axis=-2)
  mu_hat = mu_j.mean(axis=-2)
  s_e = K * delta2_j.sum(axis=-2)
  s_a = K * ((mu_j - mu_hat[..., None, :]) ** 2).sum(axis=-2)
  delta2_b = ((x - x.mean(axis=-2, keepdims=True)) ** 2).mean(axis=-2)
  return {"mu_j": mu_j, "delta2_j": delta2_j, "delta2_B": delta2_b,
          "S_e": s_e, "S_a": s_a, "S_t": s_e + s_a}


def measure_split_statistics(batches: np.ndarray, num_workers: int, sigma2: np.ndarray,
                             mu: np.ndarray | None = None,
                             kurt: np.ndarray | None = None) -> dict[str, Any]:
  """Averages eqs. (4)-(8) quantities and per-worker noise over trials and features.

  Every quantity is divided by its feature's population variance (``sigma2``,
  shape ``(F,)``; squared for the variance noise), then averaged over features;
  its standard error is the standard deviation over trials of that feature
  average divided by ``sqrt(trials)`` (valid however the features correlate).

  Args:
    batches: ``(trials, M, F)`` samples.
    num_workers: ``P``; ``M`` must be divisible by it.
    sigma2: population variance per feature, ``(F,)``.
    mu: population mean per feature (needed for the per-worker noise; if
      ``None`` the noise entries are omitted).
    kurt: population kurtosis per feature for the variance-noise prediction
      (default 3, Gaussian).

  Returns:
    A dict with ``M, P, K, trials``, measured means (in units of sigma^2)
    ``S_t, S_e, S_a, delta2_B`` and their ``*_se``; the printed and correct
    expectations (``printed_e1, printed_e2, correct_S_t, correct_S_e, correct_S_a,
    correct_delta2_B``), the z-scores of the measurement against eq. 8 and the
    correct value; and with ``mu``: ``mean_noise`` (``E(mu_j-mu)^2/sigma^2``),
    ``var_noise`` (``E(delta_j^2-sigma^2)^2/sigma^4``) with standard errors and
    predictions.
  """
  batches = np.asarray(batches, dtype=np.float64)
  if batches.ndim != 3:
    raise ValueError(f"batches must have shape (trials, M, F), got {batches.shape}")
  trials, M, F = batches.shape
  M, P = _check(M, num_workers, names=("M (batches.shape[1])", "num_workers"))
  K = M // P
  sigma2 = np.broadcast_to(np.asarray(sigma2, dtype=np.float64), (F,))
  if np.any(sigma2 <= 0):
    raise ValueError("sigma2 must be > 0 for every feature (drop constant features first)")
  st = split_statistics(batches, P)

  def avg(name, values):  # values (trials, F) already normalised
    per_trial = values.mean(axis=-1)
    out[name] = float(per_trial.mean())
    out[name + "_se"] = float(per_trial.std(ddof=1) / math.sqrt(trials)) if trials > 1 else math.nan

  out: dict[str, Any] = {"M": M, "P": P, "K": K, "trials": trials, "features": F}
  for name in ("S_t", "S_e", "S_a", "delta2_B"):
    avg(name, st[name] / sigma2)
  out.update(printed_e1=printed_e1(M), printed_e2=printed_e2(M, P),
             correct_S_t=correct_total_ss(M), correct_S_e=correct_within_ss(M, P),
             correct_S_a=correct_between_ss(M, P), correct_delta2_B=correct_batch_variance(M))
  se = max(out["S_t_se"], 1e-12)
  out["z_correct"] = (out["S_t"] - out["correct_S_t"]) / se
  out["z_printed"] = (out["S_t"] - out["printed_e2"]) / se
  if mu is not None:
    mu = np.broadcast_to(np.asarray(mu, dtype=np.float64), (F,))
    avg("mean_noise", ((st["mu_j"] - mu) ** 2 / sigma2).mean(axis=-2))
    avg("var_noise", ((st["delta2_j"] - sigma2) ** 2 / sigma2**2).mean(axis=-2))
    kurt = np.full(F, 3.0) if kurt is None else np.broadcast_to(np.asarray(kurt, np.float64), (F,))
    out["predicted_mean_noise"] = predicted_mean_noise(K)
    out["predicted_var_noise"] = float(np.mean([predicted_variance_noise(K, 1.0, k) for k in kurt]))
  return out


def expectation_table(M: int, workers: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                      sigma2: float = 1.0) -> list[dict[str, float]]:
  """Rows ``P, K, printed E1, printed E2, correct E[S_t], E[S_e], E[S_a]`` for each ``P``."""
  M, _ = _check(M)
  rows = []
  for P in workers:
    _checks.positive_int("workers item", P)  # (0 raised ZeroDivisionError)
    if M % P:
      continue
    rows.append({"P": P, "K": M // P, "printed_e1": printed_e1(M, sigma2),
                 "printed_e2": printed_e2(M, P, sigma2), "correct_S_t": correct_total_ss(M, sigma2),
                 "correct_S_e": correct_within_ss(M, P, sigma2),
                 "correct_S_a": correct_between_ss(M, P, sigma2)})
  return rows


def measure_bn_channel_noise(acts: np.ndarray, global_batch: int, num_workers: int,
                             trials: int, rng: np.random.Generator) -> dict[str, Any]:
  """Noise of the per-worker BatchNorm statistics of real activations, per channel.

  BatchNorm on ``(N, *spatial, C)`` activations normalises each channel with the mean
  and (biased) variance over a worker's ``K`` examples *and* all spatial positions.
  ``trials`` global batches of ``global_batch`` examples are drawn with replacement
  from ``acts`` (so examples are i.i.d. from the dataset's activation distribution),
  split into ``num_workers`` groups of ``K``, and each group's channel statistics are
  compared with the population ones (all of ``acts``).

  Returns:
    ``P, K, mean_noise`` = ``E[(mu_j - mu)^2] / sigma^2`` and ``var_noise`` =
    ``E[(delta_j^2 - sigma^2)^2] / sigma^4``, averaged over channels, with standard
    errors over trials; and ``predicted_mean_noise`` = ``Var_n(example mean) / (K
    sigma^2)``, exact for i.i.d. examples whatever the spatial correlation (the worker
    mean is the mean of ``K`` i.i.d. per-example channel means).
  """
  _checks.positive_int("trials", trials)  # (0 returned NaN figures)
  acts = np.asarray(acts, dtype=np.float64)
  n, c = acts.shape[0], acts.shape[-1]
  flat = acts.reshape(n, -1, c)  # (N, positions, C)
  M, P = _check(global_batch, num_workers, names=("global_batch", "num_workers"))
  K = M // P
  pop_mean = flat.mean(axis=(0, 1))
  pop_var = flat.var(axis=(0, 1))
  keep = pop_var > 1e-12 * max(float(pop_var.max()), 1e-300)
  flat, pop_mean, pop_var = flat[..., keep], pop_mean[keep], pop_var[keep]
  example_means = flat.mean(axis=1)  # (N, C)
  idx = rng.integers(0, n, size=(trials, P, K))
  mean_err, var_err = np.empty(trials), np.empty(trials)
  chunk = max(1, int(2**23 // (M * flat.shape[1] * flat.shape[2])))  # ~64 MB of float64
  for lo in range(0, trials, chunk):
    x = flat[idx[lo:lo + chunk]]  # (chunk, P, K, positions, C)
    mu_j = x.mean(axis=(2, 3))
    var_j = x.var(axis=(2, 3))
    mean_err[lo:lo + chunk] = ((mu_j - pop_mean) ** 2 / pop_var).mean(axis=(1, 2))  # per trial
    var_err[lo:lo + chunk] = ((var_j - pop_var) ** 2 / pop_var**2).mean(axis=(1, 2))
  pred = float((example_means.var(axis=0) / pop_var).mean() / K)
  return {"P": P, "K": K, "channels": int(keep.sum()), "trials": trials,
          "mean_noise": float(mean_err.mean()),
          "mean_noise_se": float(mean_err.std(ddof=1) / math.sqrt(trials)),
          "var_noise": float(var_err.mean()),
          "var_noise_se": float(var_err.std(ddof=1) / math.sqrt(trials)),
          "predicted_mean_noise": pred}
