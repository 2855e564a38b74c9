r"""Seed 004's efficiency metrics: GPU scaling efficiency and "actual average single-GPU time".

Seed 004 §1 and §3.2.2:

* GPU scaling efficiency ``= actual speed / ideal speed = 1 / (1 + comm / compute)``
  (per-GPU communication and computing time);
* convergence rate ``= 1 / (epochs to reach the target accuracy)``;
* actual average single-GPU training speed ``= convergence rate x single-GPU speed x
  scaling efficiency``, and the *time* is its inverse. With the single-GPU speed in samples/s
  and ``S`` samples per epoch, that is

  .. math::  T_{1} = \frac{E_{target}\, S}{v_1\, e},\qquad T_{N} = T_1 / N,

  (``T_N``: the "actual training time" on ``N`` GPUs; Table 3.8 of the seed: 18 min x 24 GPUs =
  432 min).

Where communication time is not measured (one device, CPU, virtual workers) the efficiency is
*projected* with :func:`mfopt.costmodel.projected_time` from the collectives the transforms
counted and the measured compute time, and every result carries ``efficiency_source`` saying so.
The per-worker compute time is ``steps x`` one worker's step time measured alone on one device
(``one_worker_step_s``, what the seed-004 experiments pass). Without it, it is derived as
``train_s * D / W`` for ``W`` virtual workers on ``D`` devices, which holds only if the devices
ran their workers one after another: under ``vmap`` they run batched, so it understates the
compute time and overstates one worker's speed (2.05x on 2 CPU cores at W = 8, a review's
measurement), and the efficiency it gives is a lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mfopt import costmodel

__all__ = ["scaling_efficiency", "epochs_to_target", "actual_single_gpu_time", "efficiency_report"]


def scaling_efficiency(compute_s: float, comm_s: float) -> float:
  """``1 / (1 + comm/compute)`` (seed 004 §3.2.2)."""
  if not compute_s > 0:
    raise ValueError(f"compute_s must be positive, got {compute_s!r}")
  if not comm_s >= 0:
    raise ValueError(f"comm_s must be non-negative, got {comm_s!r}")
  return 1.0 / (1.0 + comm_s / compute_s)


def epochs_to_target(history: Sequence[Mapping[str, Any]], target: float,
                     key: str = "test_accuracy") -> float | None:
  """First logged epoch at which ``history[i][key] >= target`` (``None`` if never reached).

  Resolution is the logging interval (rows without ``key`` are skipped).
  """
  for row in history:
    value = row.get(key)
    if value is not None and value >= target:
      return float(row["epoch"])
  return None


def actual_single_gpu_time(epochs: float | None, samples_per_epoch: int, single_gpu_speed: float,
                           efficiency: float) -> float:
  """Seed 004's actual average single-GPU training time in seconds (``inf`` if never converged).

  ``1 / (convergence_rate x speed x efficiency / samples_per_epoch)`` with ``convergence_rate =
  1 / epochs``, written as ``epochs x samples_per_epoch / (speed x efficiency)`` so that a
  target met at epoch 0 (before any training) takes 0 s instead of dividing by zero."""
  if epochs is None:
    return math.inf
  return epochs * samples_per_epoch / (single_gpu_speed * efficiency)


def efficiency_report(*, summary: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                      target: float, samples_per_epoch: int, num_devices: int,
                      net: str = "100gbit", comm_s: float | None = None,
                      device: str = "CPU",
                      one_worker_step_s: float | None = None) -> dict[str, Any]:
  """The seed-004 metrics of one :func:`mfopt.train.fit` run.

  Args:
    summary, history: ``FitResult.summary`` / ``.history``.
    target: test accuracy defining convergence.
    samples_per_epoch: training-set size.
    num_devices: devices the run used (virtual workers share them).
    net: cost-model link for the projection (``mfopt.costmodel.PRESETS``).
    comm_s: *measured* communication seconds per worker, if available; then the efficiency
      is labelled "measured".
    device: name of the compute device, for the speed label.
    one_worker_step_s: seconds of one worker's train step alone on one device at the run's
      per-worker batch (measured by the caller); ``None``: derived from ``train_s`` (see the
      module docstring; ``speed_source`` says which).

  Returns:
    ``single_device_speed`` (one worker's samples/s on its own device), ``speed_source``,
    ``compute_s`` (per worker), ``comm_s``,
    ``scaling_efficiency``, ``efficiency_source``, ``epochs_to_target``, ``convergence_rate``,
    ``actual_single_gpu_time_s``, ``actual_training_time_s``.
  """
  w = int(summary["num_workers"])
  train_s = float(summary["train_s"])
  samples = float(summary["samples"])
  per_worker_samples = samples / w
  if one_worker_step_s is not None:
    if not one_worker_step_s > 0:
      raise ValueError(f"one_worker_step_s must be positive, got {one_worker_step_s!r}")
    compute_s = float(summary["steps"]) * one_worker_step_s
    speed_source = "measured (one worker's step alone on one device)"
  else:
    compute_s = train_s * num_devices / w
    speed_source = ("derived (train_s x devices / workers: overstates one worker's speed when "
                    "vmap batches the workers)")
  speed = per_worker_samples / compute_s  # one worker on its own device
  if comm_s is None:
    proj = costmodel.projected_time(compute_s, summary, w, net)
    comm, source = proj["comm_s"], f"projected (cost model, {costmodel.link(net).describe()})"
  else:
    comm, source = float(comm_s), "measured"
  eff = scaling_efficiency(compute_s, comm)
  epochs = epochs_to_target(history, target)
  single = actual_single_gpu_time(epochs, samples_per_epoch, speed, eff)
  return {
      "single_device_speed": speed, "speed_device": device, "speed_source": speed_source,
      "compute_s": compute_s,
      "comm_s": comm, "scaling_efficiency": eff, "efficiency_source": source,
      "target_accuracy": target, "epochs_to_target": epochs,
      "convergence_rate": (0.0 if epochs is None else math.inf if epochs == 0 else 1.0 / epochs),
      "actual_single_gpu_time_s": single, "actual_training_time_s": single / w,
  }
